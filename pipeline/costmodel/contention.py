"""The client's share of the cores: what a step loses when the workers fill them.

An embedded cluster's scheduler runs in the client's process, on the same machine as
the workers. Every step costs that process CPU: the scheduler's and the client's work
for each step task (one per worker and task of `train.steps_per_task` steps: its
result taken in, the next one sent) and what they do while time passes (heartbeats,
polls). Where a core is left free (one single-thread worker on two cores), that work
runs beside the step and costs it nothing. Where the workers' threads fill every
core, it runs in their place: a worker it displaces falls behind, and since workers
wait for each other at every exchange, the step waits with it.

Only the per-task part is added here. The part that comes with time passing ran
beside the probe's own timed steps too, on the same cores (a probe's measured steps
are one task per worker: pipeline/probe/runs.py), so it already sits in every timing
the prediction adds up; adding it again priced 2-worker steps a few percent slow,
while a task per step, whose per-task CPU the probe's timings hold none of, was
priced 12 % fast (docs/model.md, "The client's share of the cores").

Not all of the per-task CPU lands on the step: part runs while the workers wait. The
part that does, the *share*, is measured by the probe on the machine at hand
(pipeline/probe/client_share.py); where it could not be, the prediction takes the
bound, `UNMEASURED_SHARE`: all of it. The measured twin is the critical breakdown's
``wait``.
"""

from __future__ import annotations

#: The share taken where the probe did not measure it: all of the client's CPU per
#: task lands on the step. A bound, not a figure fitted on some machine's runs: work
#: of the client's cannot delay the step by more than itself.
UNMEASURED_SHARE = 1.0


#: Steps a task must hold for its per-task costs to miss a run's median step.
MEDIAN_MISSES_FROM = 3


def median_task_share(task_steps: int) -> float:
    """The part of one task's costs (a worker's gap between tasks, the client's CPU
    per task) that a run's median step carries, with `task_steps` steps a task.

    Those costs land on the step at the task's boundary, and a run's step time is the
    median over its steps. With one step a task every step carries them; with two,
    half the steps do, and the median of an even count averages one of each (half of
    one task's costs, as `1 / task_steps`); with three or more, fewer than half the
    steps carry them and the median step none: the small network's `data` and
    `kernel` steps on 2 workers read alike at 3, 6 and 12 steps a task, where a
    share of `1 / task_steps` priced them 1.0-1.4 ms (5-7 %) apart (docs/model.md)."""
    if task_steps < 1:
        raise ValueError(f"a task holds at least one step, not {task_steps}")
    return 1.0 / task_steps if task_steps < MEDIAN_MISSES_FROM else 0.0


def cores_filled(worker_threads: list[int], cores: int) -> bool:
    """Whether the workers' threads leave the client no core of its own."""
    return cores > 0 and sum(worker_threads) >= cores


def contended_step(step_s: float, tasks_per_step: float, per_task_s: float,
                   share: float = UNMEASURED_SHARE) -> float:
    """The step once `share` of the client's CPU for its tasks (`per_task_s` each,
    `tasks_per_step` of them a step) delays it."""
    return step_s + share * per_task_s * tasks_per_step
