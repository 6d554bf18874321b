"""The tasks a run submits to a worker: load its work, run steps' ops, save, release.

`init_run` loads this worker's work from a checkpoint onto its device (kernel
shards and the head, a replica, or a replica's conv layers and dense slices) and
keeps it on the worker; `run_ops` runs ops of one or more consecutive steps, in the
order the step graph gave them; `save_run` writes the worker's work into a
checkpoint; `release_run` forgets the run. Each step's receipt also reports the
most memory its process held while it ran (tasks/memory.py). What each of these
means for a strategy is in the `WorkerSide` the client hands over with the layout
(tasks/run_state.py; the project's own are in tasks/kernel_ops.py, data_ops.py and
hybrid_ops.py). A task returns only receipts; tensors never pass through Dask.
"""

from __future__ import annotations

import time

import numpy as np

from storage import checkpoints
from storage.datasets import clear_read_cache
from storage.exchange import Exchange
from storage.space import writing
from tasks.layout import Layout, StepOp, exchange_slots
from tasks.link_mounts import check_link_mounts
from tasks.memory import current_rss, read_peak, reset_peak
from tasks.moves import Mover
from tasks.receipts import Receipt, TaskClock
from tasks.run_state import RunState, WorkerSide
from tasks.specs import Arithmetic, NetworkSpec, RunPaths
from tasks.worker_state import (current_profile, drop_run, get_run, prepare_thread, put_run,
                                release_freed_memory)


def init_run(run_id: str, layout: Layout, side: WorkerSide, me: int, network: NetworkSpec,
             batch: int, paths: RunPaths, arithmetic: Arithmetic, from_step: int,
             wait_timeout: float) -> Receipt:
    """Load this worker's work from checkpoint `from_step` onto its device.

    The dataset's files are opened afresh, as by a process of its own: a worker kept
    them open from run to run, and over a network file system the rows an earlier run
    read came from its page cache, so the same point's second repeat in a sweep read
    its batches up to twice as fast (docs/benchmarks.md)."""
    clear_read_cache()
    profile = current_profile()
    receipt = Receipt("init", profile.name, from_step, time.time())
    device = profile.device
    work = side.load(layout, me, network, paths.checkpoints, from_step, arithmetic, device)
    release_freed_memory()  # what loading read and dropped, and an earlier run's pages
    slots = {slot.name: slot for slot in exchange_slots(layout, network, batch)}
    with writing("workspace", paths.workspace):
        mover = Mover(Exchange(paths.workspace), slots, device, profile.synchronize,
                      wait_timeout)
    put_run(run_id, RunState(run_id, layout, me, network, batch, paths, profile, mover, side,
                             work, layout.ops(me), augmentation=arithmetic.augmentation))
    receipt.end = time.time()
    receipt.extra = {"device": device, "threads": profile.threads, "speed": profile.speed}
    return receipt


def run_ops(run_id: str, steps: tuple[int, ...], ops: tuple[StepOp, ...],
            indices: list[np.ndarray], tasks: tuple[str, ...], deps: tuple = ()
            ) -> list[Receipt]:
    """Run `ops` of each of `steps` in turn on this worker (`indices`: each step's
    batch rows; `tasks`: each step's task name, for its receipt): one receipt per
    step. Several steps in one task pay Dask's per-task costs once
    (pipeline/engine/task_steps.py). `deps` only orders the task (Dask waits)."""
    prepare_thread()
    run: RunState = get_run(run_id)
    return [_run_step(run, step, ops, rows, task)
            for step, rows, task in zip(steps, indices, tasks, strict=True)]


def _run_step(run: RunState, step: int, ops: tuple[StepOp, ...], indices: np.ndarray,
              task: str) -> Receipt:
    """Run `ops` of `step`; its receipt, with the most memory held while they ran."""
    run.check_order(step, ops)
    check_link_mounts()  # a linked worker whose mount went would bypass its link
    receipt = Receipt(task, run.profile.name, step, time.time())
    clock = TaskClock(receipt, run.profile.synchronize)
    # No malloc_trim here: handing the last step's freed pages back made every step
    # fault them in again, 1.3x the step time of the small network (docs/benchmarks.md).
    held = current_rss()  # what the worker holds between steps
    kind = reset_peak(run.profile.device)
    with writing("workspace", run.paths.workspace):  # the ops' only writes
        for op in ops:
            run.side.ops[op.kind](run, op, step, indices, clock)
    receipt.end = time.time()
    receipt.extra["memory"] = {**read_peak(run.profile.device, kind).as_dict(), "held": held}
    return receipt


class RunEnded(RuntimeError):
    """A task of a run the client has ended (aborted or removed its workspace)."""


def save_run(run_id: str, checkpoint_path: str, step: int) -> Receipt:
    """Write this worker's work into checkpoint `step` of `checkpoint_path` (the run's
    attempt's staging area, which the client commits), unless the run has ended: a
    worker removed from the cluster while frozen may wake with this task queued. One
    woken inside its write goes on writing, but only into its ended attempt's area."""
    run: RunState = get_run(run_id)
    ended = run.mover.exchange.closed()
    if ended:
        raise RunEnded(f"run {run_id}: not saving checkpoint {step}: {ended}")
    receipt = Receipt("checkpoint", run.profile.name, step, time.time())
    with writing("checkpoint store", checkpoints.store_of(checkpoint_path)):
        run.side.save(run.work, run.me, checkpoint_path, step)
    receipt.end = time.time()
    return receipt


def release_run(run_id: str) -> bool:
    """Free a finished run's state on this worker."""
    return drop_run(run_id)
