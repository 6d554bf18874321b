"""tasks/pooling.py: the channels-last max-pool gives PyTorch's own values, indices
and gradients, bit for bit, ties included; pure torch, no cluster."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tasks.pooling as pooling
from tasks.pooling import MaxPool, max_pool_with_indices


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int64)


def _relu_with_ties(shape, dtype=torch.float32, seed=0):
    z = F.relu(torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype))
    flat = z.view(-1)
    flat[: flat.numel() // 3] = flat[: flat.numel() // 3].round()  # many equal maxima
    return z


@pytest.mark.parametrize("shape,pool", [((5, 3, 8, 8), 2), ((7, 6, 9, 10), 2),
                                        ((4, 5, 12, 12), 3), ((40, 4, 6, 6), 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_values_and_indices_are_pytorchs(shape, pool, dtype, monkeypatch):
    monkeypatch.setattr(pooling, "SLICE_BYTES", 1000)  # several slices, a partial last one
    z = _relu_with_ties(shape, dtype)
    expected, where = torch.ops.aten.max_pool2d_with_indices(z, [pool] * 2, [pool] * 2)
    values, indices = max_pool_with_indices(z, pool)
    assert values.is_contiguous() and indices.is_contiguous()
    assert torch.equal(_bits(values), _bits(expected))
    assert torch.equal(indices, where)


def test_a_tie_keeps_the_first_maximum_in_scan_order():
    z = torch.tensor([[[[1.0, 2.0], [2.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]]]])
    values, indices = max_pool_with_indices(z, 2)
    assert values.flatten().tolist() == [2.0, 0.0]
    assert indices.flatten().tolist() == [1, 0]  # top right, then the first zero


def test_the_module_trains_as_nn_maxpool2d_does():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(6 * 4 * 4, 5))
    fast = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), MaxPool(2),
                         nn.Flatten(), nn.Linear(6 * 4 * 4, 5))
    fast.load_state_dict(plain.state_dict())
    x = torch.randn(9, 3, 8, 8)
    x[:, :, :4] = x[:, :, :4].round()  # ties in the conv outputs' windows
    y = torch.randint(0, 5, (9,))
    for model in (plain, fast):
        F.cross_entropy(model(x), y).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), fast.named_parameters()):
        assert torch.equal(_bits(a.grad), _bits(b.grad)), name
    assert torch.equal(_bits(plain(x)), _bits(fast(x)))


def test_an_empty_batch_pools_to_an_empty_batch():
    """A replica given no rows still runs its trunk (sync batch norm's sums need it)."""
    x = torch.zeros(0, 3, 8, 8, requires_grad=True)
    y = MaxPool(2)(x)
    assert y.shape == (0, 3, 4, 4)
    y.sum().backward()
    assert x.grad.shape == x.shape
