"""The client's share of the cores (pipeline/costmodel/contention.py): pure."""

import pytest

from pipeline.costmodel.contention import contended_step, cores_filled
from pipeline.probe.readings import client_cpu_fit, task_gap_s
from pipeline.probe.runs import PlanRun, ProbePlan


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


def _run(workers: int, steps: int, wall_s: float, cpu_s: float) -> PlanRun:
    return PlanRun(ProbePlan([[1] * workers]), [f"w{i}" for i in range(workers)], [], 0,
                   cpu_s, wall_s, steps)


def test_the_probe_fits_cpu_per_task_and_per_second():
    per_task, rate = 0.004, 0.025
    runs = [_run(p, 3, 3 * wall, 3 * (per_task * p + rate * wall))
            for p, wall in ((1, 0.04), (2, 0.03), (1, 0.5), (2, 0.2), (2, 0.08))]
    assert client_cpu_fit(runs) == pytest.approx((per_task, rate))
    # a negative part is dropped and the other fitted alone
    flat = [_run(1, 2, 0.1, 0.002), _run(2, 2, 0.1, 0.001)]
    fitted = client_cpu_fit(flat)
    assert fitted[0] == 0.0 and fitted[1] > 0
    assert client_cpu_fit([]) == (0.0, 0.0)
    assert client_cpu_fit([_run(2, 0, 0.0, 0.0)]) == (0.0, 0.0)  # no measured steps


def test_the_fit_counts_the_tasks_a_round_took_and_the_gap_is_before_the_measured_task():
    """A round of 2 single-step warm-up tasks and a measured task of 3 steps on 2 workers:
    6 tasks over 5 steps, not one per worker and step."""
    per_task, rate = 0.004, 0.025
    runs = []
    for workers, wall in ((1, 0.04), (2, 0.03), (1, 0.5), (2, 0.2)):
        tasks = 3 * workers
        run = _run(workers, 5, 5 * wall, per_task * tasks + rate * 5 * wall)
        run.tasks, run.task_gaps = tasks, [0.001 * workers]
        runs.append(run)
    assert runs[1].tasks_per_step == pytest.approx(6 / 5)
    assert client_cpu_fit(runs) == pytest.approx((per_task, rate))
    assert task_gap_s(runs) == pytest.approx(0.0015)  # the median of 1, 2, 1, 2 ms
    assert task_gap_s([_run(2, 3, 0.1, 0.01)]) == 0.0  # no gap measured
