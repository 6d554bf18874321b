"""Starting the embedded cluster: a scheduler and one nanny-managed worker process
per configured worker, on the loopback interface, a few workers at a time.

Each worker process starts a Dask worker, and many of them take a while on 2 cores.
Started in batches (`batch`, from
`pipeline.cluster.startup.start_batch`), they come up steadily and a caller can say how many
are up (`progress`); a start that fails or is interrupted (Ctrl-C) kills the
workers still starting instead of waiting for them, and the workers never see a
terminal's Ctrl-C themselves (`_block_ctrl_c`): the run stops them.

The worker processes are forked from one fork server that imported what a worker
needs (torch among it) once: pipeline/cluster/fork_server.py says why. The first embedded
cluster of a process starts it.

Every Dask server keeps a scratch folder and puts it first on its process's
`sys.path`; Dask's default is ``$TMPDIR/dask-scratch-space``, and Dask uses that
folder whoever made it, so long as it can write there: another local user who made
it first (mode 0777) could rename the run's folders in it and put modules of their
own where the run's processes import from. The run's clusters keep their scratch in
a folder of their own instead (`PrivateScratchCluster`: made by `tempfile.mkdtemp`,
mode 0700, removed when the cluster closes).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import stat
import tempfile
import threading
from typing import Callable, Iterator

import dask
import psutil
from distributed import Client, Nanny, Scheduler, SpecCluster
from distributed.utils import get_mp_context

from pipeline.config.cluster_config import WorkerConfig
from pipeline.cluster.fork_server import start_fork_server
from pipeline.cluster.semaphores import (is_resource_tracker, remove_stale_semaphores,
                                         start_resource_tracker, tag_semaphores_with_pid)
from pipeline.cluster.temp_folders import remove_stale_temp_folders
from pipeline.cluster.security import run_security

LOOPBACK = "127.0.0.1"
# Workers share the cores with the timed work: no statistical profiler (it samples
# every worker's stacks every 10 ms) and no GIL monitor.
# Every Dask server (the scheduler and each nanny, in the client's process; each
# worker) runs an event-loop health check every `tick.interval` (20 ms by default:
# 50 wake-ups a second each), which only logs (at info level, silenced here) a loop
# blocked past `tick.limit` (3 s): at 500 ms (what Dask's own test suite uses) an
# idle 2-worker cluster's client process takes 10 ms of CPU a second instead of 26,
# and its two workers 7.5 instead of 26 (docs/benchmarks.md). The system monitor (psutil
# readings of each server's process, for heartbeats and the dashboard's plots) every
# 2 s instead of 0.5 s: nothing of the run reads them; 2.5 ms/s less in the client
# process, 3.8 in the workers.
QUIET = {"distributed.worker.daemon": False, "logging.distributed": "error",
         "distributed.admin.system-monitor.gil.enabled": False,
         "distributed.worker.profile.enabled": False,
         "distributed.admin.tick.interval": "500ms",
         "distributed.admin.system-monitor.interval": "2s",
         # one malloc arena (tasks.worker_state.tune_allocator says why), set before the
         # worker process starts, as glibc reads it then
         "distributed.nanny.pre-spawn-environ.MALLOC_ARENA_MAX": 1,
         # workers forked from a server that imported torch once (pipeline/cluster/fork_server.py)
         "distributed.worker.multiprocessing-method": "forkserver"}

#: (workers up, workers asked for), while an embedded cluster starts.
Progress = Callable[[int, int], None]


def start_embedded_cluster(workers: list[WorkerConfig], progress: Progress | None = None,
                           batch: int = 0) -> SpecCluster:
    """Start a scheduler and one nanny-managed process per configured worker, `batch`
    at a time (0: all at once); `progress` hears how many are up meanwhile.

    Everything listens on the loopback interface only (scheduler, workers, nannies,
    dashboard): an embedded cluster serves this process, and a Dask worker runs
    whatever a client that reaches it submits. Loopback keeps other machines out, not
    other users of this one, so every connection is mutual TLS with credentials made
    for this cluster (`run_security`): a client without them is refused. Started in
    batches, the workers come up a few at a time rather than (nearly) all at the end.
    The semaphores of the nannies' queues carry this process's pid, and those that
    processes gone without unlinking theirs left are removed first
    (pipeline/cluster/semaphores.py), as are the temporary folders such processes left
    (pipeline/cluster/temp_folders.py).
    """
    tag_semaphores_with_pid()
    remove_stale_semaphores()
    remove_stale_temp_folders()
    security, scratch = run_security(), private_scratch()
    quiet_dashboard_errors()
    scheduler = {"cls": Scheduler,
                 "options": {"host": LOOPBACK, "dashboard_address": f"{LOOPBACK}:0",
                             "protocol": "tls", "security": security,
                             "local_directory": scratch}}
    spec = {
        worker.name: {"cls": Nanny, "options": {
            "host": LOOPBACK, "nthreads": 1, "silence_logs": logging.ERROR,
            "resources": dict(worker.resources), "memory_limit": 0,
            "protocol": "tls", "security": security, "local_directory": scratch,
        }}
        for worker in workers
    }
    names, step = list(spec), batch or len(spec) or 1
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    with dask.config.set(QUIET):
        cluster = PrivateScratchCluster(scratch, workers={}, scheduler=scheduler,
                                        silence_logs=logging.ERROR, security=security)
        try:
            cluster.sync(_block_ctrl_c)
            for first in range(0, len(names), step):
                cluster.worker_spec.update({n: spec[n] for n in names[first:first + step]})
                _start_counted(cluster, len(names), progress or (lambda up, total: None))
        except BaseException:
            _kill_new_workers(before)  # else closing waits for every start under way
            cluster.close()
            raise
        return cluster


class _DashboardErrors(logging.Filter):
    """Drops tornado's report of a dashboard page that failed (`quiet_dashboard_errors`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Uncaught exception")


def quiet_dashboard_errors() -> None:
    """Keep tornado's tracebacks of dashboard pages Dask fails to make (``/sitemap.json``
    always; ``/json/identity.json`` once tasks ran) out of this process's stderr: the
    scheduler serves its dashboard from here, any local user may ask it for a page
    (loopback keeps out other machines, not other users), and each such request printed
    a traceback into the run's output. The asker still gets the error page."""
    logger = logging.getLogger("tornado.application")
    if not any(isinstance(f, _DashboardErrors) for f in logger.filters):
        logger.addFilter(_DashboardErrors())


#: A cluster's scratch folder: this, the pid of the process that made it, a dash.
SCRATCH_PREFIX = "dask-cnn-scratch-"


def private_scratch() -> str:
    """A fresh folder for a cluster's Dask scratch that only this user can enter
    (module doc): `tempfile.mkdtemp`'s, mode 0700, under ``$TMPDIR``, named by this
    process's pid, so that a process killed before it could remove its folder leaves
    it to the next cluster to remove (`remove_stale_scratch`)."""
    remove_stale_scratch(tempfile.gettempdir())
    return tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-")


def remove_stale_scratch(folder: str) -> None:
    """Remove the scratch folders in `folder` that this user's processes made and that
    no process of that pid holds now (killed: SIGKILL leaves no time to clean).
    Another user's, a link, and a live process's stay."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        made_by = re.fullmatch(rf"{SCRATCH_PREFIX}(\d+)-.+", entry.name)
        try:
            status = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if (made_by and stat.S_ISDIR(status.st_mode) and status.st_uid == os.getuid()
                and not psutil.pid_exists(int(made_by[1]))):
            shutil.rmtree(entry.path, ignore_errors=True)


class PrivateScratchCluster(SpecCluster):
    """A SpecCluster whose servers keep their scratch in `scratch` (`private_scratch`,
    each given it as ``local_directory``), removed when the cluster closes; also when
    its start fails."""

    def __init__(self, scratch: str, *args, **kwargs) -> None:
        self.scratch = scratch
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise

    async def _close(self) -> None:
        try:
            await super()._close()
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)


async def _block_ctrl_c() -> None:
    """Block SIGINT in the event loop's thread, which starts the worker processes
    (through threads it creates, which inherit its signal mask, as a process does
    across exec). A terminal's Ctrl-C reaches every process of the run; the run
    stops its workers itself, and each worker that took it printed a
    KeyboardInterrupt traceback. Python runs signal handlers in the main thread
    only, so this thread blocking one changes nothing for this process. The
    resource tracker is started first (`start_resource_tracker`): starting it
    unblocks SIGINT in its caller.
    Then the fork server (QUIET asks for one), if none runs yet: started from here,
    it inherits the blocked Ctrl-C and hands it on to every worker forked from it."""
    start_resource_tracker()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    get_mp_context()  # Dask sets its own list of modules on its first call: before ours
    start_fork_server()


def is_worker_process(process: psutil.Process) -> bool:
    """Whether `process` is an embedded cluster's worker: forked from a fork server
    (its parent is the server, with the server's command line) or spawned by
    multiprocessing; not the fork server or the resource tracker themselves."""
    command = " ".join(process.cmdline())
    if "multiprocessing.forkserver" in command:
        parent = process.parent()
        return parent is not None and "multiprocessing.forkserver" in " ".join(parent.cmdline())
    return "spawn_main" in command and not is_resource_tracker(process)


def _kill_new_workers(before: set[int]) -> None:
    """Kill the worker processes this process started since its descendants were
    `before` (`is_worker_process`)."""
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.pid not in before and is_worker_process(child):
                child.kill()


def _start_counted(cluster: SpecCluster, total: int, progress: Progress) -> None:
    """Start the workers added to `cluster.worker_spec` as SpecCluster's own start
    does (`_correct_state`, whose failure is raised here), telling `progress` how
    many of `total` are up meanwhile. The wait is in this thread, so that Ctrl-C
    ends it at once."""
    outcome: list[BaseException | None] = []

    def start() -> None:
        try:
            cluster.sync(cluster._correct_state)
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
            outcome.append(error)

    thread = threading.Thread(target=start, name="start-embedded-workers", daemon=True)
    thread.start()
    while thread.is_alive():
        progress(len(cluster.scheduler_info.get("workers", {})), total)
        thread.join(0.2)
    if outcome and outcome[0] is not None:
        raise outcome[0]
    progress(len(cluster.scheduler_info.get("workers", {})), total)


#: How long a restart of an embedded cluster's workers may take (`restart_timeout`)
#: before its caller starts the cluster again instead: two workers restart in 0.25 s
#: here, but in one sweep one restart of about fifty never saw its two workers
#: return (cause not found), and Dask's own wait is a minute; starting the cluster
#: again takes seconds.
RESTART_BASE_S = 10.0
RESTART_PER_WORKER_S = 1.0

#: The loggers through which Dask reports a failed restart, each with a traceback
#: (its scheduler runs in this process); the caller reports it in one line.
RESTART_LOGGERS = ("distributed.scheduler", "distributed.core", "distributed.nanny")


def restart_timeout(workers: int) -> float:
    """Seconds `restart_workers` gives ``workers`` workers to come back."""
    return RESTART_BASE_S + RESTART_PER_WORKER_S * workers


class _DropAll(logging.Filter):
    """Drops every record (`_silenced`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return False


@contextlib.contextmanager
def _silenced(names: tuple[str, ...]) -> Iterator[None]:
    """The loggers ``names`` silent for the block, by a filter taken off after: their
    levels stay whatever they are set to meanwhile (a stop signal raises them, and a
    restart it cut short still logs its cancellation once the block has ended)."""
    drop = _DropAll()
    loggers = [logging.getLogger(name) for name in names]
    for logger in loggers:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(drop)


def restart_workers(client: Client, timeout: float | None = None) -> None:
    """Replace every worker process of an embedded cluster by a fresh one, forked as
    the first were (the nannies, their names and the scheduler stay; the setup plugin
    runs again on each): about 0.25 s for two workers here. Raises where they do not
    all come back within ``timeout`` (default `restart_timeout`), with Dask's own
    report of it kept off stderr (`RESTART_LOGGERS`).

    Why: a sweep runs its points one after the other on the same workers, and a
    worker that ran earlier points holds what they left (library pages they touched,
    modules they imported, heap kept by the allocator): the small network's workers
    peaked 55-60 MB above a standalone run of the same point, so a point's memory,
    and its first steps, depended on which points ran before it. Inside `QUIET`, as
    at the start: a nanny reads how to start its worker (the fork server, one malloc
    arena) when it starts one, and outside it spawned workers 60 MB larger."""
    if timeout is None:
        timeout = restart_timeout(len(client.scheduler_info()["workers"]))
    with dask.config.set(QUIET), _silenced(RESTART_LOGGERS):
        client.restart(timeout=timeout, wait_for_workers=True)
