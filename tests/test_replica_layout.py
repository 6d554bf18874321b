"""Data-parallel and hybrid layouts as pure functions (no cluster)."""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.config.schema import ConfigError
from pipeline.strategies import STRATEGIES, strategy_of

from tasks.layout import StepOp, exchange_slots, workspace_bytes
from tasks.replica_layout import (DataLayout, HybridLayout, conv_parameter_count,
                                  dense_parameter_count, split_counts)
from tasks.specs import ConvLayerSpec, NetworkSpec
from tests.helpers import tiny_config

NET = NetworkSpec((ConvLayerSpec(3, 10), ConvLayerSpec(10, 12, in_height=16, in_width=16)),
                  hidden=(16,))
FEATURES = 12 * 8 * 8
CONV = 10 * (3 * 25 + 1) + 12 * (10 * 25 + 1)
DENSE = FEATURES * 16 + 16 + 16 * 10 + 10


def test_parameter_counts():
    assert conv_parameter_count(NET) == CONV
    assert dense_parameter_count(NET) == DENSE
    assert split_counts(10, 3) == [4, 3, 3] and split_counts(2, 3) == [1, 1, 0]


def test_data_parallel_ops_slots_and_bytes():
    layout = DataLayout(("w0", "w1", "w2"), (6, 5, 5))
    assert layout.rows() == [(0, 6), (6, 11), (11, 16)]
    assert [str(op) for op in layout.ops(1)] == ["replica-step", "grad-reduce", "grad-update"]
    slots = {s.name: s for s in exchange_slots(layout, NET, 16)}
    total = CONV + DENSE
    owned = layout.owned(total)
    assert owned[0] == (0, -(-total // 3)) and owned[-1][1] == total
    assert slots["grads/0/2"].shape == (owned[2][1] - owned[2][0],)
    assert slots["grads/0/2"].readers == (2,) and slots["grads/0/2"].read_op == StepOp("grad-reduce")
    assert slots["reduced/1"].readers == (0, 2) and slots["reduced/1"].write_op == StepOp("grad-reduce")
    assert len(slots) == 3 * 2 + 3
    # G = the gradient's bytes. Reduce-scatter: each worker writes the others' ranges
    # and reads theirs of its own, (P-1) G each way; all-gather: each owned sum written
    # once (G) and read by the others ((P-1) G): (3P - 2) G in all, 7 G for P = 3
    per_worker = workspace_bytes(layout, NET, 16, 4)
    assert sum(r + w for r, w in per_worker) == 7 * total * 4
    assert DataLayout(("w0",), (16,)).slots(NET, 16) == []  # one replica: nothing moves


def test_hybrid_parts_per_scheme():
    shares = (7, 5, 4)
    neurons = ((6, 5, 5), (4, 3, 3))
    parts = {s: HybridLayout(("a", "b", "c"), shares, neurons, s).parts() for s in "abc"}
    assert parts["a"] == [[(0, 0, 7), (1, 7, 12), (2, 12, 16)]]
    assert parts["b"] == [[(0, 0, 7)], [(1, 7, 12)], [(2, 12, 16)]]
    # (c): the k-th third of every worker's share, every row in exactly one part
    assert parts["c"] == [[(0, 0, 2), (1, 7, 8), (2, 12, 13)],
                          [(0, 2, 4), (1, 8, 10), (2, 13, 14)],
                          [(0, 4, 7), (1, 10, 12), (2, 14, 16)]]
    for pieces in parts.values():
        rows = sorted(r for part in pieces for _, a, b in part for r in range(a, b))
        assert rows == list(range(16))


def test_hybrid_ops_and_slot_shapes():
    layout = HybridLayout(("w0", "w1"), (9, 7), ((8, 8), (5, 5)), "b", "worker")
    ops = [str(op) for op in layout.ops(0)]
    assert ops == ["trunk-forward",
                   "dense-forward-0-0", "dense-forward-1-0", "dense-backward-1-0",
                   "dense-backward-0-0",
                   "dense-forward-0-1", "dense-forward-1-1", "dense-backward-1-1",
                   "dense-backward-0-1",
                   "trunk-backward", "grad-reduce", "grad-update"]
    slots = {s.name: s for s in exchange_slots(layout, NET, 16)}
    assert slots["feat/0/0"].shape == (9, FEATURES) and slots["feat/0/0"].readers == (1,)
    assert "feat/0/1" not in slots  # part 0 is worker 0's share alone
    assert slots["out/1/0/1"].shape == (7, 8)  # part 1 has worker 1's 7 rows
    assert slots["out/1/1/0"].read_op == StepOp("dense-backward", 1, 1)  # the logits
    # the first dense layer's input gradient goes to the owner of the part's rows
    assert slots["din/0/0/1/0"].shape == (9, FEATURES)
    assert slots["din/0/0/1/0"].read_op == StepOp("trunk-backward")
    assert "din/0/0/0/1" not in slots  # worker 1 owns no row of part 0
    # a hidden layer's input gradient goes to the owners of its neurons (columns)
    assert slots["din/0/1/0/1"].shape == (9, 8)
    assert slots["din/0/1/0/1"].read_op == StepOp("dense-backward", 0, 0)
    assert slots["grads/0/1"].shape == (CONV - CONV // 2,)


def test_hybrid_needs_a_neuron_per_worker_and_a_known_scheme():
    with pytest.raises(ValueError, match="every worker needs a neuron"):
        HybridLayout(("w0", "w1"), (8, 8), ((16, 0),))
    with pytest.raises(ValueError, match="scheme"):
        HybridLayout(("w0", "w1"), (8, 8), ((8, 8),), "d")


BN_NET = NetworkSpec((ConvLayerSpec(3, 10, bias=False, batch_norm=True, name="0", bn_name="1"),
                      ConvLayerSpec(10, 12, in_height=16, in_width=16, name="4")), hidden=(16,))


@pytest.mark.parametrize("layout,forward,backward", [
    (DataLayout(("w0", "w1", "w2"), (6, 10, 0)), "replica-step", "replica-step"),
    (HybridLayout(("w0", "w1", "w2"), (6, 10, 0), ((6, 5, 5), (4, 3, 3)), "c"),
     "trunk-forward", "trunk-backward")])
def test_sync_batch_norm_slots_are_collective_among_every_replica(layout, forward, backward):
    """Per batch-norm layer and worker (one without rows too), its partial sums, read by
    every other worker in the same op; none with `local`, none without batch norm."""
    slots = {s.name: s for s in exchange_slots(layout, BN_NET, 16)}
    names = sorted(n for n in slots if n.startswith("bn-"))
    assert names == [f"bn-{kind}/0/{d}" for kind in ("bwd", "fwd") for d in range(3)]
    for d in range(3):
        ahead, back = slots[f"bn-fwd/0/{d}"], slots[f"bn-bwd/0/{d}"]
        assert ahead.shape == (3, 10) and back.shape == (2, 10)
        assert ahead.writer == d and ahead.readers == tuple(e for e in range(3) if e != d)
        assert ahead.write_op == ahead.read_op == StepOp(forward)
        assert back.write_op == back.read_op == StepOp(backward)
    local = dataclasses.replace(layout, batch_norm="local")
    assert not [s for s in exchange_slots(local, BN_NET, 16) if s.name.startswith("bn-")]
    assert not [s for s in exchange_slots(layout, NET, 16) if s.name.startswith("bn-")]
    with pytest.raises(ValueError, match="batch_norm"):
        dataclasses.replace(layout, batch_norm="ghost")


@pytest.mark.parametrize("strategy", ["data", "hybrid"])
def test_sync_batch_norm_refuses_scheduler_sync(tmp_path, strategy):
    """`workspace.sync: scheduler` cuts tasks at reads: a collective op would wait for
    itself. Refused where the network has batch norm; `local` or `markers` run."""
    changes = {"strategy": strategy, "workspace.sync": "scheduler",
               "train.steps_per_task": 1}
    resnet = {"network.preset": "resnet20", "network.width": 0.25}
    with pytest.raises(ConfigError, match="train.batch_norm: sync .*workspace.sync: markers"):
        strategy_of(tiny_config(tmp_path, "unused", **changes, **resnet))
    strategy_of(tiny_config(tmp_path, "unused", **changes))  # no batch norm: no exchange
    strategy_of(tiny_config(tmp_path, "unused", **changes, **resnet,
                            **{"train.batch_norm": "local"}))
    layout = STRATEGIES[strategy].layout(
        tiny_config(tmp_path, "unused", **changes, **{"train.batch_norm": "local"}),
        BN_NET, ["w0", "w1"], [8, 8])
    assert layout.batch_norm == "local"
