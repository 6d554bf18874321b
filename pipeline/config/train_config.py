"""The `train` section of a run config: SGD, its learning-rate schedule, steps,
checkpoints and tasks.

The schedule's fields mirror torch.optim.lr_scheduler's (`LinearLR`'s
`start_factor`, `MultiStepLR`'s `milestones` and `gamma`, `CosineAnnealingLR`),
so that a run's rates are what a plain PyTorch user's schedulers give, and its
arithmetic stays single-process SGD's (tasks/lr_schedule.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipeline.config.schema import FieldError, check_range, described
from tasks.lr_schedule import TORCH_WARMUP_FACTOR, LrSchedule, schedule_problem


@dataclass
class TrainConfig:
    """SGD and its learning-rate schedule, the run's steps, checkpoints and tasks."""

    steps: int = described(20, "SGD steps of the run (warm-up steps included), at most "
                           "10^9 (years of 0.1 s steps)")
    batch: int = described(64, "the mini-batch: samples a step, over all workers (at least "
                           "2 where a batch norm sees 1x1 features, docs/networks.md)")
    lr: float = described(0.05, "the learning rate (> 0): the base rate, which `lr_warmup` "
                          "and `lr_decay` move step by step")
    momentum: float = described(0.9, "SGD momentum, in [0, 1)")
    weight_decay: float = described(5e-4, "L2 weight decay (>= 0)")
    nesterov: bool = described(False, "Nesterov momentum (needs momentum > 0)")
    lr_decay: Literal["none", "step", "cosine"] = described(
        "none", "the learning rate's decay after the warm-up (docs/training.md): `none`, "
        "constant; `step`, times `lr_gamma` at each of `lr_milestones` (torch's "
        "MultiStepLR); `cosine`, from `lr` down to 0 at step `steps`, just after the last (torch's "
        "CosineAnnealingLR, T_max the steps after the warm-up, eta_min 0)")
    lr_milestones: list[int] = described(
        factory=list, doc="`lr_decay: step`: the steps at which the rate is multiplied by "
        "`lr_gamma`, increasing, counted from the run's start (not from the warm-up's end), "
        "each after the warm-up")
    lr_gamma: float = described(0.1, "`lr_decay: step`: the factor at each milestone, in "
                                "(0, 1] (torch's MultiStepLR default)")
    lr_warmup: int = described(
        0, "steps of linear warm-up before the decay, from `lr_warmup_factor` x `lr` up to "
        "`lr` (torch's LinearLR; 0: none). Not `warmup_steps`, which is about timing")
    lr_warmup_factor: float = described(
        TORCH_WARMUP_FACTOR, "the warm-up's first rate over `lr`, in (0, 1] (torch's LinearLR "
        "start_factor, whose default 1/3 it keeps)")
    seed: int = described(0, "the seed of the initial weights and of each step's samples, "
                          "0 to 2^64 - 1 (torch's generators take no more)")
    warmup_steps: int = described(1, "first steps left out of the timing summary")
    checkpoint_every: int = described(0, "steps between checkpoints (0: only step 0 and the "
                                      "last step)")
    eval_samples: int = described(1000, "test images scored at the end (0: skip)")
    resume: bool = described(False, "continue from the output directory's last complete "
                             "checkpoint")
    fresh: bool = described(
        False, "replace an earlier run's results in the output directory (checkpoints, "
        "record, summary; `--fresh`); without it (or `resume`) a run refuses a directory "
        "that has them")
    steps_per_task: int | Literal["auto"] = described(
        "auto", "consecutive steps one Dask task runs on a worker "
        "(pipeline/engine/task_steps.py), so that Dask's per-task costs are paid once per "
        "task: `auto`, tasks of about a second (one step until a step is measured, at most "
        "32); 1: a task per step. The arithmetic is the same whatever it is; above 1 needs "
        "`workspace.sync: markers`")
    inflight: int = described(
        2, "tasks submitted ahead of the one being collected: the workers find their next "
        "task queued when they finish one (1: submit each task when the last is done)")
    check_replicas: bool = described(
        False, "`data`/`hybrid`: every replica reports a fingerprint of its weights each "
        "step, and the run stops if two differ (costs a hash of the weights per step)")
    batch_norm: Literal["sync", "local"] = described(
        "sync", "`data`/`hybrid`: batch norm's statistics over the whole batch (`sync`: "
        "every replica's rows, the arithmetic of single-process SGD, two small exchanges "
        "per batch-norm layer and step; needs `workspace.sync: markers`) or over each "
        "replica's own rows (`local`: DDP's default; the replicas' running statistics "
        "differ, and the checkpoint keeps the first worker's; where a batch norm's input is 1x1 each "
        "replica gets no samples or at least 2, docs/networks.md). On a CPU `sync`'s batch "
        "norms compute about 1.3x `local`'s (`python -m benchmarks.sync_batch_norm`)")
    max_recoveries: int = described(
        3, "lost workers survived per run: restore the last complete checkpoint, re-place "
        "the lost share on the survivors and replay (0: stop at the first loss)")

    #: The most steps a run takes: more is no run anyone waits for (a run's record and
    #: progress are step by step), and a mistyped huge count is refused at once.
    MAX_STEPS = 10**9
    #: The largest seed: torch's `manual_seed` takes an unsigned 64-bit integer.
    MAX_SEED = 2**64 - 1

    def __post_init__(self) -> None:
        check_range(self, "steps", low=1, high=self.MAX_STEPS)
        for name in ("batch", "inflight"):
            check_range(self, name, low=1)
        if self.steps_per_task != "auto":
            check_range(self, "steps_per_task", low=1)
        for name in ("checkpoint_every", "warmup_steps", "eval_samples", "weight_decay",
                     "max_recoveries"):
            check_range(self, name, low=0)
        check_range(self, "seed", low=0, high=self.MAX_SEED)
        check_range(self, "lr", low=0, low_open=True)
        check_range(self, "momentum", low=0, high=1, high_open=True)
        check_range(self, "lr_gamma", low=0, high=1, low_open=True)
        check_range(self, "lr_warmup", low=0)
        check_range(self, "lr_warmup_factor", low=0, high=1, low_open=True)
        problem = schedule_problem(self.lr_schedule())
        if problem:
            raise FieldError(*problem)
        if self.nesterov and self.momentum == 0:
            raise FieldError("nesterov", "Nesterov momentum needs train.momentum > 0")
        if self.fresh and self.resume:
            raise FieldError("fresh", "true discards the results that train.resume: true "
                             "continues from; set one of them")

    def lr_schedule(self) -> LrSchedule:
        """The learning rate's schedule over the run's steps (tasks/lr_schedule.py)."""
        return LrSchedule(self.lr_decay, tuple(self.lr_milestones), self.lr_gamma,
                          self.lr_warmup, self.lr_warmup_factor, self.steps)
