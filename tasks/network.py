"""The network as torch modules: the one definition every strategy's arithmetic follows.

It lives in `tasks` because workers build the dense head from it; `pipeline.network`
builds on it for initial weights, checkpoint names and loading into plain PyTorch.
"""

from __future__ import annotations

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
