"""Share each conv layer's kernels out among workers: pure functions, no cluster.

Kernels are allotted in units of the workspace's channel quantum so that every shard
owns whole Zarr chunks; only the last unit of a layer may be short. `even` gives each
worker the same number of units; `proportional` follows measured speeds, rounding by
largest remainder so the counts add up exactly; `minmax` hands units out one at a
time to the worker that would finish its share of the layer first, where a shard
costs a fixed time plus a time per kernel (`ShardCost`), so a worker whose first
unit alone would outlast the others gets none. `choose_calibrated` predicts each
candidate split's step, every worker alone included, and takes the fastest: a set
of devices is never predicted slower than its best single device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tasks.specs import ConvLayerSpec


@dataclass
class Placement:
    """How many kernels of each layer each worker holds, and how that was chosen."""

    method: str  # "even", "calibrated", "model", "recorded" or "single"
    counts: list[list[int]]  # kernel: [layer][worker]; data, hybrid: [[samples per worker]]
    calibration: dict[str, list[float]] = field(default_factory=dict)  # worker -> s per unit
    # calibrated and model: the candidates' splits and predicted step times, the best
    # single device's, and the measurements behind them (SplitChoice.record)
    choice: dict[str, Any] = field(default_factory=dict)

    def left_out(self, names: list[str], keep: int | None = None) -> list[str]:
        """Workers given nothing in every row (but `keep`, the master): they leave
        the run."""
        return [name for d, name in enumerate(names)
                if d != keep and all(row[d] == 0 for row in self.counts)]


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
    # Largest remainder first. A tie goes to the last worker where the last unit is
    # short, since it takes that unit: 10 kernels in units of 4 split 4+6, not 8+2.
    last = 1 if units[-1] < quantum else -1
    while sum(shares) < len(units):
        shares[max(range(workers), key=lambda i: (ideal[i] - shares[i], last * i))] += 1
    while sum(shares) > len(units):  # only when the one-unit minimum overshot
        shares[max((i for i in range(workers) if shares[i] > 1),
                   key=lambda i: shares[i] - ideal[i])] -= 1
    counts, position = [], 0
    for share in shares:
        counts.append(sum(units[position:position + share]))
        position += share
    return counts


def split_even(kernels: int, workers: int, quantum: int) -> list[int]:
    """The same number of units each; with more workers than units, the first
    workers hold one unit each and the rest none."""
    units = len(_units(kernels, quantum))
    if units < workers:
        return [min(kernels, quantum * (d + 1)) - min(kernels, quantum * d)
                for d in range(workers)]
    return split_proportional(kernels, [1.0] * workers, quantum)


@dataclass(frozen=True)
class ShardCost:
    """A worker's seconds for a shard of one layer: `fixed` + kernels x `per_kernel`
    (nothing for no kernels). The fixed part is what a shard costs whatever its
    size (launches, a small GEMM's poor efficiency): on a GPU most of a small shard."""

    fixed: float
    per_kernel: float

    def seconds(self, kernels: int) -> float:
        return 0.0 if kernels <= 0 else self.fixed + kernels * self.per_kernel


def fit_shard_cost(points: list[tuple[int, float]]) -> ShardCost:
    """The line through measured ``(kernels, seconds)`` points (least squares), with
    a fixed part >= 0 and a positive slope; one size measured: no fixed part."""
    sizes = sorted({k for k, _ in points})
    if len(sizes) < 2:
        return ShardCost(0.0, sum(t for _, t in points) / sum(k for k, _ in points))
    n = len(points)
    mean_k = sum(k for k, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    slope = (sum((k - mean_k) * (t - mean_t) for k, t in points)
             / sum((k - mean_k) ** 2 for k, _ in points))
    largest = max(points)
    if slope <= 0:  # noise swamped the size: no fixed part can be told apart
        return ShardCost(0.0, largest[1] / largest[0])
    fixed = mean_t - slope * mean_k
    if fixed < 0:
        return ShardCost(0.0, largest[1] / largest[0])
    return ShardCost(fixed, slope)


def layer_seconds(costs: list[ShardCost], counts: list[int]) -> float:
    """The layer's predicted time under a split: its slowest shard."""
    return max(cost.seconds(k) for cost, k in zip(costs, counts))


def split_minmax(kernels: int, costs: list[ShardCost], quantum: int) -> list[int]:
    """Counts minimising the slowest shard's predicted time; workers may get none.

    Greedy (each unit to the worker that would finish it first) over the fastest
    1, 2, ... workers, keeping the best: a worker is left out where its first unit
    would cost more than it saves. The short unit, if any, goes to the last holder.
    """
    units = _units(kernels, quantum)
    fastest = sorted(range(len(costs)), key=lambda d: (costs[d].seconds(kernels), d))
    best: list[int] | None = None
    for active in range(1, len(costs) + 1):
        counts = [0] * len(costs)
        for unit in units:
            d = min(fastest[:active], key=lambda d: (costs[d].seconds(counts[d] + unit), d))
            counts[d] += unit
        counts = align_to_quanta(counts, quantum)
        if best is None or layer_seconds(costs, counts) < layer_seconds(costs, best):
            best = counts
    assert best is not None
    return best


def align_to_quanta(row: list[int], quantum: int) -> list[int]:
    """Keep each worker's number of units, moving a layer's short unit (if any) to
    the last holder: shards are contiguous in worker order and made of whole quanta
    (a split's unit), so only the last may hold a partial quantum."""
    return counts_from_shares(sum(row), quantum, [math.ceil(k / quantum) for k in row])


def merge_short_shares(row: list[int], least: int) -> list[int]:
    """`row` (samples per worker) with every share of fewer than `least` samples (but
    none) handed on whole, so that each worker has none or at least `least`.

    Why: with ``train.batch_norm: local`` a replica normalises over its own rows, and
    where a batch norm's input is 1x1 one row is one value per channel, which PyTorch
    refuses (`tasks.specs.batch_norm_rows` says `least`). A worker given nothing leaves
    the run, as calibrated placement may already decide. The last short share moves
    first: to another short share (the fewest samples, then the later worker), so two
    lone rows make one replica; the last one left to the holder with the fewest
    samples, the one the extra row slows least. Raises ValueError where the whole row
    is fewer than `least` (the config's check, `pipeline.preflight.check_batch_rows`,
    refuses such a batch first).
    """
    shares = list(row)
    if 0 < sum(shares) < least:
        raise ValueError(f"{sum(shares)} sample(s) cannot give any worker {least}")
    while True:
        short = [d for d, k in enumerate(shares) if 0 < k < least]
        if not short:
            return shares
        moving = short[-1]
        takers = short[:-1] or [d for d, k in enumerate(shares) if k >= least]
        taker = min(takers, key=lambda d: (shares[d], -d))
        shares[taker] += shares[moving]
        shares[moving] = 0


def counts_from_shares(total: int, quantum: int, shares: list[int]) -> list[int]:
    """Counts for `shares` units each, in worker order, of `total` in units of
    `quantum`; only the last holder's unit may be short."""
    units = _units(total, quantum)
    counts, position = [], 0
    for share in shares:
        counts.append(sum(units[position:position + share]))
        position += share
    return counts


def predict_split(costs: list[list[ShardCost]], counts: list[list[int]]) -> float:
    """A step's conv time under a split, as calibration sees it: the layers one after
    another, each as slow as its slowest shard (traffic apart: the model placement,
    pipeline/placement/model_placement.py, counts that too)."""
    return sum(layer_seconds(row, counts_row) for row, counts_row in zip(costs, counts))


@dataclass(frozen=True)
class SplitChoice:
    """The chosen split, its name, and every candidate's split and predicted time."""

    chosen: str
    counts: list[list[int]]
    candidates: dict[str, list[list[int]]]
    predicted: dict[str, float]

    def record(self, names: list[str]) -> dict[str, Any]:
        """What the run keeps of the choice (attrs, summary)."""
        single = {name: t for name, t in self.predicted.items() if name.startswith("single:")}
        best_single = min(single, key=single.__getitem__)
        return {"chosen": self.chosen, "workers": names,
                "predicted_step_time": self.predicted[self.chosen],
                "best_single_device": best_single.partition(":")[2],
                "predicted_best_single": single[best_single],
                "split": self.counts,
                "alternatives": {name: {"split": self.candidates[name],
                                        "predicted_step_time": self.predicted[name]}
                                 for name in self.candidates}}


def pick_fastest(candidates: dict[str, list[list[int]]], predicted: dict[str, float],
                 tolerance: float = CALIBRATION_TOLERANCE) -> SplitChoice:
    """The fastest predicted candidate; the even split where it is within `tolerance`
    of that and not predicted slower than any single device (noise between alike
    workers must not move kernels). `candidates` holds ``single:<name>`` splits."""
    fastest = min(candidates, key=lambda name: (predicted[name], name))
    best_single = min(t for name, t in predicted.items() if name.startswith("single:"))
    even = predicted.get("even")
    if (even is not None and predicted[fastest] >= (1 - tolerance) * even
            and even <= best_single):
        fastest = "even"
    return SplitChoice(fastest, candidates[fastest], candidates, predicted)


def single_device_splits(kernels: list[int], names: list[str]) -> dict[str, list[list[int]]]:
    """Every layer whole on one worker, for each worker: ``single:<name>``."""
    return {f"single:{name}": [[k if d == index else 0 for d in range(len(names))]
                               for k in kernels]
            for index, name in enumerate(names)}


def choose_calibrated(kernels: list[int], costs: list[list[ShardCost]], quanta: list[int],
                      names: list[str], tolerance: float = CALIBRATION_TOLERANCE
                      ) -> SplitChoice:
    """`placement: calibrated`: the even, proportional (seed papers: every worker at
    least one unit, shares by speed), min-max and single-device splits of every layer
    (``costs[layer][worker]``), predicted by `predict_split`; see `pick_fastest`.
    Layers a residual sum ties are chosen together: pipeline/placement/ties.py."""
    candidates = calibrated_candidates(kernels, costs, quanta, names)
    predicted = {name: predict_split(costs, counts) for name, counts in candidates.items()}
    return pick_fastest(candidates, predicted, tolerance)


def calibrated_candidates(kernels: list[int], costs: list[list[ShardCost]],
                          quanta: list[int], names: list[str]) -> dict[str, list[list[int]]]:
    """The splits `choose_calibrated` predicts, by name, each ``[layer][worker]``."""
    workers = len(names)
    candidates = {
        "even": [split_even(k, workers, q) for k, q in zip(kernels, quanta)],
        "minmax": [split_minmax(k, row, q) for k, row, q in zip(kernels, costs, quanta)],
        **single_device_splits(kernels, names),
    }
    if all(len(_units(k, q)) >= workers for k, q in zip(kernels, quanta)):
        candidates["proportional"] = [
            split_proportional(k, [1.0 / c.seconds(k) for c in row], q)
            for k, row, q in zip(kernels, costs, quanta)]
    return candidates


def calibration_kernels(layer: ConvLayerSpec, batch: int, workers: int, quantum: int,
                        budget_s: float = 0.5) -> int:
    """How many kernels a worker times in calibration: its even share, halved until a
    round fits the budget, never below one quantum."""
    k = min(layer.kernels, max(quantum, math.ceil(layer.kernels / workers)))
    while k > quantum and rough_seconds(layer, batch, k) > budget_s:
        k = max(quantum, k // 2)
    return k
