"""The sum of a conv layer's output gradient on a `kernel` device, as
tasks/kernel_ops.py's `_output_gradient` runs it, for both kernel walks
(kernel_memory.py, kernel_memory_graph.py).

The parts (each reader's partial input gradients, the own one kept in memory and the
others read; the adders' residual gradients; the head's slice) are summed in the
engine's fixed order, each folded into the running sum as it is taken or read and
dropped then. The sum is added into in place once it is a tensor of the op's own (a
part read, or the first add's result); a part kept in memory is a view of a larger
tensor (the own slice of a reader's whole input gradient, of the head's features
gradient), never changed, whose base lives until the view is dropped. So where the
own part stands in the order moves the peak by a read: `fold_positions` says what of
a device's place matters, so that devices alike in it are walked once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .memory import Live
from .network import Network

__all__ = ["Part", "output_parts", "fold_parts", "fold_positions"]


@dataclass(frozen=True)
class Part:
    """One part of an output gradient: `name`, the tensor the walk holds (for a kept
    view, its base); `read`, whether the op reads it now (then `nbytes` arrive, a
    tensor of the op's own) or takes it from memory (held already)."""

    name: str
    read: bool = False
    nbytes: float = 0.0


def output_parts(network: Network, holders: Sequence[Sequence[float]], me: int,
                 master: bool, layer: int, own_bytes: float) -> list[Part]:
    """The parts of device `me`'s channels of `layer`'s output gradient (`own_bytes`
    each part read), in the engine's order: the readers in layer order, each reader's
    holders in device order; the adders; the head's slice for the last layer."""
    parts = []
    for reader in network.readers(layer):
        parts += [Part(f"partial{reader}") if e == me else
                  Part(f"grad-in{layer}.{reader}.{e}", True, own_bytes)
                  for e, kernels in enumerate(holders[reader]) if kernels]
    parts += [Part(f"residual{adder}") for adder in network.adders(layer)]
    if layer == len(network.conv) - 1:
        parts.append(Part("grad-features") if master else Part("grad-head", True, own_bytes))
    return parts


def fold_parts(live: Live, parts: Sequence[Part], sum_name: str, sum_bytes: float) -> str:
    """Fold `parts` into one sum as the engine does (module doc); returns the name of
    what the op then holds as its output gradient until it ends (the sum, or the one
    part)."""
    total, own = "", False
    for part in parts:
        if part.read:
            live.alloc(part.name, "exchange", part.nbytes)
        if not total:
            total, own = part.name, part.read
        elif own:  # added into the sum in place
            live.free(part.name)
        elif part.read:  # the sum added into the part read, which becomes the sum
            live.free(total)
            total, own = part.name, True
        else:  # two kept parts: a new tensor
            live.alloc(sum_name, "backward", sum_bytes)
            live.free(total, part.name)
            total, own = sum_name, True
    return total


def fold_positions(holders: Sequence[Sequence[float]]) -> list[tuple]:
    """What of each device's place among each layer's holders (`holders[l][d]`) moves
    its fold's peak: the holders before and after it, each counted up to two (a run of
    reads longer than two folds as two do: each read is added and dropped before the
    next); None where it holds none of the layer."""
    devices = len(holders[0]) if holders else 0
    places: list[list] = [[] for _ in range(devices)]
    for row in holders:
        total = sum(1 for kernels in row if kernels)
        before = 0
        for d, kernels in enumerate(row):
            if kernels:
                places[d].append((min(before, 2), min(total - before - 1, 2)))
                before += 1
            else:
                places[d].append(None)
    return [tuple(place) for place in places]
