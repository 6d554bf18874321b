"""Probe timings that one scheduler hiccup cannot move (no cluster).

The case behind it (2026-11-25): worker cpu-1's conv1 backward at 28 kernels was
timed once at 60 ms among 7 ms neighbours, and cpu-1's whole-layer time came out
2.5x too slow. These tests feed such timings, synthetic, through the statistic, the
"time grows with kernels" check, the receipts-to-timings path and the model's tables;
and the replica plan's conv trunks, which `data` and `hybrid` predictions take instead;
and the in-process reference probe's rounds (a burst over all of one short round).
"""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.costmodel.data import measured_trunk, replica_times
from pipeline.probe import (ClusterProbe, DaskProbe, MasterProbe, ShardTiming, StoreProbe,
                            TrunkTiming, WorkerProbe, cluster_probe_from_dict)
from pipeline.probe.tables import mark_outliers, table_points
from pipeline.probe.robust import consistent, estimate, inconsistent
from pipeline.probe.readings import shard_timings, trunk_timings
from pipeline.probe.rounds import plans_holding, suspects
from pipeline.probe import reference
from pipeline.probe.runs import PlanRun, ProbePlan, replica_plan
from tasks.layout import CONV_BACKWARD, CONV_FORWARD
from tasks.replica_layout import TRUNK_BACKWARD, TRUNK_FORWARD
from tasks.receipts import OpEvent, Phase, Receipt
from tasks.specs import ConvLayerSpec, NetworkSpec

MS = 1e-3
# cpu-1's conv1 backward as a probe once timed it: 60 ms at 28 kernels, 7 ms at 24
BACKWARD = {4: 2.6 * MS, 8: 2.8 * MS, 16: 3.7 * MS, 24: 7.0 * MS, 28: 60.0 * MS}
FORWARD = {4: 4.5 * MS, 8: 5.9 * MS, 16: 9.1 * MS, 24: 12.3 * MS, 28: 13.2 * MS}


def test_median_of_rounds_ignores_one_slow_round():
    rounds = [[7.1 * MS, 7.0 * MS, 6.9 * MS], [60 * MS, 61 * MS, 59 * MS],
              [7.2 * MS, 7.0 * MS, 7.3 * MS]]
    e = estimate(rounds)
    assert e.value == pytest.approx(7.2 * MS)  # the rounds' medians: 7.0, 60, 7.2
    assert e.settled and e.rounds == 3 and e.samples == 9
    assert e.low <= e.value and e.high >= 59 * MS  # the spread keeps what was seen


def test_two_rounds_that_disagree_are_not_settled():
    e = estimate([[7 * MS] * 3, [60 * MS] * 3])
    assert not e.settled  # neither round confirms the median: time it again
    assert estimate([[7 * MS] * 3, [7.6 * MS] * 3]).settled
    assert estimate([[60 * MS, 7 * MS, 7 * MS]]).settled  # one round: taken as it is
    assert estimate([[60 * MS, 7 * MS, 7 * MS]]).value == 7 * MS  # one slow step


def test_estimate_needs_a_step():
    with pytest.raises(ValueError):
        estimate([[], []])


def test_the_60ms_outlier_among_7ms_neighbours_is_left_out():
    points = {k: (FORWARD[k], BACKWARD[k]) for k in BACKWARD}
    assert inconsistent(points) == [28]  # the largest count: no larger one to compare
    with_32 = {**points, 32: (13.8 * MS, 9.2 * MS)}
    assert inconsistent(with_32) == [28]  # slower than the larger count too
    assert set(consistent(with_32)) == {4, 8, 16, 24, 32}


def test_a_too_fast_point_is_left_out_not_its_neighbours():
    points = {k: (FORWARD[k], BACKWARD[k]) for k in (4, 8, 16, 24)}
    points[28] = (1 * MS, 1 * MS)  # breaks with every smaller count
    assert inconsistent(points) == [28]


def test_plateaus_and_block_steps_are_kept():
    # measured here: 16 and 24 kernels alike (oneDNN blocks), 8 -> 16 about 2.4x
    points = {4: (3.5 * MS, 2.7 * MS), 8: (5.2 * MS, 3.1 * MS), 16: (12.5 * MS, 3.5 * MS),
              24: (12.3 * MS, 5.9 * MS), 28: (13.4 * MS, 6.2 * MS), 32: (13.8 * MS, 9.2 * MS)}
    assert inconsistent(points) == []
    assert inconsistent({8: (1.0, 1.0)}) == []  # one point always stays


def _timings(backward: dict[int, float]) -> list[ShardTiming]:
    return [ShardTiming(0, k, 2, FORWARD[k], b, 0.2 * b) for k, b in backward.items()]


def test_the_models_table_leaves_the_outlier_out():
    timings = mark_outliers(_timings(BACKWARD))
    assert [t.kernels for t in timings if t.outlier] == [28]
    assert 28 not in table_points(timings, 0, 2)
    clean = {**BACKWARD, 28: 7.6 * MS}
    probe = _probe({"cpu-0": _timings(clean), "cpu-1": _timings(BACKWARD)})
    fast, slow = (d.layer_tables["conv1"] for d in probe.device_specs(2))
    # cpu-1's whole layer (what a data-parallel replica runs) as its clean twin's, but
    # for extrapolating from 24 kernels rather than 28
    assert sum(slow.times(32, 128)) == pytest.approx(sum(fast.times(32, 128)), rel=0.2)
    assert sum(slow.times(32, 128)) < 0.05  # against 0.13 s extrapolated through 60 ms


def _probe(timings: dict[str, list[ShardTiming]]) -> ClusterProbe:
    network = NetworkSpec((ConvLayerSpec(3, 32, in_height=32, in_width=32),))
    workers = [WorkerProbe(name, name, 1, 1.0, mine) for name, mine in timings.items()]
    return ClusterProbe("synthetic", 0.0, "host", dataclasses.asdict(network), 128, [4],
                        workers, StoreProbe("shm", 3e-4, 2e9, 3e-4, 1e9, 3e-4),
                        DaskProbe(0.002, 0.0005, 0.01, 0.01),
                        MasterProbe(1, 128, 0.002, dense_low_s=0.0018, dense_high_s=0.003))


def _receipt(worker: str, step: int, forward: float, backward: float) -> Receipt:
    def event(name: str, seconds: float) -> OpEvent:
        return OpEvent(name, 0, 0.0, seconds, [Phase("compute", 0.0, seconds)])
    return Receipt("t", worker, step, 0.0, 1.0, [event(CONV_FORWARD, forward),
                                                  event(CONV_BACKWARD, backward)])


def test_rounds_of_receipts_become_robust_timings_and_the_bad_size_is_timed_again():
    plan = ProbePlan([[4, 28]])
    runs = [PlanRun(plan, ["cpu-0", "cpu-1"],
                    [_receipt("cpu-0", s, 4.5 * MS, 2.6 * MS) for s in (2, 3, 4)]
                    + [_receipt("cpu-1", s, 13 * MS, b) for s, b in zip((2, 3, 4), slow)],
                    round_index)
            for round_index, slow in enumerate(([7 * MS] * 3, [60 * MS] * 3))]
    timings = shard_timings(runs)
    big = next(t for t in timings["cpu-1"] if t.kernels == 28)
    assert (big.rounds, big.steps, big.settled) == (2, 4, False)  # each task's first left out
    assert big.high_s >= 60 * MS and big.low_s <= 20 * MS
    assert suspects(timings) == {("cpu-1", 0, 28, 2)}
    other = ProbePlan([[16, 16]])
    assert plans_holding([other, plan], suspects(timings), ["cpu-0", "cpu-1"]) == [plan]
    # a third round agrees with the first: the figure is the quiet one, settled
    runs.append(PlanRun(plan, ["cpu-0", "cpu-1"],
                        [_receipt("cpu-1", s, 13 * MS, 7.1 * MS) for s in (2, 3, 4)], 2))
    big = next(t for t in shard_timings(runs)["cpu-1"] if t.kernels == 28)
    assert big.settled and big.rounds == 3 and big.backward_s == pytest.approx(7.1 * MS)


def test_bounds_scale_every_timing_and_survive_json():
    probe = _probe({"cpu-0": [dataclasses.replace(t, low_s=0.9 * (t.forward_s + t.backward_s),
                                                  high_s=1.2 * (t.forward_s + t.backward_s))
                              for t in _timings({**BACKWARD, 28: 7.6 * MS})]})
    low, high = probe.at("low"), probe.at("high")
    assert probe.at("mid") is probe
    for a, b, c in zip(low.workers[0].timings, probe.workers[0].timings,
                       high.workers[0].timings):
        assert a.backward_s == pytest.approx(0.9 * b.backward_s)
        assert c.forward_s == pytest.approx(1.2 * b.forward_s)
    assert (low.master.dense_s, high.master.dense_s) == (0.0018, 0.003)
    assert cluster_probe_from_dict(dataclasses.asdict(probe)) == probe
    # no spread kept (a reference probe, or an old one): the bound is the figure
    plain = ShardTiming(0, 4, 1, 1.0, 2.0)
    assert plain.scaled("low") == plain and plain.scaled("high") == plain


def _trunk_receipt(worker: str, step: int, forward: float, backward: float) -> Receipt:
    def event(name: str, seconds: float) -> OpEvent:
        return OpEvent(name, -1, 0.0, seconds, [Phase("compute", 0.0, seconds)])
    return Receipt("t", worker, step, 0.0, 1.0, [event(TRUNK_FORWARD, forward),
                                                  event(TRUNK_BACKWARD, backward)])


def test_the_replica_plan_times_each_workers_trunk_and_replicas_use_it():
    network = NetworkSpec((ConvLayerSpec(3, 32, in_height=32, in_width=32),))
    plan = replica_plan(network, 128, 2)
    assert plan is not None and plan.shares == [64, 64]
    assert replica_plan(network, 1, 2) is None  # fewer rows than workers
    runs = [PlanRun(plan, ["cpu-0", "cpu-1"],
                    [_trunk_receipt(w, s, f, 2 * f) for w, f in (("cpu-0", 0.010), ("cpu-1", 0.012))
                     for s in (2, 3, 4)], r) for r in (0, 1)]
    trunks = trunk_timings(runs)
    assert trunks["cpu-1"] == TrunkTiming(64, 2, 0.012, 0.024, 2, 4, pytest.approx(0.036),
                                          pytest.approx(0.036), True)
    assert plans_holding([ProbePlan([[16, 16]]), plan], {("cpu-1", -1, 64, 2)},
                         ["cpu-0", "cpu-1"]) == [plan]
    assert suspects({}, {**trunks, "cpu-1": dataclasses.replace(trunks["cpu-1"],
                                                                settled=False)}) == \
        {("cpu-1", -1, 64, 2)}
    # the model: a replica's conv time is the measured trunk, scaled in rows, split over
    # the layers as their tables split it; kernel shards keep their tables
    clean = _timings({**BACKWARD, 28: 7.6 * MS})
    probe = _probe({"cpu-0": clean, "cpu-1": clean})
    probe.workers[1].trunk = trunks["cpu-1"]
    plain, measured = probe.device_specs(2)
    assert plain.trunk is None and measured.trunk.times(32) == pytest.approx((0.006, 0.012))
    net = probe.costmodel_network()
    (row,) = replica_times([measured], net, [32], dense=False)
    assert (row[0].forward, row[0].backward) == pytest.approx((0.006, 0.012))
    assert measured_trunk(plain, row, 1, 32) is row  # no trunk: the tables as they are
    assert probe.device_specs(1)[0].trunk is None  # measured with 2 running, not 1
    assert cluster_probe_from_dict(dataclasses.asdict(probe)) == probe
    assert probe.at("high").workers[1].trunk.forward_s == pytest.approx(0.012)  # no spread


def test_alike_workers_trunks_are_figured_together_each_at_its_own_rows():
    """Two alike workers whose few steps read 15 % apart: together, one figure per row
    for both (not each its own, of which the model would wait for the slower); a
    worker of another kind keeps its own."""
    network = NetworkSpec((ConvLayerSpec(3, 32, in_height=32, in_width=32),))
    plan = replica_plan(network, 99, 3)
    assert plan.shares == [33, 33, 33]
    plan = dataclasses.replace(plan, shares=[40, 40, 19])
    seconds = {"cpu-0": 0.0115, "cpu-1": 0.0100, "gpu-0": 0.001}  # for their rows
    runs = [PlanRun(plan, ["cpu-0", "cpu-1", "gpu-0"],
                    [_trunk_receipt(w, s, f, 2 * f) for w, f in seconds.items()
                     for s in (2, 3, 4)], r) for r in (0, 1)]
    alone = trunk_timings(runs)
    pooled = trunk_timings(runs, [["cpu-0", "cpu-1"], ["gpu-0"]])
    assert alone["cpu-0"].forward_s == pytest.approx(0.0115)
    assert pooled["cpu-0"].forward_s == pooled["cpu-1"].forward_s
    assert 0.0100 < pooled["cpu-0"].forward_s < 0.0115
    assert pooled["cpu-0"].steps == 8 and pooled["cpu-0"].rows == 40
    assert pooled["gpu-0"] == alone["gpu-0"]
    assert pooled["gpu-0"].rows == 19


def _read_then_compute(name: str, read: float | None, compute: float) -> OpEvent:
    phases = [Phase("dataset", 0.0, read)] if read is not None else []
    return OpEvent(name, 0 if name == CONV_FORWARD else -1, 0.0, (read or 0.0) + compute,
                   phases + [Phase("compute", read or 0.0, (read or 0.0) + compute)])


def test_batch_reads_are_figured_per_shard_and_trunk_and_reach_the_model():
    """The batch read before the first layer's forward is kept per cell, as its plan
    timed it ([16, 16]: both read at once, 38 ms; [28, 4]: 16 ms), and the replica's
    per trunk; the model's first-layer table and trunk carry them; a probe whose
    receipts hold no read keeps none (the model then uses the dataset store's)."""
    def shard_receipt(worker: str, step: int, read: float | None) -> Receipt:
        return Receipt("t", worker, step, 0.0, 1.0, [
            _read_then_compute(CONV_FORWARD, read, 5 * MS),
            OpEvent(CONV_BACKWARD, 0, 0.0, 4 * MS, [Phase("compute", 0.0, 4 * MS)])])

    def runs_of(reads: dict[tuple[int, ...], float | None]) -> list[PlanRun]:
        return [PlanRun(ProbePlan([list(counts)]), ["cpu-0", "cpu-1"],
                        [shard_receipt(w, s, read) for w in ("cpu-0", "cpu-1")
                         for s in (2, 3, 4)], r)
                for counts, read in reads.items() for r in (0, 1)]

    timings = shard_timings(runs_of({(16, 16): 38 * MS, (28, 4): 16 * MS}))
    by_cell = {(w, t.kernels): t.dataset_s for w, ts in timings.items() for t in ts}
    assert by_cell == pytest.approx({("cpu-0", 16): 38 * MS, ("cpu-1", 16): 38 * MS,
                                     ("cpu-0", 28): 16 * MS, ("cpu-1", 4): 16 * MS})
    probe = _probe(timings)
    first = probe.device_specs(2)[0].layer_tables["conv1"]
    assert first.kernels == (16, 28) and first.dataset == pytest.approx((38 * MS, 16 * MS))
    assert first.dataset_time(16, 128) == pytest.approx(38 * MS)
    assert cluster_probe_from_dict(dataclasses.asdict(probe)) == probe
    unread = shard_timings(runs_of({(16, 16): None}))
    assert all(t.dataset_s is None for ts in unread.values() for t in ts)
    assert _probe(unread).device_specs(2)[0].layer_tables["conv1"].dataset == ()
    # the replica plan: each worker's read of its rows, beside its trunk
    plan = replica_plan(NetworkSpec((ConvLayerSpec(3, 32, in_height=32, in_width=32),)), 128, 2)
    trunk_runs = [PlanRun(plan, ["cpu-0", "cpu-1"], [
        Receipt("t", w, s, 0.0, 1.0, [_read_then_compute(TRUNK_FORWARD, read, 10 * MS),
                                      _read_then_compute(TRUNK_BACKWARD, None, 20 * MS)])
        for w, read in (("cpu-0", 13 * MS), ("cpu-1", 15 * MS)) for s in (2, 3, 4)], r)
        for r in (0, 1)]
    trunks = trunk_timings(trunk_runs)
    assert (trunks["cpu-0"].dataset_s, trunks["cpu-1"].dataset_s) == pytest.approx(
        (13 * MS, 15 * MS))
    assert trunks["cpu-0"].forward_s == pytest.approx(10 * MS)  # the read is not compute
    probe.workers[1].trunk = trunks["cpu-1"]
    assert probe.device_specs(2)[1].trunk.dataset_time(32) == pytest.approx(7.5 * MS)


def test_the_reference_probe_times_short_steps_in_rounds_and_long_ones_in_one():
    assert reference.rounds_for(0.01, 5) == reference.REFERENCE_ROUNDS > 1
    assert reference.rounds_for(0.4, 3) == 1  # 1.2 s a round: a burst covers one step
    tiny = NetworkSpec((ConvLayerSpec(3, 4, in_height=8, in_width=8),), classes=10)
    rounds = reference.time_network(tiny, 4)
    repeats, _ = reference.repeats_for(0.0)
    assert [len(rows) for rows in rounds] == [repeats] * reference.REFERENCE_ROUNDS
    for rows in rounds:
        for forward, backward, rest in rows:
            assert len(forward) == len(backward) == 1 and forward[0] > 0 and backward[0] > 0


def test_a_burst_over_one_whole_round_of_the_reference_probe_moves_no_figure(monkeypatch):
    """All five steps of one round 40 % slow (as a 2-thread probe of the small network
    once read, every step inside one burst), and the burst's end over two steps of the
    next: the figures are the median of the rounds' medians (all 15 steps' median
    would be a slow step)."""
    def row(scale: float) -> tuple[list[float], list[float], float]:
        return [4 * MS * scale], [6 * MS * scale], 2 * MS * scale
    rounds = [[row(1.0)] * 5, [row(1.4)] * 5, [row(1.4)] * 2 + [row(1.02)] * 3]
    monkeypatch.setattr(reference, "time_network", lambda *args, **kwargs: rounds)
    network = NetworkSpec((ConvLayerSpec(3, 4, in_height=8, in_width=8),), classes=10)
    probe = reference.probe_master(network, 4)
    (timing,) = probe.timings
    assert timing.forward_s == pytest.approx(4 * MS * 1.02)
    assert timing.backward_s == pytest.approx(6 * MS * 1.02)
    assert probe.dense_s == pytest.approx(2 * MS * 1.02)
    assert timing.rounds == 3 and timing.steps == 15
