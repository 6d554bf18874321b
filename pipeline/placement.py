"""Share each conv layer's kernels out among workers.

Kernels are allotted in units of the workspace's channel quantum so that every shard
owns whole Zarr chunks; only the last unit of a layer may be short. `even` gives each
worker the same number of units; `proportional` follows measured speeds, rounding by
largest remainder so the counts add up exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tasks.specs import ShardRange


@dataclass
class Placement:
    """How many kernels of each layer each worker holds, and how that was chosen."""

    method: str  # "even", "calibrated", "model" or "single"
    counts: list[list[int]]  # [layer][worker]
    calibration: dict[str, list[float]] = field(default_factory=dict)  # worker -> s per kernel
    model: dict[str, Any] = field(default_factory=dict)  # placement "model": its predictions


class PlacementError(ValueError):
    """The layer cannot be split as asked."""


def _units(kernels: int, quantum: int) -> list[int]:
    count = math.ceil(kernels / quantum)
    return [quantum] * (count - 1) + [kernels - quantum * (count - 1)]


def split_proportional(kernels: int, speeds: list[float], quantum: int) -> list[int]:
    """Kernel counts per worker, proportional to `speeds`, every worker at least one unit."""
    units = _units(kernels, quantum)
    workers = len(speeds)
    if len(units) < workers:
        raise PlacementError(
            f"{kernels} kernels in units of {quantum} cannot feed {workers} workers: "
            "lower workspace.channel_quantum or use fewer workers")
    total_speed = sum(speeds)
    ideal = [len(units) * speed / total_speed for speed in speeds]
    shares = [max(1, math.floor(x)) for x in ideal]
    while sum(shares) < len(units):  # largest remainder first
        shares[max(range(workers), key=lambda i: ideal[i] - shares[i])] += 1
    while sum(shares) > len(units):  # only when the one-unit minimum overshot
        shares[max((i for i in range(workers) if shares[i] > 1),
                   key=lambda i: shares[i] - ideal[i])] -= 1
    counts, position = [], 0
    for share in shares:
        counts.append(sum(units[position:position + share]))
        position += share
    return counts


def split_even(kernels: int, workers: int, quantum: int) -> list[int]:
    return split_proportional(kernels, [1.0] * workers, quantum)


def shard_ranges(layer: int, counts: list[int]) -> list[ShardRange]:
    """Contiguous kernel ranges, in worker order."""
    ranges, start = [], 0
    for count in counts:
        ranges.append(ShardRange(layer, start, start + count))
        start += count
    return ranges
