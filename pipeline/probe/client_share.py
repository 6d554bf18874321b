"""How much of the client's CPU lands on the step, measured by its own timing.

Where the workers' threads fill every core, the client's process (an embedded
cluster's scheduler, the client's polls) runs in a worker's place; part of that CPU
delays the step, part lands while the workers wait anyway (pipeline/costmodel/
contention.py, which adds that part of the client's CPU per task). That part, the
*share*, depends on the machine (its scheduler of threads, its cores, how long the
workers wait for each other), so the probe measures it rather than taking a figure
fitted on another machine.

How: the probe runs its multi-worker plans again (`ROUNDS` rounds each: a warm-up
task and the measured task queued behind it, as runs queue theirs), while a thread of
its own reads the process's CPU clock every `SAMPLE_S` (`cpu_timeline`; its own CPU is
taken off). The workers' receipts say when each one was busy: inside a task and not
waiting for a peer's slot (`busy_spans`). A round's share is the part of the client's
CPU, from the first task's start to the last one's end, that it spent while the busy
workers' threads filled every core (`landed_share`): that CPU took a worker's place;
the rest ran on a core a waiting worker had left. The probe keeps each round's figure
and their median (`median_share`). Where no round gave one (the client used under
`MIN_CPU_S` inside a round), the prediction takes the bound,
`contention.UNMEASURED_SHARE` (all of it).

Why not a known load beside the step (a *burner* spinning in bursts, the step's
slowdown over its CPU): its bursts come at any moment and read the share of a load
that is not the client's; its rounds drowned in the machine's own noise in 6 of 11
two-worker probes on the 2-core Intel Xeon (rounds spread by 0.5 or more), and some
read above 1 (a hyperthread's sibling, shared caches).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator, Sequence

import numpy as np

from pipeline.cluster.startup import usable_cores
from pipeline.probe.runs import Plan, PlanEngines
from tasks.receipts import Receipt

#: Rounds of each plan the share is measured on.
ROUNDS = 2
#: How often the sampling thread reads the process's CPU clock: fine enough to tell a
#: millisecond's wait from work, coarse enough that its own CPU (tens of microseconds
#: a read) stays near a hundredth of a core.
SAMPLE_S = 0.001
#: The widest middle half of the rounds' figures that still gives a share (half the
#: range a share can take).
SHARE_SPREAD = 0.5
#: A round whose client used less CPU than this inside it gives no figure.
MIN_CPU_S = 0.0005
#: Plans of this many seconds a step or more are not timed for the share: the
#: client's few milliseconds a step are lost in them, and the rounds would cost minutes.
SHARE_BELOW_S = 1.0

#: (wall clock ``time.time()``, the process's CPU seconds less the sampler's own)
CpuSample = tuple[float, float]


@contextlib.contextmanager
def cpu_timeline(period_s: float = SAMPLE_S) -> Iterator[list[CpuSample]]:
    """This process's CPU clock read every `period_s` by a thread of its own for the
    block; yields the list of samples, complete once the block has ended. The
    sampler's own CPU is taken off each reading."""
    samples: list[CpuSample] = []
    stop = threading.Event()

    def sample() -> None:
        own = time.thread_time()
        while True:  # a reading, a wait; once stopped, one reading more
            samples.append((time.time(), time.process_time() - (time.thread_time() - own)))
            if stop.is_set():
                return
            stop.wait(period_s)

    thread = threading.Thread(target=sample, name="client-cpu-sampler", daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def busy_spans(receipts: Sequence[Receipt]) -> dict[str, list[tuple[float, float]]]:
    """Per worker, when it was busy: each task's span less its ``wait`` phases (the
    worker polling for a peer's slot, its core free), in time order."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for receipt in sorted(receipts, key=lambda r: r.start):
        waits = sorted((p.start, p.end) for e in receipt.events for p in e.phases
                       if p.kind == "wait")
        start = receipt.start
        mine = spans.setdefault(receipt.worker, [])
        for wait_start, wait_end in waits:
            if wait_start > start:
                mine.append((start, wait_start))
            start = max(start, wait_end)
        if receipt.end > start:
            mine.append((start, receipt.end))
    return spans


def _busy_at(spans: list[tuple[float, float]], moments: np.ndarray) -> np.ndarray:
    """Whether each of `moments` (sorted or not) falls in one of `spans` (in order,
    not overlapping)."""
    if not spans:
        return np.zeros(len(moments), dtype=bool)
    starts = np.array([s for s, _ in spans])
    ends = np.array([e for _, e in spans])
    index = np.searchsorted(starts, moments, side="right") - 1
    inside = index >= 0
    inside[inside] = moments[inside] < ends[index[inside]]
    return inside


def landed_share(samples: Sequence[CpuSample], receipts: Sequence[Receipt],
                 threads: dict[str, int], cores: int) -> float | None:
    """The part of the client's CPU, from the first receipt's start to the last one's
    end, spent while the busy workers' threads (`threads` per worker) filled `cores`;
    each interval between samples counted at its middle. None where the client used
    under `MIN_CPU_S` there (nothing to tell) or nothing was timed."""
    if len(samples) < 2 or not receipts or cores <= 0:
        return None
    first, last = min(r.start for r in receipts), max(r.end for r in receipts)
    clock = np.array(samples, dtype=float)
    middles = (clock[1:, 0] + clock[:-1, 0]) / 2
    # a reading takes the sampler's own CPU off after the process's, so one that
    # catches the sampler mid-step reads a hair low and the next interval below zero:
    # no CPU runs backwards, and a share must stay a part of the whole
    cpu = np.clip(np.diff(clock[:, 1]), 0.0, None)
    inside = (middles >= first) & (middles <= last)
    middles, cpu = middles[inside], cpu[inside]
    total = float(cpu.sum())
    if total < MIN_CPU_S:
        return None
    busy_threads = np.zeros(len(middles))
    for worker, spans in busy_spans(receipts).items():
        busy_threads += threads.get(worker, 1) * _busy_at(spans, middles)
    return float(cpu[busy_threads >= cores].sum() / total)


def median_share(shares: Sequence[float | None]) -> float | None:
    """The rounds' median share; None where no round gave one or where their middle
    half spans `SHARE_SPREAD` or more (the figures disagree: what the client did
    moved between rounds, and the median would be noise)."""
    given = [s for s in shares if s is not None and np.isfinite(s)]
    if not given:
        return None
    low, high = np.percentile(given, [25, 75])
    if high - low >= SHARE_SPREAD:
        return None
    return float(np.median(given))


def measure_share(engines: PlanEngines, plans: Sequence[Plan], round_index: int
                  ) -> list[float | None]:
    """`ROUNDS` rounds of each plan with the client's CPU sampled, numbered from
    `round_index` on; one share per round (`landed_share` against the cores this process
    may run on, the rounds' receipts with their warm-up tasks: the client's work for a
    task lands as the next one runs)."""
    threads, cores = {w.name: w.threads for w in engines.offered}, usable_cores()
    shares = []
    for plan in plans:
        for index in range(ROUNDS):
            with cpu_timeline() as samples:
                run = engines.run(plan, round_index + index)
            shares.append(landed_share(samples, run.warmup_receipts + run.receipts,
                                       threads, cores))
    return shares
