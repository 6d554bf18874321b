"""The step graph and the exchange slots, as pure functions (no cluster)."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest

from pipeline.engine.step_graph import is_collective, op_graph, step_tasks
from tasks.layout import (CONV_BACKWARD, CONV_FORWARD, DENSE_HEAD, StepOp, exchange_slots,
                          layout_from_counts, worker_ops, workspace_bytes)
from tasks.network import checkpoint_row_chunks, checkpoint_shapes
from tasks.replica_layout import DataLayout, HybridLayout
from tasks.specs import ConvLayerSpec, NetworkSpec
from tasks.zoo import build_preset

F, D, B = CONV_FORWARD, DENSE_HEAD, CONV_BACKWARD


def network(widths=(10, 12, 8), hidden=(16,), batch_norm=False) -> NetworkSpec:
    layers, channels, size = [], 3, 32
    for l, width in enumerate(widths):
        layers.append(ConvLayerSpec(channels, width, in_height=size, in_width=size,
                                    batch_norm=batch_norm, name=f"c{l}",
                                    bn_name=f"n{l}" if batch_norm else ""))
        channels, size = width, size // 2
    return NetworkSpec(tuple(layers), hidden=hidden)


LAYOUTS = {
    "single": ([[10], [12], [8]], 0),
    "two": ([[4, 6], [8, 4], [4, 4]], 0),
    "two, master second": ([[4, 6], [8, 4], [4, 4]], 1),
    "three uneven": ([[4, 4, 2], [4, 4, 4], [4, 2, 2]], 2),
    "zero kernels in a layer": ([[6, 4, 0], [0, 8, 4], [4, 4, 0]], 0),
    "master holds no kernels": ([[6, 4, 0], [4, 8, 0], [4, 4, 0]], 2),
}


def resnet() -> NetworkSpec:
    """ResNet-20 at a quarter width: residual sums, shortcuts reading a block's input."""
    return build_preset("resnet20", (3, 32, 32), 10, "float32", width=0.25)


def _by_group(network: NetworkSpec, alone, tied) -> list[list[int]]:
    """Counts per layer: `alone(k)` for a layer tied to no other, `tied(k)` otherwise."""
    singles = {g[0] for g in network.tied_groups() if len(g) == 1}
    return [alone(s.kernels) if l in singles else tied(s.kernels)
            for l, s in enumerate(network.conv)]


#: Layouts of a network with residual blocks (`resnet`), tied splits.
GRAPH_LAYOUTS = {
    "resnet, three uneven": (lambda net: _by_group(
        net, *[lambda k: [k // 4, k // 2, k - k // 4 - k // 2]] * 2), 0),
    "resnet, block convs apart from the sums": (lambda net: _by_group(
        net, lambda k: [k, 0, 0], lambda k: [0, k // 2, k - k // 2]), 1),
}


NAMES = ("w0", "w1", "w2")
REPLICAS = {
    "data, one worker": DataLayout(NAMES[:1], (16,)),
    "data, uneven": DataLayout(NAMES, (7, 5, 4)),
    "data, a worker without samples": DataLayout(NAMES, (10, 6, 0)),
    **{f"hybrid {scheme}, {batch}": HybridLayout(NAMES, (7, 5, 4), ((6, 5, 5), (4, 3, 3)),
                                                 scheme, batch)
       for scheme in ("a", "b", "c") for batch in ("full", "worker")},
    "hybrid b, two workers": HybridLayout(NAMES[:2], (9, 7), ((8, 8), (5, 5)), "b"),
}
#: Replicas with sync batch norm: collective slots (written and read inside one op).
SYNCED = {f"{case}, batch norm": layout for case, layout in REPLICAS.items()
          if len(layout.workers) > 1}
ALL = sorted(LAYOUTS) + sorted(REPLICAS) + sorted(GRAPH_LAYOUTS)


def make(case: str):
    if case in SYNCED:
        return SYNCED[case], exchange_slots(SYNCED[case], network(batch_norm=True), batch=16)
    if case in GRAPH_LAYOUTS:
        counts_of, master = GRAPH_LAYOUTS[case]
        net = resnet()
        layout = layout_from_counts(list(NAMES), counts_of(net), master)
        return layout, exchange_slots(layout, net, batch=16)
    if case in REPLICAS:
        layout = REPLICAS[case]
    else:
        counts, master = LAYOUTS[case]
        layout = layout_from_counts([f"w{i}" for i in range(len(counts[0]))], counts, master)
    return layout, exchange_slots(layout, network(), batch=16)


def reachable(edges, start):
    after = defaultdict(list)
    for edge in edges:
        after[edge.source].append(edge.target)
    seen, stack = set(), [start]
    while stack:
        node = stack.pop()
        for nxt in after[node]:
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def test_worker_ops_run_forward_up_head_then_backward_down():
    layout, _ = make("two, master second")
    assert worker_ops(layout, 0) == [StepOp(F, 0), StepOp(F, 1), StepOp(F, 2),
                                     StepOp(B, 2), StepOp(B, 1), StepOp(B, 0)]
    assert worker_ops(layout, 1) == [StepOp(F, 0), StepOp(F, 1), StepOp(F, 2), StepOp(D),
                                     StepOp(B, 2), StepOp(B, 1), StepOp(B, 0)]
    layout, _ = make("zero kernels in a layer")
    assert worker_ops(layout, 2) == [StepOp(F, 1), StepOp(B, 1)]
    layout, _ = make("master holds no kernels")
    assert worker_ops(layout, 2) == [StepOp(D)]


def test_single_worker_exchanges_nothing():
    layout, slots = make("single")
    assert slots == []
    assert workspace_bytes(layout, network(), 16, 4) == [(0, 0)]


def test_slots_of_two_workers():
    layout, slots = make("two")
    names = {s.name: s for s in slots}
    assert sorted(names) == sorted([
        "act/0/0", "act/0/1", "act/1/0", "act/1/1", "act/2/1",  # master 0 keeps its act/2
        "grad/1",
        "partial/1/0/1", "partial/1/1/0", "partial/2/0/1", "partial/2/1/0"])
    assert names["act/0/1"].shape == (16, 6, 16, 16)
    assert names["act/0/1"].readers == (0,) and names["act/0/1"].read_op == StepOp(F, 1)
    assert names["act/2/1"].readers == (0,) and names["act/2/1"].read_op == StepOp(D)
    assert names["grad/1"].writer == 0 and names["grad/1"].shape == (16, 4, 4, 4)
    # worker 0's partial of layer 2 carries worker 1's channels of layer 1 (4 of 12)
    assert names["partial/2/0/1"].shape == (16, 4, 8, 8)
    assert names["partial/2/0/1"].read_op == StepOp(B, 1)


def test_workspace_bytes_formula_by_hand():
    """Two workers, batch 16, float32, split [[4, 6], [8, 4], [4, 4]], master 0."""
    layout, _ = make("two")
    per_sample = {0: 16 * 16, 1: 8 * 8, 2: 4 * 4}  # pooled h*w of layer l's output
    size = lambda layer, channels: 16 * channels * per_sample[layer] * 4  # noqa: E731
    w0_writes = size(0, 4) + size(1, 8) + size(2, 4) + size(0, 6) + size(1, 4)
    #           act/0/0     act/1/0     grad/1       partial/1/0/1 partial/2/0/1
    w1_writes = size(0, 6) + size(1, 4) + size(2, 4) + size(0, 4) + size(1, 8)
    #           act/0/1     act/1/1     act/2/1      partial/1/1/0 partial/2/1/0
    assert workspace_bytes(layout, network(), 16, 4) == [(w1_writes, w0_writes),
                                                         (w0_writes, w1_writes)]


@pytest.mark.parametrize("case", ALL + sorted(SYNCED))
def test_every_slot_is_written_before_read_and_read_before_rewritten(case):
    """The race-freedom of the exchange, from order and data edges alone."""
    layout, slots = make(case)
    _nodes, edges = op_graph(layout, slots, range(3))
    needed = [e for e in edges if e.kind == "reuse"]
    kept = [e for e in edges if e.kind != "reuse"]
    assert len(needed) == sum(len(s.readers) for s in slots) * 2
    for edge in needed:
        assert edge.target in reachable(kept, edge.source), edge
    for edge in (e for e in kept if e.kind == "data"):
        assert edge.source.step == edge.target.step
        assert edge.source.worker != edge.target.worker


@pytest.mark.parametrize("case", sorted(SYNCED))
def test_collective_ops_cannot_deadlock(case):
    """Every worker of a collective op reaches it without waiting for another's op after
    it: taken as one node per step, the collective ops leave the graph acyclic."""
    layout, slots = make(case)
    collective = {(slot.write_op, w) for slot in slots if is_collective(slot)
                  for w in (slot.writer, *slot.readers)}
    expected = ({"trunk-forward", "trunk-backward"} if isinstance(layout, HybridLayout)
                else {"replica-step"})
    assert {op.kind for op, _w in collective} == expected
    assert {w for _op, w in collective} == set(range(len(layout.workers)))  # rows or none
    nodes, edges = op_graph(layout, slots, range(2))

    def merged(node):  # a collective op's workers as one node
        if (node.op, node.worker) in collective:
            return (node.step, -1, node.op)
        return (node.step, node.worker, node.op)

    contracted = [type(e)(merged(e.source), merged(e.target), e.kind) for e in edges
                  if merged(e.source) != merged(e.target)]
    for node in {merged(n) for n in nodes}:
        assert node not in reachable(contracted, node), f"cycle through {node}"


@pytest.mark.parametrize("case", sorted(SYNCED))
def test_scheduler_sync_refuses_collective_slots(case):
    layout, slots = make(case)
    assert any(is_collective(slot) for slot in slots)
    with pytest.raises(ValueError, match="collective.*workspace.sync: markers"):
        step_tasks(layout, slots, 0, "scheduler")


@pytest.mark.parametrize("case", ALL + sorted(SYNCED))
def test_graph_is_acyclic_and_every_op_runs_once_per_step(case):
    layout, slots = make(case)
    nodes, edges = op_graph(layout, slots, range(2))
    assert len(nodes) == len(set(nodes)) == 2 * sum(
        len(worker_ops(layout, w)) for w in range(len(layout.workers)))
    for node in nodes:
        assert node not in reachable(edges, node), f"cycle through {node}"


@pytest.mark.parametrize("case", ALL + sorted(SYNCED))
def test_markers_sync_is_one_task_per_worker_without_dask_dependencies(case):
    layout, slots = make(case)
    tasks = step_tasks(layout, slots, 5, "markers")
    busy = [w for w in range(len(layout.workers)) if worker_ops(layout, w)]
    assert [t.worker for t in tasks] == busy
    for task in tasks:
        assert list(task.ops) == worker_ops(layout, task.worker)
        assert task.deps == ()
    later = step_tasks(layout, slots, 6, "markers")
    assert all(a.priority > b.priority for a, b in zip(tasks, later))  # step 5 first


@pytest.mark.parametrize("case", ALL)
def test_scheduler_sync_tasks_carry_every_edge_as_a_dependency(case):
    layout, slots = make(case)
    steps = [step_tasks(layout, slots, s, "scheduler", first_step=3) for s in (3, 4)]
    task_of = {(t.step, t.worker, op): t for tasks in steps for t in tasks for op in t.ops}
    names = {t.name: t for tasks in steps for t in tasks}
    assert all(dep in names for t in names.values() for dep in t.deps)
    for tasks in steps:  # submittable in list order: a task's dependencies come first
        seen: set[str] = set()
        for task in tasks:
            assert all(d in seen or names[d].step < task.step for d in task.deps), task
            seen.add(task.name)

    def task_after(first, second) -> bool:  # second waits for first through Dask
        todo, seen = [second], set()
        while todo:
            task = todo.pop()
            if task.name == first.name:
                return True
            for dep in task.deps:
                if dep not in seen:
                    seen.add(dep)
                    todo.append(names[dep])
        return False

    _nodes, edges = op_graph(layout, slots, range(3, 5))
    for edge in edges:
        a = task_of[(edge.source.step, edge.source.worker, edge.source.op)]
        b = task_of[(edge.target.step, edge.target.worker, edge.target.op)]
        if a is not b:
            assert task_after(a, b), edge
    # a task is cut only where its first op reads another worker's slot
    readers = {read for s in slots for read in s.reads()}
    for task in names.values():
        assert all((task.worker, op) not in readers for op in task.ops[1:])
    for task in steps[0]:  # the run's first step waits for no earlier step
        if task.name.endswith("-0") and (task.worker, task.ops[0]) not in readers:
            assert task.deps == ()


# Checkpoint chunks: no two workers ever write one chunk ------------------------------


def chunk_owners(rows: int, length: int, ranges: list[tuple[int, int]]) -> list[set[int]]:
    """Which writers write into each chunk of a `length`-row tensor chunked by `rows`."""
    owners = [set() for _ in range(-(-length // rows))]
    for writer, (start, stop) in enumerate(ranges):
        for row in range(start, stop):
            owners[row // rows].add(writer)
    return owners


@pytest.mark.parametrize("case", sorted(LAYOUTS) + sorted(GRAPH_LAYOUTS))
def test_kernel_checkpoints_give_each_worker_whole_chunks_and_no_more_chunks(case):
    """Every conv and batch-norm tensor is chunked so that each chunk has one writer
    (the worker holding its channels), in the fewest chunks that allows: the split's
    boundaries are chunk boundaries and nothing else is."""
    net = resnet() if case in GRAPH_LAYOUTS else network(batch_norm=True)
    layout, _ = make(case) if case in GRAPH_LAYOUTS else (None, None)
    if layout is None:
        counts, master = LAYOUTS[case]
        layout = layout_from_counts([f"w{i}" for i in range(len(counts[0]))], counts, master)
    quanta = checkpoint_row_chunks(net, [1] * len(net.conv))
    chunks = layout.checkpoint_chunks(net, quanta)
    assert set(chunks) <= set(quanta)
    shapes = checkpoint_shapes(net)
    layer_of = {key: l for l, spec in enumerate(net.conv) for key in quanta
                if key.startswith((f"{spec.name}.", f"{spec.bn_name}."))}
    for key, layer in layer_of.items():
        length = shapes[key][0]
        rows = chunks.get(key, length)
        ranges = [(s.start, s.stop) for s in layout.shards[layer]]
        owners = chunk_owners(rows, length, ranges)
        assert all(len(who) == 1 for who in owners), (key, rows, ranges)
        boundaries = {stop for start, stop in ranges if stop > start} - {length}
        # the most rows for which every boundary between shards is a chunk boundary
        assert rows == (math.gcd(*boundaries) if boundaries else length), (key, rows, ranges)


def test_a_replica_writes_its_trunk_whole_and_hybrid_splits_only_dense_layers():
    net = network(batch_norm=True)
    quanta = checkpoint_row_chunks(net, [4] * len(net.conv))
    assert DataLayout(NAMES, (7, 5, 4)).checkpoint_chunks(net, quanta) == {}
    hybrid = HybridLayout(NAMES, (7, 5, 4), ((6, 4, 6), (4, 3, 3)))
    assert hybrid.checkpoint_chunks(net, quanta) == {
        "10.weight": 2, "10.bias": 2, "12.weight": 1, "12.bias": 1}
