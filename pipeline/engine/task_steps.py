"""How many steps one Dask task runs, and each step's time within such a task.

Pure functions, no cluster. Every Dask task costs the same whatever it does: the
client's process (which hosts an embedded cluster's scheduler) spends 3.5-5 ms of
CPU per task here, and a worker a few ms between tasks (docs/benchmarks.md, "What
a Dask task costs here"). At one task per worker and step, on two cores that two
single-thread workers fill, that CPU comes out of a worker's time, and its peers
wait for it at the next exchange. So a worker's task runs several consecutive steps
(``train.steps_per_task``): the same ops in the same order, so the same arithmetic,
with the per-task costs paid once per task.

``auto`` sizes a task to last about `TASK_SECONDS` by the steps measured so far
(one step per task until a step is measured, at most `MAX_STEPS_PER_TASK`): long
enough that the per-task costs vanish, short enough that the progress bar, the
stall watch and a worker-loss recovery still see the run move every second or so.
A task never runs past the next checkpoint, nor past the run's last step.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Literal, Sequence

#: ``auto``: the seconds one task aims to last.
TASK_SECONDS = 1.0
#: ``auto``: the most steps one task runs.
MAX_STEPS_PER_TASK = 32
#: ``auto``: how many of the latest step times size the next task.
RECENT_STEPS = 101

StepsPerTask = int | Literal["auto"]


def steps_per_task(setting: StepsPerTask, step_s: float | None) -> int:
    """Steps per task for `setting` at a step of `step_s` seconds (None: not known
    yet); an integer setting is taken as it is."""
    if setting != "auto":
        return int(setting)
    if step_s is None or not math.isfinite(step_s) or step_s <= 0:
        return 1
    return max(1, min(MAX_STEPS_PER_TASK, int(TASK_SECONDS / step_s)))


def next_task_steps(start: int, stop: int, setting: StepsPerTask,
                    measured: Sequence[float]) -> int:
    """How many steps the task that starts at step `start` runs, ending by step `stop`
    (the next checkpoint or the run's end). `measured`: recent step times (`StepClock`
    keeps them), whose median sizes an ``auto`` task."""
    if stop <= start:
        raise ValueError(f"no steps between {start} and {stop}")
    step_s = statistics.median(measured) if measured else None
    return min(stop - start, steps_per_task(setting, step_s))


#: One checkpoint period's tasks as the loop runs them, in order: (steps a task,
#: such tasks one after another).
PeriodTasks = list[tuple[int, int]]


def _period_tasks(length: int, first_sizes: Sequence[int], size: int) -> PeriodTasks:
    """The tasks of a period of `length` steps between checkpoints: the loop cuts
    each at the period's end, sizes the first ones `first_sizes` and the rest `size`."""
    tasks: PeriodTasks = []
    left = length
    for first in first_sizes:
        if not left:
            break
        tasks.append((min(left, first), 1))
        left -= tasks[-1][0]
    whole, rest = divmod(left, size)
    return tasks + [(size, whole)] * bool(whole) + [(rest, 1)] * bool(rest)


def planned_periods(setting: StepsPerTask, step_s: float | None, steps: int,
                    checkpoint_every: int, inflight: int) -> list[tuple[PeriodTasks, int]]:
    """The tasks a run of `steps` steps will run, as the training loop
    (pipeline/training/loop.py) sizes them at a steady `step_s`, by checkpoint period:
    (a period's tasks, how many such periods one after another). The `inflight`
    tasks submitted before any step is measured run `steps_per_task(setting, None)`
    steps (one, for ``auto``), the later ones `steps_per_task(setting, step_s)`; none
    runs past a checkpoint (every `checkpoint_every` steps; 0: none but the end) or
    the run's end. Nothing is in flight at a checkpoint, so every whole period after
    the first has the same tasks: a run of 10^9 steps costs no more than one of 10."""
    every = checkpoint_every or steps
    first_length = min(every, steps)
    size = steps_per_task(setting, step_s)
    periods = [(_period_tasks(first_length, [steps_per_task(setting, None)] * inflight,
                              size), 1)]
    whole, rest = divmod(steps - first_length, every)
    if whole:
        periods.append((_period_tasks(every, [], size), whole))
    if rest:
        periods.append((_period_tasks(rest, [], size), 1))
    return periods


def planned_task_steps(setting: StepsPerTask, step_s: float | None, steps: int,
                       checkpoint_every: int, inflight: int) -> list[int]:
    """The size of the task each step of a run will run in (`planned_periods`), step
    by step. What a prediction made before the run prices its per-task costs by: a
    run of a few steps runs tasks of one or two steps whatever its step time."""
    return [count for tasks, repeats in planned_periods(setting, step_s, steps,
                                                        checkpoint_every, inflight)
            for _ in range(repeats) for count, number in tasks
            for _ in range(count * number)]


def median_task_steps(setting: StepsPerTask, step_s: float | None, steps: int,
                      checkpoint_every: int, inflight: int, warmup_steps: int) -> int:
    """The median of `planned_task_steps` over a run's timed steps (after
    `warmup_steps`; all of them if none is timed), as the run's summary gives it
    (``task_steps_median``), whole as a prediction after the run takes it
    (`pipeline.prediction.predict_point`). Counted by task size, not step by step."""
    periods = planned_periods(setting, step_s, steps, checkpoint_every, inflight)
    skip = warmup_steps if warmup_steps < steps else 0
    steps_of_size: dict[int, int] = {}  # timed steps by the size of their task
    for tasks, repeats in periods:
        period_steps = sum(count * number for count, number in tasks)
        whole = min(repeats, skip // period_steps)  # periods wholly in the warm-up
        skip, repeats = skip - whole * period_steps, repeats - whole
        if repeats and skip:  # one period partly in the warm-up
            for count, number in tasks:
                dropped = min(skip, count * number)
                steps_of_size[count] = steps_of_size.get(count, 0) + count * number - dropped
                skip -= dropped
            repeats -= 1
        for count, number in tasks:
            steps_of_size[count] = steps_of_size.get(count, 0) + count * number * repeats
    return int(_median_of_counts(steps_of_size))


def _median_of_counts(counts: dict[int, int]) -> float:
    """`statistics.median` of a list holding each key of `counts` that many times."""
    total = sum(counts.values())
    middle: list[int] = []  # the values at positions (total - 1) // 2 and total // 2
    seen = 0
    for value in sorted(counts):
        seen += counts[value]
        while len(middle) < 2 and seen > ((total - 1) // 2, total // 2)[len(middle)]:
            middle.append(value)
    return middle[0] if total % 2 else (middle[0] + middle[1]) / 2


class StepClock:
    """The step times that size ``auto`` tasks: the last `RECENT_STEPS`, the loop's
    first step (a warm-up: allocation, the first task's start) only until another is
    known."""

    def __init__(self) -> None:
        self.first: list[float] = []
        self.recent: deque[float] = deque(maxlen=RECENT_STEPS)

    def add(self, times: Sequence[float]) -> None:
        for seconds in times:
            (self.recent if self.first else self.first).append(seconds)

    def steps(self) -> Sequence[float]:
        return self.recent or self.first


def steps_label(first: int, count: int) -> str:
    """How messages and the trace name a task's steps: "step 4", "steps 4-13"."""
    return f"step {first}" if count == 1 else f"steps {first}-{first + count - 1}"


def step_times(ends: Sequence[float], previous_end: float | None, wall_s: float) -> list[float]:
    """Each step's time in one task's run of steps.

    `ends`: when each step finished (its last task's end, on the workers' clocks);
    `previous_end`: when the step before finished, if it ran in the task before on
    the same workers without a checkpoint between; `wall_s`: the client's time from
    the previous task's collection (or the checkpoint's end) to this one's.

    A step's time runs from the previous step's end to its own. Without a previous
    end, the first step gets the client's time less what the task's other steps
    took, so that the steps add up to what the client waited.
    """
    if not ends:
        return []
    if previous_end is None:
        first = max(0.0, wall_s - (ends[-1] - ends[0]))
    else:
        first = ends[0] - previous_end
    return [first] + [b - a for a, b in zip(ends, ends[1:])]
