"""Who computes what in a run, and which tensors cross workers: pure value logic.

A `Layout` says which kernels of every conv layer each worker holds (possibly none)
and which worker runs the dense head (the *master*). From it, `worker_ops` gives the
ops each worker runs in one step, and `exchange_slots` every tensor one worker
writes for another, with the op that writes it and the op that reads it. The
workers execute exactly these (tasks/step_task.py); the client builds the step
graph's dependencies from the same slots (pipeline/step_graph.py) and creates their
arrays; docs/design.md gives the bytes they add up to. One source, three users.

Per step of kernel-parallel training (METHODS.md §1), with ``H(l)`` the workers
holding kernels of conv layer ``l`` and ``m`` the master:

- ``act/<l>/<d>``: shard d's pooled output of layer l, read by the other holders
  of layer l+1 (the last layer's by the master);
- ``grad/<d>``: the dense head's gradient for shard d's channels of the last layer;
- ``partial/<l>/<d>/<e>``: shard d's partial input gradient of layer l, only the
  channels of shard e of layer l-1: the reduce-scatter, summed by its reader e.

A worker's own slices never enter the workspace.
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks.specs import NetworkSpec, ShardRange

CONV_FORWARD = "conv-forward"
DENSE_HEAD = "dense-head"
CONV_BACKWARD = "conv-backward"


@dataclass(frozen=True)
class StepOp:
    """One op of a step on one worker: a conv layer's forward or backward, or the head."""

    kind: str
    layer: int = -1

    def __str__(self) -> str:
        return self.kind if self.layer < 0 else f"{self.kind}-{self.layer}"


@dataclass(frozen=True)
class Layout:
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


def layout_from_counts(workers: list[str], counts: list[list[int]], master: int) -> Layout:
    """Contiguous kernel ranges in worker order from per-layer counts."""
    rows = []
    for layer, row in enumerate(counts):
        start, ranges = 0, []
        for count in row:
            ranges.append(ShardRange(layer, start, start + count))
            start += count
        rows.append(tuple(ranges))
    return Layout(tuple(workers), tuple(rows), master)


def worker_ops(layout: Layout, worker: int) -> list[StepOp]:
    """The ops `worker` runs in one step, in order: forward up, head, backward down."""
    layers = range(layout.layers)
    ops = [StepOp(CONV_FORWARD, l) for l in layers if worker in layout.holders(l)]
    if worker == layout.master:
        ops.append(StepOp(DENSE_HEAD))
    ops += [StepOp(CONV_BACKWARD, l) for l in reversed(layers) if worker in layout.holders(l)]
    return ops


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


def _activation_shape(network: NetworkSpec, layer: int, batch: int, channels: int
                      ) -> tuple[int, ...]:
    spec = network.conv[layer]
    return (batch, channels, spec.out_height, spec.out_width)


def exchange_slots(layout: Layout, network: NetworkSpec, batch: int) -> list[Slot]:
    """Every tensor a worker writes for others in one step (see the module doc)."""
    last = layout.layers - 1
    slots: list[Slot] = []
    for layer in range(layout.layers):
        for d in layout.holders(layer):
            k = layout.shards[layer][d].size
            shape = _activation_shape(network, layer, batch, k)
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
            slots.append(Slot(f"grad/{d}", _activation_shape(network, last, batch, k),
                              layout.master, StepOp(DENSE_HEAD), (d,),
                              StepOp(CONV_BACKWARD, last)))
    for layer in range(1, layout.layers):
        for d in layout.holders(layer):
            for e in layout.holders(layer - 1):
                if e != d:
                    k = layout.shards[layer - 1][e].size
                    slots.append(Slot(
                        f"partial/{layer}/{d}/{e}", _activation_shape(network, layer - 1, batch, k),
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
