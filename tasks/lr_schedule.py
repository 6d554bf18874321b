"""The learning rate of each SGD step: a pure function of the step and the schedule.

A schedule is a linear warm-up followed by a decay, each mirroring one of
torch.optim.lr_scheduler's schedulers, so that a run's rates are those a plain
PyTorch user gets from them (tests/test_lr_schedule.py checks step by step):

- warm-up (`warmup` steps): ``LinearLR(start_factor=warmup_factor, end_factor=1,
  total_iters=warmup)``: from ``warmup_factor x lr`` at step 0 up to ``lr`` at
  step `warmup`;
- ``none``: the rate stays ``lr``;
- ``step``: ``MultiStepLR(milestones, gamma)``: the rate is multiplied by `gamma` at
  each milestone. Milestones count steps from the run's start, as a MultiStepLR alone
  would and as papers quote them ("divided by 10 at 32k and 48k iterations"); under a
  warm-up torch's ``SequentialLR`` counts its second scheduler's steps from the
  warm-up's end, so there the torch equivalent takes ``milestone - warmup``;
- ``cosine``: ``CosineAnnealingLR(T_max=steps - warmup, eta_min=0)`` after the
  warm-up: from ``lr`` down towards 0, which it reaches at step `steps`, just after
  the run's last (whose rate is ``lr x (1 - cos(pi / T_max)) / 2``, T_max the steps after
  the warm-up), as torch's gives it.

Together they are ``SequentialLR([LinearLR(...), decay], milestones=[warmup])``
(`torch_scheduler` in tasks/optim.py builds exactly that for the `reference`).

Step numbers are those of the run: step s is the (s+1)-th SGD step, the one that
turns checkpoint s into checkpoint s+1, and its rate is the one torch's scheduler
gives after s calls of ``scheduler.step()``. Every worker computes the rate of the
step it is taking from this function (`tasks.optim.WorkerSGD.step`), so a task
running several steps, a resume and a recovery's replay all use the rate of the
step, whatever ran before.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from typing import Literal

#: torch's LinearLR's default `start_factor`.
TORCH_WARMUP_FACTOR = 1.0 / 3.0


@dataclass(frozen=True)
class LrSchedule:
    """How the learning rate moves over a run's steps (the module doc says how).

    The default is a constant rate. `steps` is the run's length (`train.steps`), which
    only the cosine decay uses."""

    decay: Literal["none", "step", "cosine"] = "none"
    milestones: tuple[int, ...] = ()
    gamma: float = 0.1
    warmup: int = 0
    warmup_factor: float = TORCH_WARMUP_FACTOR
    steps: int = 0

    @property
    def constant(self) -> bool:
        """Whether every step has the base rate (no warm-up, no decay)."""
        return self.decay == "none" and self.warmup == 0


def lr_factor(step: int, schedule: LrSchedule) -> float:
    """The factor the base learning rate is multiplied by at `step` (1.0 exactly when
    the schedule leaves the rate as it is, so a constant schedule's rate is the base
    rate bit for bit)."""
    if step < 0:
        raise ValueError(f"step {step}: steps count from 0")
    if step < schedule.warmup:
        start = schedule.warmup_factor
        return start + (1.0 - start) * step / schedule.warmup
    if schedule.decay == "step":
        return schedule.gamma ** bisect_right(schedule.milestones, step)
    if schedule.decay == "cosine":
        annealed = step - schedule.warmup
        length = schedule.steps - schedule.warmup
        return (1.0 + math.cos(math.pi * annealed / length)) / 2.0
    return 1.0


def lr_at(step: int, lr: float, schedule: LrSchedule) -> float:
    """The learning rate of step `step` for base rate `lr` under `schedule`."""
    factor = lr_factor(step, schedule)
    return lr if factor == 1.0 else lr * factor


def schedule_problem(schedule: LrSchedule) -> tuple[str, str] | None:
    """(field, why) where `schedule`'s milestones or length are not a schedule torch's
    schedulers give, else None. The fields are `train.*`'s names; the numbers' own
    ranges (gamma, the warm-up) are the config's to check (`check_range`)."""
    milestones = list(schedule.milestones)
    if schedule.decay != "step":
        if milestones:
            return ("lr_milestones", f"milestones {milestones} are for train.lr_decay: step "
                    f"(it is {schedule.decay}); set it, or leave the milestones out")
        if schedule.decay == "cosine" and schedule.warmup >= schedule.steps:
            return ("lr_warmup", f"{schedule.warmup} warm-up steps leave none of the run's "
                    f"{schedule.steps} steps (train.steps) for the cosine decay")
        return None
    if not milestones:
        return ("lr_milestones", "train.lr_decay: step needs milestones: the steps at which "
                "the rate is multiplied by train.lr_gamma, e.g. [30, 60]")
    if any(later <= earlier for earlier, later in zip(milestones, milestones[1:])):
        return "lr_milestones", f"expected increasing step numbers, got {milestones}"
    if milestones[0] < 1:
        return "lr_milestones", f"expected step numbers >= 1, got {milestones}"
    if milestones[0] <= schedule.warmup:
        return ("lr_milestones", f"milestone {milestones[0]} is within the warm-up "
                f"(train.lr_warmup: {schedule.warmup} steps); milestones count steps from "
                "the run's start")
    return None
