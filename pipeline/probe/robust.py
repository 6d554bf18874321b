"""Shard timings that one scheduler hiccup cannot move (pure: no cluster, no torch).

On a machine shared with other work a size timed once can read 8x slow: the probe of
2026-11-25 timed worker cpu-1's conv1 backward at 28 kernels at 60 ms where its
neighbour at 24 kernels took 7 ms (and cpu-0 took 7 ms at 28). Steps of one
calibration run are consecutive, so a burst of load that covers one covers its
neighbours too, and their median does not help. So the probe times every size in
several *rounds* (each plan once per round, the rounds one after the other, so the
same size is timed at moments seconds apart) and this module turns the rounds into
one figure per size:

- `estimate`: the median of the rounds' medians (a step median inside a round
  absorbs one slow step; the median across rounds one slow round), the quartiles of
  every step as the spread, and whether the figure is *settled*: confirmed by two
  rounds within `SETTLE_TOL` of it (one round alone is taken as it is);
- `inconsistent`: which sizes of one layer break "time grows with kernels, at most
  in proportion": a smaller shard may not take longer than a larger one (by more
  than `GROW_TOL`), nor a larger one longer than a smaller one scaled up by the
  kernel ratio (by more than `PROPORTION_TOL`: oneDNN's blocks of output channels
  make the step from 8 to 16 kernels cost up to about twice and a little more). A
  loaded machine only ever slows a timing down, so of a breaking pair the slower
  point is the suspect; the point in the most breaking pairs goes first, until none
  breaks. The probe times unsettled and inconsistent sizes again, and the model's
  tables leave out what is still inconsistent after that.

Why the median and not the minimum of k: the model predicts the median step a run
measures under the load it meets, and a minimum would predict every step as fast as
the luckiest one (here 5-10 % under the median on a quiet machine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

__all__ = ["SETTLE_TOL", "GROW_TOL", "PROPORTION_TOL", "Estimate", "estimate", "inconsistent",
           "consistent"]

#: A round confirms an estimate when its median is within this fraction of it.
SETTLE_TOL = 0.2
#: A smaller shard may be timed this much slower than a larger one (noise, blocking).
GROW_TOL = 0.15
#: A larger shard may be timed this much slower than a smaller one scaled by kernels.
PROPORTION_TOL = 0.5


@dataclass(frozen=True)
class Estimate:
    """One size's figure from its rounds of step timings.

    Attributes
    ----------
    value : float
        Median of the rounds' medians.
    low, high : float
        Lower and upper quartile of every step timed, all rounds together.
    rounds, samples : int
        Rounds, and steps over all rounds, the figure comes from.
    settled : bool
        Two rounds (or the only one) within `SETTLE_TOL` of ``value``.
    """

    value: float
    low: float
    high: float
    rounds: int
    samples: int
    settled: bool


def estimate(rounds: Sequence[Sequence[float]], tol: float = SETTLE_TOL) -> Estimate:
    """The figure of one size timed in ``rounds`` (each a list of step timings)."""
    rounds = [list(r) for r in rounds if len(r)]
    if not rounds:
        raise ValueError("a size needs at least one timed step")
    medians = [float(np.median(r)) for r in rounds]
    value = float(np.median(medians))
    steps = np.concatenate([np.asarray(r, float) for r in rounds])
    low, high = (float(q) for q in np.percentile(steps, [25, 75]))
    agree = sum(abs(m - value) <= tol * value for m in medians)
    return Estimate(value, min(low, value), max(high, value), len(rounds), len(steps),
                    agree >= min(2, len(rounds)))


def _breaks(points: Mapping[int, Sequence[float]], grow_tol: float, proportion_tol: float
            ) -> dict[int, tuple[int, int]]:
    """Per kernel count: in how many breaking pairs it is, and in how many as the slower."""
    pairs = {k: [0, 0] for k in points}
    ks = sorted(points)
    for i, k1 in enumerate(ks):
        for k2 in ks[i + 1:]:
            slower = None
            for t1, t2 in zip(points[k1], points[k2]):
                if t1 > (1 + grow_tol) * t2:  # the smaller shard slower than the larger
                    slower = k1
                elif t2 > (1 + proportion_tol) * t1 * k2 / k1:  # more than proportional
                    slower = k2
            if slower is not None:
                pairs[k1][0] += 1
                pairs[k2][0] += 1
                pairs[slower][1] += 1
    return {k: (n, s) for k, (n, s) in pairs.items()}


def inconsistent(points: Mapping[int, Sequence[float]], grow_tol: float = GROW_TOL,
                 proportion_tol: float = PROPORTION_TOL) -> list[int]:
    """Kernel counts to leave out so that the rest grows with kernels, at most in
    proportion (module doc), in the order they are found.

    ``points`` maps a kernel count to its seconds per pass (e.g. ``(forward,
    backward)``); a pair breaks if any pass breaks. The count in the most breaking
    pairs goes first (one wrong point breaks with all the others: a too-slow one and
    a too-fast one alike), ties to the one that was the slower point more often,
    then to the slower per kernel; then the rest is checked again. One point
    always stays.
    """
    left = {int(k): tuple(float(t) for t in v) for k, v in points.items()}
    dropped: list[int] = []
    while len(left) > 1:
        pairs = _breaks(left, grow_tol, proportion_tol)
        worst = max(pairs, key=lambda k: (*pairs[k], sum(left[k]) / k))
        if not pairs[worst][0]:
            break
        dropped.append(worst)
        del left[worst]
    return dropped


def consistent(points: Mapping[int, Sequence[float]], grow_tol: float = GROW_TOL,
               proportion_tol: float = PROPORTION_TOL) -> dict[int, tuple[float, ...]]:
    """``points`` without the counts `inconsistent` leaves out."""
    out = set(inconsistent(points, grow_tol, proportion_tol))
    return {k: tuple(v) for k, v in points.items() if k not in out}
