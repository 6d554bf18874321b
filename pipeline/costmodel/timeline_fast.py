"""The per-device timeline of timeline.py, one phase of all devices at a time.

`Timeline` follows every read and write of every device one by one: a phase where
each of ``P`` devices reads the other ``P - 1`` shards costs ``P^2`` Python steps, and
scaling sweeps go to thousands of devices. `FastTimeline` computes the same clocks
with numpy, a whole phase at once, from two facts:

- a device's reads in turn are a max-plus fold: reading ``(ready_i, seconds_i)`` one
  after the other from clock ``c`` ends at ``max(c + sum_i t_i, max_i (ready_i +
  sum_{j >= i} t_j))`` (each ``t_i`` with its marker check, `Timeline.read`), and the
  last wait is at the first maximiser (none if the first term is the maximum);
- the ready times and read seconds the engine's ops give are sums of a part per
  reader and a part per source (one link for every device; a writer's writes in
  turn add up along the reader order), so the maximum over sources is a prefix
  maximum of the sources before the reader and a suffix maximum of those after it.

Segments are kept as columns (device, start, end, kind, writer, ready); a device's
reads in turn become at most three: the I/O before its last wait, that wait (which
the critical path follows back to its writer), the I/O after it. The critical path
only ever enters a run of reads from its end, so it takes the same way as through
`Timeline`'s segments; a lane of ``details["timeline"]`` shows the reads before the
last wait as one I/O stretch. Clocks agree with `Timeline` up to rounding; ties
(equal devices finishing at the same instant) are decided within `TIE` as
`Timeline` decides exact ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .devices import DaskOverhead, LinkSpec, StoreSpec
from .timeline import io_rates
from .timeline_columns import (CODE, KINDS, TIE, WAIT, Lanes, Segments, equal_groups,
                               first_prefix_max, first_suffix_max, found, tolerance)

__all__ = ["FastTimeline", "InTurn", "KINDS", "Lanes", "Sources", "TIE"]

@dataclass
class Sources:
    """The slots a phase's readers read, one per source device, in device order.

    Reader ``d`` reads every source but itself. The slot of source ``e`` is ready at
    ``base[e] + shift[d]``, less ``lower[e]`` where ``e`` comes before ``d`` (a writer's
    writes in turn: later readers' slots are ready later, and a writer skips itself),
    and holds ``own_bytes[d] + bytes[e]`` bytes (``own_bytes``: the reader's part,
    given to `FastTimeline.read`).
    """

    devices: np.ndarray
    base: np.ndarray
    bytes: np.ndarray
    lower: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.lower is None:
            self.lower = np.zeros(len(self.devices))


@dataclass(frozen=True)
class InTurn:
    """Slots each writer wrote in turn, one per target (`FastTimeline.write_in_turn`)."""

    writers: np.ndarray
    start: np.ndarray  # when each writer began writing
    targets: np.ndarray
    seconds: np.ndarray  # a write of each target's slot


@dataclass
class FastTimeline:
    """Devices' clocks as an array, segments as columns (see the module doc)."""

    link: LinkSpec
    devices: int
    store: StoreSpec | None
    overhead: DaskOverhead = DaskOverhead()
    sync: str = "markers"
    clock: np.ndarray = field(default_factory=lambda: np.zeros(0))
    moved: float = 0.0
    _columns: list[tuple] = field(default_factory=list)  # `_add`'s, in the order added
    _in_order: Segments | None = None  # `_segments`'s, until a segment is added

    def __post_init__(self) -> None:
        self.clock = np.zeros(self.devices)

    # -- segments ---------------------------------------------------------------------

    def _add(self, devs: np.ndarray, start: np.ndarray, end: np.ndarray, kind: int,
             writer: np.ndarray | None = None, ready: np.ndarray | None = None) -> None:
        """Segments of `devs` from `start` to `end` (those taking no time left out);
        a wait's `writer` and `ready` (None: -1 and NaN, filled in by `Segments.of`)."""
        keep = end > start
        n = int(np.count_nonzero(keep))
        if n == 0:
            return
        self._in_order = None
        if n < len(keep):
            devs, start, end = devs[keep], start[keep], end[keep]
            writer = None if writer is None else writer[keep]
            ready = None if ready is None else ready[keep]
        self._columns.append((devs, start, end, kind, writer, ready))

    def run(self, devs: np.ndarray, kind: str, seconds: np.ndarray | float) -> None:
        """Each of `devs` spends `seconds` (its own, or the same) on `kind`."""
        start = self.clock[devs]
        end = start + seconds
        self._add(devs, start, end, CODE[kind])
        self.clock[devs] = end

    def io(self, direction: str, n_bytes: np.ndarray, sharing: int) -> np.ndarray:
        """Seconds of single-chunk accesses of `n_bytes` each (`io_time`)."""
        per_op, per_chunk, per_byte = io_rates(self.link, self.store, direction, sharing)
        if self.store is None:
            return per_op + n_bytes * per_byte
        return per_op + per_chunk + n_bytes * per_byte

    # -- reads ---------------------------------------------------------------------------

    def read(self, readers: np.ndarray, src: Sources, sharing: int, own_bytes: np.ndarray,
             shift: np.ndarray) -> None:
        """Each reader reads every source's slot but its own, in device order."""
        n = len(src.devices)
        if n == 0 or len(readers) == 0:
            return
        own = self._holds_own(readers, src)
        if n == 1:  # a reader whose only source is itself reads nothing (`Timeline.read`)
            keep = ~own
            readers, own_bytes, shift, own = readers[keep], own_bytes[keep], shift[keep], own[keep]
            if len(readers) == 0:
                return
        pos, total, p, q, q_own = self._read_seconds(readers, src, sharing, own_bytes, own)
        start = self.clock[readers]
        if self.sync == "scheduler":
            latest, writer, tol = self._latest_slot(readers, src, pos, own, shift, start)
            self._scheduled_wait(readers, start, total, latest, writer, tol)
        else:
            self._marked_reads(readers, src, pos, own, shift, start, total, p, q, q_own)

    def _read_seconds(self, readers: np.ndarray, src: Sources, sharing: int,
                      own_bytes: np.ndarray, own: np.ndarray) -> tuple[np.ndarray, ...]:
        """Each reader's place among the sources and seconds of all its reads (counting
        the bytes into `moved`), with the parts of a read: ``p`` per reader, ``q`` per
        source, ``q_own`` the reader's own source's (0 where it is none)."""
        n = len(src.devices)
        per_op, per_chunk, per_byte = io_rates(self.link, self.store, "read", sharing)
        fixed = per_op + (per_chunk if self.store is not None else 0.0)
        if self.sync != "scheduler":  # every marked read checks its marker (`Timeline.read`)
            fixed += self.overhead.marker_check
        pos = np.searchsorted(src.devices, readers)
        count = n - own
        q = src.bytes * per_byte  # seconds per source, the reader's part apart
        p = fixed + own_bytes * per_byte  # seconds per read, the source's part apart
        q_own = np.where(own, q[np.minimum(pos, n - 1)], 0.0)
        total = p * count + (q.sum() - q_own)
        self.moved += float(own_bytes @ count + src.bytes.sum() * len(readers)
                            - np.where(own, src.bytes[np.minimum(pos, n - 1)], 0.0).sum())
        return pos, total, p, q, q_own

    @staticmethod
    def _holds_own(readers: np.ndarray, src: Sources) -> np.ndarray:
        """Whether each reader is among the sources (it skips its own slot)."""
        return found(src.devices, readers, np.searchsorted(src.devices, readers))

    def _marked_reads(self, readers: np.ndarray, src: Sources, pos: np.ndarray,
                      own: np.ndarray, shift: np.ndarray, start: np.ndarray,
                      total: np.ndarray, p: np.ndarray, q: np.ndarray,
                      q_own: np.ndarray) -> None:
        """Ready markers: each read waits for its own slot (until `notice_lag` after its
        write), then checks its marker (the check, `overhead.marker_check`, is in every
        read's seconds ``p``)."""
        n = len(src.devices)
        suffix_q = np.cumsum(q[::-1])[::-1]
        left_of = np.arange(n, 0, -1)  # sources from each index on
        end = np.empty(len(readers))
        binding = np.full(len(readers), -1)
        lag = self.overhead.notice_lag
        for value, group in equal_groups(p):  # readers reading equal bytes share the maxima
            after = src.base + lag + suffix_q + value * left_of
            before = after - src.lower
            tol = tolerance(after, start[group] - shift[group])
            pre, pre_first = first_prefix_max(before, tol)
            suf, suf_first = first_suffix_max(after, tol)
            g_pos, g_own = pos[group], own[group]
            left = np.where(g_pos > 0, pre[np.maximum(g_pos - 1, 0)]
                            - g_own * (value + q_own[group]), -np.inf)
            right_at = g_pos + g_own
            right = np.where(right_at < n, suf[np.minimum(right_at, n - 1)], -np.inf)
            free = start[group] + total[group] - shift[group]
            best = np.maximum(free, np.maximum(left, right))
            end[group] = best + shift[group]
            waits = free < best - tol
            binding[group] = np.where(
                ~waits, -1, np.where(left >= best - tol, pre_first[np.maximum(g_pos - 1, 0)],
                                     suf_first[np.minimum(right_at, n - 1)]))
        self._reads_done(readers, src, pos, own, shift, start, end, binding, p, q, q_own)

    def _latest_slot(self, readers: np.ndarray, src: Sources, pos: np.ndarray,
                     own: np.ndarray, shift: np.ndarray, start: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, float]:
        """Through the scheduler: when each reader's latest slot is ready (-inf: it
        reads none), its writer (the first of equal ones), and the tie tolerance."""
        n = len(src.devices)
        tol = tolerance(src.base, start - shift)
        pre, pre_first = first_prefix_max(src.base - src.lower, tol)
        suf, suf_first = first_suffix_max(src.base, tol)
        left = np.where(pos > 0, pre[np.maximum(pos - 1, 0)], -np.inf)
        right_at = pos + own
        right = np.where(right_at < n, suf[np.minimum(right_at, n - 1)], -np.inf)
        latest = np.maximum(left, right)
        writer = src.devices[np.where(left >= latest - tol, pre_first[np.maximum(pos - 1, 0)],
                                      suf_first[np.minimum(right_at, n - 1)])]
        return latest + shift, writer, tol

    def _scheduled_wait(self, readers: np.ndarray, start: np.ndarray, total: np.ndarray,
                        ready: np.ndarray, writer: np.ndarray, tol: float) -> None:
        """Through the scheduler: one wait (`overhead.hop`) for the latest slot (ready
        at `ready`, written by `writer`), then the reads back to back."""
        hop = self.overhead.hop
        mine = start >= ready - tol
        writer, ready = np.where(mine, readers, writer), np.where(mine, start, ready)
        waits = ready + hop > start + tol
        begin = np.where(waits, ready + hop, start)
        self._add(readers[waits], start[waits], begin[waits], WAIT, writer[waits], ready[waits])
        self._add(readers, begin, begin + total, CODE["io"])
        self.clock[readers] = begin + total

    def _reads_done(self, readers: np.ndarray, src: Sources, pos: np.ndarray, own: np.ndarray,
                    shift: np.ndarray, start: np.ndarray, end: np.ndarray, binding: np.ndarray,
                    p: np.ndarray, q: np.ndarray, q_own: np.ndarray) -> None:
        """Segments of marked reads: I/O before the last wait, the wait, I/O after."""
        waits = binding >= 0
        i = np.maximum(binding, 0)
        prefix_q = np.concatenate(([0.0], np.cumsum(q)))
        skipped = own & (i > pos)  # the reader's own slot lies before the waited one
        io_before = p * (i - skipped) + prefix_q[i] - np.where(skipped, q_own, 0.0)
        ready = src.base[i] + shift - np.where(i < pos, src.lower[i], 0.0)
        resume = ready + self.overhead.notice_lag  # the wait is for `ready`'s writer
        io_end = np.where(waits, start + io_before, start)
        self._add(readers, start, io_end, CODE["io"])
        self._add(readers[waits], io_end[waits], resume[waits], WAIT, src.devices[i][waits],
                  ready[waits])
        self._add(readers, np.where(waits, resume, start), end, CODE["io"])
        self.clock[readers] = end

    def read_own(self, readers: np.ndarray, writer: int, ready: np.ndarray,
                 n_bytes: np.ndarray, sharing: int) -> None:
        """Each reader reads one slot of its own (``grad/d``), written by `writer`."""
        if len(readers) == 0:
            return
        self.read(readers, Sources(np.array([writer]), np.zeros(1), np.zeros(1)), sharing,
                  n_bytes, ready)

    def read_in_turn(self, readers: np.ndarray, written: InTurn, n_bytes: np.ndarray,
                     sharing: int) -> None:
        """Each reader (one of `written`'s targets) reads the slot every other writer
        wrote it; a slot holds `n_bytes` of its reader."""
        src, shift = self._in_turn_sources(readers, written)
        self.read(readers, src, sharing, n_bytes, shift)

    def read_each_in_turn(self, readers: np.ndarray, written: Sequence[InTurn],
                          n_bytes: np.ndarray, sharing: int) -> None:
        """`read_in_turn` of each of `written` one after the other (a layer that several
        layers read gathers their partial gradients); through the scheduler, one wait
        for the latest slot of them all, as `Timeline.read` waits once per task."""
        if self.sync != "scheduler" or len(written) == 1:
            for group in written:
                self.read_in_turn(readers, group, n_bytes, sharing)
            return
        start = self.clock[readers]
        total, ready = np.zeros(len(readers)), np.full(len(readers), -np.inf)
        writer, tol = np.full(len(readers), -1), 0.0
        for group in written:
            src, shift = self._in_turn_sources(readers, group)
            own = self._holds_own(readers, src)
            pos, seconds, *_ = self._read_seconds(readers, src, sharing, n_bytes, own)
            latest, by, group_tol = self._latest_slot(readers, src, pos, own, shift, start)
            tol = max(tol, group_tol)
            later = latest > ready + tol  # the first of equal slots, as `Timeline.read`
            total, ready, writer = total + seconds, np.where(later, latest, ready), \
                np.where(later, by, writer)
        reads = np.isfinite(ready)
        self._scheduled_wait(readers[reads], start[reads], total[reads], ready[reads],
                             writer[reads], tol)

    @staticmethod
    def _in_turn_sources(readers: np.ndarray, written: InTurn) -> tuple[Sources, np.ndarray]:
        """`written` as the sources of `read` for `readers`, and each reader's shift."""
        seconds = written.seconds
        at = np.searchsorted(written.targets, written.writers)
        held = found(written.targets, written.writers, at)
        lower = np.where(held, seconds[np.minimum(at, len(seconds) - 1)], 0.0)
        shift = np.cumsum(seconds)[np.searchsorted(written.targets, readers)]
        return Sources(written.writers, written.start, np.zeros(len(lower)), lower), shift

    # -- writes ----------------------------------------------------------------------

    def write_each(self, writers: np.ndarray, n_bytes: np.ndarray, sharing: int) -> np.ndarray:
        """Each writer writes one slot; returns the instants they are ready."""
        self.run(writers, "io", self.io("write", n_bytes, sharing))
        self.moved += float(n_bytes.sum())
        return self.clock[writers].copy()

    def write_in_turn(self, writers: np.ndarray, targets: np.ndarray, n_bytes: np.ndarray,
                      sharing: int) -> InTurn:
        """Each writer writes a slot for every target but itself, in target order; the
        slot for a target holds `n_bytes` of that target."""
        seconds = self.io("write", n_bytes, sharing)
        at = np.searchsorted(targets, writers)
        own = found(targets, writers, at)
        at = np.minimum(at, len(targets) - 1)
        start = self.clock[writers].copy()
        self.run(writers, "io", np.where(own, seconds.sum() - seconds[at], seconds.sum()))
        self.moved += float(np.where(own, n_bytes.sum() - n_bytes[at], n_bytes.sum()).sum())
        return InTurn(writers, start, targets, seconds)

    # -- the step's split ---------------------------------------------------------------

    def critical_path(self, start: float, end: float) -> dict[str, float]:
        """Seconds per kind on the critical path between `start` and `end`, walked as
        `Timeline.critical_path` walks it."""
        seg = self._segments()
        begin = seg.begin_in_order
        totals = {"compute": 0.0, "master": 0.0, "io": 0.0, "overhead": 0.0}
        top = self.clock.max()
        d = int(np.flatnonzero(self.clock >= top - TIE * abs(top))[0])
        t = end
        while t > start + 1e-15:
            lo, hi = seg.offsets[d], seg.offsets[d + 1]
            at = lo + int(np.searchsorted(begin[lo:hi], t - 1e-15, side="left")) - 1
            if at < lo:
                break
            i = seg.order[at]
            if seg.kind[i] == WAIT:
                totals["overhead"] += max(min(seg.stop[i], t) - max(seg.ready[i], start), 0.0)
                d, t = int(seg.writer[i]), float(seg.ready[i])
                continue
            totals[KINDS[seg.kind[i]]] += min(seg.stop[i], t) - max(begin[at], start)
            t = float(begin[at])
        return totals

    def _segments(self) -> Segments:
        """The columns as added, and the order putting each device's segments together
        and in time order (only the start instants are kept in that order: the walk
        and the lanes read a few of the rest)."""
        if self._in_order is None:
            self._in_order = Segments.of(self._columns, self.devices)
        return self._in_order

    def lanes_since(self, t: float) -> Lanes:
        """Each device's segments starting at or after `t`: ``(start, end, kind)``."""
        seg = self._segments()
        since = seg.begin_in_order >= t
        picked = seg.order[since]
        bounds = np.searchsorted(seg.devs[picked], np.arange(self.devices + 1))
        return Lanes(seg.begin_in_order[since], seg.stop[picked], seg.kind[picked], bounds)
