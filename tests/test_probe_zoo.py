"""The probe on the zoo: its records come back whole, it times every layer of a graph
network on a real cluster (shards, replica trunks, the dense head, the client's share
of the cores) and in this process (``strategy: reference``).

The cluster test probes resnet20 at width 0.25 on two of the shared cluster's workers
(tests/conftest.py, tag PROBE) with a quantum of 2 channels, so that every layer splits
over both; its checks are on completeness and sanity, not on accuracy.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from functools import partial

import pytest

import pipeline.probe.cluster as cluster_probe
import pipeline.probe.reference as reference
import pipeline.probe.runs as runs
from pipeline.cluster.worker_setup import register_setup
from pipeline.cluster.workers import find_workers
from pipeline.placement.ties import check_tied
from pipeline.probe import cached_probe, costmodel_network, find_cached_probe, probe_master
from pipeline.probe.cache import cached_master_probe
from pipeline.probe.keys import optimizer_key, probe_key
from pipeline.probe.client_share import busy_spans, cpu_timeline, landed_share, median_share
from pipeline.probe.tables import network_spec_from_dict
from tasks.receipts import OpEvent, Phase, Receipt
from tasks.specs import NetworkSpec, OptimizerSpec
from tasks.zoo import PRESETS, NetworkBuilder, build_preset
from tests.helpers import cut_probe_to_one_round, shared_workers
from tests.test_costmodel_zoo import zoo_network


def _spec(preset: str, width: float):
    small = preset in ("resnet20", "marques")
    size, classes = (32, 10) if small else (224, 1000)
    return build_preset(preset, (3, size, size), classes, "float32", width, 0.5)


@pytest.mark.parametrize("preset", PRESETS)
def test_a_zoo_probe_record_round_trips_to_the_same_spec_and_costmodel_network(preset):
    spec = _spec(preset, 0.25)
    record = json.loads(json.dumps(asdict(spec)))  # as the probe's cache keeps it
    back = network_spec_from_dict(record)
    assert back == spec
    assert costmodel_network(back) == zoo_network(preset, 0.25)


def test_the_probes_plans_keep_every_tied_group_on_one_split():
    spec = _spec("resnet50", 1 / 16)
    plans = runs.plans_for(spec, 8, [2] * len(spec.conv), 2)
    assert len(plans) >= 2
    for plan in plans:
        check_tied(spec, plan.counts)


def test_every_worker_is_timed_on_every_layer_of_a_narrow_network():
    """resnet20 at width 1/4 has layers of one channel quantum (4 kernels): the even
    split over 2 workers leaves the second without them, so its rotation gives them to
    it; every worker's plans then cover every layer (the calibrated split and `auto`
    read each worker's table of each layer)."""
    spec = _spec("resnet20", 0.25)
    plans = runs.plans_for(spec, 8, [4] * len(spec.conv), 2, budget_s=0.0)
    for worker in range(2):
        held = {l for plan in plans if plan.workers == 2
                for l, row in enumerate(plan.counts) if row[worker]}
        assert held == set(range(len(spec.conv)))
    for plan in plans:
        check_tied(spec, plan.counts)


def _receipt(worker: str, start: float, end: float,
             waits: tuple[tuple[float, float], ...] = ()) -> Receipt:
    phases = [Phase("wait", a, b) for a, b in waits]
    return Receipt("run-ops", worker, 1, start, end, [OpEvent("conv-forward", 0, start, end,
                                                              phases)])


def test_a_worker_is_busy_in_its_tasks_but_not_while_it_waits_for_a_peer():
    receipts = [_receipt("a", 10.5, 11.0), _receipt("a", 10.0, 10.4, ((10.1, 10.2),)),
                _receipt("b", 10.0, 10.3, ((10.0, 10.1), (10.25, 10.3)))]
    spans = busy_spans(receipts)
    flat = {worker: [t for span in mine for t in span] for worker, mine in spans.items()}
    assert flat["a"] == pytest.approx([10.0, 10.1, 10.2, 10.4, 10.5, 11.0])
    assert flat["b"] == pytest.approx([10.1, 10.25])


def test_the_share_is_the_clients_cpu_spent_while_the_workers_filled_the_cores():
    """Two single-thread workers on two cores, busy together from 10.0 to 10.2; worker b
    waits from 10.2 on. The client spends 1 ms of CPU in each 10 ms before 10.2 and
    3 ms in each after: 20 of its 50 ms land while both cores are busy."""
    receipts = [_receipt("a", 10.0, 10.3), _receipt("b", 10.0, 10.3, ((10.2, 10.3),))]
    samples, cpu = [], 0.0
    for i in range(31):
        at = 10.0 + i * 0.01
        samples.append((at, cpu))
        cpu += 0.001 if at < 10.195 else 0.003
    share = landed_share(samples, receipts, {"a": 1, "b": 1}, cores=2)
    assert share == pytest.approx(0.020 / 0.050)
    # one worker of two threads fills both cores alone: all of it landed
    assert landed_share(samples, receipts, {"a": 2, "b": 1}, cores=2) == pytest.approx(1.0)
    # a core left over: none did
    assert landed_share(samples, receipts, {"a": 1, "b": 1}, cores=3) == 0.0
    # CPU before the first task and after the last is not the round's
    outside = [(9.0, 0.0), (9.99, 1.0)] + [(t, c + 1.0) for t, c in samples] + [(11.0, 5.0)]
    assert landed_share(outside, receipts, {"a": 1, "b": 1}, cores=2) == pytest.approx(share)
    # nothing to tell: a client that did nothing, or no samples or receipts
    idle = [(10.0 + i * 0.01, 0.0) for i in range(31)]
    assert landed_share(idle, receipts, {"a": 1, "b": 1}, 2) is None
    assert landed_share(samples[:1], receipts, {"a": 1, "b": 1}, 2) is None
    assert landed_share(samples, [], {"a": 1, "b": 1}, 2) is None
    # a reading a hair low (the sampler caught mid-step) makes the interval before it
    # read below zero: no CPU given back, or the share of what follows passes the whole
    late = [_receipt("a", 10.0, 10.3), _receipt("b", 10.0, 10.3, ((10.0, 10.1),))]
    dipped = [(10.0, 0.0), (10.05, 0.0), (10.1, -0.001), (10.15, 0.001), (10.3, 0.001)]
    assert landed_share(dipped, late, {"a": 1, "b": 1}, cores=2) == pytest.approx(1.0)


def test_the_client_cpu_timeline_reads_this_process_cpu_less_the_samplers_own():
    with cpu_timeline(0.001) as samples:
        spun = time.thread_time() + 0.05
        while time.thread_time() < spun:  # 50 ms of this thread's CPU
            pass
        spin_end = time.time()
        time.sleep(0.05)  # and then none
    assert len(samples) > 10
    clock = [t for t, _ in samples]
    assert clock == sorted(clock)
    cpu = samples[-1][1] - samples[0][1]
    assert 0.04 <= cpu < 0.075  # the spin (a first ms before the first read), no reads
    after = [c for t, c in samples if t > spin_end + 0.002]
    assert after and after[-1] - after[0] < 0.01  # none of it while the thread slept


def test_the_share_is_the_median_round_and_none_without_a_measurement():
    assert median_share([0.2, None, 0.4, 0.5]) == pytest.approx(0.4)
    assert median_share([0.9, 1.0, 1.0]) == 1.0
    assert median_share([None]) is None and median_share([]) is None
    # rounds that disagree: the median would be noise
    assert median_share([0.0, 0.1, 0.9, 1.0]) is None


def test_the_reference_probe_steps_with_the_runs_sgd(tmp_path, monkeypatch):
    """One cached reference probe per kind of SGD (momentum, weight decay, Nesterov: the
    passes of its update), each timed with that SGD; the learning rate is not one."""
    monkeypatch.setenv("CNN_PROBE_CACHE", str(tmp_path / "probes"))
    stepped: list[OptimizerSpec] = []
    real = reference.torch_sgd
    monkeypatch.setattr(reference, "torch_sgd",
                        lambda params, spec: stepped.append(spec) or real(params, spec))
    spec = _spec("resnet20", 0.25)
    plain = OptimizerSpec(lr=0.1, momentum=0.0, weight_decay=0.0)
    default = cached_master_probe(spec, 8, 1)
    without = cached_master_probe(spec, 8, 1, optimizer=plain)
    assert without.key != default.key
    assert stepped == [reference.DEFAULT_OPTIMIZER, plain]
    assert cached_master_probe(spec, 8, 1, optimizer=replace(plain, lr=0.01)).key == without.key
    assert cached_master_probe(spec, 8, 1, optimizer=OptimizerSpec(lr=0.2)).key == default.key
    assert len(stepped) == 2  # both cached: neither timed again
    assert optimizer_key(OptimizerSpec(lr=1.0)) == ""


def test_the_reference_probe_times_every_layer_of_a_graph_network():
    spec = _spec("resnet20", 0.25)
    master = probe_master(spec, 8, 1)
    assert [t.layer for t in master.timings] == list(range(len(spec.conv)))
    for t in master.timings:
        assert t.forward_s > 0 and t.backward_s > 0, t
    assert master.dense_s > 0


@pytest.fixture
def probe_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CNN_PROBE_CACHE", str(tmp_path / "probes"))
    return tmp_path / "probes"


def test_a_probe_of_resnet20_on_two_workers_times_every_layer(shared_cluster, probe_cache,
                                                              monkeypatch):
    cut_probe_to_one_round(monkeypatch)
    client, cluster = shared_workers(shared_cluster, "PROBE")
    register_setup(client, cluster)
    offered = find_workers(client, cluster)
    spec = _spec("resnet20", 0.25)
    probe = cached_probe(client, offered, spec, 8, [2] * len(spec.conv))
    assert probe.network_spec() == spec
    names = [conv.name for conv in costmodel_network(spec).conv]
    for active in (1, 2):
        for device in probe.device_specs(active):
            assert sorted(device.layer_tables) == sorted(names), (active, device.name)
    for worker in probe.workers:
        assert worker.trunk is not None and worker.trunk.forward_s > 0
    assert probe.master.dense_s > 0
    assert find_cached_probe(probe.key) == probe  # its JSON record comes back whole


def _normed() -> NetworkSpec:
    """Two conv layers with batch norm (no bias) and a max-pool between them: a network
    that gives the replica plan's trunk a batch norm to synchronise, or not, at the
    cost of a tiny checkpoint."""
    builder = NetworkBuilder(3, 16, 16)
    builder.conv(4, 3, 1, 1, False, True, True, name="0", bn_name="1")
    builder.pool("max", 2)
    builder.conv(4, 3, 1, 1, False, True, True, name="4", bn_name="5")
    return builder.network([], 10, "float32", ["8"], [])


def _slots_read(network: NetworkSpec, batch_norm: str, client, offered) -> set[str]:
    """The kinds of slot (``bn-fwd``, ``grads``...) the replica plan's trunk read."""
    plan = runs.replica_plan(network, 8, len(offered))
    with cluster_probe._dataset_for(network, 8, None) as dataset, \
            runs.PlanEngines(client, offered, network, 8, dataset, [plan],
                             batch_norm=batch_norm) as engines:
        run = engines.run(plan, 0)
    return {phase.slot.split("/")[0] for receipt in run.receipts for event in receipt.events
            for phase in event.phases if phase.kind == "read" and phase.slot}


def test_the_replica_plan_runs_the_replicas_batch_norm_as_the_run_does(shared_cluster):
    """The probe times the replicas' trunk in the run's ``train.batch_norm``: under
    ``sync`` it meets its peer at every batch norm (a ``local`` run's trunk, timed that
    way, read 14-15 % slow on resnet20), under ``local`` it does not; the two are
    cached apart, and a network without batch norm keeps one probe for both."""
    client, cluster = shared_workers(shared_cluster, "PROBE")
    register_setup(client, cluster)
    offered = find_workers(client, cluster)[:2]
    normed = _normed()
    assert {"bn-fwd", "bn-bwd"} <= _slots_read(normed, "sync", client, offered)
    assert not {"bn-fwd", "bn-bwd"} & _slots_read(normed, "local", client, offered)
    key = partial(probe_key, quanta=[1, 1], workers=[("a", 1)], workspace="shm", dataset=None)
    assert key(normed, 8, batch_norm="local") != key(normed, 8, batch_norm="sync")
    plain = _spec("marques", 0.25)  # no batch norm
    assert key(plain, 8, batch_norm="local") == key(plain, 8, batch_norm="sync")
