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

- ``act/<l>/<d>``: shard d's output of layer l, read by the other holders of every
  layer that reads l's whole output (l+1 in a chain; a residual block's input is
  read by its first conv and its shortcut), the last layer's by the master; each
  reader reads it at the first of its ops that needs it;
- ``grad/<d>``: the dense head's gradient for shard d's channels of the last layer;
- ``partial/<r>/<d>/<e>``: shard d's partial input gradient of layer r, only the
  channels of shard e of r's source layer: the reduce-scatter, summed by its reader e.

A worker's own slices never enter the workspace. Layers a residual sum ties
(`NetworkSpec.tied_groups`) must hold the same kernel ranges (`check_tied`): the
sum and its gradient then stay on each channel's owner.
"""

from __future__ import annotations

import math
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
    read_ops: tuple[StepOp, ...] = ()  # each reader's, where they differ (else read_op)

    def reads(self) -> list[tuple[int, StepOp]]:
        """Each reader with the op of it that reads the slot."""
        ops = self.read_ops or (self.read_op,) * len(self.readers)
        return list(zip(self.readers, ops, strict=True))

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
        """Checkpoint rows per chunk: a conv layer's tensors (and its batch norm's) in
        as few chunks as leave each worker's kernels whole chunks of their own
        (`shared_rows`: two chunks per tensor on two workers, against one per channel
        quantum in `chunks`); a layer one worker holds, and the dense head the master
        writes, in one chunk. Each chunk is a file: fewer chunks, fewer files to make."""
        layer_of = {name: layer for layer, spec in enumerate(network.conv)
                    for name in (spec.name, spec.bn_name) if name}
        rows = {}
        for key in chunks:  # "<module>.<tensor>", e.g. "layer1.0.bn2.running_mean"
            shared = shared_rows(self.shards[layer_of[key.rsplit(".", 1)[0]]])
            if shared is not None:
                rows[key] = shared
        return rows


def shared_rows(row: tuple[ShardRange, ...]) -> int | None:
    """The most rows per chunk for which every shard of a layer owns whole chunks: the
    greatest common divisor of the boundaries between its shards (None where one
    shard holds them all: one chunk)."""
    total = max(shard.stop for shard in row)
    inner = {bound for shard in row if shard.size
             for bound in (shard.start, shard.stop)} - {0, total}
    return math.gcd(*inner) if inner else None


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
    ever write one chunk (`chunks` maps each conv layer's tensors to its channel
    quantum; the answer maps a tensor to rows per chunk, a tensor left out is one
    chunk).
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


def check_tied(layout: KernelLayout, network: NetworkSpec) -> None:
    """Raise ValueError, naming them, where two layers a residual sum ties
    (`NetworkSpec.tied_groups`) hold different kernel ranges on some worker."""
    names = network.conv_keys()
    for group in network.tied_groups():
        first = layout.shards[group[0]]
        for layer in group[1:]:
            row = layout.shards[layer]
            if [(r.start, r.stop) for r in row] != [(r.start, r.stop) for r in first]:
                raise ValueError(
                    f"conv layers {names[group[0]]} and {names[layer]} are added channel "
                    "by channel (a residual sum) and must share one kernel split, got "
                    f"{[r.size for r in first]} and {[r.size for r in row]}")


def _kernel_slots(layout: KernelLayout, network: NetworkSpec, batch: int) -> list[Slot]:
    check_tied(layout, network)
    last = layout.layers - 1
    slots: list[Slot] = []
    for layer in range(layout.layers):
        first_reads = _first_reads(layout, network, layer)
        for d in layout.holders(layer):
            shape = activation_shape(network, layer, batch, layout.shards[layer][d].size)
            reads = [(e, op) for e, op in first_reads.items() if e != d]
            if reads:
                ops = tuple(op for _, op in reads)
                slots.append(Slot(f"act/{layer}/{d}", shape, d, StepOp(CONV_FORWARD, layer),
                                  tuple(e for e, _ in reads), ops[0],
                                  ops if len(set(ops)) > 1 else ()))
    for d in layout.holders(last):
        if d != layout.master:
            k = layout.shards[last][d].size
            slots.append(Slot(f"grad/{d}", activation_shape(network, last, batch, k),
                              layout.master, StepOp(DENSE_HEAD), (d,),
                              StepOp(CONV_BACKWARD, last)))
    for reader in range(layout.layers):
        source = network.source(reader)
        if source < 0:
            continue
        for d in layout.holders(reader):
            for e in layout.holders(source):
                if e != d:
                    k = layout.shards[source][e].size
                    slots.append(Slot(
                        f"partial/{reader}/{d}/{e}", activation_shape(network, source, batch, k),
                        d, StepOp(CONV_BACKWARD, reader), (e,), StepOp(CONV_BACKWARD, source)))
    return slots


def _first_reads(layout: KernelLayout, network: NetworkSpec, layer: int
                 ) -> dict[int, StepOp]:
    """Each worker that reads `layer`'s whole output, in worker order, with its first
    op that does: the forward of the first reader of it that the worker holds, or
    (the last layer) the master's dense head."""
    first: dict[int, StepOp] = {}
    for reader in network.readers(layer):
        for e in layout.holders(reader):
            first.setdefault(e, StepOp(CONV_FORWARD, reader))
    if layer == layout.layers - 1:
        first.setdefault(layout.master, StepOp(DENSE_HEAD))
    return dict(sorted(first.items()))


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
