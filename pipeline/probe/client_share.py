"""How much of the client's CPU lands on the step, measured on this machine.

Where the workers' threads fill every core, the client's process (an embedded
cluster's scheduler, the client's polls) runs in a worker's place; part of that CPU
delays the step, part lands while the workers wait anyway (pipeline/costmodel/
contention.py, which adds that part of the client's CPU per task). That part, the
*share*, depends on the machine (its scheduler of
threads, its cores, how long the workers wait), so the probe measures it rather than
taking a figure fitted on another machine.

How: the probe runs its multi-worker plans again, rounds as they are alternating
with rounds beside a *burner*: a process on the same cores that spins for
`BURN_ON_S` and sleeps for `BURN_OFF_S`, a known load in bursts like the client's.
The burner's extra CPU per step, and how much longer the step got, give the share:
``busy = idle + share * rate * busy``, with ``rate`` the burner's CPU per second: the
seconds a step lost per second of CPU taken in bursts, as the prediction prices the
client's per-task CPU (`contention.contended_step`). A step is
its workers' span in the measured task (the first op's start to the last op's end
over every worker): the gaps between tasks are priced apart. Each busy round,
against the idle rounds either side of it, gives one figure; the share is their
median (`PAIRS` busy rounds on each plan timed), clipped to [0, 1]: at most all of
the client's CPU lands on the step. A round that timed no step gives none; with none
at all, or figures that disagree by `SHARE_SPREAD` or more (on a machine other work
loads, where the burner's effect is lost in theirs), the probe records None and the
prediction takes the bound, `contention.UNMEASURED_SHARE` (all of it).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from typing import Iterator, Sequence

import numpy as np
import psutil

from pipeline.probe.runs import Plan, PlanEngines, PlanRun
from tasks.receipts import Receipt

#: Rounds beside the burner on each plan the share is measured on.
PAIRS = 2
#: The widest middle half of the busy rounds' figures that still gives a share (half
#: the range a share can take).
SHARE_SPREAD = 0.5
#: Plans of this many seconds a step or more are not timed for the share: the
#: client's few milliseconds a step are lost in them, and ten rounds would cost minutes.
SHARE_BELOW_S = 1.0
#: The burner's duty cycle: this long spinning, then this long asleep (about a sixth
#: of a core, in bursts of a millisecond or so as the scheduler's work comes).
BURN_ON_S = 0.001
BURN_OFF_S = 0.005


def burner_code(parent: int) -> str:
    """The burner's code: it spins and sleeps by the duty cycle until its parent
    `parent` (the probe's process) is gone, so that a killed probe leaves no spinning
    process behind (the pid is given, not read at its start: the parent may die first)."""
    return (f"import os, time\nwhile os.getppid() == {parent}:\n"
            f"    end = time.perf_counter() + {BURN_ON_S}\n"
            "    while time.perf_counter() < end:\n        pass\n"
            f"    time.sleep({BURN_OFF_S})\n")


def step_spans(receipts: Sequence[Receipt]) -> list[float]:
    """Each step's span over its workers: the first receipt's start to the last one's
    end (receipts of one step, one per worker)."""
    by_step: dict[int, list[Receipt]] = {}
    for receipt in receipts:
        by_step.setdefault(receipt.step, []).append(receipt)
    return [max(r.end for r in rs) - min(r.start for r in rs)
            for _, rs in sorted(by_step.items())]


def pair_share(idle_s: float, busy_s: float, burner_rate: float) -> float | None:
    """One pair's share: ``(busy - idle) / (burner_rate * busy)`` (None where the
    burner used no CPU or no step was timed)."""
    if burner_rate <= 0 or busy_s <= 0 or idle_s <= 0:
        return None
    return (busy_s - idle_s) / (burner_rate * busy_s)


def median_share(shares: Sequence[float | None]) -> float | None:
    """The busy rounds' median share, at least 0; None where no round gave one, where
    their middle half spans `SHARE_SPREAD` or more (the machine's other load drowned
    the burner's: the figure would be noise), or where the median is above 1.

    Why a median above 1 is no figure: then the burner slowed the step by more than
    its own CPU, which no share of the client's CPU can do. It contended for more
    than a core's time (a hyperthread's sibling, shared caches); the prediction then
    takes the bound, all of the client's CPU (on the 2-core Intel Xeon some rounds
    read 0.8-2.4)."""
    given = [s for s in shares if s is not None and np.isfinite(s)]
    if not given:
        return None
    low, high = np.percentile(given, [25, 75])
    median = float(np.median(given))
    if high - low >= SHARE_SPREAD or median > 1.0:
        return None
    return max(median, 0.0)


@contextlib.contextmanager
def burner() -> Iterator[list[float]]:
    """A burner process for the block; yields a list that holds, after the block, its
    CPU per second of wall time over the block."""
    rate: list[float] = []
    process = subprocess.Popen([sys.executable, "-c", burner_code(os.getpid())],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        handle = psutil.Process(process.pid)
        time.sleep(0.05)  # past the interpreter's start
        before, started = sum(handle.cpu_times()[:2]), time.perf_counter()
        yield rate
        used, wall = sum(handle.cpu_times()[:2]) - before, time.perf_counter() - started
        rate.append(used / wall if wall > 0 else 0.0)
    finally:
        process.kill()
        process.wait()


def _median_span(run: PlanRun) -> float:
    spans = step_spans(run.receipts)
    return float(np.median(spans)) if spans else 0.0


def measure_share(engines: PlanEngines, plans: Sequence[Plan], round_index: int
                  ) -> list[float | None]:
    """`PAIRS` rounds of each plan beside the burner, each between two rounds as it
    is (idle, busy, idle, busy, idle: a busy round against the mean of the idle ones
    either side of it, so that the machine's drift drops out), numbered from
    `round_index` on; one share per busy round (`pair_share`)."""
    shares = []
    for plan in plans:
        idle = [_median_span(engines.run(plan, round_index))]
        for pair in range(PAIRS):
            with burner() as rate:
                busy = _median_span(engines.run(plan, round_index + 2 * pair + 1))
            idle.append(_median_span(engines.run(plan, round_index + 2 * pair + 2)))
            shares.append(pair_share((idle[-2] + idle[-1]) / 2, busy, rate[0]))
    return shares
