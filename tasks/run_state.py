"""What one run keeps on one worker between tasks, for every strategy."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tasks.layout import Layout, StepOp
from tasks.moves import Mover
from tasks.receipts import TaskClock
from tasks.specs import NetworkSpec, RunPaths
from tasks.worker_state import WorkerProfile


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
    work: Any
    ops: list[StepOp]  # this worker's ops of every step, in order
    next_op: tuple[int, int] | None = None  # (step, index into ops) expected next

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
