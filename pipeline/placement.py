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

from tasks.specs import ConvLayerSpec, ShardRange


@dataclass
class Placement:
    """How many kernels of each layer each worker holds, and how that was chosen."""

    method: str  # "even", "calibrated", "model" or "single"
    counts: list[list[int]]  # kernel: [layer][worker]; data, hybrid: [[samples per worker]]
    calibration: dict[str, list[float]] = field(default_factory=dict)  # worker -> s per unit
    model: dict[str, Any] = field(default_factory=dict)  # placement "model": its predictions


#: A rough single-thread conv rate (FLOP/s), only to budget how long a measurement
#: takes; never used to place kernels.
ROUGH_FLOPS = 100e9
#: Calibrated placement leaves the even split only where the measured speeds predict
#: a slowest shard at least this much faster. Two alike single-thread workers on the
#: project's shared 2-core machine were measured up to 30 % apart, either way round,
#: for seconds at a time (docs/benchmarks.md): a split made on such noise lost more
#: than it could win. A half-speed worker predicts a 31 % gain and is still served.
CALIBRATION_TOLERANCE = 0.15


def rough_seconds(layer: ConvLayerSpec, batch: int, kernels: int) -> float:
    """About how long a shard's forward + backward takes (3 convolutions), for budgets."""
    return 6 * layer.macs(batch, kernels) / ROUGH_FLOPS


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


def split_calibrated(kernels: int, seconds_per_kernel: list[float], quantum: int,
                     tolerance: float = CALIBRATION_TOLERANCE) -> list[int]:
    """Kernels in proportion to measured speed, unless that is not clearly better.

    The slowest worker's predicted time (kernels x seconds per kernel) of the
    proportional split must beat the even split's by `tolerance`; otherwise the
    difference is within calibration noise and the even split stands.
    """
    even = split_even(kernels, len(seconds_per_kernel), quantum)
    proportional = split_proportional(kernels, [1.0 / t for t in seconds_per_kernel], quantum)

    def slowest(counts: list[int]) -> float:
        return max(k * t for k, t in zip(counts, seconds_per_kernel))

    return proportional if slowest(proportional) < (1 - tolerance) * slowest(even) else even


def calibration_kernels(layer: ConvLayerSpec, batch: int, workers: int, quantum: int,
                        budget_s: float = 0.5) -> int:
    """How many kernels a worker times in calibration: its even share, halved until a
    round fits the budget, never below one quantum."""
    k = min(layer.kernels, max(quantum, math.ceil(layer.kernels / workers)))
    while k > quantum and rough_seconds(layer, batch, k) > budget_s:
        k = max(quantum, k // 2)
    return k


def shard_ranges(layer: int, counts: list[int]) -> list[ShardRange]:
    """Contiguous kernel ranges, in worker order."""
    ranges, start = [], 0
    for count in counts:
        ranges.append(ShardRange(layer, start, start + count))
        start += count
    return ranges
