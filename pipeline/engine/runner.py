"""The one place that submits a run's tasks and collects their results.

Every task of a run is pinned to its worker (``workers=[address]``, the worker's
resource tag, ``allow_other_workers=False``): shard state lives there. Waiting is
bounded and watched: a task that fails, or a worker that leaves, stops the run at
once with a message naming it (and `on_failure` tells the other workers, which may
be waiting for the lost one's data, to give up). A run that makes no progress for
its `StallWatch`'s limit has stalled: the workers holding its unfinished tasks are
asked whether they answer, and pipeline/engine/stalls.py judges on whom or what
(a worker fenced off and reported lost, or stores that stopped answering).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import CancelledError
from typing import Any, Callable, NoReturn, Sequence

from distributed import Client, Future, wait

from pipeline.cluster.workers import (ClusterError, ClusterWorker, SchedulerLost,
                                      SchedulerSilent, SchedulerWatch, WorkerLost,
                                      abandon_client, fence_workers, live_workers,
                                      unresponsive)
from pipeline.cluster.job_ends import lost_at_walltime
from pipeline.cluster.worker_limits import lost_for_memory
from pipeline.engine.stalls import (PROBE_S, StallWatch, StoreStalled, stall_verdict,
                                    store_names, stores_silent_on, waiting_note)
from storage.datasets.store import DatasetChanged
from storage.space import NoSpace

#: Seconds between questions whether a worker left, while finished results are fetched.
FETCH_ASK_S = 1.0


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
                 on_failure: Callable[[str], None] = lambda reason: None,
                 watch: StallWatch | None = None, stores: Sequence[str] = (),
                 on_wait: Callable[[str], None] = lambda note: None,
                 scheduler_watch: SchedulerWatch | None = None) -> None:
        self.client = client
        self.workers = list(workers)
        self.run_id = run_id
        self.on_failure = on_failure
        self.watch = watch or StallWatch("auto")  # a probe's tasks: lost if frozen
        self.stores = list(stores)  # what a stall probe asks the workers to list
        self.stalled_stores: list[str] = []  # set when the run stopped on StoreStalled
        self._store_silence: dict[str, list[str]] = {}  # this stall's last store probe
        self._doing: dict[str, tuple[int, str]] = {}  # key -> (worker, what it does)
        self.on_wait = on_wait  # hears `waiting_note`s (the progress bar)
        self._last_seen: dict[str, dict] = {}  # the scheduler's table, by address
        self.scheduler_watch = scheduler_watch  # None: ask without a limit

    def submit(self, function: Callable[..., Any], worker: int, *args: Any, name: str,
               priority: int = 0, doing: str = "", **kwargs: Any) -> Future:
        """Run `function(*args, **kwargs)` on worker number `worker` of the run;
        `doing` names its work in a stall report (default: the task's name). The task
        asks for all the worker offers of its tag (`ClusterWorker.amount`), so that a
        worker offering two units (or half of one) runs one task of the run at a time,
        in the step graph's order, as one offering one unit does."""
        member = self.workers[worker]
        key = f"{name}-{self.run_id}"
        self._doing[key] = (worker, doing or name)
        return self.client.submit(function, *args, workers=[member.address],
                                  resources={member.resource: member.amount},
                                  allow_other_workers=False,
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
        if not self._last_seen:  # once: each worker's memory limit, should it be lost
            self.lost_workers()
        while True:
            try:
                with self.client.as_current():
                    wait(futures, timeout=self.watch.wait_s(time.monotonic() - progress_at))
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
                if isinstance(error, (NoSpace, DatasetChanged)):  # the disk or the data,
                    self._fail(error)  # not the cluster: said as it is
                self._fail(ClusterError(f"{what}: a task failed: {type(error).__name__}: "
                                        f"{error}"))
            if any(f.cancelled() for f in futures):
                self._scheduler_lost(what)
            if all(f.done() for f in futures):
                results = self._fetch(futures, what)
                if results is not None:
                    for future in futures:
                        self._doing.pop(future.key, None)
                    return results
            self._check_workers(what)
            quiet = time.monotonic() - progress_at
            note = waiting_note(quiet, self.watch.limit(), self._held(futures, labels=True))
            if note:
                self.on_wait(note)
            self._check_stall(futures, what, quiet)

    def lost_workers(self, what: str = "asking for the workers") -> list[ClusterWorker]:
        """The run's workers the scheduler no longer knows (and, of those it knows,
        the scheduler's last word kept: their memory, should they go)."""
        try:
            alive = live_workers(self.client, watch=self.scheduler_watch)
        except SchedulerSilent as silent:
            self._scheduler_lost(what, silent)
        except SchedulerLost:
            self._scheduler_lost(what)
        self._last_seen.update({a: info for a, info in alive.items()
                                if a in {w.address for w in self.workers}})
        return [worker for worker in self.workers if worker.address not in alive]

    def _check_workers(self, what: str) -> None:
        gone = self.lost_workers(what)
        if gone:
            notes = lost_for_memory(self.client, [w.address for w in gone], self._last_seen)
            lost = [f"{w.label} ({notes[w.address]})" if w.address in notes else w.label
                    for w in gone]
            many = len(lost) > 1  # "worker w1 ... its", "workers w0, w1 ... their"
            why, walltime = lost_at_walltime(self.client, [w.name for w in gone])
            self._fail(WorkerLost(f"{what}: worker{'s' * many} {', '.join(lost)} left the "
                                  f"cluster{f': {why}' if why else ''}; "
                                  f"{'their' if many else 'its'} work in the run is lost",
                                  [worker.address for worker in gone],
                                  [worker.label for worker in gone], memory=bool(notes),
                                  walltime=walltime))

    def _fetch(self, futures: list[Future], what: str) -> list[Any] | None:
        """The finished `futures`' results; None where they did not come (a holder of
        one, or the scheduler, is gone: the caller's check names which). One fetch runs
        on the client's loop for up to `_fetch_s`, and every FETCH_ASK_S meanwhile the
        scheduler is asked whether a worker left: a result held by a worker that left
        after finishing is waited for, not recomputed (its task is pinned there), and
        held a run that lost its last workers 10 s before it said so."""
        fetch = asyncio.run_coroutine_threadsafe(self.client._gather(futures),
                                                 self.client.loop.asyncio_loop)
        deadline = time.monotonic() + self._fetch_s()
        try:
            while True:
                try:
                    return fetch.result(timeout=max(0.0, min(FETCH_ASK_S,
                                                             deadline - time.monotonic())))
                except OSError:  # not yet (TimeoutError), or CommClosedError ("Stream is
                    if fetch.done() or time.monotonic() >= deadline:  # closed"): a lost
                        return None  # scheduler was once a bare comm error here
                except CancelledError:
                    self._scheduler_lost(what)
                self._check_workers(what)
        finally:
            fetch.cancel()

    def _fetch_s(self) -> float:
        """How long to wait for finished results: 10 s, or the stall limit if shorter
        (a result held by a stopped worker is what a stall probe then finds)."""
        limit = self.watch.limit()
        return 10.0 if limit is None else min(10.0, limit)

    def _check_stall(self, futures: list[Future], what: str, quiet_s: float) -> None:
        """After `quiet_s` seconds without a task finishing, past the watch's limit:
        probe the workers holding unfinished tasks; those that do not answer are
        fenced off and raised as lost (`WorkerLost`, `stalled`). If all answer, every
        worker of the run lists the stores (`stall_verdict` judges)."""
        limit = self.watch.limit()
        if limit is None or quiet_s < limit:
            self._store_silence = {}
            return
        holding = self._held(futures)
        patience = min(PROBE_S, limit)
        silent = unresponsive(self.client, list(holding), patience)
        store_silence = {} if silent or not self.stores else stores_silent_on(
            self.client, [w.address for w in self.workers], self.stores, PROBE_S)
        verdict = stall_verdict(silent, list(holding), store_silence, self._store_silence)
        self._store_silence = store_silence
        quiet = (f"no task of the run finished for {quiet_s:.0f} s (cluster.stall_timeout: "
                 f"{limit:g} s)")
        if verdict.stores and not verdict.workers:
            self.stalled_stores = verdict.stores
            labels = [w.label for w in self.workers if w.address in store_silence]
            self._fail(StoreStalled(
                f"{what}: {store_names(verdict.stores)} stopped answering: {quiet}, and none of "
                f"the run's workers ({', '.join(labels)}) could list "
                f"{'it' if len(verdict.stores) == 1 else 'them'} within {PROBE_S:g} s; the "
                "run stopped (a recovery would wait on the same store)",
                verdict.stores), abort=False)
        if not verdict.workers:
            return  # busy, or waiting for data (workspace.wait_timeout ends that)
        try:
            fence_workers(self.client, verdict.workers)
        except (OSError, CancelledError):  # the scheduler went too
            self._scheduler_lost(what)
        labels = [w.label for w in self.workers if w.address in verdict.workers]
        tasks = "; ".join(", ".join(holding[address]) for address in verdict.workers)
        why = (f"it did not answer for {patience:g} s" if silent else
               f"it could not list {', '.join(verdict.stores)} within {PROBE_S:g} s twice")
        self._fail(WorkerLost(
            f"{what}: worker {', '.join(labels)} stalled: {quiet} while it held {tasks}, and "
            f"{why}; removed from the cluster and treated as lost",
            verdict.workers, labels, stalled=True))

    def _held(self, futures: list[Future], labels: bool = False) -> dict[str, list[str]]:
        """What each worker holds of `futures` (by address, or by label): unfinished
        tasks, or, when all finished, the results not fetched."""
        holding: dict[str, list[str]] = {}
        for future in [f for f in futures if not f.done()] or futures:
            if future.key in self._doing:
                worker, doing = self._doing[future.key]
                member = self.workers[worker]
                holding.setdefault(member.label if labels else member.address, []).append(doing)
        return holding

    def _scheduler_lost(self, what: str, silent: SchedulerSilent | None = None) -> None:
        address = getattr(self.client.scheduler, "address", None) or "?"
        if silent is not None:  # its connection is open: calls on it would wait for ever
            abandon_client(self.client)
        why = f" ({silent})" if silent is not None else ""
        self._fail(SchedulerLost(f"{what}: lost the Dask scheduler at {address}{why}; the "
                                 "run stopped (its checkpoints are kept)"))

    def _fail(self, error: ClusterError | NoSpace | DatasetChanged,
              abort: bool = True) -> NoReturn:
        """Tell the workers (`on_failure`: the workspace's abort marker; not when the
        stores stopped answering, where the write could hang this process) and raise."""
        if abort:
            try:
                self.on_failure(str(error))
            except Exception:  # noqa: BLE001 - the workspace may be unreachable too
                pass
        raise error
