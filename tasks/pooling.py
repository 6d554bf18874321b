"""Max-pooling with PyTorch's own results, faster than its kernel for NCHW tensors.

PyTorch's CPU max-pool on a contiguous (NCHW) tensor walks each window with scalar
code: on the small network at batch 128 the two pools took about 45 ms of a 145 ms
single-thread step, more than either convolution (docs/benchmarks.md). Its
channels-last kernel runs the same comparisons over the channels with vector
instructions, 2-3x faster even with the copies there and back. A maximum is chosen,
not computed, so the values are the same bits, and both kernels keep the first
maximum of a window in the same scan order, so the indices are the same too
(tests/test_pooling.py compares both, ties included). The copies are made a few
samples at a time, so that the pool needs only a slice's worth of memory more than
PyTorch's kernel does.

The in-process `reference` and the DDP peer keep `nn.MaxPool2d`: plain PyTorch, what
a user would otherwise run. So every strategy's speed against them includes this
kernel's gain; docs/benchmarks.md gives it apart.
"""

from __future__ import annotations

import torch
from torch import nn

#: Bytes of conv output pooled per channels-last slice (whole samples, at least one):
#: the extra memory the pool needs, and small enough to stay in the cache between the
#: copy and the pool (0.25-1 MB slices ran fastest here, on both networks).
SLICE_BYTES = 512 * 1024


def max_pool_with_indices(z: torch.Tensor, pool: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.aten.max_pool2d_with_indices(z, [pool] * 2, [pool] * 2)``: the same
    pooled values and indices (NCHW, contiguous), from the channels-last kernel."""
    if z.device.type != "cpu" or z.dim() != 4:
        return torch.ops.aten.max_pool2d_with_indices(z, [pool] * 2, [pool] * 2)
    n, c, h, w = z.shape
    y = z.new_empty((n, c, h // pool, w // pool))
    indices = torch.empty(y.shape, dtype=torch.int64, device=z.device)
    samples = max(1, SLICE_BYTES // max(c * h * w * z.element_size(), 1))
    for start in range(0, n, samples):
        part = z[start:start + samples].contiguous(memory_format=torch.channels_last)
        values, where = torch.ops.aten.max_pool2d_with_indices(part, [pool] * 2, [pool] * 2)
        y[start:start + samples] = values
        indices[start:start + samples] = where
    return y, indices


class _MaxPool(torch.autograd.Function):
    """Forward by `max_pool_with_indices`, backward by PyTorch's own max-pool backward
    with those indices: autograd's bits for `nn.MaxPool2d` both ways."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pool: int) -> torch.Tensor:
        y, indices = max_pool_with_indices(x, pool)
        ctx.save_for_backward(x, indices)
        ctx.pool = pool
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, indices = ctx.saved_tensors
        p = ctx.pool
        return torch.ops.aten.max_pool2d_with_indices_backward(
            grad_y, x, [p, p], [p, p], [0, 0], [1, 1], False, indices), None


class MaxPool(nn.Module):
    """`nn.MaxPool2d(pool)` (stride = pool, no padding) through `max_pool_with_indices`:
    the workers' replicas use it (tasks/network.py); it has no state."""

    def __init__(self, pool: int) -> None:
        super().__init__()
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _MaxPool.apply(x, self.pool)

    def extra_repr(self) -> str:
        return f"pool={self.pool}"
