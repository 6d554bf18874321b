"""Batch norm over the replicas (tasks/sync_batch_norm.py) against nn.BatchNorm2d on the
whole batch, without a cluster: three replicas in threads, exchanging their partial
sums through an in-memory stand-in for the workspace that waits as the real one does."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from tasks.receipts import Receipt, TaskClock
from tasks.specs import ConvLayerSpec, NetworkSpec
from tasks.network import build_network
from tasks.sync_batch_norm import (BatchNormExchange, ComputeSpans, combine_moments,
                                   exchanging, local_moments, synchronise)

SHARES = (5, 0, 3)  # the second replica has no rows, and still takes part


class MemorySlots:
    """Slots in memory: a read waits until its slot holds the step."""

    def __init__(self) -> None:
        self.values: dict[str, tuple[int, torch.Tensor]] = {}
        self.changed = threading.Condition()

    def write(self, slot: str, step: int, tensor: torch.Tensor, clock: TaskClock) -> None:
        with self.changed:
            self.values[slot] = (step, tensor.detach().clone())
            self.changed.notify_all()

    def read(self, slot: str, step: int, clock: TaskClock) -> torch.Tensor:
        with self.changed:
            assert self.changed.wait_for(lambda: self.values.get(slot, (-1,))[0] >= step, 10)
            return self.values[slot][1].clone()


def _network() -> NetworkSpec:
    """Two conv layers, each with batch norm (the first reads the images)."""
    return NetworkSpec((ConvLayerSpec(3, 4, 3, 1, 1, 6, 6, bias=False, batch_norm=True,
                                      name="0", bn_name="1"),
                        ConvLayerSpec(4, 5, 3, 1, 2, 6, 6, bias=False, batch_norm=True,
                                      name="3", bn_name="4")), dtype="float64")


def _replica_step(model, slots: MemorySlots, me: int, x: torch.Tensor, dy: torch.Tensor,
                  steps: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Forward and backward of `steps` steps on this replica's rows; its last output,
    its input gradient and its parameters' gradients summed over the steps."""
    norms = synchronise(model)
    clock = TaskClock(Receipt("t", f"w{me}", 0, 0.0))
    for step in range(steps):
        x = x.detach().requires_grad_(True)
        with clock.op("replica-step"), ComputeSpans(clock) as spans, \
                exchanging(norms, BatchNormExchange(slots, me, len(SHARES), step, spans)):
            y = model.trunk(x)
            y.backward(dy)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()
             if p.grad is not None}  # the conv layers' and batch norms'; not the dense
    return y.detach(), x.grad, grads


def test_replicas_equal_batch_norm_on_the_whole_batch():
    torch.manual_seed(0)
    spec = _network()
    reference = build_network(spec)
    x = torch.randn(sum(SHARES), 3, 6, 6, dtype=torch.float64) * 2 + 0.5
    dy = torch.randn(sum(SHARES), 5, 3, 3, dtype=torch.float64)
    steps = 2
    replicas = [build_network(spec) for _ in SHARES]
    for replica in replicas:
        replica.load_state_dict(reference.state_dict())
    slots = MemorySlots()
    bounds = [0, SHARES[0], SHARES[0] + SHARES[1], sum(SHARES)]
    with ThreadPoolExecutor(len(SHARES)) as pool:
        results = list(pool.map(
            lambda d: _replica_step(replicas[d], slots, d, x[bounds[d]:bounds[d + 1]],
                                    dy[bounds[d]:bounds[d + 1]], steps), range(len(SHARES))))
    for step in range(steps):
        x_whole = x.detach().requires_grad_(True)
        y_whole = reference.trunk(x_whole)
        y_whole.backward(dy)
    options = {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(torch.cat([y for y, _g, _p in results]), y_whole.detach(),
                               **options)
    torch.testing.assert_close(torch.cat([g for _y, g, _p in results]), x_whole.grad, **options)
    for name, param in reference.named_parameters():  # the replicas' gradients add up
        if param.grad is not None:
            torch.testing.assert_close(sum(p[name] for _y, _g, p in results), param.grad,
                                       **options)
    expected = reference.state_dict()
    for replica in replicas:  # the running statistics: the whole batch's, the same bits
        state = replica.state_dict()
        assert int(state["1.num_batches_tracked"]) == steps
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, **options)
            assert torch.equal(state[key], replicas[0].state_dict()[key])


def test_moments_of_parts_combine_to_the_whole_batch():
    torch.manual_seed(1)
    x = torch.randn(9, 3, 4, 4, dtype=torch.float64) * 5 + 100  # a mean far from zero
    parts = [local_moments(x[a:b]) for a, b in ((0, 4), (4, 4), (4, 9))]
    count, mean, squares = combine_moments(parts)
    assert count == 9 * 16
    torch.testing.assert_close(mean, x.mean((0, 2, 3)), rtol=1e-14, atol=0)
    torch.testing.assert_close(squares / count, x.var((0, 2, 3), unbiased=False),
                               rtol=1e-12, atol=0)


def test_a_synchronised_batch_norm_trains_only_inside_an_exchange():
    model = build_network(_network())
    synchronise(model)
    assert isinstance(model.norms[0], nn.BatchNorm2d)  # the same module, the same keys
    assert set(model.state_dict()) == set(build_network(_network()).state_dict())
    with pytest.raises(RuntimeError, match="exchanging"):
        model.trunk(torch.zeros(2, 3, 6, 6, dtype=torch.float64))
    model.eval()  # evaluation: the running statistics, no exchange
    assert model.trunk(torch.zeros(2, 3, 6, 6, dtype=torch.float64)).shape == (2, 5, 3, 3)
