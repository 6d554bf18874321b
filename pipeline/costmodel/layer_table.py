"""A conv layer's measured shard times at several kernel counts (`LayerTable`), which
replace the roofline where a device was calibrated (devices.py's module doc says why:
on CPUs a shard's time is far from linear in its kernel count)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["LayerTable"]


@dataclass(frozen=True)
class LayerTable:
    """Measured seconds of one conv layer's shard at several kernel counts.

    Attributes
    ----------
    batch : int
        Batch of the measurement.
    kernels : tuple of int
        Kernel counts timed, ascending.
    forward, backward : tuple of float
        Seconds of the forward (conv + ReLU + pool) and of the backward
        (gradients, input gradient where the layer has one, and the SGD
        update) at each count.
    input_grad : tuple of float, optional
        The first part of each backward: pool/ReLU backward and the input
        gradient (what the engine hands on before the weight gradient).
        Empty: half of the backward (the two conv products have equal work).
    dataset : tuple of float, optional
        First layer only: the read of the batch from the dataset that precedes
        the shard's forward, timed in the same runs (empty: not timed). Every
        holder of the first layer reads the whole batch, whatever its count,
        but how long that takes depends on what the other workers do meanwhile
        (a read over a network file system is CPU on the same cores), so it is
        kept per count, as measured, not as one figure.

    Notes
    -----
    Between measured counts the time is interpolated linearly; below the
    smallest it stays at the smallest's (a fixed per-task cost dominates
    there); above the largest it grows with the slope of the last two
    points (or in proportion, with one point).  Another batch scales the
    times linearly: the products are linear in the batch.
    """

    batch: int
    kernels: tuple[int, ...]
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    input_grad: tuple[float, ...] = ()
    dataset: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.kernels or not len(self.kernels) == len(self.forward) == len(self.backward):
            raise ValueError("a layer table needs matching, non-empty kernels/forward/backward")
        if self.input_grad and len(self.input_grad) != len(self.kernels):
            raise ValueError("a layer table's input_grad needs one value per kernel count")
        if self.dataset and len(self.dataset) != len(self.kernels):
            raise ValueError("a layer table's dataset needs one value per kernel count")
        if list(self.kernels) != sorted(set(self.kernels)) or self.kernels[0] <= 0:
            raise ValueError("table kernel counts must be positive and strictly ascending")

    @classmethod
    def from_points(cls, batch: int, points: Sequence[tuple[float | None, ...]]
                    ) -> "LayerTable":
        """Build from ``(kernels, forward_s, backward_s[, input_grad_s[, dataset_s]])``
        points (duplicates: median); an optional column with a point that lacks it
        (shorter, or ``None``) is left empty."""
        by_k: dict[int, list[tuple[float | None, ...]]] = {}
        for k, *times in points:
            by_k.setdefault(int(k), []).append(tuple(None if t is None else float(t)
                                                     for t in times))
        ks = sorted(by_k)

        def column(i: int) -> tuple[float, ...]:
            if any(len(p) <= i or p[i] is None for rows in by_k.values() for p in rows):
                return ()
            return tuple(float(np.median([p[i] for p in by_k[k]])) for k in ks)

        return cls(int(batch), tuple(ks), column(0), column(1), column(2), column(3))

    def _at(self, values: tuple[float, ...], k: float) -> float:
        ks = self.kernels
        if k <= ks[0]:
            return values[0]
        if k >= ks[-1]:
            if len(ks) == 1:
                return values[0] * k / ks[0]
            slope = max((values[-1] - values[-2]) / (ks[-1] - ks[-2]), 0.0)
            return values[-1] + slope * (k - ks[-1])
        return float(np.interp(k, ks, values))

    def input_time(self, kernels: float, batch: float) -> float:
        """Seconds of the input-gradient part of the backward (see ``input_grad``)."""
        if kernels <= 0 or batch <= 0:
            return 0.0
        if not self.input_grad:
            return 0.5 * self.times(kernels, batch)[1]
        return self._at(self.input_grad, kernels) * batch / self.batch

    def dataset_time(self, kernels: float, batch: float) -> float | None:
        """Seconds of the batch read before ``kernels`` kernels' forward (``None``: not
        timed): interpolated between the counts timed, the nearest one's beyond them,
        in proportion to the batch (a batch is read a row at a time)."""
        if not self.dataset or kernels <= 0 or batch <= 0:
            return None
        return float(np.interp(kernels, self.kernels, self.dataset)) * batch / self.batch

    def times(self, kernels: float, batch: float) -> tuple[float, float]:
        """``(forward, backward)`` seconds of ``kernels`` kernels at ``batch``."""
        if kernels <= 0 or batch <= 0:
            return 0.0, 0.0
        scale = batch / self.batch
        return self._at(self.forward, kernels) * scale, self._at(self.backward, kernels) * scale
