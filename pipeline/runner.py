"""The one place that submits a run's tasks and collects their results.

Every task of a run is pinned to its worker (``workers=[address]``, the worker's
resource tag, ``allow_other_workers=False``): shard state lives there. Waiting is
bounded and watched: a task that fails, or a worker that leaves, stops the run at
once with a message naming it (and `on_failure` tells the other workers, which may
be waiting for the lost one's data, to give up).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from distributed import Client, Future, wait

from pipeline.cluster import ClusterError, WorkerSlot


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


class TaskRunner:
    """Submits pinned tasks for one run and gathers them, failing fast."""

    def __init__(self, client: Client, workers: Sequence[WorkerSlot], run_id: str,
                 on_failure: Callable[[str], None] = lambda reason: None) -> None:
        self.client = client
        self.workers = list(workers)
        self.run_id = run_id
        self.on_failure = on_failure

    def submit(self, function: Callable[..., Any], worker: int, *args: Any, name: str,
               priority: int = 0, **kwargs: Any) -> Future:
        """Run `function(*args, **kwargs)` on worker number `worker` of the run."""
        slot = self.workers[worker]
        return self.client.submit(function, *args, workers=[slot.address],
                                  resources={slot.resource: 1}, allow_other_workers=False,
                                  pure=False, key=f"{name}-{self.run_id}", priority=priority,
                                  **kwargs)

    def gather(self, futures: list[Future], what: str) -> list[Any]:
        """Wait for `futures`; a failed task or a lost worker raises ClusterError.

        Results are fetched with a time limit too: a result held by a worker that
        died after finishing would otherwise be waited for forever (the task is
        pinned to that worker, so Dask cannot recompute it elsewhere).
        """
        while True:
            try:
                with self.client.as_current():
                    wait(futures, timeout=2.0)
            except TimeoutError:
                pass
            errored = [f for f in futures if f.status == "error"]
            if errored:
                error = errored[0].exception()
                self._fail(f"{what}: a task failed: {type(error).__name__}: {error}")
            if all(f.done() for f in futures):
                try:
                    return self.client.sync(self.client._gather, futures, callback_timeout=10)
                except TimeoutError:
                    pass  # a holder of some result is gone: the check below names it
            gone = self.lost_workers()
            if gone:
                self._fail(f"{what}: worker {', '.join(gone)} left the cluster; its shards are "
                           "lost. Start the run again with train.resume=true to continue from "
                           "the last checkpoint")

    def lost_workers(self) -> list[str]:
        """Labels of the run's workers the scheduler no longer knows."""
        try:
            alive = set(self.client.scheduler_info(n_workers=-1)["workers"])
        except (OSError, TimeoutError) as error:
            self._fail(f"lost the Dask scheduler ({type(error).__name__})")
        return [slot.label for slot in self.workers if slot.address not in alive]

    def _fail(self, reason: str) -> None:
        try:
            self.on_failure(reason)
        finally:
            raise ClusterError(reason)
