"""Who computes what in a run, and which tensors cross workers: pure value logic.

A layout (one kind per strategy) says what each worker holds and does in a step.
Every layout answers two questions: `ops(worker)`, the ops that worker runs in one
step, in order; and `slots(network, batch)`, every tensor one worker writes for
another, with the op that writes it and the op that reads it. The workers execute
exactly these (tasks/step_task.py); the client builds the step graph's
dependencies from the same slots (pipeline/engine/step_graph.py) and creates their arrays;
docs/design.md gives the bytes they add up to. One source, three users.

`KernelLayout` (here) is kernel-parallel training; `DataLayout` and `HybridLayout`
(tasks/replica_layout.py) are the data-parallel and hybrid strategies.

Per step of kernel-parallel training (docs/methods.md §1), with ``H(l)`` the workers
holding kernels of conv layer ``l`` and ``m`` the master (the worker with the dense
head):

- ``act/<l>/<d>``: shard d's pooled output of layer l, read by the other holders
  of layer l+1 (the last layer's by the master);
- ``grad/<d>``: the dense head's gradient for shard d's channels of the last layer;
- ``partial/<l>/<d>/<e>``: shard d's partial input gradient of layer l, only the
  channels of shard e of layer l-1: the reduce-scatter, summed by its reader e.

A worker's own slices never enter the workspace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tasks.specs import NetworkSpec, ShardRange

CONV_FORWARD = "conv-forward"
DENSE_HEAD = "dense-head"
CONV_BACKWARD = "conv-backward"


@dataclass(frozen=True)
class StepOp:
    """One op of a step on one worker: e.g. a conv layer's forward, the dense head.

    `layer` and `part` say which layer and which part of the batch, where the op
    is about one (-1: not).
    """

    kind: str
    layer: int = -1
    part: int = -1

    def __str__(self) -> str:
        return "-".join([self.kind] + [str(n) for n in (self.layer, self.part) if n >= 0])


@dataclass(frozen=True)
class Slot:
    """One tensor that crosses workers each step."""

    name: str
    shape: tuple[int, ...]
    writer: int
    write_op: StepOp
    readers: tuple[int, ...]
    read_op: StepOp

    def nbytes(self, itemsize: int) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * itemsize


@dataclass(frozen=True)
class KernelLayout:
    """The kernel split of every conv layer over the run's workers, and the master.

    ``shards[l][d]`` is the kernel range worker ``d`` holds of layer ``l``; an empty
    range means none. ``master`` indexes the worker that runs the dense head.
    """

    workers: tuple[str, ...]
    shards: tuple[tuple[ShardRange, ...], ...]
    master: int

    def __post_init__(self) -> None:
        if not 0 <= self.master < len(self.workers):
            raise ValueError(f"master {self.master} is not one of {len(self.workers)} workers")
        for layer, row in enumerate(self.shards):
            if len(row) != len(self.workers):
                raise ValueError(f"layer {layer}: {len(row)} shards for "
                                 f"{len(self.workers)} workers")
            if not self.holders(layer):
                raise ValueError(f"layer {layer}: no worker holds any kernel")

    @property
    def layers(self) -> int:
        return len(self.shards)

    def holders(self, layer: int) -> list[int]:
        """Workers holding at least one kernel of `layer`, in worker order."""
        return [d for d, shard in enumerate(self.shards[layer]) if shard.size > 0]

    def counts(self) -> list[list[int]]:
        """Kernels per layer (rows) and worker (columns)."""
        return [[shard.size for shard in row] for row in self.shards]

    def ops(self, worker: int) -> list[StepOp]:
        """The ops `worker` runs in one step, in order: forward up, head, backward down."""
        layers = range(self.layers)
        ops = [StepOp(CONV_FORWARD, l) for l in layers if worker in self.holders(l)]
        if worker == self.master:
            ops.append(StepOp(DENSE_HEAD))
        ops += [StepOp(CONV_BACKWARD, l) for l in reversed(layers) if worker in self.holders(l)]
        return ops

    def slots(self, network: NetworkSpec, batch: int) -> list[Slot]:
        """Every tensor a worker writes for others in one step (see the module doc)."""
        return _kernel_slots(self, network, batch)

    def checkpoint_chunks(self, network: NetworkSpec, chunks: dict[str, int]
                          ) -> dict[str, int]:
        """Checkpoint rows per chunk: shards own whole channel quanta already."""
        return chunks


def layout_from_counts(workers: list[str], counts: list[list[int]], master: int
                       ) -> KernelLayout:
    """Contiguous kernel ranges in worker order from per-layer counts."""
    rows = []
    for layer, row in enumerate(counts):
        start, ranges = 0, []
        for count in row:
            ranges.append(ShardRange(layer, start, start + count))
            start += count
        rows.append(tuple(ranges))
    return KernelLayout(tuple(workers), tuple(rows), master)


class Layout(Protocol):
    """What every strategy's layout answers: the ops of each worker in a step, the
    slots that cross workers, and how to chunk checkpoints so that no two workers
    ever write one chunk (`chunks` maps a tensor to rows per chunk; adjust or keep).
    `master` is the worker that reports the step's loss."""

    workers: tuple[str, ...]
    master: int

    def ops(self, worker: int) -> list[StepOp]: ...
    def slots(self, network: NetworkSpec, batch: int) -> list[Slot]: ...
    def checkpoint_chunks(self, network: NetworkSpec, chunks: dict[str, int]
                          ) -> dict[str, int]: ...


def worker_ops(layout: Layout, worker: int) -> list[StepOp]:
    """The ops `worker` runs in one step, in order."""
    return layout.ops(worker)


def exchange_slots(layout: Layout, network: NetworkSpec, batch: int) -> list[Slot]:
    """Every tensor a worker writes for another in one step."""
    return layout.slots(network, batch)


def activation_shape(network: NetworkSpec, layer: int, batch: int, channels: int
                      ) -> tuple[int, ...]:
    spec = network.conv[layer]
    return (batch, channels, spec.out_height, spec.out_width)


def _kernel_slots(layout: KernelLayout, network: NetworkSpec, batch: int) -> list[Slot]:
    last = layout.layers - 1
    slots: list[Slot] = []
    for layer in range(layout.layers):
        for d in layout.holders(layer):
            k = layout.shards[layer][d].size
            shape = activation_shape(network, layer, batch, k)
            if layer < last:
                readers = tuple(e for e in layout.holders(layer + 1) if e != d)
                read_op = StepOp(CONV_FORWARD, layer + 1)
            else:
                readers = () if d == layout.master else (layout.master,)
                read_op = StepOp(DENSE_HEAD)
            if readers:
                slots.append(Slot(f"act/{layer}/{d}", shape, d, StepOp(CONV_FORWARD, layer),
                                  readers, read_op))
    for d in layout.holders(last):
        if d != layout.master:
            k = layout.shards[last][d].size
            slots.append(Slot(f"grad/{d}", activation_shape(network, last, batch, k),
                              layout.master, StepOp(DENSE_HEAD), (d,),
                              StepOp(CONV_BACKWARD, last)))
    for layer in range(1, layout.layers):
        for d in layout.holders(layer):
            for e in layout.holders(layer - 1):
                if e != d:
                    k = layout.shards[layer - 1][e].size
                    slots.append(Slot(
                        f"partial/{layer}/{d}/{e}", activation_shape(network, layer - 1, batch, k),
                        d, StepOp(CONV_BACKWARD, layer), (e,), StepOp(CONV_BACKWARD, layer - 1)))
    return slots


def workspace_bytes(layout: Layout, network: NetworkSpec, batch: int, itemsize: int
                    ) -> list[tuple[int, int]]:
    """``(read, written)`` workspace bytes per worker and step: the formula the
    measured bytes must meet (docs/design.md)."""
    totals = [[0, 0] for _ in layout.workers]
    for slot in exchange_slots(layout, network, batch):
        size = slot.nbytes(itemsize)
        totals[slot.writer][1] += size
        for reader in slot.readers:
            totals[reader][0] += size
    return [(read, written) for read, written in totals]
