"""Distributed training steps, for every strategy that runs on a cluster.

The client plans, the workers compute. For each step the engine builds the step's
task graph (pipeline/engine/step_graph.py) from the layout (who computes what, which slices
cross workers: the strategy's `RunPlan`) and submits it whole, several consecutive
steps in one task per worker where `train.steps_per_task` says so
(pipeline/engine/task_steps.py); the training loop keeps a few tasks in flight and
collects their receipts as they finish. No activation
or gradient ever reaches the client: tensors a worker needs again stay in its memory,
tensors another worker needs go through the run's exchange workspace
(storage/exchange.py).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from distributed import Client, Future, wait

from pipeline.cluster.workers import (ClusterError, ClusterWorker, SchedulerSilent,
                                      SchedulerWatch, abandon_client, all_local, live_workers)
from pipeline.config.run_config import RunConfig
from pipeline.cluster.object_store import workspace_url
from pipeline.placement.split import Placement
from pipeline.records.record import StepResult
from pipeline.engine.checkpointing import data_identity
from pipeline.engine.runner import TaskRunner
from pipeline.engine.stalls import StallWatch
from pipeline.engine.sampler import step_indices
from pipeline.engine.step_graph import step_tasks
from pipeline.engine.task_steps import steps_label
from storage import checkpoints
from storage.exchange import Exchange, SlotSpec, create_exchange
from storage.exchange_folders import remove_exchange, remove_root_if_empty, remove_stale_exchanges
from storage.private import default_workspace_root
from storage.space import writing
from tasks import step_task
from tasks.layout import Layout, exchange_slots
from tasks.network import checkpoint_row_chunks, checkpoint_shapes
from tasks.receipts import Receipt
from tasks.run_state import WorkerSide
from tasks.specs import Arithmetic, NetworkSpec, RunPaths


#: Seconds `StepEngine.close` gives the workspace's abort and removal after the stores
#: stopped answering (on a store this process cannot reach either, they would hang).
CLOSE_STALLED_S = 2.0
#: Seconds `StepEngine.close` waits for the workers to free the run; a scheduler that
#: stops answering meanwhile ends the wait at its limit (the runner's `SchedulerWatch`).
RELEASE_S = 10.0


def workspace_path(config: RunConfig, run_id: str, workers: list[ClusterWorker]) -> str:
    """Where this run's exchange workspace goes (always a fresh, run-named directory).

    `workspace.path` if set (it must be shared by every worker's host); else, when
    every worker shares the client's host, /dev/shm (a chunk write there cost 0.3 ms
    against 2 ms on disk); else the output directory. Workers behind `cluster.link`
    reach the client's /dev/shm folder only through their links (mounted over sftp),
    never directly, or with `cluster.link.workspace: s3` the run's object store.
    """
    if config.cluster.workspace_transport() == "s3":
        return workspace_url(run_id)
    if config.workspace.path:
        return f"{config.workspace.folder().rstrip('/')}/{run_id}.zarr"
    shm = "/dev/shm"
    linked = config.cluster.link_rates() is not None
    if (linked or all_local(workers)) and os.path.isdir(shm) and os.access(shm, os.W_OK):
        return os.path.join(default_workspace_root(), f"{run_id}.zarr")
    return os.path.join(config.output_dir, f"workspace-{run_id}.zarr")


@dataclass
class RunPlan:
    """Everything the engine needs to run a strategy's steps: its workers (in layout
    order), its layout (who computes what, which slices cross workers), how the split
    was chosen, the code its workers run, and how they compute."""

    workers: list[ClusterWorker]
    layout: Layout
    placement: Placement
    side: WorkerSide
    arithmetic: Arithmetic


class StepEngine:
    """Runs the steps of one strategy's plan on Dask workers."""

    def __init__(self, client: Client, config: RunConfig, network: NetworkSpec, plan: RunPlan,
                 train_samples: int) -> None:
        self.config = config
        self.network = network
        self.plan = plan
        self.workers: list[ClusterWorker] = plan.workers
        self.layout = plan.layout
        self.train_samples = train_samples
        self.run_id = f"{config.name}-{uuid.uuid4().hex[:8]}"
        self.paths = RunPaths(config.dataset_path,
                              workspace_path(config, self.run_id, self.workers),
                              config.checkpoint_path, data_identity(config.checkpoint_path))
        self.exchange = Exchange(self.paths.workspace)
        self.slots = exchange_slots(self.layout, network, config.train.batch)
        self.watch = StallWatch(config.cluster.stall_timeout)
        self.runner = TaskRunner(client, self.workers, self.run_id,
                                 on_failure=self.exchange.abort, watch=self.watch,
                                 stores=[self.paths.workspace, self.paths.checkpoints,
                                         self.paths.dataset],
                                 scheduler_watch=SchedulerWatch(
                                     config.cluster.scheduler_timeout,
                                     getattr(client.scheduler, "address", "?")))
        self.devices: list[str] = ["cpu"] * len(self.workers)
        self.first_step = 0
        self._submitted: dict[int, tuple[int, list[Future]]] = {}  # first step: (count, tasks)
        self._by_name: dict[str, Future] = {}
        self._last_collect = time.perf_counter()  # a step's time, for the stall watch

    def start(self, from_step: int) -> None:
        """Create the workspace and load every worker's work from checkpoint `from_step`.

        Workspaces that killed runs left beside it go first (`remove_stale_exchanges`).
        """
        for line in remove_stale_exchanges(os.path.dirname(self.paths.workspace)):
            print(line, file=sys.stderr)
        with writing("workspace", self.paths.workspace):
            create_exchange(self.paths.workspace,
                            [SlotSpec(s.name, s.shape, self.network.dtype) for s in self.slots])
        futures = [
            self.runner.submit(step_task.init_run, worker, self.run_id, self.layout,
                               self.plan.side, worker, self.network,
                               self.config.train.batch, self.paths, self.plan.arithmetic,
                               from_step, self.config.workspace.wait_timeout,
                               name=f"init-w{worker}")
            for worker in range(len(self.workers))
        ]
        receipts = self.runner.gather(futures, "loading the shards")
        self.devices = [r.extra["device"] for r in receipts]
        self.first_step = from_step
        self._last_collect = time.perf_counter()

    def submit(self, first: int, count: int = 1) -> None:
        """Submit steps `first` .. `first + count - 1`; returns at once. With the
        default markers each worker gets one task running them all in turn
        (pipeline/engine/task_steps.py); with `workspace.sync: scheduler`, `count` must be 1
        (its tasks wait for each other through the scheduler, step by step)."""
        train, sync = self.config.train, self.config.workspace.sync
        if count > 1 and sync != "markers":
            raise ValueError(f"several steps per task need workspace.sync: markers, not {sync}")
        steps = list(range(first, first + count))
        indices = [step_indices(train.seed, s, train.batch, self.train_samples) for s in steps]
        per_step = [step_tasks(self.layout, self.slots, s, sync, self.first_step) for s in steps]
        futures = []
        for position, task in enumerate(per_step[0]):
            same = [tasks[position] for tasks in per_step]  # this task in every step
            name = task.name if count == 1 else f"steps-{first}-{steps[-1]}-w{task.worker}"
            deps = [self._by_name[dep] for dep in task.deps]
            future = self.runner.submit(step_task.run_ops, task.worker, self.run_id,
                                        tuple(steps), task.ops, indices,
                                        tuple(t.name for t in same), deps=deps, name=name,
                                        priority=task.priority,
                                        doing=f"{steps_label(first, count)} "
                                              f"({' '.join(map(str, task.ops))})")
            self._by_name[task.name] = future
            futures.append(future)
        self._submitted[first] = (count, futures)

    def collect(self, first: int) -> list[StepResult]:
        """Wait for the steps submitted from step `first`; each one's loss and receipts."""
        count, futures = self._submitted.pop(first)
        last = first + count - 1
        per_task: list[list[Receipt]] = self.runner.gather(futures, steps_label(first, count))
        now = time.perf_counter()
        self.watch.task_took(now - self._last_collect)
        self._last_collect = now
        # a step's tasks may be the next step's dependencies; older ones are done with
        self._by_name = {name: f for name, f in self._by_name.items()
                         if int(name.split("-")[1]) >= last}
        return [self._result(step, [receipts[i] for receipts in per_task])
                for i, step in enumerate(range(first, last + 1))]

    def _result(self, step: int, receipts: list[Receipt]) -> StepResult:
        """Step `step`'s result from its tasks' receipts (replicas checked alike)."""
        digests = {r.extra["replica_digest"] for r in receipts if "replica_digest" in r.extra}
        if len(digests) > 1:
            raise ClusterError(f"step {step}: the replicas' weights differ")
        # the master's loss, or each replica's part of the batch's loss
        return StepResult(step, sum(r.loss for r in receipts if r.loss is not None), receipts,
                          self.plan.arithmetic.optimizer.lr_at(step))

    def checkpoint(self, done_steps: int) -> str:
        """Save every worker's work as checkpoint `done_steps` (no step may be in flight)
        into this attempt's staging area; returns the attempt (this engine's run id),
        whose checkpoint `mark_complete` then commits. A worker of an engine that
        ended can write only there (storage/checkpoints.py, fencing)."""
        assert not self._submitted, "checkpoint with steps in flight"
        chunks = self.layout.checkpoint_chunks(
            self.network,
            checkpoint_row_chunks(self.network, self.config.channel_quanta(self.network)))
        staged = checkpoints.stage_checkpoint(self.paths.checkpoints, self.run_id, done_steps,
                                              checkpoint_shapes(self.network), chunks,
                                              self.network.dtype)
        futures = [self.runner.submit(step_task.save_run, worker, self.run_id, staged,
                                      done_steps, name=f"save-{done_steps}-w{worker}")
                   for worker in range(len(self.workers))]
        self.runner.gather(futures, "checkpoint")
        self._last_collect = time.perf_counter()  # the save is no step's time
        return self.run_id

    def show_waits(self, note: Callable[[str], None]) -> None:
        """Have `note` hear what the run waits on when it waits long
        (`pipeline.engine.stalls.waiting_note`): the progress bar."""
        self.runner.on_wait = note

    def _remove_workspace(self) -> None:
        """Remove the workspace, and the default root in /dev/shm if that leaves it
        empty (never a `workspace.path` folder: the user's)."""
        remove_exchange(self.paths.workspace)
        root = os.path.dirname(self.paths.workspace)
        if root == default_workspace_root():
            remove_root_if_empty(root)

    def close(self) -> None:
        """Stop any waiting task, free the run's state on every worker, drop the workspace
        and this attempt's checkpoint staging area (nothing there was committed).

        Also after a failure: the steps still queued are cancelled, and only workers
        still in the cluster are asked to free the run (a lost one would make the
        release wait out its time limit). After the stores stopped answering, no
        worker is asked (their task threads wait on the store) and this process
        touches the workspace only from a thread it does not wait for long.
        """
        stalled = bool(self.runner.stalled_stores)
        if not stalled:
            try:
                self.exchange.abort("the run is closing")
            except OSError:  # a full disk: the workspace's removal below tells its readers
                pass
        pending = [f for _count, futures in self._submitted.values() for f in futures]
        self._submitted, self._by_name = {}, {}
        try:
            client = self.runner.client
            if pending:
                client.cancel(pending)
            watch = self.runner.scheduler_watch
            try:  # a scheduler silent past its limit: its connection would hold what follows
                alive = {} if stalled else live_workers(client, patience=2.0, watch=watch)
                futures = [self.runner.submit(step_task.release_run, worker, self.run_id,
                                              name=f"release-w{worker}")
                           for worker, member in enumerate(self.workers)
                           if member.address in alive]
                deadline = time.monotonic() + RELEASE_S
                while futures and time.monotonic() < deadline:
                    with client.as_current():
                        wait(futures, timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                    if all(f.done() for f in futures):
                        break
                    if watch is not None:  # stopped meanwhile: given up at its limit
                        live_workers(client, patience=2.0, watch=watch)
            except SchedulerSilent:
                abandon_client(client)
                raise
        except Exception:  # noqa: BLE001 - the cluster may already be gone
            pass
        if not stalled:
            self._remove_workspace()
            checkpoints.end_attempt(self.paths.checkpoints, self.run_id)
            return

        def abort_and_remove() -> None:  # in this order: an abort makes the folder again
            try:
                self.exchange.abort("the run is closing")
                self._remove_workspace()
                checkpoints.end_attempt(self.paths.checkpoints, self.run_id)
            except Exception:  # noqa: BLE001 - best effort on a store that failed
                pass

        thread = threading.Thread(target=abort_and_remove, daemon=True, name="close-workspace")
        thread.start()
        thread.join(CLOSE_STALLED_S)
