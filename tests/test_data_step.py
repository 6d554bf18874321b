"""A ``data`` replica timed as ``data`` runs it (pure: no cluster).

The case behind it (2026-11-29): on the small network at 2 workers, a ``data``
replica's step computed for 24.8-25.0 ms where ``hybrid``'s trunk ops took 25.4-25.8
and the probe's (hybrid) replica plan read the trunk alone at 26.1, so every ``data``
point was predicted several percent slow. The probe now runs a data replica plan
beside the hybrid one, and the model brings a ``data`` replica's layers to its
measured whole step. Its real run on a cluster is checked in tests/test_prediction.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.costmodel import DeviceSpec, Options, StoreSpec, conv_net
from pipeline.costmodel.compute import FLATTEN_ACCESSES, GATHER_ACCESSES
from pipeline.costmodel.data import replica_times, whole_step
from pipeline.costmodel.devices import IDEAL_LINK, TrunkTime
from pipeline.costmodel.replicas import predict_data_store, predict_hybrid_store
from pipeline.probe.readings import steady_receipts, trunk_timings
from pipeline.probe.runs import PlanRun, replica_plan
from tasks.receipts import OpEvent, Phase, Receipt
from tasks.replica_layout import (DENSE_BACKWARD, DENSE_FORWARD, GRAD_UPDATE, REPLICA_STEP,
                                  TRUNK_BACKWARD, TRUNK_FORWARD)
from tasks.specs import ConvLayerSpec, NetworkSpec

MS = 1e-3
NARROW = NetworkSpec((ConvLayerSpec(3, 8, in_height=8, in_width=8),), hidden=(), classes=2)


def _event(name: str, *phases: tuple[str, float]) -> OpEvent:
    out, t = [], 0.0
    for kind, seconds in phases:
        out.append(Phase(kind, t, t + seconds))
        t += seconds
    return OpEvent(name, -1, 0.0, t, out)


def _runs(step_compute: dict[str, float], rows: list[int],
          update: dict[str, float] | None = None) -> list[PlanRun]:
    """Two rounds of a hybrid replica plan (trunk 10 + 20 ms a worker, its dense ops
    1 ms forward after a 2 ms gather of the features and 3 ms backward) and of a data
    one whose replica-step reads its batch, computes, waits for a peer, and computes
    its hand-on copies (the compute split 80/20 around the wait); then its grad-update
    reads the peer's sum and computes `update` (4 ms where not given)."""
    update = update or {}
    hybrid = replica_plan(NARROW, sum(rows), len(rows))
    data = replica_plan(NARROW, sum(rows), len(rows), whole=True)
    names = list(step_compute)
    out = []
    for r in (0, 1):
        out.append(PlanRun(dataclasses.replace(hybrid, shares=rows), names, [
            Receipt("t", w, s, 0.0, 1.0, [_event(TRUNK_FORWARD, ("dataset", 3 * MS),
                                                 ("compute", 10 * MS)),
                                          _event(DENSE_FORWARD, ("read", 2 * MS),
                                                 ("compute", 1 * MS)),
                                          _event(DENSE_BACKWARD, ("compute", 3 * MS)),
                                          _event(TRUNK_BACKWARD, ("compute", 20 * MS))])
            for w in names for s in (2, 3, 4)], r))
        out.append(PlanRun(dataclasses.replace(data, shares=rows), names, [
            Receipt("t", w, s, 0.0, 1.0, [
                _event(REPLICA_STEP, ("dataset", 3 * MS), ("compute", 0.8 * seconds),
                       ("wait", 5 * MS), ("compute", 0.2 * seconds), ("io", 2 * MS)),
                _event(GRAD_UPDATE, ("read", 1 * MS), ("compute", update.get(w, 4 * MS)))])
            for w, seconds in step_compute.items() for s in (2, 3, 4)], r))
    return out


def test_a_data_replica_plan_runs_where_hybrid_cannot_split_the_head():
    assert replica_plan(NARROW, 16, 4) is None  # hybrid's head: 2 classes over 4 workers
    plan = replica_plan(NARROW, 16, 4, whole=True)
    assert plan is not None and plan.shares == [4, 4, 4, 4] and plan.whole
    assert replica_plan(NARROW, 3, 4, whole=True) is None  # fewer rows than workers


def test_the_data_step_is_read_off_the_replica_step_compute_alone():
    trunks = trunk_timings(_runs({"cpu-0": 27 * MS, "cpu-1": 33 * MS}, [8, 8]))
    # the compute around the wait, not the batch read, the wait or the write
    assert trunks["cpu-0"].data_step_s == pytest.approx(27 * MS)
    assert trunks["cpu-1"].data_step_s == pytest.approx(33 * MS)
    assert trunks["cpu-0"].forward_s == pytest.approx(10 * MS)  # the hybrid plan's trunk
    # alike workers pool their steps as their trunks do
    pooled = trunk_timings(_runs({"cpu-0": 27 * MS, "cpu-1": 33 * MS}, [8, 8]),
                           [["cpu-0", "cpu-1"]])
    assert pooled["cpu-0"].data_step_s == pooled["cpu-1"].data_step_s
    assert 27 * MS < pooled["cpu-0"].data_step_s < 33 * MS
    # quartile bounds move it with the trunk
    spread = dataclasses.replace(trunks["cpu-0"], low_s=27 * MS, high_s=33 * MS)
    assert spread.scaled("high").data_step_s == pytest.approx(27 * MS * 1.1)


def test_no_data_step_without_a_data_plan_at_the_trunks_rows():
    runs = [run for run in _runs({"cpu-0": 27 * MS, "cpu-1": 33 * MS}, [8, 8])
            if not run.plan.whole]
    assert trunk_timings(runs)["cpu-0"].data_step_s is None
    assert trunk_timings(runs)["cpu-0"].update_s is None


def test_hybrids_dense_ops_are_read_off_its_plan_as_they_are_whatever_the_rows():
    """Their compute, not the features' gather; the whole batch's neurons, so alike
    workers at uneven rows pool them as they are; none without a hybrid plan."""
    steps = {"cpu-0": 27 * MS, "cpu-1": 33 * MS}
    trunks = trunk_timings(_runs(steps, [8, 8]))
    assert [trunks[w].hybrid_head_s for w in steps] == pytest.approx([4 * MS, 4 * MS])
    pooled = trunk_timings(_runs(steps, [9, 3]), [["cpu-0", "cpu-1"]])
    assert pooled["cpu-0"].hybrid_head_s == pytest.approx(4 * MS)
    assert pooled["cpu-1"].hybrid_head_s == pytest.approx(4 * MS)
    data_only = [run for run in _runs(steps, [8, 8]) if run.plan.whole]
    assert all(t.hybrid_head_s is None for t in trunk_timings(data_only).values())


def test_the_update_is_read_off_the_grad_update_compute_at_any_rows():
    steps = {"cpu-0": 27 * MS, "cpu-1": 33 * MS}
    update = {"cpu-0": 4 * MS, "cpu-1": 6 * MS}
    trunks = trunk_timings(_runs(steps, [8, 8], update))
    # the compute alone, not the read of the peer's sum
    assert [trunks[w].update_s for w in steps] == pytest.approx([4 * MS, 6 * MS])
    # an update covers every parameter whatever the rows: alike workers at uneven rows
    # pool their updates as they are, where their trunks pool per row
    pooled = trunk_timings(_runs(steps, [9, 3], update), [["cpu-0", "cpu-1"]])
    assert pooled["cpu-0"].update_s == pooled["cpu-1"].update_s
    assert 4 * MS <= pooled["cpu-0"].update_s <= 6 * MS
    assert pooled["cpu-0"].data_step_s > 2 * pooled["cpu-1"].data_step_s


NETWORK = conv_net([16, 32], image=16, kernel=3, padding=1, classes=10)


def _device(data_step: float | None) -> DeviceSpec:
    return DeviceSpec(flops=5e9, mem_bw=2e9,
                      trunk=TrunkTime(16, 4 * MS, 8 * MS, dense=1 * MS, data_step=data_step))


def test_a_data_replicas_layers_come_to_its_measured_step():
    plain, timed = _device(None), _device(10 * MS)
    (before,) = replica_times([plain], NETWORK, [16])
    (after,) = replica_times([timed], NETWORK, [8], data_step=True)
    flatten = timed.stream_time(FLATTEN_ACCESSES * (NETWORK.params() - NETWORK.conv_params()))
    # forward and backward of every layer, at half the rows: half the step, less the
    # dense gradients' flattening the store model adds
    assert sum(t.forward + t.backward for t in after) == pytest.approx(5 * MS - flatten)
    # each layer keeps its share of the pass
    ratio = [a.forward / b.forward for a, b in zip(after, before)]
    assert max(ratio) == pytest.approx(min(ratio))
    assert replica_times([plain], NETWORK, [8], data_step=True) == \
        replica_times([plain], NETWORK, [8])  # nothing measured: the trunk stands
    (hybrid,) = replica_times([timed], NETWORK, [8], dense=False, data_step=False)
    assert sum(t.forward + t.backward for t in hybrid) == pytest.approx(6 * MS)
    assert whole_step(_device(flatten / 2), after, NETWORK, 16) is after  # nothing left


def test_replica_updates_are_priced_at_the_measured_update_rate():
    store = StoreSpec(write_bw=2e9, read_bw=2e9, latency=0.0, client_write_bw=1e9,
                      client_read_bw=1e9, read_chunk=1e-4, write_chunk=1e-4)
    plain = _device(10 * MS)
    # the update streams four times as fast as the memory rate: one quarter the time
    fast = dataclasses.replace(plain, update_bw=4 * plain.mem_bw)
    assert fast.update_time(1e6) == pytest.approx(plain.stream_time(1e6) / 4)
    assert fast.stream_time(1e6) == plain.stream_time(1e6)  # every other pass as it was
    accesses = (GATHER_ACCESSES + NETWORK.update_accesses())
    for model, params in ((predict_data_store, NETWORK.params()),
                          (predict_hybrid_store, NETWORK.conv_params())):
        slow_step, fast_step = (model(NETWORK, 32, [d] * 2, IDEAL_LINK, store,
                                      Options(dense_batch="worker")).step_time
                                for d in (plain, fast))
        saved = 0.75 * plain.stream_time(accesses * params)
        assert slow_step - fast_step == pytest.approx(saved, rel=1e-6), model


def test_data_predictions_use_the_data_step_and_hybrid_its_trunk():
    store = StoreSpec(write_bw=2e9, read_bw=2e9, latency=0.0, client_write_bw=1e9,
                      client_read_bw=1e9, read_chunk=1e-4, write_chunk=1e-4)
    def predict(model, data_step):
        return model(NETWORK, 32, [_device(data_step)] * 2, IDEAL_LINK, store, Options())
    slow, fast = predict(predict_data_store, 30 * MS), predict(predict_data_store, 20 * MS)
    assert slow.step_time - fast.step_time == pytest.approx(10 * MS, rel=0.05)
    assert predict(predict_hybrid_store, 30 * MS).step_time == \
        predict(predict_hybrid_store, 20 * MS).step_time


def test_a_measured_tasks_first_step_is_left_out_of_the_readings():
    """The first step of a measured task pays the task's start on the worker's core
    (the model prices it apart): a task of three steps is read off its last two, so a
    slow first step cannot leave the slower of the others as the median; a task of
    two keeps both."""
    data = replica_plan(NARROW, 16, 2, whole=True)
    hybrid = [run for run in _runs({"cpu-0": 0.0, "cpu-1": 0.0}, [8, 8]) if not run.plan.whole]

    def run(step_ms: dict[int, float], r: int) -> PlanRun:
        return PlanRun(data, ["cpu-0", "cpu-1"], [
            Receipt("t", w, s, 0.0, 1.0, [_event(REPLICA_STEP, ("compute", ms * MS))])
            for w in ("cpu-0", "cpu-1") for s, ms in step_ms.items()], r)

    three = [run({2: 40.0, 3: 27.0, 4: 25.0}, 0), run({6: 38.0, 7: 25.0, 8: 27.0}, 1)]
    assert trunk_timings(hybrid + three)["cpu-0"].data_step_s == pytest.approx(26 * MS)  # not 27
    assert [r.step for r in steady_receipts(three[1])] == [7, 8, 7, 8]
    two = [run({2: 40.0, 3: 26.0}, 0), run({6: 38.0, 7: 24.0}, 1)]
    assert trunk_timings(hybrid + two)["cpu-0"].data_step_s == pytest.approx(32 * MS)
    assert len(steady_receipts(two[0])) == 4
