"""What a batch system says of a run's jobs (`cluster.jobqueue`), read through its
commands: its partitions (`sinfo`), each job's state and the queue's reason for a
pending one (`squeue`), and which of those mean a job's worker will never join (it
ended, or Slurm keeps it pending for a reason no wait clears: more cores than a
node has, a walltime over the partition's limit); a job's log; cancelling jobs
(`scancel`, `qdel`). Each command is bounded (`COMMAND_TIMEOUT_S`) and its failure is
one line (`JobqueueError`). pipeline/cluster/jobqueue.py starts the jobs and waits on
them with these.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections import Counter

from pipeline.config.jobqueue_config import JobqueueConfig

#: Slurm job states after which a job's worker will never join.
ENDED_STATES = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
                "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT"}
#: Slurm's reasons for a pending job that no wait clears (the job asks for what its
#: partition or account will never give), with the fields that ask for it.
NEVER_STARTS = {
    "PartitionConfig": "more than the partition's nodes have: cluster.jobqueue.cores, "
                       "memory or extra",
    "PartitionNodeLimit": "more nodes than the partition allows: cluster.jobqueue.extra",
    "PartitionTimeLimit": "more time than the partition allows: cluster.jobqueue.walltime",
    "BadConstraints": "constraints no node has: cluster.jobqueue.extra",
    "DependencyNeverSatisfied": "a dependency never met: cluster.jobqueue.extra",
    "InvalidAccount": "an account it may not use: cluster.jobqueue.account",
    "InvalidQOS": "a QOS it may not use: cluster.jobqueue.extra"}
#: Seconds a batch command (`sinfo`, `squeue`, `scancel`) may take.
COMMAND_TIMEOUT_S = 20.0


class JobqueueError(RuntimeError):
    """The batch system cannot give the run its workers (one line saying why)."""


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


def slurm_states(ids: list[str]) -> dict[str, tuple[str, ...]]:
    """(state, reason, partition) of each of the Slurm jobs `ids` that `squeue` still
    lists, ended ones included (`-t all`: without it, `squeue -j` hides a job that
    has ended, `FAILED` or `TIMEOUT`, for the minutes Slurm keeps it, `MinJobAge`)."""
    if not ids:
        return {}
    listed = batch_command(["squeue", "-h", "-t", "all", "-j", ",".join(ids),
                            "-o", "%i %T %P %r"])
    states = {}
    for line in listed.splitlines():
        parts = line.split(None, 3)
        if len(parts) >= 3:
            states[parts[0]] = (parts[1], parts[3] if len(parts) > 3 else "", parts[2])
    return states


def partitions_of(states: dict[str, tuple[str, ...]], waiting: list[str]) -> str:
    """Where the jobs `waiting` (ids) wait, as a sentence's end: `` in Slurm partition
    debug`` (`` partitions cpu, gpu``); "" where `squeue` did not say."""
    names = sorted({states[i][2] for i in waiting if i in states and len(states[i]) > 2})
    if not names:
        return ""
    return f" in Slurm partition{'s' if len(names) > 1 else ''} {', '.join(names)}"


def pending_summary(states: dict[str, tuple[str, ...]], waiting: list[str]) -> str:
    """What the queue says of the jobs whose workers have not joined (`waiting`, their
    ids), e.g. ``2 pending (Resources), 1 starting``: a pure function of `squeue`'s
    answer."""
    pending = Counter(states[i][1] or "no reason given" for i in waiting
                      if i in states and states[i][0] == "PENDING")
    parts = [f"{count} pending ({reason})" for reason, count in sorted(pending.items())]
    running = sum(1 for i in waiting if i in states
                  and states[i][0] not in ENDED_STATES | {"PENDING"})
    if running:
        parts.append(f"{running} starting")
    return ", ".join(parts)


def ended_jobs(states: dict[str, tuple[str, ...]], waiting: dict[str, str]) -> list[str]:
    """Names (of `waiting`: job id by worker name) whose job ended without its worker
    joining: in an ended state, or no longer listed at all."""
    return [name for name, job in waiting.items()
            if job not in states or states[job][0] in ENDED_STATES]


def never_starting(states: dict[str, tuple[str, ...]], waiting: dict[str, str]
                   ) -> str | None:
    """What stops the first job of `waiting` (job id by worker name) that Slurm keeps
    pending for a reason no wait clears (`NEVER_STARTS`), as one line; None if none."""
    for name, job in waiting.items():
        state, reason = states.get(job, ("", ""))[:2]
        if state == "PENDING" and reason in NEVER_STARTS:
            return (f"cluster.jobqueue: slurm job {job} ({name}) will never start: Slurm "
                    f"keeps it pending ({reason}){partitions_of(states, [job])}: it asks "
                    f"for {NEVER_STARTS[reason]}")
    return None


def wait_advice(states: dict[str, tuple[str, ...]], waiting: dict[str, str]) -> str:
    """What to do about jobs (`waiting`: job id by worker name) whose workers did not
    join in time: release the held ones (a held job waits for a person, not for the
    queue, so a longer wait would not help), else wait longer on a busy queue."""
    held = [job for job in waiting.values()
            if states.get(job, ("", ""))[1].startswith("JobHeld")]
    if held:
        return (f"job(s) {', '.join(held)} are held: release them "
                f"(scontrol release {','.join(held)}) and start the run again")
    return "raise cluster.wait_timeout if the queue is busy"


def log_tail(folder: str, job: str) -> str:
    """The last lines of a job's error log in `folder` (dask-jobqueue names it
    `<job name>-<id>.err`), joined by ' | '."""
    for name in os.listdir(folder):
        if name.endswith(f"-{job}.err"):
            with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as log:
                return " | ".join(log.read().strip().splitlines()[-3:])
    return "no log"


def cancel_jobs(system: str, ids: list[str]) -> None:
    """Cancel batch jobs by id (`scancel`, `qdel`); jobs already gone are no error."""
    if ids:
        command = "scancel" if system == "slurm" else "qdel"
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run([command, *ids], capture_output=True, timeout=COMMAND_TIMEOUT_S,
                           check=False)
