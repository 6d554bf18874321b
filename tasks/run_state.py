"""What one run keeps on one worker between tasks, and what a strategy runs there.

Every strategy has one `WorkerSide`, a module-level value next to its ops (for
example `tasks.kernel_ops.KERNEL_SIDE`): how to load its work (its share of a run), its ops by
kind, and how to save its work. The client hands it to the worker with the layout
when a run starts (`tasks.step_task.init_run`); from then on the worker's tasks ask
it, never which strategy they serve. A strategy defined outside the project brings
its own `WorkerSide` the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from tasks.augment import Augmentation
from tasks.layout import Layout, StepOp
from tasks.moves import Mover
from tasks.receipts import TaskClock
from tasks.specs import Arithmetic, NetworkSpec, RunPaths
from tasks.worker_state import WorkerProfile


#: ``load(layout, me, network, checkpoint_path, step, arithmetic, device) -> work``:
#: this worker's work (its shards, replica, dense slices), from a checkpoint.
LoadFunction = Callable[[Layout, int, NetworkSpec, str, int, Arithmetic, str], Any]

#: ``save(work, me, checkpoint_path, step)``: write this worker's work into a checkpoint.
SaveFunction = Callable[[Any, int, str, int], None]


@dataclass(frozen=True)
class WorkerSide:
    """A strategy's worker code: `load` and `save` its work, and its ops by kind.

    An op is ``op(run, op, step, sample_indices, clock)``: it reads its inputs (own
    tensors from ``run.work``, others' through ``run.mover``) and writes its outputs.
    """

    load: LoadFunction
    save: SaveFunction
    ops: Mapping[str, Callable[["RunState", StepOp, int, np.ndarray, TaskClock], None]]


@dataclass
class RunState:
    """One run as one worker holds it: who it is in the layout, how it moves tensors,
    and `work`, the strategy's own state (shards, replica, dense slices, kept tensors)."""

    run_id: str
    layout: Layout
    me: int
    network: NetworkSpec
    batch: int
    paths: RunPaths
    profile: WorkerProfile
    mover: Mover
    side: WorkerSide
    work: Any
    ops: list[StepOp]  # this worker's ops of every step, in order
    next_op: tuple[int, int] | None = None  # (step, index into ops) expected next
    augmentation: Augmentation = Augmentation()  # of the training images this run reads

    def check_order(self, step: int, ops: tuple[StepOp, ...]) -> None:
        """Ops must arrive exactly in step-graph order (tasks are queued by priority)."""
        expected_step, index = self.next_op or (step, 0)
        expected = self.ops[index:index + len(ops)]
        if step != expected_step or list(ops) != expected:
            raise RuntimeError(
                f"run {self.run_id}: worker got {[str(o) for o in ops]} of step {step}, "
                f"expected {[str(o) for o in expected]} of step {expected_step}: tasks ran "
                "out of order")
        index += len(ops)
        self.next_op = (step + 1, 0) if index == len(self.ops) else (step, index)

    def emulate(self, clock: TaskClock, compute_s: float) -> None:
        """On an emulated slow device, sleep so the compute appears `speed` times as fast."""
        if self.profile.emulated:
            start = time.time()
            self.profile.emulate(compute_s)
            clock.add("emulated", start, time.time())
