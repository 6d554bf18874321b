"""The array pieces of the fast timeline (timeline_fast.py): segment kinds and ties,
the running maxima a phase of reads folds over, and the segments as columns with the
lanes a prediction shows. Apart so that timeline_fast.py holds the phases only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["CODE", "KINDS", "TIE", "WAIT", "Lanes", "Segments", "equal_groups",
           "first_prefix_max", "first_suffix_max", "found", "tolerance"]

#: Segment kinds, by their code in `FastTimeline`'s columns.
KINDS = ("compute", "master", "io", "overhead", "wait")
CODE = {kind: code for code, kind in enumerate(KINDS)}
WAIT = CODE["wait"]

#: Relative difference under which two instants count as the same (a tie).
TIE = 1e-10


def first_prefix_max(values: np.ndarray, tol: float) -> tuple[np.ndarray, np.ndarray]:
    """Running maximum of `values` and, at each index, the first index reaching it."""
    running = np.maximum.accumulate(values)
    before = np.concatenate(([-np.inf], running[:-1]))
    index = np.arange(len(values))
    record = values > before + tol
    return running, np.maximum.accumulate(np.where(record, index, 0))


def first_suffix_max(values: np.ndarray, tol: float) -> tuple[np.ndarray, np.ndarray]:
    """Maximum of `values` from each index on, and the first index reaching it."""
    running = np.maximum.accumulate(values[::-1])[::-1]
    after = np.concatenate((running[1:], [-np.inf]))
    index = np.arange(len(values))
    record = values >= after - tol
    first = np.minimum.accumulate(np.where(record, index, len(values))[::-1])[::-1]
    return running, first


def equal_groups(values: np.ndarray) -> list[tuple[float, np.ndarray | slice]]:
    """Each distinct value, ascending, with the indices holding it (all of them as a
    slice where every value is the same, as is usual)."""
    if values[0] == values.min() == values.max():
        return [(values[0], slice(None))]
    return [(value, np.flatnonzero(values == value)) for value in np.unique(values)]


def tolerance(*arrays: np.ndarray) -> float:
    """`TIE` relative to the largest finite instant among `arrays`."""
    finite = [np.abs(a[np.isfinite(a)]).max() for a in arrays if np.isfinite(a).any()]
    return TIE * max(finite + [1e-300])


def found(sorted_values: np.ndarray, values: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Whether each of `values` sits at its insertion point `at` in `sorted_values`."""
    if len(sorted_values) == 0:
        return np.zeros(len(values), dtype=bool)
    return (at < len(sorted_values)) & (sorted_values[np.minimum(at, len(sorted_values) - 1)]
                                        == values)


@dataclass(frozen=True)
class Segments:
    """`FastTimeline`'s segments as columns in the order added, with ``order`` (each
    device's together, in time order), ``offsets`` (where each device's begin in it)
    and the start instants in that order."""

    devs: np.ndarray
    stop: np.ndarray
    kind: np.ndarray
    writer: np.ndarray
    ready: np.ndarray
    order: np.ndarray
    offsets: np.ndarray
    begin_in_order: np.ndarray

    @classmethod
    def of(cls, columns: list[tuple], devices: int) -> Segments:
        """From `FastTimeline._add`'s chunks: ``(devs, start, end, kind, writer, ready)``,
        writer and ready None where the chunk holds no wait."""
        if not columns:  # nothing took any time
            empty = np.zeros(0)
            return cls(empty.astype(int), empty, empty.astype(int), empty.astype(int), empty,
                       empty.astype(int), np.zeros(devices + 1, dtype=int), empty)
        devs, begin, stop, kinds, writers, readies = zip(*columns)
        sizes = [len(d) for d in devs]
        ends = np.cumsum(sizes).tolist()
        writer, ready = np.full(ends[-1], -1), np.full(ends[-1], np.nan)
        for c in (c for c, w in enumerate(writers) if w is not None):  # the waits
            writer[ends[c] - sizes[c]:ends[c]] = writers[c]
            ready[ends[c] - sizes[c]:ends[c]] = readies[c]
        dev = np.concatenate(devs)
        by_device = dev.astype(np.uint16) if devices <= 1 << 16 else dev
        order = np.argsort(by_device, kind="stable")  # small ints: numpy's radix sort
        offsets = np.concatenate(([0], np.cumsum(np.bincount(dev, minlength=devices))))
        return cls(dev, np.concatenate(stop), np.repeat(np.array(kinds), sizes), writer, ready,
                   order, offsets, np.concatenate(begin)[order])


class Lanes(Sequence[list[tuple[float, float, str]]]):
    """Each device's segments ``(start, end, kind)``, as `Timeline.lanes_since` lists
    them, a lane built when it is read: a prediction for thousands of devices carries
    its timeline, and a sweep reads none of it."""

    def __init__(self, begin: np.ndarray, end: np.ndarray, kind: np.ndarray,
                 bounds: np.ndarray) -> None:
        self._begin, self._end, self._kind, self._bounds = begin, end, kind, bounds

    def __len__(self) -> int:
        return len(self._bounds) - 1

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[d] for d in range(len(self))[index]]
        d = range(len(self))[index]
        a, b = self._bounds[d], self._bounds[d + 1]
        kinds = [KINDS[code] for code in self._kind[a:b].tolist()]
        return list(zip(self._begin[a:b].tolist(), self._end[a:b].tolist(), kinds))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]
