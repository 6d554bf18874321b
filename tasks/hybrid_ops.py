"""Hybrid training on a worker (Krizhevsky's "one weird trick"): a conv replica and
slices of every dense layer.

`hybrid` (tasks/replica_layout.py, `HybridLayout`): the conv layers as a replica
(``trunk-forward`` / ``trunk-backward``), each dense layer's output neurons as a
slice per worker. Per part of the batch, ``dense-forward j`` computes this worker's
output neurons of layer j from the whole input (its own rows or slice from memory,
the rest read) and ``dense-backward j`` its weight gradient and its partial gradient
of the layer's input, handed to whoever owns that input. The conv gradients are then
reduced like `data`'s (tasks/data_ops.py). With ``dense_batch: full`` the dense slices
step once with the summed gradient of every part; with ``worker`` after each part, on
the part's mean loss, and the conv trunk then gets each part's input gradient
weighted by its share of the batch.

Dropout on a dense layer's input draws, per part, the mask of the part's batch rows
alone (`tasks.network.dropout_mask`): those rows of the whole batch's mask, the mask
a replica or a plain-PyTorch replay draws. Batch norm in the trunk is as `data`'s
(sync: the whole batch's statistics, exchanged inside ``trunk-forward`` and
``trunk-backward``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from storage import checkpoints
from storage.datasets import read_batch, read_labels
from tasks.data_ops import (Gradients, batch_norm_exchange, dtype_of, grad_reduce, grad_update,
                            hand_on_ranges, read_tensors, write_tensors)
from tasks.layout import StepOp
from tasks.network import SpecNetwork, backward_from, conv_trunk, dropout_mask, to_arrays
from tasks.optim import WorkerSGD, make_sgd, momentum_of, restore_momentum, weights_of
from tasks.receipts import TaskClock
from tasks.replica_layout import (DENSE_BACKWARD, DENSE_FORWARD, GRAD_REDUCE, GRAD_UPDATE,
                                  TRUNK_BACKWARD, TRUNK_FORWARD, HybridLayout)
from tasks.run_state import RunState, WorkerSide
from tasks.specs import Arithmetic, NetworkSpec
from tasks.sync_batch_norm import ComputeSpans, ReplicaBatchNorm2d, exchanging, synchronise


@dataclass
class DenseSlice:
    """One dense layer's output neurons [start, stop) on this worker."""

    key: str  # e.g. "5": the layer's module index in the equivalent nn.Sequential
    start: int
    stop: int
    weight: torch.Tensor
    bias: torch.Tensor
    dropout: float = 0.0  # on the layer's input


@dataclass
class HybridWork:
    """The conv trunk (a replica), this worker's dense slices, and a step's tensors."""

    trunk: SpecNetwork
    conv_optimizer: WorkerSGD
    dense: list[DenseSlice]
    dense_optimizer: WorkerSGD
    grads: Gradients
    check_replicas: bool
    seed: int = 0  # the run's, for the dropout masks
    norms: list[ReplicaBatchNorm2d] = field(default_factory=list)  # sync batch norm's
    features: torch.Tensor | None = None  # own rows' conv output, with its graph
    kept: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def dropout_rows(self, step: int, j: int, rows: np.ndarray, batch: int,
                     inputs: torch.Tensor) -> torch.Tensor:
        """Rows `rows` of dense layer j's dropout mask of `step` for a batch of `batch`,
        drawn for those rows alone (`dropout_mask`), on the inputs' device."""
        mask = dropout_mask(self.seed, step, j, (batch, inputs.shape[1]),
                            self.dense[j].dropout, inputs.dtype, rows)
        return mask.to(inputs.device)

    def apply_reduced(self, layout: HybridLayout, step: int) -> None:
        """Step `step`'s conv update once the summed conv gradient is in place; the
        dense slices' too with ``dense_batch: full`` (with ``worker`` they stepped after
        each part, at the same step's rate)."""
        self.conv_optimizer.step(step)
        if layout.dense_batch == "full":
            self.dense_optimizer.step(step)
            self.dense_optimizer.zero_grad(set_to_none=True)


# Loading and saving ----------------------------------------------------------------------


def load_hybrid(layout: HybridLayout, me: int, network: NetworkSpec, checkpoint_path: str,
                step: int, arithmetic: Arithmetic, device: str) -> HybridWork:
    """The conv trunk and this worker's neurons of every dense layer from checkpoint
    `step`; the conv layers' learning rate scaled as the arithmetic says."""
    trunk = conv_trunk(network, fast_pool=True)
    weights = read_tensors(checkpoint_path, step, "weights")
    trunk.load_state_dict({k: v for k, v in weights.items() if k in trunk.state_dict()})
    trunk.to(device)
    conv_sgd = make_sgd(trunk.parameters(), arithmetic.conv_optimizer())
    named = dict(trunk.named_parameters())
    momentum = checkpoints.read_tensors(checkpoint_path, step, "momentum")
    restore_momentum(conv_sgd, named, momentum)
    slices = []
    for j, key in enumerate(network.dense_names):
        start, stop = layout.neuron_ranges(j)[me]
        rows = {name: torch.from_numpy(checkpoints.read_slice(checkpoint_path, step, "weights",
                                                              f"{key}.{name}", start, stop))
                .to(device).requires_grad_(True) for name in ("weight", "bias")}
        slices.append(DenseSlice(str(key), start, stop, rows["weight"], rows["bias"],
                                 network.dense_dropout(j)))
    dense_sgd = make_sgd([t for s in slices for t in (s.weight, s.bias)], arithmetic.optimizer)
    restore_momentum(dense_sgd, _dense_named(slices),
                     {f"{s.key}.{name}": momentum[f"{s.key}.{name}"][s.start:s.stop]
                      for s in slices for name in ("weight", "bias")})
    norms = synchronise(trunk) if layout.batch_norm == "sync" else []
    return HybridWork(trunk, conv_sgd, slices, dense_sgd, Gradients(list(named.items())),
                      arithmetic.check_replicas, arithmetic.seed, norms)


def save_hybrid(work: HybridWork, me: int, checkpoint_path: str, step: int) -> None:
    """The first worker writes the conv layers; each worker its dense rows."""
    if me == 0:
        named = dict(work.trunk.named_parameters())
        write_tensors(checkpoint_path, step, to_arrays(work.trunk.state_dict(), dtype_of(named)),
                      momentum_of(work.conv_optimizer, named), 0)
    for piece in work.dense:
        named = {f"{piece.key}.weight": piece.weight, f"{piece.key}.bias": piece.bias}
        write_tensors(checkpoint_path, step, weights_of(named),
                      momentum_of(work.dense_optimizer, named), piece.start)


def _dense_named(slices: list[DenseSlice]) -> dict[str, torch.Tensor]:
    return {f"{s.key}.{name}": getattr(s, name) for s in slices for name in ("weight", "bias")}


# Steps -----------------------------------------------------------------------------------


def trunk_forward(run: RunState, op: StepOp, step: int, indices: np.ndarray,
                  clock: TaskClock) -> None:
    work: HybridWork = run.work
    layout: HybridLayout = run.layout
    start, stop = layout.rows()[run.me]
    with clock.op(TRUNK_FORWARD):
        work.conv_optimizer.zero_grad(set_to_none=True)
        work.features = None
        if stop == start and not work.norms:  # with sync batch norm: a party on no rows
            return
        with clock.phase("dataset") as phase:
            images = read_batch(run.paths.dataset, "train", indices[start:stop],
                                run.paths.dataset_identity)[0]
            phase.nbytes = images.nbytes
            images = run.augmentation.apply(images, indices[start:stop], step)
        with ComputeSpans(clock) as spans, \
                exchanging(work.norms, batch_norm_exchange(run, step, spans)):
            work.features = work.trunk(torch.from_numpy(images).to(run.profile.device))
        run.emulate(clock, spans.seconds)
        mine = work.features.detach()
        for k, part in enumerate(layout.parts()):
            for e, a, b in part:
                if e == run.me:
                    work.kept[("features", k)] = mine[a - start:b - start]
                    run.mover.write(f"feat/{k}/{e}", step, mine[a - start:b - start], clock)


def dense_forward(run: RunState, op: StepOp, step: int, indices: np.ndarray,
                  clock: TaskClock) -> None:
    work: HybridWork = run.work
    layout: HybridLayout = run.layout
    j, k = op.layer, op.part
    last = len(layout.neurons) - 1
    with clock.op(DENSE_FORWARD, j):
        if j == 0:
            inputs = torch.cat([work.kept.pop(("features", k)) if e == run.me
                                else run.mover.read(f"feat/{k}/{e}", step, clock)
                                for e, _a, _b in layout.parts()[k]])
        else:
            inputs = torch.cat([work.kept[("out", k, j - 1)] if d == run.me
                                else run.mover.read(f"out/{k}/{j - 1}/{d}", step, clock)
                                for d in range(len(layout.workers))], dim=1)
        piece = work.dense[j]
        with clock.phase("compute") as phase:
            if piece.dropout > 0:
                mask = work.dropout_rows(step, j, part_rows(layout.parts()[k]), run.batch,
                                         inputs)
                inputs = inputs * mask
                work.kept[("mask", k, j)] = mask
            pre = F.linear(inputs, piece.weight.detach(), piece.bias.detach())
            out = F.relu(pre) if j < last else pre
        run.emulate(clock, phase.seconds)
        work.kept[("in", k, j)] = inputs  # after the dropout: what the layer multiplied
        work.kept[("out", k, j)] = out
        run.mover.write(f"out/{k}/{j}/{run.me}", step, out, clock)


def dense_backward(run: RunState, op: StepOp, step: int, indices: np.ndarray,
                   clock: TaskClock) -> None:
    work: HybridWork = run.work
    layout: HybridLayout = run.layout
    j, k = op.layer, op.part
    last = len(layout.neurons) - 1
    part = layout.parts()[k]
    workers = range(len(layout.workers))
    piece = work.dense[j]
    with clock.op(DENSE_BACKWARD, j):
        if j == last:
            logits = torch.cat([work.kept[("out", k, last)] if d == run.me
                                else run.mover.read(f"out/{k}/{last}/{d}", step, clock)
                                for d in workers], dim=1)
            with clock.phase("dataset"):
                rows = indices[part_rows(part)]
                labels = torch.from_numpy(read_labels(run.paths.dataset, "train", rows,
                                                      run.paths.dataset_identity))
            with clock.phase("compute") as phase:
                grad_out = _logit_gradient(run, logits, labels.to(logits.device), clock)
                grad_pre = grad_out[:, piece.start:piece.stop]
        else:
            parts = [work.kept.pop(("din", k, j + 1)) if d == run.me
                     else run.mover.read(f"din/{k}/{j + 1}/{d}/{run.me}", step, clock)
                     for d in workers]
            with clock.phase("compute") as phase:
                grad_out = parts[0]
                for extra in parts[1:]:
                    grad_out = grad_out + extra
                activated = work.kept[("out", k, j)]  # after ReLU: its backward passes
                grad_pre = torch.where(activated > 0, grad_out, torch.zeros_like(grad_out))
        inputs = work.kept.pop(("in", k, j))
        mask = work.kept.pop(("mask", k, j), None)
        with clock.phase("compute") as more:
            grad_in = grad_pre @ piece.weight.detach()  # before any update of this layer
            if mask is not None:
                grad_in = grad_in * mask
            grad_weight, grad_bias = grad_pre.t() @ inputs, grad_pre.sum(dim=0)
            _add_or_step(work, piece, grad_weight, grad_bias, layout.dense_batch, step)
        run.emulate(clock, phase.seconds + more.seconds)
        work.kept.pop(("out", k, j), None)
        if j == 0:
            offset = 0
            for e, a, b in part:
                rows_of_e = grad_in[offset:offset + b - a]
                offset += b - a
                if e == run.me:
                    work.kept[("din", k, 0)] = rows_of_e
                else:
                    run.mover.write(f"din/{k}/0/{run.me}/{e}", step, rows_of_e, clock)
        else:
            for e, (a, b) in enumerate(layout.neuron_ranges(j - 1)):
                columns = grad_in[:, a:b]
                if e == run.me:
                    work.kept[("din", k, j)] = columns
                else:
                    run.mover.write(f"din/{k}/{j}/{run.me}/{e}", step, columns, clock)


def part_rows(part: list[tuple[int, int, int]]) -> np.ndarray:
    """The batch rows of a part, in its order."""
    return np.concatenate([np.arange(a, b) for _e, a, b in part])


def _logit_gradient(run: RunState, logits: torch.Tensor, labels: torch.Tensor,
                    clock: TaskClock) -> torch.Tensor:
    """dLoss/dlogits of a part: its mean loss (dense_batch worker) or its share of the
    batch's (full). The master reports the part's share of the batch's loss."""
    leaf = logits.detach().requires_grad_(True)
    summed = F.cross_entropy(leaf, labels, reduction="sum")
    if run.me == run.layout.master:
        clock.receipt.loss = (clock.receipt.loss or 0.0) + float(summed.detach()) / run.batch
    loss = summed / len(labels) if run.layout.dense_batch == "worker" else summed / run.batch
    (grad,) = torch.autograd.grad(loss, leaf)
    return grad


def _add_or_step(work: HybridWork, piece: DenseSlice, grad_weight: torch.Tensor,
                 grad_bias: torch.Tensor, dense_batch: str, step: int) -> None:
    """Full batch: add to the slice's gradient (one step after every part); per part:
    step this slice now, at step `step`'s rate."""
    if dense_batch == "full":
        for param, grad in ((piece.weight, grad_weight), (piece.bias, grad_bias)):
            param.grad = grad if param.grad is None else param.grad + grad
        return
    piece.weight.grad, piece.bias.grad = grad_weight, grad_bias
    work.dense_optimizer.step(step)
    piece.weight.grad = piece.bias.grad = None


def trunk_backward(run: RunState, op: StepOp, step: int, indices: np.ndarray,
                   clock: TaskClock) -> None:
    work: HybridWork = run.work
    layout: HybridLayout = run.layout
    start, stop = layout.rows()[run.me]
    workers = range(len(layout.workers))
    with clock.op(TRUNK_BACKWARD):
        if work.features is not None:
            grad = torch.zeros_like(work.features)
            for k, part in enumerate(layout.parts()):
                for e, a, b in part:
                    if e != run.me:
                        continue
                    pieces = [work.kept.pop(("din", k, 0)) if d == run.me
                              else run.mover.read(f"din/{k}/0/{d}/{run.me}", step, clock)
                              for d in workers]
                    total = pieces[0]
                    for extra in pieces[1:]:
                        total = total + extra
                    if layout.dense_batch == "worker":  # the part's mean loss, as its share
                        total = total * (sum(q - p for _e, p, q in part) / run.batch)
                    grad[a - start:b - start] = total
            with ComputeSpans(clock) as spans, \
                    exchanging(work.norms, batch_norm_exchange(run, step, spans)):
                backward_from(work.features, grad)
                work.features = None
            run.emulate(clock, spans.seconds)
        hand_on_ranges(run, work.grads, work.conv_optimizer, step, clock)


#: What `hybrid` runs on a worker.
HYBRID_SIDE = WorkerSide(load_hybrid, save_hybrid, {
    TRUNK_FORWARD: trunk_forward, DENSE_FORWARD: dense_forward,
    DENSE_BACKWARD: dense_backward, TRUNK_BACKWARD: trunk_backward,
    GRAD_REDUCE: grad_reduce, GRAD_UPDATE: grad_update})
