"""One training step as a graph: which ops run on which worker, and what waits for what.

Pure functions, no cluster. The ops of a step per worker come from the layout
(`tasks.layout.worker_ops`); the edges between them are:

- **order**: a worker runs its ops one after the other, and its first op of step
  s+1 after its last op of step s. This carries "forward of step s+1 after the
  backward of step s" (a shard's weights are updated in place);
- **data**: every exchange slot's write comes before its reads in the same step;
- **reuse**: every read of a slot in step s comes before the slot is rewritten in
  step s+1. The graph never needs these as extra waits: `op_graph` lists them so
  that tests/test_step_graph.py can check they follow from the other two.

A *collective* slot (`is_collective`) is written and read by the same op, which its
writer and readers run at once, each writing its own slot before it waits for the
others' (sync batch norm's partial sums, tasks/sync_batch_norm.py). Its write comes
before its reads inside that op, so it adds no data edge between ops (the edge
would be a cycle between workers that wait for each other only inside the op); its
reuse edges stay. With these, a step cannot deadlock when the graph with each
collective op's workers taken as one node is acyclic (tests/test_step_graph.py).

`step_tasks` turns one step into Dask tasks, in one of two ways (`workspace.sync`):

- ``markers`` (the default): one task per worker and step, holding all its ops;
  tasks carry no Dask dependencies. A worker runs its queue in priority order
  (step by step), and a data edge is a wait inside the reading task for the
  writer's ready marker in the workspace (storage/exchange.py): about 0.5 ms
  instead of a scheduler hop (20-30 ms measured here, docs/benchmarks.md).
- ``scheduler``: a worker's ops are cut into a new task before every op that reads
  another worker's slot, and every edge that crosses tasks is a Dask dependency.
  Same ops, same arithmetic; each hop goes through the scheduler. A collective op
  cannot be had this way (each worker's task would wait for the others' to finish),
  so a layout with collective slots is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tasks.layout import Layout, Slot, StepOp, worker_ops

Sync = Literal["markers", "scheduler"]
#: Priorities count down through a worker's tasks: step * this + position.
PRIORITY_STRIDE = 1000


@dataclass(frozen=True)
class OpNode:
    step: int
    worker: int
    op: StepOp


@dataclass(frozen=True)
class Edge:
    source: OpNode
    target: OpNode
    kind: Literal["order", "data", "reuse"]
    slot: str = ""


@dataclass(frozen=True)
class TaskSpec:
    """One Dask task: consecutive ops of one worker in one step."""

    name: str  # unique within a run, e.g. "step-3-w1-0"
    step: int
    worker: int
    ops: tuple[StepOp, ...]
    deps: tuple[str, ...]  # names of tasks Dask must finish first (sync "scheduler")
    priority: int  # higher runs first on its worker


def is_collective(slot: Slot) -> bool:
    """Whether `slot` is written and read by the same op, run by its writer and
    readers at once (module doc)."""
    return slot.write_op == slot.read_op


def op_graph(layout: Layout, slots: list[Slot], steps: range) -> tuple[list[OpNode], list[Edge]]:
    """Every op of `steps` and every edge between them (see the module doc)."""
    nodes: list[OpNode] = []
    edges: list[Edge] = []
    previous_last: dict[int, OpNode] = {}
    for step in steps:
        for worker in range(len(layout.workers)):
            ops = [OpNode(step, worker, op) for op in worker_ops(layout, worker)]
            nodes += ops
            if not ops:
                continue
            if worker in previous_last:
                edges.append(Edge(previous_last[worker], ops[0], "order"))
            edges += [Edge(a, b, "order") for a, b in zip(ops, ops[1:])]
            previous_last[worker] = ops[-1]
        for slot in slots:
            for reader, read_op in slot.reads():
                if not is_collective(slot):
                    edges.append(Edge(OpNode(step, slot.writer, slot.write_op),
                                      OpNode(step, reader, read_op), "data", slot.name))
                if step + 1 in steps:
                    edges.append(Edge(OpNode(step, reader, read_op),
                                      OpNode(step + 1, slot.writer, slot.write_op), "reuse",
                                      slot.name))
    return nodes, edges


def _segments(ops: list[StepOp], worker: int, readers_of_others: set[tuple[int, StepOp]],
              sync: Sync) -> list[list[StepOp]]:
    """A worker's ops of one step cut into tasks: one piece, or cut before each op that
    reads another worker's slot."""
    if sync == "markers":
        return [ops] if ops else []
    pieces: list[list[StepOp]] = []
    for op in ops:
        if not pieces or (worker, op) in readers_of_others:
            pieces.append([])
        pieces[-1].append(op)
    return pieces


def step_tasks(layout: Layout, slots: list[Slot], step: int, sync: Sync,
               first_step: int = 0) -> list[TaskSpec]:
    """The tasks of one step, each worker's in order (see the module doc).

    `first_step` is where the run started: its tasks wait for no earlier step.
    Raises ValueError for ``scheduler`` with collective slots (module doc).
    """
    collective = next((slot.name for slot in slots if is_collective(slot)), None)
    if sync == "scheduler" and collective is not None:
        raise ValueError(f"slot {collective} is collective (its workers exchange inside one "
                         "op), which needs workspace.sync: markers")
    reading = {read for slot in slots for read in slot.reads()}
    pieces = {worker: _segments(worker_ops(layout, worker), worker, reading, sync)
              for worker in range(len(layout.workers))}

    def task_of(worker: int, op: StepOp) -> str:
        index = next(i for i, piece in enumerate(pieces[worker]) if op in piece)
        return f"step-{step}-w{worker}-{index}"

    tasks = []
    for worker, worker_pieces in pieces.items():
        for index, piece in enumerate(worker_pieces):
            deps: list[str] = []
            if sync == "scheduler":
                if index:
                    deps.append(f"step-{step}-w{worker}-{index - 1}")
                elif step > first_step:
                    deps.append(f"step-{step - 1}-w{worker}-{len(worker_pieces) - 1}")
                deps += [task_of(slot.writer, slot.write_op) for slot in slots
                         for reader, read_op in slot.reads()
                         if reader == worker and read_op in piece]
            tasks.append(TaskSpec(f"step-{step}-w{worker}-{index}", step, worker, tuple(piece),
                                  tuple(dict.fromkeys(deps)), -(step * PRIORITY_STRIDE + index)))
    return _in_dependency_order(tasks)


def _in_dependency_order(tasks: list[TaskSpec]) -> list[TaskSpec]:
    """The tasks reordered so that each comes after the tasks of its step it waits for
    (a Dask dependency must exist before it is named); otherwise in worker order."""
    names = {task.name for task in tasks}
    placed: set[str] = set()
    ordered: list[TaskSpec] = []
    while len(ordered) < len(tasks):
        ready = [t for t in tasks if t.name not in placed
                 and all(d in placed or d not in names for d in t.deps)]
        if not ready:
            raise ValueError("the step's tasks wait for each other in a cycle")
        ordered.append(ready[0])
        placed.add(ready[0].name)
    return ordered
