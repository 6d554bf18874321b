"""The learning-rate schedule (tasks/lr_schedule.py) against torch's own schedulers.

`lr_at` is what every worker's SGD steps with; torch.optim.lr_scheduler is what a
plain PyTorch user (and the `reference` strategy) steps with. Each case builds torch's
schedulers by hand, as such a user would, and compares the rate of every step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.optim import lr_scheduler

from tasks.lr_schedule import LrSchedule, lr_at, lr_factor, schedule_problem
from tasks.optim import WorkerSGD, torch_scheduler, torch_sgd
from tasks.specs import OptimizerSpec

LR = 0.05


def _optimizer() -> torch.optim.SGD:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=LR, momentum=0.9)


def torch_rates(make, steps: int) -> list[float]:
    """The rate of each of `steps` steps under the scheduler `make(optimizer)` builds:
    read before the step, the scheduler stepped after it (torch's order)."""
    optimizer = _optimizer()
    scheduler = make(optimizer)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def rates(schedule: LrSchedule, steps: int) -> list[float]:
    return [lr_at(step, LR, schedule) for step in range(steps)]


CASES = {
    "multistep": (LrSchedule("step", (3, 7), gamma=0.5, steps=12),
                  lambda o: lr_scheduler.MultiStepLR(o, [3, 7], gamma=0.5)),
    "cosine": (LrSchedule("cosine", steps=10),
               lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=10, eta_min=0.0)),
    "warmup alone": (LrSchedule("none", warmup=4, warmup_factor=0.25, steps=9),
                     lambda o: lr_scheduler.LinearLR(o, start_factor=0.25, total_iters=4)),
    # milestones from the run's start: torch's SequentialLR counts them from the warm-up's end
    "warmup then step": (
        LrSchedule("step", (5, 8), gamma=0.1, warmup=3, warmup_factor=0.1, steps=12),
        lambda o: lr_scheduler.SequentialLR(
            o, [lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3),
                lr_scheduler.MultiStepLR(o, [2, 5], gamma=0.1)], milestones=[3])),
    "warmup then cosine": (
        LrSchedule("cosine", warmup=2, steps=10),
        lambda o: lr_scheduler.SequentialLR(
            o, [lr_scheduler.LinearLR(o, start_factor=1 / 3, total_iters=2),
                lr_scheduler.CosineAnnealingLR(o, T_max=8)], milestones=[2])),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_steps_rate_is_torchs_schedulers(name):
    schedule, make = CASES[name]
    ours, theirs = rates(schedule, schedule.steps), torch_rates(make, schedule.steps)
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=0)
    assert len(set(ours)) > 2  # the rate did move


@pytest.mark.parametrize("name", list(CASES))
def test_the_references_schedulers_are_torchs_from_any_step(name):
    """`torch_scheduler`, stepped on to a resume's step, gives the rates of the rest."""
    schedule, _ = CASES[name]
    spec = OptimizerSpec(lr=LR, schedule=schedule)
    for from_step in (0, 4):
        optimizer = torch_sgd([torch.nn.Parameter(torch.zeros(2))], spec)
        scheduler = torch_scheduler(optimizer, spec, from_step)
        got = []
        for _ in range(from_step, schedule.steps):
            got.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        np.testing.assert_allclose(got, rates(schedule, schedule.steps)[from_step:],
                                   rtol=1e-12, atol=0)


def test_a_constant_schedule_is_the_base_rate_bit_for_bit():
    schedule = LrSchedule(steps=5)
    assert schedule.constant and all(lr_at(s, 0.0123, schedule) == 0.0123 for s in range(5))
    assert torch_scheduler(torch_sgd([torch.nn.Parameter(torch.zeros(1))],
                                     OptimizerSpec(lr=LR, schedule=schedule)),
                           OptimizerSpec(lr=LR, schedule=schedule)) is None
    # past the warm-up and before a milestone the factor is exactly 1 too
    assert lr_factor(4, LrSchedule("step", (6,), warmup=4)) == 1.0


def test_the_workers_sgd_steps_with_each_steps_rate():
    """WorkerSGD told the step's number equals torch's SGD under torch's schedulers."""
    schedule, _ = CASES["warmup then step"]
    spec = OptimizerSpec(lr=LR, momentum=0.9, weight_decay=1e-3, schedule=schedule)
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(6, generator=generator, dtype=torch.float64)
    grads = torch.randn(schedule.steps, 6, generator=generator, dtype=torch.float64)
    ours, theirs = (torch.nn.Parameter(start.clone()) for _ in range(2))
    worker, optimizer = WorkerSGD([ours], spec), torch_sgd([theirs], spec)
    scheduler = torch_scheduler(optimizer, spec)
    for step in range(schedule.steps):
        ours.grad, theirs.grad = grads[step].clone(), grads[step].clone()
        worker.step(step)
        optimizer.step()
        scheduler.step()
    np.testing.assert_allclose(ours.detach().numpy(), theirs.detach().numpy(),
                               rtol=1e-13, atol=0)


@pytest.mark.parametrize("schedule,field,names", [
    (LrSchedule("step", ()), "lr_milestones", "needs milestones"),
    (LrSchedule("step", (4, 4)), "lr_milestones", "increasing"),
    (LrSchedule("step", (0, 4)), "lr_milestones", ">= 1"),
    (LrSchedule("step", (2,), warmup=2), "lr_milestones", "within the warm-up"),
    (LrSchedule("cosine", (2,), steps=9), "lr_milestones", "are for train.lr_decay: step"),
    (LrSchedule("cosine", warmup=9, steps=9), "lr_warmup", "none of the run's 9 steps"),
])
def test_schedules_torch_would_not_give_are_named(schedule, field, names):
    problem = schedule_problem(schedule)
    assert problem is not None and problem[0] == field and names in problem[1], problem


def test_schedules_torch_gives_pass():
    for schedule, _ in CASES.values():
        assert schedule_problem(schedule) is None
