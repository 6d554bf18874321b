"""A timeline per device: how the engine's ops of a step follow each other.

The engine runs each device's ops in order; a read waits until its slot is
written and the reader has seen its marker (``DaskOverhead.sync`` with ready
markers, paid by every read: a slot written earlier is seen by one check; through
the scheduler, a task starts a ``hop`` after all its dependencies). A strategy's
model (kernel.py, and data.py / hybrid.py with a store) drives a `Timeline` op by op
for a few steps; `steady` returns the steady step time and walks back along the
critical path to split it into compute, dense head, I/O and overhead, which add up
to the step time.

Devices whose compute time varies from step to step (``spread``, which the probe
measures against each worker's peers) meet at every read of a peer's slot, and a reader waits for the later of
its own clock and the slot's: the expected later of two uncertain times is later
than the later expected time, by most where they are close. So each clock carries
its uncertainty as a sum of independent deviations (`Noise`, the first-order
canonical form of statistical timing analysis): each stretch of a device's compute
and workspace accesses between two meetings is one deviation of its own, of variance
the sum of its ops' ``(spread * seconds)^2`` (an access's spread the store's), and a
slot keeps the writer's deviations as they were when it was written. A wait goes to
Clark's expected maximum of the two as correlated normals (`later_of`): what both
times owe to the same deviations (the reader's and the writer's common past: the
meetings they both waited for) cancels, so two devices that met at the last
exchange wait at the next for what varied since, not again for what they already
waited for; two devices that each waited for the other's slot end at one time
(`Timeline.later`). Where every spread is 0 this is the plain maximum: the timeline as
without it. Why it matters: several single-thread workers on fewer cores take turns
on them, their ops' times spread by a quarter, and every exchange waits for the
slowest (docs/model.md, "Uneven steps").
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from .devices import DaskOverhead, LinkSpec, StoreSpec

__all__ = ["Timeline", "Noise", "expected_max", "later_of", "io_rates", "io_time", "steady",
           "SIMULATED_STEPS"]

#: Steps simulated; the step time is the mean period of the last two.
SIMULATED_STEPS = 4


def _clark(mean_a: float, var_a: float, mean_b: float, var_b: float, theta: float
           ) -> tuple[float, float, float]:
    """Clark's (1961, "The greatest of a finite set of random variables") mean and
    variance of the later of two normal times whose difference has standard
    deviation `theta` > 0, and the chance that the first is the later."""
    alpha = (mean_a - mean_b) / theta
    above = 0.5 * math.erfc(-alpha / math.sqrt(2.0))  # P(A is the later)
    below = 1.0 - above
    density = math.exp(-0.5 * alpha * alpha) / math.sqrt(2.0 * math.pi)
    mean = mean_a * above + mean_b * below + theta * density
    second = ((mean_a ** 2 + var_a) * above + (mean_b ** 2 + var_b) * below
              + (mean_a + mean_b) * theta * density)
    return mean, max(second - mean * mean, 0.0), above


def expected_max(mean_a: float, var_a: float, mean_b: float, var_b: float
                 ) -> tuple[float, float]:
    """Mean and variance of the later of two independent normal times (`_clark`);
    with no variance, the later time itself."""
    spread = var_a + var_b
    if spread <= 0.0:
        return (mean_a, var_a) if mean_a >= mean_b else (mean_b, var_b)
    mean, variance, _ = _clark(mean_a, var_a, mean_b, var_b, math.sqrt(spread))
    return mean, variance


#: A time's deviations from its mean: coefficient (seconds) per independent source.
Noise = dict[int, float]


def _variance(noise: Noise) -> float:
    return sum(c * c for c in noise.values())


def later_of(mean_a: float, noise_a: Noise, mean_b: float, noise_b: Noise, fresh: int
             ) -> tuple[float, Noise]:
    """The later of two normal times that may share deviations (`_clark` with the
    correlation: theta^2 = var(a - b)); its deviations are each input's weighted by
    the chance it is the later, plus a new one, source `fresh`, for the variance
    that weighting leaves out (Visweswariah et al., DAC 2004)."""
    pairs = [(k, noise_a.get(k, 0.0), noise_b.get(k, 0.0))
             for k in noise_a.keys() | noise_b.keys()]
    spread = sum((a - b) ** 2 for _, a, b in pairs)
    if spread <= 1e-30:
        return (mean_a, dict(noise_a)) if mean_a >= mean_b else (mean_b, dict(noise_b))
    mean, variance, above = _clark(mean_a, sum(a * a for _, a, _ in pairs), mean_b,
                                   sum(b * b for _, _, b in pairs), math.sqrt(spread))
    # a deviation weighted down to nothing is dropped (below 1e-4 of the time's
    # standard deviation: at most 1e-8 of its variance), or the sums grow every meeting
    noise = {k: c for k, a, b in pairs
             if (c := above * a + (1.0 - above) * b) ** 2 > 1e-8 * variance}
    left = variance - _variance(noise)
    if left > 0.0:
        noise[fresh] = math.sqrt(left)
    return mean, noise


def io_time(link: LinkSpec, store: StoreSpec | None, n_bytes: float, ops: int, direction: str,
            chunks: int = 0, sharing: int = 1) -> float:
    """One device moving ``n_bytes`` in ``ops`` operations to or from the store.

    Link and store are in series: each operation pays both latencies, each chunk
    the store's per-chunk cost, and the bytes flow at the slowest of the link,
    the store's one-client bandwidth and its aggregate over ``sharing`` devices
    accessing it at once.
    """
    if ops <= 0 and n_bytes <= 0:
        return 0.0
    if store is None:
        return link.time(n_bytes, ops)
    per_op, per_chunk, per_byte = io_rates(link, store, direction, sharing)
    return ops * per_op + chunks * per_chunk + n_bytes * per_byte


def io_rates(link: LinkSpec, store: StoreSpec | None, direction: str,
             sharing: int = 1) -> tuple[float, float, float]:
    """Seconds per operation, per chunk and per byte of `io_time`: the fast timeline
    (timeline_fast.py) prices thousands of accesses at once from these three numbers."""
    if store is None:
        return link.alpha, 0.0, link.beta
    bandwidth = min(store.client_bw(direction), store.aggregate_bw(direction) / max(sharing, 1))
    return (link.alpha + store.latency, store.chunk_cost(direction),
            max(link.beta, 1.0 / bandwidth))


@dataclass
class _Segment:
    """A stretch of one device's time: what it did, and what it waited for."""

    start: float
    end: float
    kind: str  # "compute", "master", "io", "overhead", "wait"
    waited_for: tuple[int, float] | None = None  # (writer, ready time) of a wait


@dataclass
class Timeline:
    """Devices' clocks and what filled them; slots' write times. ``spread``: each
    device's compute time's coefficient of variation from step to step (empty: none;
    see the module); an access's is the store's (`StoreSpec.spread`; the batch
    reads too, which cross the same link)."""

    links: Sequence[LinkSpec]
    store: StoreSpec | None
    overhead: DaskOverhead = DaskOverhead()
    sync: str = "markers"
    spread: Sequence[float] = ()
    clock: list[float] = field(default_factory=list)
    noise: list[Noise] = field(default_factory=list)  # each clock's deviations (module doc)
    state: list[int] = field(default_factory=list)  # which uncertain time each clock is
    own: list[int] = field(default_factory=list)  # the source a device's next op adds to
    segments: list[list[_Segment]] = field(default_factory=list)
    ready: dict[str, tuple[int, float]] = field(default_factory=dict)  # slot -> (writer, t)
    ready_noise: dict[str, tuple[int, Noise]] = field(default_factory=dict)  # slot -> time
    later: dict[tuple[int, int], int] = field(default_factory=dict)  # two times -> the later
    sources: int = 0  # deviations and times made so far
    meetings: int = 0  # waits for another device so far
    moved: float = 0.0  # bytes read + written in the current step

    def __post_init__(self) -> None:
        self.clock = [0.0] * len(self.links)
        self.noise = [{} for _ in self.links]
        self.state = [self._fresh() for _ in self.links]
        self.own = [self._fresh() for _ in self.links]
        self.segments = [[] for _ in self.links]

    def run(self, d: int, kind: str, seconds: float) -> None:
        if seconds > 0:
            self.segments[d].append(_Segment(self.clock[d], self.clock[d] + seconds, kind))
            self.clock[d] += seconds
            if kind == "io":
                share = self.store.spread if self.store is not None else 0.0
            else:
                share = self.spread[d] if self.spread and kind in ("compute", "master") else 0.0
            if share:
                noise, own = self.noise[d], self.own[d]
                noise[own] = math.hypot(noise.get(own, 0.0), share * seconds)
                self.state[d] = self._fresh()

    def _fresh(self) -> int:
        self.sources += 1
        return self.sources

    def _forget_common(self) -> None:
        """Drop the deviations every clock and every slot holds alike: they cancel in
        every difference, so no later wait depends on them (the clocks' common past:
        without this the sums grow with every step simulated)."""
        if not any(self.noise):  # no clock deviates (every spread 0): nothing is common
            return  # but zeros, and the walk over every slot grew the step as P^3
        holders = [*self.noise, *(noise for _, noise in self.ready_noise.values())]
        # alike within 1e-4 of the largest clock's deviation: what dropping it moves
        # any difference by is far below what that difference varies
        tolerance = 1e-4 * math.sqrt(max(_variance(n) for n in self.noise))
        keys = set().union(*holders)
        common = [k for k in keys
                  if max(values := [h.get(k, 0.0) for h in holders]) - min(values) <= tolerance]
        for holder in holders:
            for k in common:
                holder.pop(k, None)

    def wait(self, d: int, writer: int, ready: float, latency: float,
             written: tuple[int, Noise] | None = None) -> None:
        """Device `d` idles until `ready + latency` (data written by `writer` at `ready`,
        `written` that time's identity and deviations): until the expected later of
        that and its own clock."""
        if writer == d:  # after its own work: one clock, nothing uncertain between
            until = max(self.clock[d], ready + latency)
        else:
            self.meetings += 1
            if self.meetings % 32 == 0:
                self._forget_common()
            state, noise = written or (self._fresh(), {})
            # two devices that wait for the same two times (each for the other's slot)
            # end at the same time: one identity, one new deviation for both
            pair = (min(self.state[d], state), max(self.state[d], state))
            if pair not in self.later:
                self.later[pair] = self._fresh()
            self.state[d] = self.later[pair]
            until, self.noise[d] = later_of(self.clock[d], self.noise[d], ready + latency,
                                            noise, self.state[d])
            self.own[d] = self._fresh()  # what it does next varies apart from both
        if until > self.clock[d]:
            self.segments[d].append(_Segment(self.clock[d], until, "wait", (writer, ready)))
            self.clock[d] = until

    def read(self, d: int, sources: list[tuple[str, float]], sharing: int = 1) -> None:
        """Read each ``(slot, bytes)`` in turn, as soon as it is ready.

        With ready markers each read looks at its slot's marker and reads it (the
        look, ``overhead.marker_check``, is part of the read's I/O); a reader that
        came before the slot was written notices it ``overhead.sync`` after the write,
        so it waits until ``notice_lag`` after it, the look following. Through the
        scheduler the task holding the reads starts a hop after all its dependencies
        (its own previous task included) have finished.
        """
        if not sources:
            return
        if self.sync == "scheduler":
            slot = max((slot for slot, _ in sources), key=lambda slot: self.ready[slot][1])
            (writer, ready), written = self.ready[slot], self.ready_noise[slot]
            if self.clock[d] >= ready:
                writer, ready = d, self.clock[d]
            self.wait(d, writer, ready, self.overhead.hop, written)
        marked = self.sync != "scheduler"
        check = self.overhead.marker_check if marked else 0.0
        for slot, n_bytes in sources:
            if marked:
                self.wait(d, *self.ready[slot], self.overhead.notice_lag,
                          self.ready_noise[slot])
            self.run(d, "io", check + io_time(self.links[d], self.store, n_bytes, 1, "read", 1,
                                              sharing))
            self.moved += n_bytes

    def write(self, d: int, slot: str, n_bytes: float, sharing: int = 1) -> None:
        self.run(d, "io", io_time(self.links[d], self.store, n_bytes, 1, "write", 1, sharing))
        self.ready[slot] = (d, self.clock[d])
        self.ready_noise[slot] = (self.state[d], dict(self.noise[d]))
        self.own[d] = self._fresh()  # what it does next is not in the slot
        self.moved += n_bytes

    def lanes_since(self, t: float) -> list[list[tuple[float, float, str]]]:
        """Each device's segments starting at or after `t`: ``(start, end, kind)``."""
        return [[(s.start, s.end, s.kind) for s in segs if s.start >= t]
                for segs in self.segments]

    def critical_path(self, start: float, end: float) -> dict[str, float]:
        """Seconds per kind on the critical path between `start` and `end`."""
        totals = {"compute": 0.0, "master": 0.0, "io": 0.0, "overhead": 0.0}
        starts = [[s.start for s in segs] for segs in self.segments]  # ascending per device
        d = max(range(len(self.clock)), key=lambda i: self.clock[i])
        t = end
        while t > start + 1e-15:
            at = bisect_left(starts[d], t - 1e-15) - 1  # the last segment starting before t
            if at < 0:
                break
            segment = self.segments[d][at]
            if segment.kind == "wait":
                writer, ready = segment.waited_for or (d, segment.start)
                totals["overhead"] += max(min(segment.end, t) - max(ready, start), 0.0)
                d, t = writer, ready
                continue
            totals[segment.kind] += min(segment.end, t) - max(segment.start, start)
            t = segment.start
        return totals


class Clocked(Protocol):
    """What `steady` needs of a timeline: `Timeline`, or timeline_fast's `FastTimeline`."""

    clock: Sequence[float]
    moved: float

    def critical_path(self, start: float, end: float) -> dict[str, float]: ...

    def lanes_since(self, t: float) -> Sequence[list[tuple[float, float, str]]]: ...


@dataclass
class Steady:
    """What `steady` found: the step time, its critical path, bytes per step."""

    step: float
    path: dict[str, float]
    moved: float
    timeline: Clocked
    last_start: float


def steady(timeline: Clocked, one_step: Callable[[Any], None]) -> Steady:
    """Simulate `one_step` a few times; the mean period of the last two steps."""
    ends = []
    for _ in range(SIMULATED_STEPS):
        timeline.moved = 0.0
        one_step(timeline)
        ends.append(float(max(timeline.clock)))
    window = 2
    step = (ends[-1] - ends[-1 - window]) / window
    path = {k: v / window
            for k, v in timeline.critical_path(ends[-1 - window], ends[-1]).items()}
    path["overhead"] += step - sum(path.values())  # idle gaps, float error
    return Steady(step, path, timeline.moved, timeline, ends[-2])
