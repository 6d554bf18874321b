"""Keeping a split inside every device's memory: pure functions, no cluster.

Why here and not in the speed arithmetic (pipeline/placement/split.py): a split is chosen
for speed first (even, calibrated, by the model, recorded), then checked against
each worker's capacity with the model's predicted peak
(`pipeline.costmodel.memory`). Where a device would overflow, whole units (a channel
quantum of kernels, a sample of the batch) move from it to the device with the most
room left, one at a time, the unit whose move lowers the overflow most first, until
every device fits. Where no move can make the split fit, the run is refused before
it starts, in one line naming the device, what it needs and what it has
(`MemoryRefused`, a `PlacementError`: the command line exits with status 2).

A device given nothing leaves the run and holds nothing of it (the master stays
and keeps the dense head).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from pipeline.costmodel import Network
from pipeline.costmodel.memory import DEFAULT_CONSTANTS, Footprint, MemoryConstants, fmt_bytes
from pipeline.placement.split import PlacementError, counts_from_shares

#: Per-device peaks of a split ``[row][device]``; a device with nothing is not counted.
Peaks = Callable[[list[list[int]]], list[float]]


class MemoryModel(Protocol):
    """A strategy's memory count (`pipeline.strategies.base.Strategy.peak_memory`)."""

    #: False for a strategy the count has no model of (every check leaves it out).
    memory_model: bool

    def peak_memory(self, network: Network, batch: int,
                    split: Sequence[Sequence[int]] | None = None, s: int = 4,
                    master: int | None = 0, constants: MemoryConstants = DEFAULT_CONSTANTS,
                    gpu: Sequence[bool] | None = None) -> Footprint: ...


class MemoryRefused(PlacementError):
    """No split of this run fits its devices' memory: `needed` and `available` (bytes)
    are the predicted peak and the capacity of the device named, where one is."""

    def __init__(self, message: str, needed: float | None = None,
                 available: float | None = None) -> None:
        super().__init__(message)
        self.needed, self.available = needed, available


@dataclass(frozen=True)
class Fit:
    """A split that fits, its predicted peaks, and the units moved to make it fit."""

    counts: list[list[int]]
    peaks: list[float]
    moved: int


def split_peaks(strategy: MemoryModel, network: Network, batch: int, s: int = 4,
                master: int | None = 0, gpu: Sequence[bool] | None = None,
                constants: MemoryConstants = DEFAULT_CONSTANTS) -> Peaks:
    """The peaks of `strategy`'s memory count for splits of one run: a device left with
    nothing (and not the master) counts zero."""

    def peaks(counts: list[list[int]]) -> list[float]:
        devices = len(counts[0])
        head = -1 if master is None else master
        result = strategy.peak_memory(network, batch, counts, s, head, constants,
                                      gpu).per_device
        return [0.0 if d != head and not any(row[d] for row in counts) else p
                for d, p in zip(range(devices), result)]

    return peaks


def planned(peak: float, margin: float = 0.0) -> float:
    """What a device must have for a predicted `peak`: the peak and `margin` (a share of
    it, `cluster.memory_margin`) kept free for the model's error."""
    return peak * (1.0 + margin)


def overflows(peaks: Sequence[float], capacities: Sequence[float],
              margin: float = 0.0) -> list[int]:
    """Devices whose peak, with `margin`, exceeds their capacity."""
    return [d for d, (p, c) in enumerate(zip(peaks, capacities)) if planned(p, margin) > c]


def fits(counts: list[list[int]], capacities: Sequence[float], peaks: Peaks,
         margin: float = 0.0) -> bool:
    """Whether every device's predicted peak, with `margin`, is within its capacity."""
    return not overflows(peaks(counts), capacities, margin)


def move_to_fit(counts: list[list[int]], quanta: Sequence[int], capacities: Sequence[float],
                peaks: Peaks, names: Sequence[str] | None = None,
                tied: Sequence[Sequence[int]] | None = None, margin: float = 0.0) -> Fit:
    """`counts` (``[row][device]``, rows of `quanta`-sized units) changed as little as
    the capacities need: while a device overflows, one unit of some row moves from it
    to another device that still fits after taking it, the move leaving the least
    overflow (then the most room) first. The rows of each group of `tied` (layers a
    residual sum ties, `NetworkSpec.tied_groups`; default: every row alone) are
    equal and move together, a unit of each at once. A device fits where its peak with
    `margin` (`planned`) is within its capacity. Raises `MemoryRefused` naming the
    device that cannot be brought within its capacity."""
    names = list(names or [f"device {d}" for d in range(len(capacities))])
    groups = [list(g) for g in tied] if tied else [[r] for r in range(len(counts))]
    current = [list(row) for row in counts]
    shares = [[math.ceil(k / q) for k in row] for row, q in zip(current, quanta)]
    now = peaks(current)
    moved = 0
    while True:
        over = overflows(now, capacities, margin)
        if not over:
            return Fit(current, now, moved)
        worst = max(over, key=lambda d: (planned(now[d], margin) - capacities[d], -d))
        best: tuple | None = None
        for group in groups:
            r = group[0]
            row = shares[r]
            if not row[worst]:
                continue
            for e in range(len(row)):
                if e == worst:
                    continue
                trial = [list(x) for x in shares]
                for tied_row in group:
                    trial[tied_row][worst] -= 1
                    trial[tied_row][e] += 1
                trial_counts = [counts_from_shares(sum(c), q, sh)
                                for c, q, sh in zip(current, quanta, trial)]
                after = peaks(trial_counts)
                if planned(after[e], margin) > capacities[e] or after[worst] >= now[worst]:
                    continue
                key = (max(planned(after[worst], margin) - capacities[worst], 0.0),
                       -(capacities[e] - planned(after[e], margin)), r, e)
                if best is None or key < best[0]:
                    best = (key, trial, trial_counts, after)
        if best is None:
            raise MemoryRefused(refusal(names[worst], now[worst], capacities[worst],
                                        margin=margin),
                                planned(now[worst], margin), capacities[worst])
        _, shares, current, now = best
        moved += 1


def refuse_overflow(now: list[float], capacities: list[float], names: list[str],
                    margin: float, recorded: bool = False) -> None:
    """Raise `MemoryRefused` naming the device furthest over its capacity, if any is,
    for a split that cannot be moved (recorded, or merged after the moves)."""
    over = overflows(now, capacities, margin)
    if over:
        worst = max(over, key=lambda d: planned(now[d], margin) - capacities[d])
        raise MemoryRefused(refusal(names[worst], now[worst], capacities[worst], recorded,
                                    margin), planned(now[worst], margin), capacities[worst])


def refusal(name: str, peak: float, available: float, recorded: bool = False,
            margin: float = 0.0) -> str:
    """The one line a run that fits nowhere (or whose recorded split does not fit) is
    refused with: what the device needs (its predicted `peak` with `margin`) and has."""
    why = ("the recorded split (placement: recorded) does not fit: place it anew"
           if recorded else "no split of this run fits its workers' memory: add workers "
           "or memory, or lower train.batch")
    needs = (f"{fmt_bytes(planned(peak, margin))} (predicted peak {fmt_bytes(peak)} and "
             f"cluster.memory_margin's {margin:.0%})" if margin
             else f"{fmt_bytes(peak)} (predicted peak)")
    return f"memory: worker {name} needs {needs}, has {fmt_bytes(available)}; {why}"
