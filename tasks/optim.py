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


def make_sgd(params: Iterable[torch.Tensor], spec: OptimizerSpec) -> torch.optim.SGD:
    return torch.optim.SGD(list(params), lr=spec.lr, momentum=spec.momentum,
                           weight_decay=spec.weight_decay, nesterov=spec.nesterov)


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
