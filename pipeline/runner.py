"""The one place that submits a run's tasks and collects their results.

Every task of a run is pinned to its worker (``workers=[address]``, the worker's
resource tag, ``allow_other_workers=False``): shard state lives there. Waiting is
bounded and watched: a task that fails, or a worker that leaves, stops the run at
once with a message naming it (and `on_failure` tells the other workers, which may
be waiting for the lost one's data, to give up).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import CancelledError
from typing import Any, Callable, Sequence

from distributed import Client, Future, wait

from pipeline.cluster import (ClusterError, ClusterWorker, SchedulerLost, WorkerLost,
                              live_workers)


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


class TaskRunner:
    """Submits pinned tasks for one run and gathers them, failing fast."""

    def __init__(self, client: Client, workers: Sequence[ClusterWorker], run_id: str,
                 on_failure: Callable[[str], None] = lambda reason: None) -> None:
        self.client = client
        self.workers = list(workers)
        self.run_id = run_id
        self.on_failure = on_failure

    def submit(self, function: Callable[..., Any], worker: int, *args: Any, name: str,
               priority: int = 0, **kwargs: Any) -> Future:
        """Run `function(*args, **kwargs)` on worker number `worker` of the run."""
        member = self.workers[worker]
        return self.client.submit(function, *args, workers=[member.address],
                                  resources={member.resource: 1}, allow_other_workers=False,
                                  pure=False, key=f"{name}-{self.run_id}", priority=priority,
                                  **kwargs)

    def gather(self, futures: list[Future], what: str) -> list[Any]:
        """Wait for `futures`; a failed task or a lost worker raises ClusterError.

        A lost worker raises `WorkerLost` (which a run can recover from), also when
        a peer's task failed first because of it; a lost scheduler `SchedulerLost`
        (Dask then cancels every future). Results are fetched with a time limit
        too: a result held by a worker that died after finishing would otherwise be
        waited for forever (the task is pinned to that worker, so Dask cannot
        recompute it elsewhere).
        """
        while True:
            try:
                with self.client.as_current():
                    wait(futures, timeout=2.0)
            except TimeoutError:
                pass
            except CancelledError:
                self._scheduler_lost(what)
            errored = [f for f in futures if f.status == "error"]
            if errored:
                self._check_workers(what)
                error = errored[0].exception()
                self._fail(ClusterError(f"{what}: a task failed: {type(error).__name__}: "
                                        f"{error}"))
            if any(f.cancelled() for f in futures):
                self._scheduler_lost(what)
            if all(f.done() for f in futures):
                try:
                    return self.client.sync(self.client._gather, futures, callback_timeout=10)
                except OSError:  # TimeoutError, or CommClosedError ("Stream is closed"):
                    pass  # the holder of a result, or the scheduler, is gone: the check
                    # below names which (a lost scheduler was once a bare comm error here)
                except CancelledError:
                    self._scheduler_lost(what)
            self._check_workers(what)

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

    def _scheduler_lost(self, what: str) -> None:
        address = getattr(self.client.scheduler, "address", None) or "?"
        self._fail(SchedulerLost(f"{what}: lost the Dask scheduler at {address}; the run "
                                 "stopped (its checkpoints are kept)"))

    def _fail(self, error: ClusterError) -> None:
        try:
            self.on_failure(str(error))
        except Exception:  # noqa: BLE001 - the workspace may be unreachable too
            pass
        raise error
