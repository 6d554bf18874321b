"""Batch norm over the whole batch on replicas that each hold some of its rows.

Under `data` and `hybrid` every worker runs the conv layers on its own rows. With
``train.batch_norm: sync`` (the default) each batch-norm layer still normalises by the
statistics of the whole batch, as single-process training does (and PyTorch's
SyncBatchNorm): the forward needs every channel's mean and variance over every
replica's rows, the backward every channel's sums of dy and dy * (x - mean) over
them. Each replica writes its partial sums to its own slot (``bn-fwd/<l>/<d>``,
``bn-bwd/<l>/<d>``, tasks/replica_layout.py) and reads every other replica's, inside
the op that runs the layer; all replicas run that op at once, and in it every
batch-norm layer in the same order (the same graph, forward and backward), each
writing before it waits. A replica with no rows takes part with zero sums.

The forward's partial sums are, per channel, the count, the sum and the sum of
squared deviations from the replica's own mean; they are combined in worker order
(Chan's parallel variance), which is as exact as one pass over the whole batch and
needs no second exchange. Every replica combines the same numbers in the same order,
so every replica computes the same bits: the same normalisation, and the same
running statistics (momentum and unbiased variance as nn.BatchNorm2d; the counter
counts the steps), so that any replica's are the checkpoint's.

The modules stay nn.BatchNorm2d (their state_dict keys are the checkpoint's):
`synchronise` swaps their forward for `ReplicaBatchNorm2d`'s, which needs an
exchange set (`exchanging`) whenever it trains; in evaluation it is nn.BatchNorm2d's.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from tasks.moves import Mover
from tasks.receipts import TaskClock
from tasks.replica_layout import BN_BACKWARD, BN_FORWARD, batch_norm_slot

CHANNEL_DIMS = (0, 2, 3)


class ComputeSpans:
    """An op's compute phase cut around the exchanges inside it: each stretch of
    compute is recorded as a compute phase of its own, so that the waits, reads and
    writes of the exchanges are not counted as compute too. `seconds` is their sum."""

    def __init__(self, clock: TaskClock) -> None:
        self.clock = clock
        self.started: float | None = None
        self.seconds = 0.0

    def __enter__(self) -> ComputeSpans:
        self.started = time.time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.pause()

    def pause(self) -> None:
        """End the current stretch of compute (the device's queued work included)."""
        if self.started is None:
            return
        self.clock.sync()
        now = time.time()
        self.clock.add("compute", self.started, now)
        self.seconds += now - self.started
        self.started = None

    def resume(self) -> None:
        self.started = time.time()


@dataclass
class BatchNormExchange:
    """Where one replica's batch norms swap partial sums during one op: the run's
    slots (`mover`), this worker among `workers`, the step, and the op's clock."""

    mover: Mover
    me: int
    workers: int
    step: int
    spans: ComputeSpans

    def gather(self, kind: str, layer: int, local: torch.Tensor) -> list[torch.Tensor]:
        """Every worker's partial sums of `layer` (`kind`: forward or backward), in
        worker order: this worker's written for the others, theirs read."""
        clock = self.spans.clock
        self.spans.pause()
        try:
            self.mover.write(batch_norm_slot(kind, layer, self.me), self.step, local, clock)
            return [local if d == self.me
                    else self.mover.read(batch_norm_slot(kind, layer, d), self.step, clock)
                    for d in range(self.workers)]
        finally:
            self.spans.resume()


def local_moments(x: torch.Tensor) -> torch.Tensor:
    """Per channel of `x` (N, C, H, W): its count, sum, and sum of squared deviations
    from its own mean, as rows of a (3, C) tensor (zeros for no rows)."""
    count = x.numel() // x.shape[1]
    total = x.sum(CHANNEL_DIMS)
    if count:
        deviation = x - (total / count)[None, :, None, None]
        squares = deviation.square_().sum(CHANNEL_DIMS)
    else:
        squares = torch.zeros_like(total)
    return torch.stack([torch.full_like(total, count), total, squares])


def combine_moments(parts: list[torch.Tensor]) -> tuple[float, torch.Tensor, torch.Tensor]:
    """The whole batch's count, mean and sum of squared deviations from `local_moments`
    of its parts, combined in the order given (Chan et al.'s pairwise update)."""
    count = parts[0][0]
    total = parts[0][1]
    for part in parts[1:]:
        count, total = count + part[0], total + part[1]
    mean = total / count
    squares = torch.zeros_like(mean)
    for part in parts:
        n = part[0]
        shift = part[1] / n.clamp(min=1) - mean  # a part without rows adds nothing
        squares = squares + part[2] + n * (shift * shift)
    return float(count[0]), mean, squares


def sum_in_order(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


class _WholeBatchNorm(torch.autograd.Function):
    """Training-mode batch norm with the whole batch's statistics (module doc). The
    passes over the tensors are PyTorch's own fused batch-norm kernels where they fit:
    the normalisation is its evaluation-mode forward with the whole batch's mean and
    variance, the backward's sums its training-mode backward's weight and bias
    gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                norm: ReplicaBatchNorm2d) -> torch.Tensor:
        count, mean, squares = combine_moments(
            norm.current_exchange().gather(BN_FORWARD, norm.layer, local_moments(x)))
        if count <= 1:
            raise ValueError(f"batch norm {norm.layer}: expected more than 1 value per "
                             f"channel when training, got {int(count)}")
        norm.update_running(mean, squares / (count - 1))
        variance = squares / count
        y = torch.ops.aten.native_batch_norm(x, weight, bias, mean, variance, False, 0.0,
                                             norm.eps)[0]
        ctx.save_for_backward(x, weight, mean, variance)
        ctx.norm, ctx.count = norm, count
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, mean, variance = ctx.saved_tensors
        norm: ReplicaBatchNorm2d = ctx.norm
        invstd = torch.rsqrt(variance + norm.eps)
        ones = weight if weight is not None else torch.ones_like(mean)
        if x.numel():
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dy, x, ones, None, None, mean, invstd, True, norm.eps, [False, True, True])
        else:  # no rows: zero sums (PyTorch's kernels crash on an empty batch)
            sum_dy_xhat, sum_dy = torch.zeros_like(mean), torch.zeros_like(mean)
        total_dy, total_dy_xhat = sum_in_order(norm.current_exchange().gather(
            BN_BACKWARD, norm.layer, torch.stack([sum_dy, sum_dy_xhat])))
        grad_x = None
        if ctx.needs_input_grad[0] and not x.numel():
            grad_x = torch.zeros_like(dy)
        elif ctx.needs_input_grad[0]:
            # scale * (dy - mean dy - xhat * mean(dy * xhat)) over the whole batch, per
            # channel an affine function of x and dy: x * slope + offset first, then dy *
            # scale added in place: two passes over the layer's tensors and one tensor of
            # its size (`python -m benchmarks.sync_batch_norm` times it against local)
            scale = invstd * ones
            slope = -scale * invstd * total_dy_xhat / ctx.count
            offset = -scale * total_dy / ctx.count - slope * mean
            grad_x = torch.addcmul(offset[None, :, None, None], x, slope[None, :, None, None])
            grad_x.addcmul_(dy, scale[None, :, None, None])
        if weight is None:
            return grad_x, None, None, None
        return grad_x, sum_dy_xhat, sum_dy, None


class ReplicaBatchNorm2d(nn.BatchNorm2d):
    """nn.BatchNorm2d whose training forward takes the whole batch's statistics over
    the replicas (`synchronise` makes one of an nn.BatchNorm2d in place)."""

    layer: int  # the conv layer it follows: its slots' index
    exchange: BatchNormExchange | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        return _WholeBatchNorm.apply(x, self.weight, self.bias, self)

    def current_exchange(self) -> BatchNormExchange:
        if self.exchange is None:
            raise RuntimeError(f"batch norm {self.layer} trains over the replicas: run it "
                               "inside exchanging(...)")
        return self.exchange

    @torch.no_grad()
    def update_running(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        """The running statistics as nn.BatchNorm2d keeps them."""
        if not self.track_running_stats:
            return
        self.num_batches_tracked.add_(1)
        factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                  else self.momentum)
        self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased_var, alpha=factor)


def synchronise(model: nn.Module) -> list[ReplicaBatchNorm2d]:
    """Make every batch norm of `model` (a `tasks.network.SpecNetwork`) a
    `ReplicaBatchNorm2d`, in place: same module, same tensors, same keys."""
    norms = []
    for layer, norm in enumerate(model.norms):
        if norm is not None:
            norm.__class__ = ReplicaBatchNorm2d
            norm.layer, norm.exchange = layer, None
            norms.append(norm)
    return norms


@contextmanager
def exchanging(norms: list[ReplicaBatchNorm2d], exchange: BatchNormExchange
               ) -> Iterator[None]:
    """The batch norms exchange through `exchange` while inside."""
    for norm in norms:
        norm.exchange = exchange
    try:
        yield
    finally:
        for norm in norms:
            norm.exchange = None
