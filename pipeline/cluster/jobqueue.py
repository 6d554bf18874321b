"""The run's workers as batch jobs (`cluster.jobqueue`): Slurm, PBS or SGE, through
dask-jobqueue.

The run starts a Dask scheduler in its own process, on `cluster.jobqueue.host` (or
`interface`), and submits one batch job per worker (`sbatch`, `qsub`); each job runs
one `dask worker` with the run's tag and as many torch threads as the job has cores.
Several kinds of job (a GPU partition and a CPU one: `groups`) are one cluster with
several job templates, each a tagged group of workers.

Like the embedded cluster, the scheduler and the workers speak mutual TLS with
credentials made for this cluster (`pipeline.cluster.security.run_security`). A job gets
them as files in a folder only this user can enter (mode 0700, the files 0600), on
a file system the job's node sees: its script names the files, never the key. The
scheduler listens on loopback unless the config names another address, and its
dashboard on loopback always.

The edges of a batch system: jobs that wait in the queue are counted, with the
queue's reason (`squeue`), while the run waits for its workers (at most
`cluster.wait_timeout`); a job that ends before its worker joins fails the start
with its state and the end of its log, and so, at once, does one that Slurm keeps
pending for a reason no wait clears (pipeline/cluster/batch_queue.py); a job that
ends mid-run (its walltime, a `scancel`) is a lost worker, recovered from as any
other (pipeline/training/recovery.py), one ended at its walltime named so
(pipeline/cluster/job_ends.py, which also has the start say the walltime); a partition that does not exist, a missing
`sbatch` or a missing dask-jobqueue are refused in one line before anything is
submitted, and so is a scheduler address this machine does not have; and every job
is cancelled when the run ends, however it ends short of SIGKILL (a worker whose
scheduler is gone exits, which ends its job). Jobs the run will not use are not
submitted, or are cancelled once it knows (pipeline/cluster/job_choice.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import importlib.util
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterator

import dask
from distributed import Client, Security

from pipeline.config.cluster_config import ClusterConfig
from pipeline.config.jobqueue_config import JobGroupConfig, JobqueueConfig
from pipeline.cluster.embedded import QUIET, quiet_dashboard_errors
from pipeline.cluster.batch_queue import (JobqueueError, cancel_jobs, ended_jobs, log_tail,
                                          never_starting, partition_problem, partitions_of,
                                          pending_summary, slurm_states, wait_advice)
from pipeline.cluster.job_ends import walltime_limits
from pipeline.cluster.security import TlsConfig, run_security, write_credentials

#: dask-jobqueue's cluster class for each batch system.
CLUSTER_CLASSES = {"slurm": "SLURMCluster", "pbs": "PBSCluster", "sge": "SGECluster"}
#: The command that submits a job, per batch system.
SUBMIT_COMMANDS = {"slurm": "sbatch", "pbs": "qsub", "sge": "qsub"}
#: Seconds a job's worker waits for a scheduler that does not answer before it exits.
DEATH_TIMEOUT_S = 60
#: (workers up, workers asked for, what the queue says of the rest), while jobs start.
JobProgress = Callable[[int, int, str], None]


def jobqueue_problem(config: ClusterConfig) -> str | None:
    """What stops `cluster.jobqueue` before anything is submitted, as one line:
    dask-jobqueue missing, its `directory` missing or not writable, the batch system's
    submit command missing, or (Slurm) a partition it does not have. None if nothing
    does."""
    jobqueue = config.jobqueue
    if jobqueue is None:
        return None
    if importlib.util.find_spec("dask_jobqueue") is None:
        return ("cluster.jobqueue needs dask-jobqueue, which is not installed: "
                "pip install -c constraints.txt -e '.[slurm]'")
    directory = jobqueue.directory
    if directory and not os.path.isdir(directory):
        return (f"cluster.jobqueue.directory: {directory} "
                f"{'is not a folder' if os.path.exists(directory) else 'does not exist'} "
                "(a folder every node sees, for the jobs' credentials and logs)")
    if directory and not os.access(directory, os.W_OK | os.X_OK):
        return f"cluster.jobqueue.directory: {directory} is not writable by this user"
    submit = SUBMIT_COMMANDS[jobqueue.system]
    if shutil.which(submit) is None:
        return (f"cluster.jobqueue.system: {jobqueue.system}, but its `{submit}` is not on "
                "this machine's PATH (run from a login node of the cluster)")
    if jobqueue.system == "slurm":
        return partition_problem(jobqueue, config.tags()[0])
    return None


_IMPORTING = threading.Lock()


def import_dask_jobqueue() -> Any:
    """dask-jobqueue, imported without what its import does to signals: its `runner`
    module sets SIGINT's handler to `sys.exit()` (Ctrl-C would then end a run with
    exit 0, no record and no `interrupted` line) and, outside the main thread, fails
    (`signal only works in main thread`). Python's `signal.signal` is set aside while
    it imports, so the handler in place (the run's `stops_on_signals`) stays."""
    if "dask_jobqueue" in sys.modules:
        return sys.modules["dask_jobqueue"]
    with _IMPORTING:
        real = signal.signal
        signal.signal = lambda signum, handler: signal.getsignal(signum)
        try:
            return importlib.import_module("dask_jobqueue")
        finally:
            signal.signal = real


def file_security(files: TlsConfig) -> Security:
    """The cluster's `Security` from its credential files: one certificate for every
    role, as `run_security` made it. Jobs get these paths, never the key's text."""
    key = files.key or files.cert
    return Security(require_encryption=True, tls_ca_file=files.ca_file,
                    tls_scheduler_cert=files.cert, tls_scheduler_key=key,
                    tls_worker_cert=files.cert, tls_worker_key=key,
                    tls_client_cert=files.cert, tls_client_key=key)


def worker_names(system: str, groups: list[JobGroupConfig]) -> list[list[str]]:
    """The workers' names per group: `slurm-0`, `slurm-1`, ... for one kind of job;
    `slurm-<queue or group number>-0`, ... for several."""
    names = []
    for index, group in enumerate(groups):
        prefix = system if len(groups) == 1 else f"{system}-{group.queue or index}"
        names.append([f"{prefix}-{n}" for n in range(group.jobs or 0)])
    return names


def job_options(jobqueue: JobqueueConfig, group: JobGroupConfig, security: Security,
                folder: str) -> dict[str, Any]:
    """dask-jobqueue's options for one job of `group`: one worker process with the
    job's cores as threads (its torch threads), its tags, no Dask memory limit (the
    batch system holds the job to `memory`), no nanny, its HTTP server on the node's
    loopback, its comm on loopback too where the scheduler is, and its log in
    `folder`."""
    tags = ",".join(f"{tag}={amount:g}" for tag, amount in (group.resources or {}).items())
    worker_args = ["--resources", tags, "--memory-limit", "0",
                   "--dashboard-address", "127.0.0.1:0"]
    if jobqueue.interface is None and jobqueue.host in ("127.0.0.1", "localhost"):
        worker_args += ["--host", "127.0.0.1"]
    options: dict[str, Any] = {
        "cores": group.cores, "processes": 1, "memory": group.memory,
        "walltime": group.walltime, "queue": group.queue,
        "job_extra_directives": list(group.extra or []),
        "job_script_prologue": list(group.prologue or []),
        # `exec`: the worker replaces the job's shell, so the batch system's signals
        # (scancel, the walltime) reach it, and a SIGKILL after them finds it too (a
        # worker left as the shell's child outlives a cancelled job on a node that
        # tracks a job's processes by their parents, as proctrack/linuxproc does)
        "worker_extra_args": worker_args, "nanny": False, "python": f"exec {sys.executable}",
        "log_directory": folder, "protocol": "tls://", "security": security,
        "interface": jobqueue.interface, "job_name": f"hetcnn-{jobqueue.system}",
        # a job that starts after its run's scheduler is gone (the client killed while
        # it queued) ends within this many seconds instead of holding its node
        "death_timeout": DEATH_TIMEOUT_S}
    if jobqueue.system != "sge":
        options["account"] = group.account
    return options


def start_jobqueue_cluster(config: ClusterConfig, folder: str,
                           only: list[str] | None = None) -> Any:
    """A dask-jobqueue cluster of the config's batch system, its scheduler in this
    process, every job of every group submitted (or those of the workers named in
    `only`: pipeline/cluster/job_choice.py); credentials, job logs and the
    scheduler's scratch in `folder` (this user's, mode 0700). Returns once the jobs
    are submitted, not joined."""
    jobqueue = config.jobqueue
    assert jobqueue is not None
    cls = getattr(import_dask_jobqueue(), CLUSTER_CLASSES[jobqueue.system])
    security = file_security(write_credentials(run_security(), folder))
    quiet_dashboard_errors()
    groups = jobqueue.group_list(config.tags()[0])
    where = ({"interface": jobqueue.interface} if jobqueue.interface
             else {"host": jobqueue.host})
    try:
        with dask.config.set(QUIET):
            cluster = cls(n_workers=0, name=jobqueue.system, silence_logs=logging.ERROR,
                          scheduler_options={**where, "dashboard_address": "127.0.0.1:0",
                                             # not Dask's shared default (embedded.py's doc)
                                             "local_directory": folder},
                          **job_options(jobqueue, groups[0], security, folder))
    except Exception as error:  # an address not on this machine, an unknown interface
        field, value = next(iter(where.items()))
        raise JobqueueError(f"cluster.jobqueue.{field}: the run's scheduler cannot listen on "
                            f"{value}: {last_line(first_cause(error))}") from None
    names_by_group = worker_names(jobqueue.system, groups)
    cluster.hetcnn_walltimes = {name: limit for names, limit in  # job_ends.lost_at_walltime
                                zip(names_by_group, walltime_limits(jobqueue)) for name in names}
    try:
        for group, names in zip(groups, names_by_group):
            options = job_options(jobqueue, group, security, folder)
            options["config_name"] = cls.job_cls.config_name
            for name in names:  # the job named after its worker (squeue, its log's name)
                if only is not None and name not in only:
                    continue
                cluster.worker_spec[name] = {"cls": cls.job_cls, "options": {
                    **options, "job_name": f"hetcnn-{name}"}}
        with dask.config.set(QUIET):
            cluster.sync(cluster._correct_state)  # submits every job (SpecCluster's start)
    except BaseException as error:
        with contextlib.suppress(Exception):  # jobs never submitted fail dask's close
            close_jobqueue_cluster(cluster)
        if isinstance(error, Exception):
            raise JobqueueError(f"cluster.jobqueue: submitting the {jobqueue.system} jobs "
                                f"failed: {last_line(error)}") from None
        raise
    return cluster


def last_line(error: BaseException) -> str:
    """The last non-empty line of an error's text (a batch command's own message)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def first_cause(error: BaseException) -> BaseException:
    """The error at the bottom of `error`'s chain (what it was raised from, or while
    handling): Dask's "cannot get address of non-running Server" came of an OSError
    such as "Cannot assign requested address"."""
    seen = [error]
    while (below := seen[-1].__cause__ or seen[-1].__context__) and below not in seen:
        seen.append(below)
    return seen[-1]


def job_ids(cluster: Any) -> dict[str, str]:
    """Each submitted job's id by its worker's name."""
    return {name: str(job.job_id) for name, job in cluster.workers.items()
            if getattr(job, "job_id", None)}


def wait_for_jobs(cluster: Any, jobqueue: JobqueueConfig, wanted: int, timeout: float,
                  folder: str, progress: JobProgress) -> None:
    """Wait until `wanted` workers of the jobs have joined, telling `progress` how many
    are up and what the queue says of the rest; JobqueueError (one line) when a job
    ends before its worker joined, when Slurm says one will never start, or after
    `timeout` seconds."""
    total = len(cluster.worker_spec)
    deadline = time.monotonic() + timeout
    while True:
        joined = {str(info.get("name")) for info in cluster.scheduler_info["workers"].values()}
        waiting = {name: job for name, job in job_ids(cluster).items() if name not in joined}
        states = slurm_states(list(waiting.values())) if jobqueue.system == "slurm" else {}
        detail = pending_summary(states, list(waiting.values()))
        progress(len(joined), total, detail)
        if len(joined) >= wanted:
            return
        never = never_starting(states, waiting)
        if never:  # not worth `timeout`: the job is cancelled with the others
            raise JobqueueError(never)
        ended = ended_jobs(states, waiting) if jobqueue.system == "slurm" else []
        if ended:
            job = waiting[ended[0]]
            state = states.get(job, ("ended",))[0]
            raise JobqueueError(f"cluster.jobqueue: {jobqueue.system} job {job} ({ended[0]}) "
                                f"ended ({state}) before its worker joined; its log: "
                                f"{log_tail(folder, job)}")
        if time.monotonic() > deadline:
            where = partitions_of(states, list(waiting.values()))
            raise JobqueueError(f"cluster.jobqueue: {len(joined)} of {wanted} worker(s) up "
                                f"after {timeout:g} s ({detail or 'no job listed'}{where}); "
                                f"{wait_advice(states, waiting)}")
        time.sleep(0.25)


def release_jobs(cluster: Any, keep: set[str]) -> list[str]:
    """Retire the workers of `cluster` not named in `keep` and cancel their jobs (they
    leave its spec, so nothing submits them again); returns their names."""
    released = sorted(name for name in cluster.worker_spec if name not in keep)
    if released:
        ids = [job for name, job in job_ids(cluster).items() if name in released]
        for name in released:
            del cluster.worker_spec[name]
        try:
            with dask.config.set(QUIET):
                cluster.sync(cluster._correct_state)  # retires them, then cancels each job
        finally:
            cancel_jobs(cluster.job_cls.config_name, ids)  # however that went
    return released


def close_jobqueue_cluster(cluster: Any) -> None:
    """Tell every worker to exit (its job then ends by itself), close the scheduler
    and cancel every job it submitted, even if closing fails half-way (dask-jobqueue
    cancels them one by one as it closes its workers). What the scheduler says of
    the workers it loses meanwhile is not said (`closing_quietly`)."""
    ids = list(job_ids(cluster).values())
    try:
        with closing_quietly(cluster):
            with contextlib.suppress(Exception):  # a scheduler already gone closes nothing
                cluster.sync(_close_workers, cluster.scheduler)
            cluster.close()
    finally:
        cancel_jobs(cluster.job_cls.config_name, ids)


@contextlib.contextmanager
def closing_quietly(cluster: Any) -> Iterator[None]:
    """The scheduler's errors of its own close kept off stderr. A run stopped (Ctrl-C,
    a signal, a failure) while the scheduler waited on its workers (a `client.run`
    they had not answered: their set-up, the checks of their folders and code) closes
    it with those waits open: it logged `broadcast to ... failed: CommClosedError`
    and a `CancelledError` traceback of each worker's stream, and asyncio printed
    `Future exception was never retrieved` with a CommClosedError traceback, after
    the run's one line. Such errors of comms that the close ends are dropped while it
    closes, and those of futures it left that are collected then (the loop's handler,
    put back after: the loop may serve other clients, whose errors are theirs to
    say); any other is said as before."""
    logger = logging.getLogger("distributed.scheduler")
    level = logger.level
    loop = getattr(getattr(cluster, "loop", None), "asyncio_loop", None)
    handler = loop.get_exception_handler() if loop is not None else None
    if loop is not None:
        loop.set_exception_handler(_closed_comms_unsaid)
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        gc.collect()  # the close's abandoned futures report (or not) now, not later
        if loop is not None:
            loop.set_exception_handler(handler)
        logger.setLevel(level)


def _closed_comms_unsaid(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """asyncio's handler of errors no one retrieved, less those of closed comms and
    cancelled waits (a closed cluster's)."""
    if not isinstance(context.get("exception"), (OSError, asyncio.CancelledError)):
        loop.default_exception_handler(context)


async def _close_workers(scheduler: Any) -> None:
    """Remove every worker from `scheduler`, telling each to close."""
    await asyncio.gather(*(scheduler.remove_worker(address, stimulus_id="jobqueue-closed",
                                                   close=True)
                           for address in list(scheduler.workers)))


@contextlib.contextmanager
def open_jobqueue_client(config: ClusterConfig, progress: JobProgress | None = None,
                         only: list[str] | None = None) -> Iterator[Client]:
    """A client to a fresh cluster of batch jobs (`start_jobqueue_cluster`, the jobs
    of the workers in `only` where given) once `cluster.use_workers` (else all) of its
    workers have joined; every job cancelled, the credentials and logs removed, when
    the block ends. The client's `cluster` is the dask-jobqueue cluster."""
    jobqueue = config.jobqueue
    assert jobqueue is not None
    problem = jobqueue_problem(config)
    if problem:
        raise JobqueueError(problem)
    parent = jobqueue.directory or os.path.expanduser("~")
    folder = tempfile.mkdtemp(prefix=".hetcnn-jobqueue-", dir=parent)  # mode 0700
    try:
        cluster = start_jobqueue_cluster(config, folder, only)
        try:
            wanted = config.use_workers or len(cluster.worker_spec)
            wait_for_jobs(cluster, jobqueue, wanted, config.wait_timeout, folder,
                          progress or (lambda up, total, detail: None))
            with Client(cluster, set_as_default=False, security=cluster.security) as client:
                yield client
        finally:
            close_jobqueue_cluster(cluster)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
