"""The one place SGD is built, and its momentum saved and restored.

Every part of a run (conv shards on workers, the dense head, the in-process
reference) uses the same `torch.optim.SGD` with the same hyper-parameters, so that
the distributed arithmetic is exactly single-process SGD's. A checkpoint stores
each parameter's momentum buffer beside its weights (zeros before the first step).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from tasks.specs import OptimizerSpec


def make_sgd(params: Iterable[torch.Tensor], spec: OptimizerSpec,
             lean: bool = False) -> torch.optim.SGD:
    """torch's SGD with `spec`'s hyper-parameters; `lean`: `LeanSGD` (the same
    arithmetic without a parameter-sized copy per step), for the workers."""
    if lean:
        return LeanSGD(list(params), spec)
    return torch.optim.SGD(list(params), lr=spec.lr, momentum=spec.momentum,
                           weight_decay=spec.weight_decay, nesterov=spec.nesterov)


class LeanSGD(torch.optim.SGD):
    """torch's SGD, the weight decay added into each gradient in place.

    torch's step computes ``grad.add(param, alpha=weight_decay)``, a new tensor the
    size of the parameter, before the momentum: on the paper network's conv layer
    75 MB at the moment a step holds the most. Here the same ``add`` runs in place
    into the gradient (which the step consumes anyway), and torch's step follows with
    no weight decay of its own: the same kernels on the same values, so the weights
    are the plain SGD's bit for bit (tests/test_memory.py).
    """

    def __init__(self, params: list[torch.Tensor], spec: OptimizerSpec) -> None:
        super().__init__(params, lr=spec.lr, momentum=spec.momentum, weight_decay=0.0,
                         nesterov=spec.nesterov)
        self.decay = spec.weight_decay

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch's signature
        if self.decay:
            for group in self.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.grad.add_(param, alpha=self.decay)
        return super().step(closure)


def restore_momentum(optimizer: torch.optim.SGD, named: dict[str, torch.Tensor],
                     buffers: dict[str, np.ndarray]) -> None:
    """Load momentum buffers (numpy, by parameter name) next to their parameters.

    Buffers that are all zeros are skipped: a fresh SGD starts its buffer from the
    first gradient, which is what a zero buffer from step 0 means.
    """
    for name, param in named.items():
        buffer = buffers[name]
        if np.any(buffer):
            optimizer.state[param]["momentum_buffer"] = torch.from_numpy(
                np.array(buffer)).to(param.device)


def momentum_of(optimizer: torch.optim.SGD, named: dict[str, torch.Tensor]
                ) -> dict[str, np.ndarray]:
    """Every parameter's momentum buffer as numpy (zeros where SGD has none yet)."""
    out = {}
    for name, param in named.items():
        buffer = optimizer.state.get(param, {}).get("momentum_buffer")
        out[name] = (np.zeros(tuple(param.shape), dtype=_numpy_dtype(param)) if buffer is None
                     else buffer.detach().to("cpu").numpy().copy())
    return out


def weights_of(named: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {name: param.detach().to("cpu").numpy().copy() for name, param in named.items()}


def _numpy_dtype(tensor: torch.Tensor) -> np.dtype:
    return torch.empty((), dtype=tensor.dtype).numpy().dtype
