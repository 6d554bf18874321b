"""Several probes of one cluster taken as one (pipeline/probe/samples.py), and the cache
that keeps them (`cached_probe(sample=True)`).

The merge is a pure function, tested on made-up probes; the cache on made-up probes
standing for measured ones (no cluster: what `probe_cluster` measures is
tests/test_prediction.py's). A sweep's samples on a real cluster are
tests/test_sweep.py's.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time

import pytest

import pipeline.probe.cache
from pipeline.cluster.workers import ClusterWorker, all_local
from pipeline.probe import (ClusterProbe, DaskProbe, MasterProbe, ShardTiming, StoreProbe,
                            TrunkTiming, WorkerProbe, cached_master_probe, cached_probe,
                            cluster_probe_from_dict, find_cached_probe)
from pipeline.probe.keys import probe_key, worker_identity, workspace_location
from pipeline.probe.samples import MAX_SAMPLES, merge_samples
from tasks.specs import ConvLayerSpec, NetworkSpec

NETWORK = NetworkSpec((ConvLayerSpec(3, 8, in_height=8, in_width=8),))


def made_up_probe(speed: float, created: float, key: str = "k") -> ClusterProbe:
    """A probe of two workers whose every time is `speed` times a base figure (and
    every rate 1/`speed` times)."""
    workers = [WorkerProbe(name, name, 1, 1.0,
                           [ShardTiming(0, 4, 2, 0.01 * speed, 0.02 * speed, 0.005 * speed,
                                        rounds=2, steps=6, low_s=0.028 * speed,
                                        high_s=0.032 * speed),
                            ShardTiming(0, 8, 2, 0.02 * speed, 0.04 * speed, 0.01 * speed)],
                           TrunkTiming(8, 2, 0.03 * speed, 0.06 * speed, rounds=4, steps=12,
                                       dense_s=0.001 * speed),
                           {2: 0.05 * speed}, 1e9 / speed)
               for name in ("cpu-0", "cpu-1")]
    store = StoreProbe("shm", 3e-4 * speed, 2e9 / speed, 4e-4 * speed, 1e9 / speed,
                       0.002 * speed, {2: 0.1 * speed})
    dask = DaskProbe(0.002 * speed, 0.0005 * speed, 0.01 * speed, 0.01 * speed,
                     contention_share=0.3 * speed, contention_shares=[0.3 * speed])
    master = MasterProbe(1, 16, 0.002 * speed, dense_low_s=0.0018 * speed,
                         dense_high_s=0.0022 * speed)
    plain = json.loads(json.dumps(dataclasses.asdict(NETWORK)))  # as the cache gives it
    return ClusterProbe(key, created, "host", plain, 16, [4], workers,
                        store, dask, master, seconds=3.0)


def test_a_merged_probe_holds_the_median_of_every_figure():
    """Three samples at 1.0, 1.3 and 0.9 times one set of figures: every time and rate
    of the merge is the middle one's (1.0), whatever order they come in; counts add
    up; it carries the newest sample's time and when each was taken."""
    samples = [made_up_probe(1.3, 200.0), made_up_probe(1.0, 100.0), made_up_probe(0.9, 300.0)]
    merged = merge_samples(samples)
    middle = made_up_probe(1.0, 300.0)
    assert merged.created == 300.0 and merged.samples_created == [100.0, 200.0, 300.0]
    assert merged.created_times() == [100.0, 200.0, 300.0]
    assert merged.seconds == pytest.approx(9.0)
    for got, want in zip(merged.workers, middle.workers):
        assert got.name == want.name and got.memory_bw == pytest.approx(want.memory_bw)
        assert got.spread == pytest.approx(want.spread)
        first, expected = got.timings[0], want.timings[0]
        for name in ("forward_s", "backward_s", "input_grad_s", "low_s", "high_s"):
            assert getattr(first, name) == pytest.approx(getattr(expected, name)), name
        assert (first.rounds, first.steps) == (6, 18)
        assert got.trunk.forward_s == pytest.approx(want.trunk.forward_s)
        assert got.trunk.dense_s == pytest.approx(want.trunk.dense_s)
        assert got.trunk.rounds == 12
    store, want = dataclasses.asdict(merged.store), dataclasses.asdict(middle.store)
    assert store.pop("spread") == pytest.approx(want.pop("spread"))
    assert store == pytest.approx(want)
    assert merged.dask.task_s == pytest.approx(middle.dask.task_s)
    assert sorted(merged.dask.contention_shares) == pytest.approx([0.27, 0.3, 0.39])
    assert merged.dask.contention_share == pytest.approx(0.3)
    assert merged.master.dense_s == pytest.approx(middle.master.dense_s)
    assert merge_samples(list(reversed(samples))) == merged
    # one sample is itself; the merge is a probe like any other (JSON and back)
    assert merge_samples([samples[0]]) is samples[0]
    assert cluster_probe_from_dict(json.loads(json.dumps(dataclasses.asdict(merged)))) == merged


def test_a_figure_some_samples_lack_is_the_median_of_those_that_hold_it():
    """A size only one sample timed keeps that sample's figure; a timing is settled only
    if every sample settled it, and an outlier where most samples marked it one."""
    a, b, c = (made_up_probe(s, t) for s, t in ((1.0, 1.0), (2.0, 2.0), (3.0, 3.0)))
    extra = ShardTiming(0, 12, 2, 0.5, 1.0, 0.25)
    a.workers[0].timings.append(extra)
    a.workers[0].timings[0] = dataclasses.replace(a.workers[0].timings[0], outlier=True)
    b.workers[0].timings[0] = dataclasses.replace(b.workers[0].timings[0], outlier=True,
                                                  settled=False)
    c.workers[1].trunk = None
    merged = merge_samples([a, b, c])
    timings = {t.kernels: t for t in merged.workers[0].timings}
    assert timings[12].forward_s == 0.5 and timings[12].rounds == 1
    assert timings[4].outlier and not timings[4].settled
    assert not timings[8].outlier and timings[8].settled
    assert merged.workers[1].trunk.forward_s == pytest.approx(0.03 * 1.5)  # of 1.0 and 2.0


def test_the_clients_share_is_figured_from_every_samples_busy_rounds():
    """Two samples whose busy rounds were too spread to give a share and one that gave
    0.6 do not make 0.6: the rounds together are as spread, so no share (the model's
    default); rounds that agree across samples give their median even where each
    sample alone had too few to settle."""
    a, b, c = (made_up_probe(1.0, t) for t in (1.0, 2.0, 3.0))
    a.dask = dataclasses.replace(a.dask, contention_share=None, contention_shares=[0.81, 1.29])
    b.dask = dataclasses.replace(b.dask, contention_share=None, contention_shares=[0.24, 2.2])
    c.dask = dataclasses.replace(c.dask, contention_share=0.6, contention_shares=[0.62, 0.6])
    assert merge_samples([a, b, c]).dask.contention_share is None
    a.dask = dataclasses.replace(a.dask, contention_shares=[0.3, None])
    b.dask = dataclasses.replace(b.dask, contention_shares=[0.35, 0.4])
    c.dask = dataclasses.replace(c.dask, contention_share=None, contention_shares=[])
    assert merge_samples([a, b, c]).dask.contention_share == pytest.approx(0.35)


def test_samples_of_different_clusters_are_refused():
    with pytest.raises(ValueError, match="different clusters"):
        merge_samples([made_up_probe(1.0, 1.0, "a"), made_up_probe(1.0, 2.0, "b")])
    with pytest.raises(ValueError, match="no probe samples"):
        merge_samples([])


@pytest.fixture
def measured(tmp_path, monkeypatch):
    """`probe_cluster` standing for a measurement: each call returns the next made-up
    probe (speeds 1.0, 1.4, 0.8, 1.1, 0.9, 1.2, ... in turn), taken now."""
    monkeypatch.setenv("CNN_PROBE_CACHE", str(tmp_path / "probes"))
    monkeypatch.delenv("CNN_PROBE_MAX_AGE", raising=False)
    speeds = itertools.cycle([1.0, 1.4, 0.8, 1.1, 0.9, 1.2, 1.3, 0.7])
    calls: list[ClusterProbe] = []

    def probe_cluster(client, offered, network, batch, quanta, *rest):
        where = workspace_location(all_local(list(offered)), None)
        key = probe_key(network, batch, quanta, worker_identity(offered), where, None, "")
        calls.append(made_up_probe(next(speeds), time.time(), key))
        return calls[-1]

    monkeypatch.setattr(pipeline.probe.cache, "probe_cluster", probe_cluster)
    return calls


def _cached(sample: bool = False, refresh: bool = False) -> ClusterProbe:
    offered = [ClusterWorker(f"tcp://127.0.0.1:{port}", f"cpu-{i}", "CPU", 1, 1.0)
               for i, port in enumerate((40001, 40002))]
    return cached_probe(None, offered, NETWORK, 16, [4], sample=sample, refresh=refresh)


def _conv(probe: ClusterProbe) -> float:
    return probe.workers[0].timings[0].forward_s


def test_a_sample_adds_to_the_cached_probe_and_the_median_is_kept(measured):
    first = _cached()
    assert len(measured) == 1 and _cached() == first and len(measured) == 1  # reused
    second = _cached(sample=True)  # measured again however fresh: the median of 1.0, 1.4
    assert len(measured) == 2 and second.created_times() == [m.created for m in measured]
    assert _conv(second) == pytest.approx(0.01 * 1.2)
    assert find_cached_probe(first.key) == second == _cached()  # what predictions get now
    third = _cached(sample=True)  # 1.0, 1.4, 0.8
    assert _conv(third) == pytest.approx(0.01)
    for _ in range(MAX_SAMPLES):
        newest = _cached(sample=True)
    assert len(newest.created_times()) == MAX_SAMPLES  # the newest MAX_SAMPLES only
    assert newest.created_times() == [m.created for m in measured[-MAX_SAMPLES:]]
    assert len(_cached(refresh=True).created_times()) == 1  # a refresh starts anew
    _cached(sample=True)
    os.remove(os.path.join(os.environ["CNN_PROBE_CACHE"], f"cluster-{first.key}.json"))
    assert len(_cached().created_times()) == 1  # so does measuring where it was deleted


def test_a_sample_leaves_out_samples_older_than_the_max_age(measured, monkeypatch):
    old = _cached()
    path = pipeline.probe.cache._samples_path("cluster", old.key)
    stale = dataclasses.replace(old, created=time.time() - 7200)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump([dataclasses.asdict(stale)], handle)
    assert _cached(sample=True).created_times() == [measured[-1].created]
    monkeypatch.setenv("CNN_PROBE_MAX_AGE", "3h")  # now it counts
    with open(path, "w", encoding="utf-8") as handle:
        json.dump([dataclasses.asdict(stale)], handle)
    assert len(_cached(sample=True).created_times()) == 2


def test_a_probe_cached_before_samples_were_kept_is_the_first_sample(measured):
    """A cache written before samples were kept has a probe and no samples file: sampling
    keeps that probe as the first sample instead of forgetting it."""
    first = _cached()
    os.remove(pipeline.probe.cache._samples_path("cluster", first.key))
    assert _cached(sample=True).created_times() == [first.created, measured[-1].created]


def test_a_reference_probe_keeps_samples_too(tmp_path, monkeypatch):
    """`reference`'s probe of this process: a sample adds to it, the probe read back is
    the samples' median (dense head and every layer), and one that may not measure
    (`measure=False`) takes the cache as it is; a refresh starts anew."""
    monkeypatch.setenv("CNN_PROBE_CACHE", str(tmp_path / "probes"))
    speeds = iter([1.0, 1.5, 0.9, 1.2])

    def probe_master(network, batch, threads, dataset=None, optimizer=None):
        f = next(speeds)
        return MasterProbe(threads, batch, 0.002 * f, [ShardTiming(0, 8, 1, 0.01 * f, 0.02 * f)],
                           created=time.time())

    monkeypatch.setattr(pipeline.probe.cache, "probe_master", probe_master)
    first = cached_master_probe(NETWORK, 16, 2)
    assert cached_master_probe(NETWORK, 16, 2) == first  # reused
    assert cached_master_probe(NETWORK, 16, 2, sample=True).dense_s == pytest.approx(0.0025)
    third = cached_master_probe(NETWORK, 16, 2, sample=True)
    assert third.dense_s == pytest.approx(0.002) and len(third.created_times()) == 3
    assert third.timings[0].forward_s == pytest.approx(0.01)
    assert cached_master_probe(NETWORK, 16, 2, measure=False, sample=True) == third
    again = cached_master_probe(NETWORK, 16, 2, refresh=True)  # anew: its one sample
    assert again.dense_s == pytest.approx(0.0024) and len(again.created_times()) == 1
