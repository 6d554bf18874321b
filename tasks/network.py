"""The network as torch modules: the one definition every strategy's arithmetic follows,
and the single source of initial weights and parameter names.

It lives in `tasks` because workers build the dense head from it. Every strategy
starts from `initial_state`, the state_dict of the equivalent `torch.nn.Sequential`
built with the run's seed, so that kernel-parallel training can be compared with,
and its checkpoints loaded into, ordinary PyTorch (`load_sequential`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tasks.pooling import MaxPool
from tasks.specs import NetworkSpec


def build_sequential(spec: NetworkSpec, fast_pool: bool = False) -> nn.Sequential:
    """conv -> ReLU -> max-pool per conv layer, flatten, dense (+ReLU) layers.

    ``fast_pool``: the pools through `tasks.pooling.MaxPool` (PyTorch's results and
    gradients, from its faster channels-last kernel), as the workers' replicas run
    them; without it `nn.MaxPool2d`, as plain PyTorch (the reference) runs them."""
    modules: list[nn.Module] = []
    for layer in spec.conv:
        modules += [nn.Conv2d(layer.in_channels, layer.kernels, layer.kernel_size,
                              padding=layer.padding), nn.ReLU()]
        if layer.pool > 1:
            modules.append(MaxPool(layer.pool) if fast_pool else nn.MaxPool2d(layer.pool))
    modules.append(nn.Flatten())
    features = spec.flat_features
    for width in spec.hidden:
        modules += [nn.Linear(features, width), nn.ReLU()]
        features = width
    modules.append(nn.Linear(features, spec.classes))
    return nn.Sequential(*modules).to(getattr(torch, spec.dtype))


def dense_head(spec: NetworkSpec) -> tuple[nn.Sequential, list[str]]:
    """The part of the network after the convs, and its modules' Sequential indices.

    The head's own state_dict keys are renumbered from 0; the second value maps its
    positions back to the full network's keys.
    """
    full = build_sequential(spec)
    first = spec.conv_module_index(len(spec.conv))  # the Flatten
    head = nn.Sequential(*list(full.children())[first:])
    full_indices = [str(first + i) for i in range(len(head))]
    return head, full_indices


def conv_trunk(spec: NetworkSpec, fast_pool: bool = False) -> nn.Sequential:
    """The conv layers and the Flatten: the equivalent nn.Sequential's modules up to the
    dense layers, with the same state_dict keys (``fast_pool`` as `build_sequential`)."""
    full = build_sequential(spec, fast_pool)
    first = spec.conv_module_index(len(spec.conv))  # the Flatten
    return nn.Sequential(*list(full.children())[:first + 1])


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
