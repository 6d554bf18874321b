"""The one place that submits a run's tasks and collects their results.

Every task of a run is pinned to its worker (``workers=[address]``, the worker's
resource tag, ``allow_other_workers=False``): shard state lives there. Waiting is
bounded and watched: a task that fails, or a worker that leaves, stops the run at
once with a message naming it (and `on_failure` tells the other workers, which may
be waiting for the lost one's data, to give up). A worker that stops answering
while the run waits on it (SIGSTOP, a frozen host) is a stall: after the run made no
progress for the `StallWatch`'s limit, the workers holding its unfinished tasks are
probed, and one that does not answer is fenced off (removed from the cluster) and
reported as lost, so the run recovers as from a dead worker (before that, a long
wait is named on the progress bar: `waiting_note`). A worker whose link is
cut is the same case: its Dask process cannot answer across the link. When every
worker answers, each is asked to list the run's stores (storage/liveness.py): a
store that none of them can list stopped answering (a frozen file server), which
no recovery gets past (the survivors would wait on it too), so the run stops with
`StoreStalled`; a store only some workers cannot reach makes those workers stalled.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, NoReturn, Sequence

from distributed import Client, Future, wait

from pipeline.cluster.workers import (ClusterError, ClusterWorker, SchedulerLost,
                                      SchedulerSilent, SchedulerWatch, WorkerLost,
                                      abandon_client, fence_workers, live_workers,
                                      unresponsive)
from pipeline.cluster.job_ends import lost_at_walltime
from pipeline.cluster.worker_limits import lost_for_memory
from storage.liveness import silent_stores
from storage.datasets.store import DatasetChanged
from storage.space import NoSpace

#: `cluster.stall_timeout: auto`: the limit is this many median steps, at least
#: STALL_FLOOR_S; before any step is measured (loading the shards, the first step),
#: FIRST_STALL_S.
STALL_STEPS, STALL_FLOOR_S, FIRST_STALL_S = 10.0, 30.0, 120.0
#: Seconds a probed worker has to answer before it counts as stalled (at most the
#: limit itself), and to list the run's stores.
PROBE_S = 5.0
#: Seconds between questions whether a worker left, while finished results are fetched.
FETCH_ASK_S = 1.0
#: Seconds without a task finishing after which the progress bar names the workers
#: waited for (at most half the stall limit).
WAIT_NOTE_S = 5.0


class StoreStalled(ClusterError):
    """The run's stores stopped answering every worker: the run cannot go on."""

    def __init__(self, message: str, paths: list[str]) -> None:
        super().__init__(message)
        self.paths = paths  # the stores (directories or URLs) that did not answer


@dataclass
class Verdict:
    """What a stall probe found: workers to fence off, or stores that stopped answering
    (neither: the run is busy, or waits for data, which workspace.wait_timeout ends)."""

    workers: list[str] = field(default_factory=list)  # addresses
    stores: list[str] = field(default_factory=list)  # paths; with workers: what they missed


def stall_verdict(silent: list[str], holders: list[str], store_silence: dict[str, list[str]],
                  before: dict[str, list[str]]) -> Verdict:
    """Judge a stall probe: `silent`, the holders of unfinished tasks that did not
    answer a call; `store_silence`, for every worker that answered the store probe,
    the stores it could not list (`before`: the same from the previous probe of this
    stall, {} if none). Workers that do not answer are stalled (the store is not
    asked). A store no replying worker could list has stopped (the stores every one
    of them missed; their union if none is common). Holders that could not reach a
    store on two probes in a row are stalled (their own mount or link fails them; one
    slow listing on a loaded host is not enough)."""
    if silent:
        return Verdict(workers=list(silent))
    if store_silence and all(store_silence.values()):
        common = set.intersection(*(set(paths) for paths in store_silence.values()))
        missed = common or set().union(*store_silence.values())
        order = [p for paths in store_silence.values() for p in paths]
        return Verdict(stores=sorted(missed, key=order.index))
    cut_off = [a for a in holders if store_silence.get(a) and before.get(a)]
    if cut_off:
        missed = {p for a in cut_off for p in store_silence[a]}
        return Verdict(workers=cut_off, stores=sorted(missed))
    return Verdict()


def waiting_note(quiet_s: float, limit: float | None, holding: dict[str, list[str]]) -> str:
    """What the progress bar says while the run waits on workers before the stall
    limit: for how long, on whom (`holding`: each worker's label and what it holds),
    and the limit; "" when it is not waiting long enough to say
    (`WAIT_NOTE_S`, or half the limit if shorter). A frozen worker is seen
    here well before the limit declares it stalled."""
    if not holding or quiet_s < (WAIT_NOTE_S if limit is None else min(WAIT_NOTE_S, limit / 2)):
        return ""
    whom = "; ".join(f"{label} ({', '.join(doing)})" for label, doing in holding.items())
    after = "never" if limit is None else f"at {limit:g} s"
    return f"waiting {quiet_s:.0f} s on {whom}; stall declared {after}"


def stores_silent_on(client: Client, addresses: list[str], paths: list[str],
                     timeout: float) -> dict[str, list[str]]:
    """Each worker's stores (of `paths`) it could not list within `timeout` seconds,
    for the workers that replied (a worker that did not is left out: no evidence)."""

    async def ask(address: str) -> Any:
        try:
            replies = await asyncio.wait_for(
                client._run(silent_stores, paths, timeout, workers=[address], on_error="return"),
                timeout + PROBE_S)
        except (asyncio.TimeoutError, OSError):
            return None
        return replies.get(address)

    async def probe() -> list[Any]:
        return await asyncio.gather(*(ask(a) for a in addresses))

    replies = client.sync(probe)
    return {a: list(r) for a, r in zip(addresses, replies) if isinstance(r, list)}


def _stores(paths: list[str]) -> str:
    return f"the store {paths[0]}" if len(paths) == 1 else f"the stores {', '.join(paths)}"


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
    of the last 101 collected tasks (each of one or more steps: progress is seen when
    one finishes), at least `STALL_FLOOR_S` (a step's time varies with the machine's
    load; a stall is a worker gone silent, not a slow step).
    """

    def __init__(self, setting: float | None | Literal["auto"]) -> None:
        self.setting = setting
        self.tasks: deque[float] = deque(maxlen=101)

    def task_took(self, seconds: float) -> None:
        self.tasks.append(seconds)

    def limit(self) -> float | None:
        if self.setting != "auto":
            return None if self.setting is None else float(self.setting)
        if not self.tasks:
            return FIRST_STALL_S
        return max(STALL_FLOOR_S, STALL_STEPS * statistics.median(self.tasks))


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
        if not self._last_seen:  # once: each worker's memory limit, should it be lost
            self.lost_workers()
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
                f"{what}: {_stores(verdict.stores)} stopped answering: {quiet}, and none of "
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
