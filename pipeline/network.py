"""The network as plain PyTorch: the single source of initial weights and names.

Every strategy starts from `initial_state`, the state_dict of the equivalent
`torch.nn.Sequential` built with the run's seed, so that kernel-parallel training can
be compared with, and its checkpoints loaded into, ordinary PyTorch.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tasks.network import build_sequential  # noqa: F401 (re-exported)
from tasks.specs import NetworkSpec


def initial_state(spec: NetworkSpec, seed: int) -> dict[str, np.ndarray]:
    """PyTorch's default initialisation under `seed`, as numpy arrays."""
    torch.manual_seed(seed)
    model = build_sequential(spec)
    return {key: value.detach().numpy().copy() for key, value in model.state_dict().items()}


def conv_keys(spec: NetworkSpec) -> list[str]:
    """Module index of each conv layer in the Sequential ("0", "3", ...)."""
    return [str(spec.conv_module_index(layer)) for layer in range(len(spec.conv))]


def checkpoint_row_chunks(spec: NetworkSpec, quanta: list[int]) -> dict[str, int]:
    """Checkpoint chunking: each conv tensor by its layer's channel quantum, so that a
    worker writes (and reads) only the chunks of its own kernels."""
    chunks = {}
    for key, quantum in zip(conv_keys(spec), quanta):
        chunks[f"{key}.weight"] = chunks[f"{key}.bias"] = quantum
    return chunks


def load_sequential(spec: NetworkSpec, state: dict[str, np.ndarray]) -> nn.Sequential:
    """A plain nn.Sequential holding `state` (e.g. from a checkpoint)."""
    model = build_sequential(spec)
    model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in state.items()})
    return model


def parameter_shapes(spec: NetworkSpec) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape under the Sequential's keys, without building it."""
    shapes: dict[str, tuple[int, ...]] = {}
    for layer, conv in enumerate(spec.conv):
        key = spec.conv_module_index(layer)
        shapes[f"{key}.weight"] = (conv.kernels, conv.in_channels, conv.kernel_size,
                                   conv.kernel_size)
        shapes[f"{key}.bias"] = (conv.kernels,)
    features = spec.flat_features
    for key, width in zip(spec.dense_module_indices(), list(spec.hidden) + [spec.classes]):
        shapes[f"{key}.weight"] = (width, features)
        shapes[f"{key}.bias"] = (width,)
        features = width
    return shapes
