"""Data-parallel and hybrid layouts: every worker a replica of the conv layers, with a
share of the batch (docs/methods.md §2 and §3). Pure value logic, like tasks/layout.py.

`DataLayout` (``strategy: data``): each worker trains a full replica on its share of
the batch; the gradients are summed by a reduce-scatter through the workspace (each
worker sums one range of the flat gradient, the range it *owns*) and an all-gather
(each reads the others' summed ranges); every replica then takes the same SGD step.
Per worker and step: ``replica-step``, ``grad-reduce``, ``grad-update``.

`HybridLayout` (``strategy: hybrid``, Krizhevsky's "one weird trick"): the conv
layers as in `DataLayout`; every dense layer split by output neurons over the
workers. The dense layers run as a sequence of *parts* of the batch, by scheme:
(a) the whole batch at once (an all-gather of every worker's last conv features),
(b) one worker's share at a time, (c) the k-th fraction of every worker's share at
a time (an all-to-all). Per part, each dense layer's forward (its output slice,
gathered by all for the next layer or the loss) and backward (its weight gradient
and partial input gradient, scattered to whoever owns that input). Then the conv
trunk's backward, and the conv gradients' reduce-scatter and all-gather. With
``dense_batch: full`` the dense weights step once, after all parts, and the
arithmetic is single-process SGD on the whole batch; with ``worker`` they step
after each part (Krizhevsky's variable batch size).

Batch norm (``train.batch_norm``): ``sync`` (the default) takes each batch-norm
layer's statistics over the whole batch, every replica's rows
(tasks/sync_batch_norm.py), so that the arithmetic stays single-process SGD's; ``local``
takes them over each replica's own rows (DDP's default). Sync's exchanges are
*collective* slots: written and read by the same op on every worker, which all
run it at once (pipeline/engine/step_graph.py).

Slots (every one written by one worker, read by others):

    grads/<d>/<e>        worker d's gradient, the range worker e owns
    reduced/<e>          the sum of the range worker e owns
    feat/<k>/<e>         hybrid: worker e's rows of part k of the last conv features
    out/<k>/<j>/<d>      hybrid: worker d's output neurons of dense layer j, part k
    din/<k>/<j>/<d>/<e>  hybrid: worker d's partial gradient of dense layer j's input,
                         the piece worker e needs (j = 0: e's rows; j > 0: e's neurons
                         of layer j-1)
    bn-fwd/<l>/<d>       sync batch norm: worker d's count, sum and sum of squared
                         deviations (from its own mean) per channel of conv layer l's
                         batch-norm input (replica-step / trunk-forward, read by all)
    bn-bwd/<l>/<d>       sync batch norm: worker d's sums of dy and dy * (x - mean)
                         per channel (replica-step / trunk-backward, read by all)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tasks.layout import Slot, StepOp
from tasks.specs import NetworkSpec

REPLICA_STEP = "replica-step"
TRUNK_FORWARD = "trunk-forward"
DENSE_FORWARD = "dense-forward"
DENSE_BACKWARD = "dense-backward"
TRUNK_BACKWARD = "trunk-backward"
GRAD_REDUCE = "grad-reduce"
GRAD_UPDATE = "grad-update"
SCHEMES = ("a", "b", "c")
BATCH_NORMS = ("sync", "local")
BN_FORWARD = "bn-fwd"
BN_BACKWARD = "bn-bwd"


def batch_norm_slot(kind: str, layer: int, worker: int) -> str:
    """The slot of worker `worker`'s partial sums of conv layer `layer`'s batch norm
    (`kind`: `BN_FORWARD` or `BN_BACKWARD`)."""
    return f"{kind}/{layer}/{worker}"


def batch_norm_slots(network: NetworkSpec, workers: int, forward_op: StepOp,
                     backward_op: StepOp) -> list[Slot]:
    """Sync batch norm's collective slots: per batch-norm layer and worker, its partial
    sums of the forward (3 rows: count, sum, sum of squared deviations) and of the
    backward (2 rows: sums of dy and dy * (x - mean)), read by every other worker in
    the same op."""
    slots = []
    for l, layer in enumerate(network.conv):
        if not layer.batch_norm:
            continue
        for d in range(workers):
            others = tuple(e for e in range(workers) if e != d)
            if others:
                slots += [Slot(batch_norm_slot(BN_FORWARD, l, d), (3, layer.kernels), d,
                               forward_op, others, forward_op),
                          Slot(batch_norm_slot(BN_BACKWARD, l, d), (2, layer.kernels), d,
                               backward_op, others, backward_op)]
    return slots


def conv_parameter_count(network: NetworkSpec) -> int:
    return sum(c.kernels * (c.in_channels * c.kernel_size ** 2 + c.bias + 2 * c.batch_norm)
               for c in network.conv)


def dense_widths(network: NetworkSpec) -> list[tuple[int, int]]:
    """``(inputs, outputs)`` of every dense layer."""
    widths, features = [], network.flat_features
    for width in [*network.hidden, network.classes]:
        widths.append((features, width))
        features = width
    return widths


def dense_parameter_count(network: NetworkSpec) -> int:
    return sum(n_in * n_out + n_out for n_in, n_out in dense_widths(network))


def split_counts(total: int, parts: int) -> list[int]:
    """`total` into `parts` counts as equal as can be, the larger ones first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def ranges(counts: list[int]) -> list[tuple[int, int]]:
    """Consecutive ``(start, stop)`` ranges of the given sizes."""
    out, start = [], 0
    for count in counts:
        out.append((start, start + count))
        start += count
    return out


def _gradient_slots(workers: int, length: int, write_op: StepOp) -> list[Slot]:
    """The reduce-scatter and all-gather of a flat gradient of `length` values."""
    owned = ranges(split_counts(length, workers))
    slots = []
    for d in range(workers):
        for e in range(workers):
            if d != e:
                size = owned[e][1] - owned[e][0]
                slots.append(Slot(f"grads/{d}/{e}", (size,), d, write_op, (e,),
                                  StepOp(GRAD_REDUCE)))
    for e in range(workers):
        others = tuple(d for d in range(workers) if d != e)
        if others:
            slots.append(Slot(f"reduced/{e}", (owned[e][1] - owned[e][0],), e,
                              StepOp(GRAD_REDUCE), others, StepOp(GRAD_UPDATE)))
    return slots


def _check_replicas(workers: tuple[str, ...], shares: tuple[int, ...], batch_norm: str
                    ) -> None:
    if len(shares) != len(workers) or min(shares) < 0:
        raise ValueError(f"batch shares {shares} for {len(workers)} workers")
    if batch_norm not in BATCH_NORMS:
        raise ValueError(f"batch_norm {batch_norm!r}, expected one of {BATCH_NORMS}")


@dataclass(frozen=True)
class DataLayout:
    """Every worker a full replica and `shares[d]` samples of each step's batch."""

    workers: tuple[str, ...]
    shares: tuple[int, ...]
    master: int = 0  # reports nothing special: every worker adds its part of the loss
    batch_norm: str = "sync"  # BATCH_NORMS: statistics over the whole batch, or own rows

    def __post_init__(self) -> None:
        _check_replicas(self.workers, self.shares, self.batch_norm)

    def rows(self) -> list[tuple[int, int]]:
        """Each worker's ``(start, stop)`` rows of the step's batch."""
        return ranges(list(self.shares))

    def owned(self, length: int) -> list[tuple[int, int]]:
        """The range of a flat gradient of `length` values each worker sums."""
        return ranges(split_counts(length, len(self.workers)))

    def ops(self, worker: int) -> list[StepOp]:
        return [StepOp(REPLICA_STEP), StepOp(GRAD_REDUCE), StepOp(GRAD_UPDATE)]

    def slots(self, network: NetworkSpec, batch: int) -> list[Slot]:
        length = conv_parameter_count(network) + dense_parameter_count(network)
        step = StepOp(REPLICA_STEP)
        synced = (batch_norm_slots(network, len(self.workers), step, step)
                  if self.batch_norm == "sync" else [])
        return _gradient_slots(len(self.workers), length, step) + synced

    def checkpoint_chunks(self, network: NetworkSpec, chunks: dict[str, int]
                          ) -> dict[str, int]:
        """The first replica writes the whole network: one chunk per tensor."""
        return {}


@dataclass(frozen=True)
class HybridLayout:
    """Conv layers data-parallel on `shares`; dense layer j's output neurons split by
    `neurons[j]` over the workers; dense layers fed part by part per `scheme`."""

    workers: tuple[str, ...]
    shares: tuple[int, ...]
    neurons: tuple[tuple[int, ...], ...]
    scheme: str = "a"
    dense_batch: str = "full"
    master: int = 0  # reports the loss
    batch_norm: str = "sync"  # BATCH_NORMS, as `DataLayout`'s

    def __post_init__(self) -> None:
        _check_replicas(self.workers, self.shares, self.batch_norm)
        if self.scheme not in SCHEMES or self.dense_batch not in ("full", "worker"):
            raise ValueError(f"scheme {self.scheme!r} / dense_batch {self.dense_batch!r}")
        for j, row in enumerate(self.neurons):
            if len(row) != len(self.workers) or min(row) < 1:
                raise ValueError(f"dense layer {j}: every worker needs a neuron, got {row}")

    def rows(self) -> list[tuple[int, int]]:
        return ranges(list(self.shares))

    def owned(self, length: int) -> list[tuple[int, int]]:
        return ranges(split_counts(length, len(self.workers)))

    def neuron_ranges(self, layer: int) -> list[tuple[int, int]]:
        return ranges(list(self.neurons[layer]))

    def parts(self) -> list[list[tuple[int, int, int]]]:
        """The parts the dense layers run on, in order: ``(worker, start, stop)``
        pieces of batch rows, in worker order."""
        rows = self.rows()
        owners = [e for e, (a, b) in enumerate(rows) if b > a]
        if self.scheme == "a":
            return [[(e, *rows[e]) for e in owners]]
        if self.scheme == "b":
            return [[(e, *rows[e])] for e in owners]
        count = len(self.workers)
        parts = []
        for k in range(count):
            piece = []
            for e in owners:
                start, stop = rows[e]
                size = stop - start
                a = start + math.floor(k * size / count)
                b = start + math.floor((k + 1) * size / count)
                if b > a:
                    piece.append((e, a, b))
            if piece:
                parts.append(piece)
        return parts

    def ops(self, worker: int) -> list[StepOp]:
        layers = range(len(self.neurons))
        ops = [StepOp(TRUNK_FORWARD)]
        for k in range(len(self.parts())):
            ops += [StepOp(DENSE_FORWARD, j, k) for j in layers]
            ops += [StepOp(DENSE_BACKWARD, j, k) for j in reversed(layers)]
        return ops + [StepOp(TRUNK_BACKWARD), StepOp(GRAD_REDUCE), StepOp(GRAD_UPDATE)]

    def slots(self, network: NetworkSpec, batch: int) -> list[Slot]:
        workers = range(len(self.workers))
        features = network.flat_features
        last = len(self.neurons) - 1
        slots: list[Slot] = []
        for k, part in enumerate(self.parts()):
            n = sum(b - a for _, a, b in part)
            for e, a, b in part:
                others = tuple(d for d in workers if d != e)
                if others:
                    slots.append(Slot(f"feat/{k}/{e}", (b - a, features), e,
                                      StepOp(TRUNK_FORWARD), others, StepOp(DENSE_FORWARD, 0, k)))
            for j in range(len(self.neurons)):
                read_op = (StepOp(DENSE_FORWARD, j + 1, k) if j < last
                           else StepOp(DENSE_BACKWARD, last, k))
                for d in workers:
                    others = tuple(e for e in workers if e != d)
                    if others:
                        slots.append(Slot(f"out/{k}/{j}/{d}", (n, self.neurons[j][d]), d,
                                          StepOp(DENSE_FORWARD, j, k), others, read_op))
                for d in workers:
                    if j == 0:
                        pieces = [(e, (b - a, features), StepOp(TRUNK_BACKWARD))
                                  for e, a, b in part]
                    else:
                        pieces = [(e, (n, self.neurons[j - 1][e]), StepOp(DENSE_BACKWARD, j - 1, k))
                                  for e in workers]
                    for e, shape, op in pieces:
                        if e != d:
                            slots.append(Slot(f"din/{k}/{j}/{d}/{e}", shape, d,
                                              StepOp(DENSE_BACKWARD, j, k), (e,), op))
        if self.batch_norm == "sync":
            slots += batch_norm_slots(network, len(self.workers), StepOp(TRUNK_FORWARD),
                                      StepOp(TRUNK_BACKWARD))
        return slots + _gradient_slots(len(self.workers), conv_parameter_count(network),
                                       StepOp(TRUNK_BACKWARD))

    def checkpoint_chunks(self, network: NetworkSpec, chunks: dict[str, int]
                          ) -> dict[str, int]:
        """Each worker writes its own rows of every dense layer; the first replica
        writes the conv trunk, one chunk per tensor."""
        chunks = {}
        for key, row in zip(network.dense_names, self.neurons):
            chunks[f"{key}.weight"] = chunks[f"{key}.bias"] = math.gcd(*row)
        return chunks
