"""The client's share of the cores (pipeline/costmodel/contention.py): pure."""

import pytest

from pipeline.costmodel.contention import contended_step, cores_filled, median_task_share
import numpy as np

from pipeline.probe.client_cpu import client_cpu_fit
from pipeline.probe.dask_readings import step_gap_s, task_gap_s
from pipeline.probe.runs import PlanRun, ProbePlan, TaskCpu


def test_the_workers_fill_the_cores_only_without_a_core_for_the_client():
    assert not cores_filled([1], 2)  # one single-thread worker on two cores
    assert cores_filled([1, 1], 2) and cores_filled([1, 1, 1], 2) and cores_filled([2], 2)
    assert not cores_filled([1, 1], 0)  # cores unknown: no contention


def test_the_contended_step_adds_the_share_of_the_clients_cpu_for_its_tasks():
    """Two tasks a step (two workers, a task per step) of 4 ms of the client's CPU each:
    half of it lands on the step; the bound where the share is unmeasured is all of it."""
    assert contended_step(0.030, 2, 0.004, share=0.5) == pytest.approx(0.034)
    assert contended_step(0.030, 0.2, 0.004) == pytest.approx(0.030 + 0.0008)  # 10 steps a task
    assert contended_step(0.030, 2, 0.0, 0.5) == 0.030
    assert contended_step(0.030, 2, 0.004, share=0.0) == 0.030


def test_a_runs_median_step_carries_a_tasks_costs_only_where_most_steps_meet_them():
    """A task's costs land on the step at its boundary: every step at one step a task,
    half of them at two (the median of an even count averages one of each), fewer than
    half from three on."""
    assert median_task_share(1) == 1.0
    assert median_task_share(2) == 0.5
    assert [median_task_share(k) for k in (3, 4, 10, 32)] == [0.0] * 4
    with pytest.raises(ValueError):
        median_task_share(0)


def _round(workers: int, step_s: float, first: bool, send: float, take: float, rate: float,
           noise: list[float] | None = None) -> list[TaskCpu]:
    """One calibration round's collects as `PlanEngines.run` reads them (two tasks
    ahead): the first round two one-step warm-ups and a 3-step measured task, a later
    one a warm-up and the measured task; each collect's CPU from `send` and `take`
    per task and worker and `rate` per second (plus its `noise`, seconds)."""
    counts = [1, 1, 3] if first else [1, 3]
    sent = [2, 1, 0] if first else [2, 0]
    noise = noise or [0.0] * len(counts)
    return [TaskCpu(workers, s, n, n * step_s,
                    workers * (send * s + take) + rate * n * step_s + e)
            for s, n, e in zip(sent, counts, noise)]


def _probe_rounds(send: float, take: float, rate: float, noise_s: float = 0.0
                  ) -> list[TaskCpu]:
    """The collects of a probe's rounds: plans on 1 and 2 workers of various step
    times, two rounds each; `noise_s`: each collect's CPU off by up to that much."""
    rng = np.random.default_rng(0)
    readings = []
    for workers, step_s in ((1, 0.12), (2, 0.07), (2, 0.09), (2, 0.15), (1, 0.25),
                            (2, 0.03)):
        for first in (True, False):
            noise = list(rng.uniform(-noise_s, noise_s, 3 if first else 2))
            readings += _round(workers, step_s, first, send, take, rate, noise)
    return readings


def test_the_probe_fits_cpu_per_task_and_per_second_collect_by_collect():
    """A task's CPU is its sending and its taking in, whichever collect each falls in."""
    assert client_cpu_fit(_probe_rounds(0.003, 0.008, 0.03)) == pytest.approx((0.011, 0.03))
    assert client_cpu_fit(_probe_rounds(0.0, 0.004, 0.02)) == pytest.approx((0.004, 0.02))


def test_the_fit_holds_with_each_collects_reading_off_by_milliseconds():
    """ResNet-20's runs' figures (11 ms a task, 0.031 s a second), each collect's
    reading off by up to 2 ms: the per-task part within a fifth."""
    per_task, rate = client_cpu_fit(_probe_rounds(0.004, 0.007, 0.031, noise_s=0.002))
    assert per_task == pytest.approx(0.011, rel=0.2) and rate == pytest.approx(0.031, rel=0.2)


def test_a_collect_that_took_a_burst_of_cpu_is_left_out():
    """One collect of 350 ms that took 190 ms of CPU beside its tasks (as on a tiny
    network's probe on a loaded machine): without it the fit, not with it."""
    readings = _probe_rounds(0.003, 0.008, 0.03)
    readings[4] = TaskCpu(2, 2, 1, 0.35, readings[4].cpu_s + 0.19)
    assert client_cpu_fit(readings) == pytest.approx((0.011, 0.03))


def test_a_part_the_fit_would_make_negative_is_zero():
    """No per-task CPU at all (the client only polls): the rate alone; no readings, or
    none with steps: nothing."""
    per_task, rate = client_cpu_fit(_probe_rounds(0.0, 0.0, 0.03))
    assert per_task == pytest.approx(0.0, abs=1e-12) and rate == pytest.approx(0.03)
    falling = [TaskCpu(1, 1, 1, 0.1, 0.004), TaskCpu(2, 1, 1, 0.1, 0.002)]
    fitted = client_cpu_fit(falling)  # more tasks, less CPU: no per-task part
    assert fitted[0] == 0.0 and fitted[1] > 0
    assert client_cpu_fit([]) == (0.0, 0.0)
    assert client_cpu_fit([TaskCpu(2, 0, 0, 0.0, 0.0)]) == (0.0, 0.0)


def _run(workers: int, gap_s: float) -> PlanRun:
    return PlanRun(ProbePlan([[1] * workers]), [f"w{i}" for i in range(workers)], [], 0,
                   task_gaps=[gap_s] if gap_s else [])


def test_the_gap_between_steps_inside_a_task_is_read_off_consecutive_receipts():
    """Each worker's measured steps 4-6 run in one task: the gaps between them, not
    across a step missing from the receipts (a warm-up left out) nor between workers."""
    from tasks.receipts import Receipt
    receipts = [Receipt("t", "w0", 4, 0.000, 0.010), Receipt("t", "w0", 5, 0.0102, 0.020),
                Receipt("t", "w0", 6, 0.0203, 0.030), Receipt("t", "w1", 4, 0.0001, 0.0101),
                Receipt("t", "w1", 6, 0.050, 0.060)]  # no step 5: no gap to read
    run = PlanRun(ProbePlan([[1, 1]]), ["w0", "w1"], receipts, 0)
    assert step_gap_s([run]) == pytest.approx(0.00025)  # the median of 0.2 and 0.3 ms
    assert step_gap_s([_run(2, 0.001)]) is None  # no receipts: not measured


def test_the_gap_is_the_median_before_the_measured_task():
    runs = [_run(w, 0.001 * w) for w in (1, 2, 1, 2)]
    assert task_gap_s(runs) == pytest.approx(0.0015)  # the median of 1, 2, 1, 2 ms
    assert task_gap_s([_run(2, 0.0)]) == 0.0  # no gap measured
