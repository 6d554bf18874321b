"""The probing process's CPU per step task and per second, from its calibration rounds.

An embedded cluster's scheduler runs in the client's process; every step task costs
that process CPU (the task sent, its result taken in) and so does time passing
(heartbeats, polls). Where the workers fill the cores, the per-task part delays the
step (pipeline/costmodel/contention.py), so the probe needs it as a figure of its own.

How: each round of a plan (pipeline/probe/runs.py, `PlanEngines.run`) reads the
process's CPU clock at each collect's return, giving one `TaskCpu` per collect:
the tasks it submitted since the last one (warm-up tasks go ahead ``train.inflight``
at a time), the task per worker it collected and that task's steps, and the wall time.
The warm-ups hold one step a task and the measured task two or three, and the first
collect of a round sends two tasks where the last sends none, so a collect's tasks per
step vary severalfold within every plan, where over a whole round they hardly vary
(about half a task a worker and step): fitted per round, ResNet-20's probe gave no
per-task part (the joint fit negative) where its runs used about 11 ms of client CPU
a task.

The fit (`client_cpu_fit`), per collect and step, least squares with no part negative::

    cpu / steps = send * P * submitted / steps + take * P / steps + rate * wall / steps

``P`` workers. A task's CPU is ``send + take``, whichever collect each part falls in:
a task sent ahead is sent in one collect's interval and taken in at another's.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from pipeline.probe.readings import nonneg_fit
from pipeline.probe.runs import TaskCpu


def client_cpu_rows(readings: Sequence[TaskCpu]) -> tuple[np.ndarray, np.ndarray]:
    """The fit's design (tasks sent, tasks taken in, wall seconds, each per step of the
    collected task) and its target (CPU seconds per step); collects of no steps left
    out."""
    kept = [r for r in readings if r.steps > 0]
    design = np.array([(r.workers * r.submitted / r.steps, r.workers / r.steps,
                        r.wall_s / r.steps) for r in kept], dtype=float).reshape(-1, 3)
    cpu = np.array([r.cpu_s / r.steps for r in kept], dtype=float)
    return design, cpu


#: Residuals beyond this many (robust) standard deviations drop a collect from the fit.
OUTLIER_SIGMAS = 5.0
#: Times the fit drops the outlying collects and fits again.
TRIMS = 3


def trimmed_fit(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """`readings.nonneg_fit`, fitted again `TRIMS` times without the rows whose residual
    lies beyond `OUTLIER_SIGMAS` of the kept rows' (their median absolute deviation,
    as a normal's standard deviation).

    Why: a collect now and then takes a burst of CPU that has nothing to do with its
    tasks (a tiny network's probe on a loaded 2-core machine: 190 ms in one collect of
    350 ms, the others 4-12 ms); least squares follows it, and that probe read no
    per-task CPU and 0.47 s a second where its other collects said about 3 ms a task
    and 0.06 s a second."""
    keep = np.ones(len(target), dtype=bool)
    coef = nonneg_fit(design, target)
    for _ in range(TRIMS):
        residual = target - design @ coef
        centre = np.median(residual[keep])
        sigma = 1.4826 * np.median(np.abs(residual[keep] - centre))
        inside = np.abs(residual - centre) <= OUTLIER_SIGMAS * max(sigma, 1e-12)
        if inside.sum() < design.shape[1] or (inside == keep).all():
            break
        keep = inside
        coef = nonneg_fit(design[keep], target[keep])
    return coef


def client_cpu_fit(readings: Sequence[TaskCpu]) -> tuple[float, float]:
    """``(per_task, rate)``: the probing process's CPU for each step task (one per worker
    and task: sending it and taking its result in) and per second of wall time, fitted
    (module doc) to the calibration rounds' collects, outlying ones left out
    (`trimmed_fit`). A part the fit would make negative is 0 and the others fitted
    without it (`readings.nonneg_fit`); (0, 0) with no collect to fit."""
    design, cpu = client_cpu_rows(readings)
    if not len(cpu):
        return 0.0, 0.0
    send, take, rate = trimmed_fit(design, cpu)
    return float(send + take), float(rate)
