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
with its state and the end of its log; a job that ends mid-run (its walltime, a
`scancel`) is a lost worker, recovered from as any other (pipeline/training/recovery.py); a
partition that does not exist, a missing `sbatch` or a missing dask-jobqueue are
refused in one line before anything is submitted; and every job is cancelled when
the run ends, however it ends short of SIGKILL (a worker whose scheduler is gone
exits, which ends its job).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any, Callable, Iterator

import dask
from distributed import Client, Security

from pipeline.config.cluster_config import ClusterConfig, JobGroupConfig, JobqueueConfig
from pipeline.cluster.embedded import QUIET, quiet_dashboard_errors
from pipeline.cluster.security import TlsConfig, run_security, write_credentials

#: dask-jobqueue's cluster class for each batch system.
CLUSTER_CLASSES = {"slurm": "SLURMCluster", "pbs": "PBSCluster", "sge": "SGECluster"}
#: The command that submits a job, per batch system.
SUBMIT_COMMANDS = {"slurm": "sbatch", "pbs": "qsub", "sge": "qsub"}
#: Slurm job states after which a job's worker will never join.
ENDED_STATES = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
                "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT"}
#: Seconds a job's worker waits for a scheduler that does not answer before it exits.
DEATH_TIMEOUT_S = 60
#: Seconds a batch command (`sinfo`, `squeue`, `scancel`) may take.
COMMAND_TIMEOUT_S = 20.0

#: (workers up, workers asked for, what the queue says of the rest), while jobs start.
JobProgress = Callable[[int, int, str], None]


class JobqueueError(RuntimeError):
    """The batch system cannot give the run its workers (one line saying why)."""


def jobqueue_problem(config: ClusterConfig) -> str | None:
    """What stops `cluster.jobqueue` before anything is submitted, as one line:
    dask-jobqueue missing, the batch system's submit command missing, or (Slurm) a
    partition it does not have. None if nothing does."""
    jobqueue = config.jobqueue
    if jobqueue is None:
        return None
    if importlib.util.find_spec("dask_jobqueue") is None:
        return ("cluster.jobqueue needs dask-jobqueue, which is not installed: "
                "pip install -c constraints.txt -e '.[slurm]'")
    submit = SUBMIT_COMMANDS[jobqueue.system]
    if shutil.which(submit) is None:
        return (f"cluster.jobqueue.system: {jobqueue.system}, but its `{submit}` is not on "
                "this machine's PATH (run from a login node of the cluster)")
    if jobqueue.system == "slurm":
        return partition_problem(jobqueue, config.tags()[0])
    return None


def partition_problem(jobqueue: JobqueueConfig, tag: str) -> str | None:
    """A `queue` of the jobs that Slurm has no partition of, or a Slurm that does not
    answer, as one line; None if every partition named exists."""
    wanted = [g.queue for g in jobqueue.group_list(tag) if g.queue]
    if not wanted:
        return None
    try:
        listed = batch_command(["sinfo", "-h", "-o", "%R"])
    except JobqueueError as error:
        return f"cluster.jobqueue: {error}"
    partitions = sorted(set(listed.split()))
    for queue in wanted:
        if queue not in partitions:
            return (f"cluster.jobqueue.queue: Slurm has no partition '{queue}' (partitions: "
                    f"{', '.join(partitions) or 'none'})")
    return None


def batch_command(command: list[str]) -> str:
    """The output of a batch system's command; JobqueueError with its last line of
    error if it fails or takes longer than `COMMAND_TIMEOUT_S`."""
    try:
        done = subprocess.run(command, capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise JobqueueError(f"`{command[0]}` failed ({type(error).__name__}: {error})") from None
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
        raise JobqueueError(f"`{command[0]}` failed (exit {done.returncode}): {lines[-1]}")
    return done.stdout


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


def start_jobqueue_cluster(config: ClusterConfig, folder: str) -> Any:
    """A dask-jobqueue cluster of the config's batch system, its scheduler in this
    process, every job of every group submitted; credentials, job logs and the
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
    with dask.config.set(QUIET):
        cluster = cls(n_workers=0, name=jobqueue.system, silence_logs=logging.ERROR,
                      scheduler_options={**where, "dashboard_address": "127.0.0.1:0",
                                         # not Dask's shared default (embedded.py's doc)
                                         "local_directory": folder},
                      **job_options(jobqueue, groups[0], security, folder))
    try:
        for group, names in zip(groups, worker_names(jobqueue.system, groups)):
            options = job_options(jobqueue, group, security, folder)
            options["config_name"] = cls.job_cls.config_name
            for name in names:  # the job named after its worker (squeue, its log's name)
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


def job_ids(cluster: Any) -> dict[str, str]:
    """Each submitted job's id by its worker's name."""
    return {name: str(job.job_id) for name, job in cluster.workers.items()
            if getattr(job, "job_id", None)}


def slurm_states(ids: list[str]) -> dict[str, tuple[str, str]]:
    """(state, reason) of each of the Slurm jobs `ids` that `squeue` still lists."""
    if not ids:
        return {}
    listed = batch_command(["squeue", "-h", "-j", ",".join(ids), "-o", "%i %T %r"])
    states = {}
    for line in listed.splitlines():
        parts = line.split(None, 2)
        if len(parts) >= 2:
            states[parts[0]] = (parts[1], parts[2] if len(parts) > 2 else "")
    return states


def pending_summary(states: dict[str, tuple[str, str]], waiting: list[str]) -> str:
    """What the queue says of the jobs whose workers have not joined (`waiting`, their
    ids), e.g. ``2 pending (Resources), 1 starting``: a pure function of `squeue`'s
    answer."""
    pending = Counter(states[i][1] or "no reason given" for i in waiting
                      if i in states and states[i][0] == "PENDING")
    parts = [f"{count} pending ({reason})" for reason, count in sorted(pending.items())]
    running = sum(1 for i in waiting if i in states and states[i][0] != "PENDING")
    if running:
        parts.append(f"{running} starting")
    return ", ".join(parts)


def ended_jobs(states: dict[str, tuple[str, str]], waiting: dict[str, str]) -> list[str]:
    """Names (of `waiting`: job id by worker name) whose job ended without its worker
    joining: in an ended state, or no longer listed at all."""
    return [name for name, job in waiting.items()
            if job not in states or states[job][0] in ENDED_STATES]


def log_tail(folder: str, job: str) -> str:
    """The last lines of a job's error log in `folder` (dask-jobqueue names it
    `<job name>-<id>.err`), joined by ' | '."""
    for name in os.listdir(folder):
        if name.endswith(f"-{job}.err"):
            with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as log:
                return " | ".join(log.read().strip().splitlines()[-3:])
    return "no log"


def wait_for_jobs(cluster: Any, jobqueue: JobqueueConfig, wanted: int, timeout: float,
                  folder: str, progress: JobProgress) -> None:
    """Wait until `wanted` workers of the jobs have joined, telling `progress` how many
    are up and what the queue says of the rest; JobqueueError (one line) when a job
    ends before its worker joined, or after `timeout` seconds."""
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
        ended = ended_jobs(states, waiting) if jobqueue.system == "slurm" else []
        if ended:
            job = waiting[ended[0]]
            state = states.get(job, ("ended",))[0]
            raise JobqueueError(f"cluster.jobqueue: {jobqueue.system} job {job} ({ended[0]}) "
                                f"ended ({state}) before its worker joined; its log: "
                                f"{log_tail(folder, job)}")
        if time.monotonic() > deadline:
            raise JobqueueError(f"cluster.jobqueue: {len(joined)} of {wanted} worker(s) up "
                                f"after {timeout:g} s ({detail or 'no job listed'}); raise "
                                "cluster.wait_timeout if the queue is busy")
        time.sleep(0.25)


def cancel_jobs(system: str, ids: list[str]) -> None:
    """Cancel batch jobs by id (`scancel`, `qdel`); jobs already gone are no error."""
    if ids:
        command = "scancel" if system == "slurm" else "qdel"
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run([command, *ids], capture_output=True, timeout=COMMAND_TIMEOUT_S,
                           check=False)


def close_jobqueue_cluster(cluster: Any) -> None:
    """Tell every worker to exit (its job then ends by itself), close the scheduler
    and cancel every job it submitted, even if closing fails half-way (dask-jobqueue
    cancels them one by one as it closes its workers)."""
    ids = list(job_ids(cluster).values())
    try:
        with contextlib.suppress(Exception):  # a scheduler already gone closes nothing
            cluster.sync(_close_workers, cluster.scheduler)
        cluster.close()
    finally:
        cancel_jobs(cluster.job_cls.config_name, ids)


async def _close_workers(scheduler: Any) -> None:
    """Remove every worker from `scheduler`, telling each to close."""
    await asyncio.gather(*(scheduler.remove_worker(address, stimulus_id="jobqueue-closed",
                                                   close=True)
                           for address in list(scheduler.workers)))


@contextlib.contextmanager
def open_jobqueue_client(config: ClusterConfig, progress: JobProgress | None = None
                         ) -> Iterator[Client]:
    """A client to a fresh cluster of batch jobs (`start_jobqueue_cluster`) once
    `cluster.use_workers` (else all) of its workers have joined; every job cancelled,
    the credentials and logs removed, when the block ends."""
    jobqueue = config.jobqueue
    assert jobqueue is not None
    problem = jobqueue_problem(config)
    if problem:
        raise JobqueueError(problem)
    parent = jobqueue.directory or os.path.expanduser("~")
    folder = tempfile.mkdtemp(prefix=".hetcnn-jobqueue-", dir=parent)  # mode 0700
    try:
        cluster = start_jobqueue_cluster(config, folder)
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
