"""The one place that submits a run's tasks and collects their results.

Every task of a run is pinned to its worker (``workers=[address]``, the worker's
resource tag, ``allow_other_workers=False``): shard state lives there. Waiting is
bounded and watched: a task that fails, or a worker that leaves, stops the run at
once with a message naming it (and `on_failure` tells the other workers, which may
be waiting for the lost one's data, to give up). A worker that stops answering
while the run waits on it (SIGSTOP, a frozen host) is a stall: after the run made no
progress for the `StallWatch`'s limit, the workers holding its unfinished tasks are
probed, and one that does not answer is fenced off (removed from the cluster) and
reported as lost, so the run recovers as from a dead worker.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from concurrent.futures import CancelledError
from typing import Any, Callable, Literal, NoReturn, Sequence

from distributed import Client, Future, wait

from pipeline.cluster import (ClusterError, ClusterWorker, SchedulerLost, WorkerLost,
                              fence_workers, live_workers, unresponsive)
from storage.space import NoSpace

#: `cluster.stall_timeout: auto`: the limit is this many median steps, at least
#: STALL_FLOOR_S; before any step is measured (loading the shards, the first step),
#: FIRST_STALL_S.
STALL_STEPS, STALL_FLOOR_S, FIRST_STALL_S = 10.0, 30.0, 120.0
#: Seconds a probed worker has to answer before it counts as stalled (at most the
#: limit itself).
PROBE_S = 5.0


class _DropAbandonedGather(logging.Filter):
    """Hide the noise of a result fetch `gather` gave up on.

    When a worker dies holding a finished result, the time limit on fetching it
    cancels Dask's fetch, and asyncio later logs the fetch's internal `AllExit`
    with a traceback. The run reports the lost worker itself, in one line.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exception = record.exc_info[1] if record.exc_info else None
        return type(exception).__name__ != "AllExit"


logging.getLogger("asyncio").addFilter(_DropAbandonedGather())


class _DropCancelledReconnect(logging.Filter):
    """Hide what Dask's client logs when it gives up on a lost scheduler (the
    traceback of its cancelled reconnect task, or "Failed to reconnect to scheduler
    after 10 seconds" when the wait runs out first): the run says it lost the
    scheduler itself, in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exception = record.exc_info[1] if record.exc_info else None
        if isinstance(exception, asyncio.CancelledError):
            return False
        return not record.getMessage().startswith("Failed to reconnect to scheduler")


logging.getLogger("distributed.client").addFilter(_DropCancelledReconnect())


class StallWatch:
    """How long a run may go without progress before its busy workers are probed.

    A fixed number of seconds, None (never), or "auto": `STALL_STEPS` times the median
    of the last 101 measured steps, at least `STALL_FLOOR_S` (a step's time varies
    with the machine's load; a stall is a worker gone silent, not a slow step).
    """

    def __init__(self, setting: float | None | Literal["auto"]) -> None:
        self.setting = setting
        self.steps: deque[float] = deque(maxlen=101)

    def step_took(self, seconds: float) -> None:
        self.steps.append(seconds)

    def limit(self) -> float | None:
        if self.setting != "auto":
            return None if self.setting is None else float(self.setting)
        if not self.steps:
            return FIRST_STALL_S
        return max(STALL_FLOOR_S, STALL_STEPS * statistics.median(self.steps))


class TaskRunner:
    """Submits pinned tasks for one run and gathers them, failing fast."""

    def __init__(self, client: Client, workers: Sequence[ClusterWorker], run_id: str,
                 on_failure: Callable[[str], None] = lambda reason: None,
                 watch: StallWatch | None = None) -> None:
        self.client = client
        self.workers = list(workers)
        self.run_id = run_id
        self.on_failure = on_failure
        self.watch = watch or StallWatch(None)
        self._doing: dict[str, tuple[int, str]] = {}  # key -> (worker, what it does)

    def submit(self, function: Callable[..., Any], worker: int, *args: Any, name: str,
               priority: int = 0, doing: str = "", **kwargs: Any) -> Future:
        """Run `function(*args, **kwargs)` on worker number `worker` of the run;
        `doing` names its work in a stall report (default: the task's name)."""
        member = self.workers[worker]
        key = f"{name}-{self.run_id}"
        self._doing[key] = (worker, doing or name)
        return self.client.submit(function, *args, workers=[member.address],
                                  resources={member.resource: 1}, allow_other_workers=False,
                                  pure=False, key=key, priority=priority, **kwargs)

    def gather(self, futures: list[Future], what: str) -> list[Any]:
        """Wait for `futures`; a failed task or a lost worker raises ClusterError.

        A lost worker raises `WorkerLost` (which a run can recover from), also when
        a peer's task failed first because of it; a lost scheduler `SchedulerLost`
        (Dask then cancels every future). Results are fetched with a time limit
        too: a result held by a worker that died after finishing would otherwise be
        waited for forever (the task is pinned to that worker, so Dask cannot
        recompute it elsewhere). A stall (`StallWatch`) raises `WorkerLost` too.
        """
        progress_at, done_before = time.monotonic(), 0
        while True:
            try:
                with self.client.as_current():
                    wait(futures, timeout=2.0)
            except TimeoutError:
                pass
            except CancelledError:
                self._scheduler_lost(what)
            done = sum(f.done() for f in futures)
            if done > done_before:  # progress, counted before a fetch that may hang
                progress_at, done_before = time.monotonic(), done
            errored = [f for f in futures if f.status == "error"]
            if errored:
                self._check_workers(what)
                error = errored[0].exception()
                if isinstance(error, NoSpace):  # the disk, not the cluster: said as it is
                    self._fail(error)
                self._fail(ClusterError(f"{what}: a task failed: {type(error).__name__}: "
                                        f"{error}"))
            if any(f.cancelled() for f in futures):
                self._scheduler_lost(what)
            if all(f.done() for f in futures):
                try:
                    results = self.client.sync(self.client._gather, futures,
                                               callback_timeout=self._fetch_s())
                except OSError:  # TimeoutError, or CommClosedError ("Stream is closed"):
                    pass  # the holder of a result, or the scheduler, is gone: the check
                    # below names which (a lost scheduler was once a bare comm error here)
                except CancelledError:
                    self._scheduler_lost(what)
                else:
                    for future in futures:
                        self._doing.pop(future.key, None)
                    return results
            self._check_workers(what)
            self._check_stall(futures, what, time.monotonic() - progress_at)

    def lost_workers(self) -> list[ClusterWorker]:
        """The run's workers the scheduler no longer knows."""
        try:
            alive = live_workers(self.client)
        except SchedulerLost:
            self._scheduler_lost("asking for the workers")
        return [worker for worker in self.workers if worker.address not in alive]

    def _check_workers(self, what: str) -> None:
        gone = self.lost_workers()
        if gone:
            labels = [worker.label for worker in gone]
            self._fail(WorkerLost(f"{what}: worker {', '.join(labels)} left the cluster; "
                                  "its work in the run is lost",
                                  [worker.address for worker in gone], labels))

    def _fetch_s(self) -> float:
        """How long to wait for finished results: 10 s, or the stall limit if shorter
        (a result held by a stopped worker is what a stall probe then finds)."""
        limit = self.watch.limit()
        return 10.0 if limit is None else min(10.0, limit)

    def _check_stall(self, futures: list[Future], what: str, quiet_s: float) -> None:
        """After `quiet_s` seconds without a task finishing, past the watch's limit:
        probe the workers holding unfinished tasks; those that do not answer are
        fenced off and raised as lost (`WorkerLost`, `stalled`)."""
        limit = self.watch.limit()
        if limit is None or quiet_s < limit:
            return
        holding: dict[str, list[str]] = {}
        # unfinished tasks, or, when all finished, the holders of results not fetched
        for future in [f for f in futures if not f.done()] or futures:
            if future.key in self._doing:
                worker, doing = self._doing[future.key]
                holding.setdefault(self.workers[worker].address, []).append(doing)
        patience = min(PROBE_S, limit)
        silent = unresponsive(self.client, list(holding), patience)
        if not silent:
            return  # busy, or waiting for data (workspace.wait_timeout ends that)
        try:
            fence_workers(self.client, silent)
        except (OSError, CancelledError):  # the scheduler went too
            self._scheduler_lost(what)
        labels = [w.label for w in self.workers if w.address in silent]
        tasks = "; ".join(", ".join(holding[address]) for address in silent)
        self._fail(WorkerLost(
            f"{what}: worker {', '.join(labels)} stalled: no task of the run finished for "
            f"{quiet_s:.0f} s (cluster.stall_timeout: {limit:g} s) while it held {tasks}, and "
            f"it did not answer for {patience:g} s; removed from the cluster and treated as "
            "lost", silent, labels, stalled=True))

    def _scheduler_lost(self, what: str) -> None:
        address = getattr(self.client.scheduler, "address", None) or "?"
        self._fail(SchedulerLost(f"{what}: lost the Dask scheduler at {address}; the run "
                                 "stopped (its checkpoints are kept)"))

    def _fail(self, error: ClusterError | NoSpace) -> NoReturn:
        try:
            self.on_failure(str(error))
        except Exception:  # noqa: BLE001 - the workspace may be unreachable too
            pass
        raise error
