"""The run's batch jobs' time limit (`cluster.jobqueue.walltime`): said as the jobs
are submitted, and named when jobs end at it.

Every job of `cluster.jobqueue` asks for a walltime (01:00:00 unless set), and the
batch system ends the job, its worker with it, when it is up: the start line that
says the jobs are being submitted names it (`submitting_line`), so that a long run
does not learn of the default at its first hour. A worker whose job ended so leaves
the cluster like any other lost worker (pipeline/engine/runner.py); Slurm says why
(`squeue`: state TIMEOUT, or COMPLETING with the reason TimeLimit while the job's
processes end; `sacct` once `squeue` no longer lists it), and the lost-worker line
says so (`walltime_note`), naming the field to raise (`WorkerLost.walltime`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pipeline.cluster.batch_queue import JobqueueError, batch_command, slurm_states
from pipeline.config.jobqueue_config import JobqueueConfig

#: `cluster.jobqueue.walltime` when the config leaves it out.
DEFAULT_WALLTIME = next(f.default for f in dataclasses.fields(JobqueueConfig)
                        if f.name == "walltime")
#: (the config field that sets it, its value: None where unset) of a job's walltime.
Limit = tuple[str, "str | None"]


def walltime_limits(jobqueue: JobqueueConfig) -> list[Limit]:
    """Each group's walltime and the field that sets it (a group's own, else
    `cluster.jobqueue.walltime`), in the order of `group_list`."""
    groups = jobqueue.groups or [jobqueue]
    return [(f"cluster.jobqueue.groups.{index}.walltime", group.walltime)
            if jobqueue.groups and group.walltime is not None
            else ("cluster.jobqueue.walltime", jobqueue.walltime)
            for index, group in enumerate(groups)]


def walltime_words(jobqueue: JobqueueConfig) -> str:
    """The jobs' walltime as the start says it: ``walltime 01:00:00 (the default of
    cluster.jobqueue.walltime)``, ``walltime 02:00:00``, ``walltimes 02:00:00,
    04:00:00`` (groups that differ), ``no walltime asked (the queue's time limit)``."""
    limits = walltime_limits(jobqueue)
    values = sorted({value or "" for _field, value in limits})
    if values == [""]:
        return "no walltime asked (the queue's time limit)"
    if len(values) > 1:
        return "walltimes " + ", ".join(value or "the queue's limit" for value in values)
    if values[0] == DEFAULT_WALLTIME and all(field == "cluster.jobqueue.walltime"
                                             for field, _ in limits):
        return f"walltime {values[0]} (the default of cluster.jobqueue.walltime)"
    return f"walltime {values[0]}"


def submitting_line(jobqueue: JobqueueConfig, jobs: int) -> str:
    """What the start says as it submits `jobs` jobs: how many, and when they end
    (a job and its worker end at its walltime)."""
    return f"starting {jobs} {jobqueue.system} job(s) for the workers, {walltime_words(jobqueue)}"


def timed_out(states: dict[str, tuple[str, ...]], jobs: dict[str, str]) -> list[str]:
    """Names (of `jobs`: job id by worker name) whose Slurm job ended at its walltime:
    state TIMEOUT, or the reason TimeLimit (the job still completing). A pure
    function of `squeue`'s (or `sacct`'s) answer."""
    return [name for name, job in jobs.items()
            if job in states and (states[job][0] == "TIMEOUT"
                                  or states[job][1:2] == ("TimeLimit",))]


def walltime_note(ended: list[str], gone: list[str], limits: dict[str, Limit],
                  system: str) -> tuple[str, str]:
    """What the lost-worker line says of the workers `ended` (of those `gone`) whose
    jobs reached their walltime, and the field(s) to raise: ("", "") where none did.
    ``their slurm jobs reached their walltime (cluster.jobqueue.walltime: 00:01:00)``;
    ``slurm-1's slurm job reached ...`` where only some of those gone did."""
    if not ended:
        return "", ""
    set_by = sorted({limits.get(name, ("cluster.jobqueue.walltime", None)) for name in ended},
                    key=lambda limit: limit[0])
    fields = ", ".join(sorted({field for field, _ in set_by}))
    values = ", ".join(f"{field}: {value}" if value else
                       f"{field} unset: the queue's time limit" for field, value in set_by)
    if len(ended) == len(gone):
        whose = f"their {system} jobs" if len(gone) > 1 else f"its {system} job"
    else:
        whose = f"{', '.join(ended)}'s {system} job{'s' * (len(ended) > 1)}"
    their = "their" if len(ended) > 1 else "its"
    return f"{whose} reached {their} walltime ({values})", fields


def job_states(system: str, jobs: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """(state, reason) of the Slurm jobs `jobs` (id by name): `squeue`'s, and
    `sacct`'s for those it no longer lists; {} where neither answers (or not Slurm)."""
    if system != "slurm" or not jobs:
        return {}
    try:
        states = slurm_states(list(jobs.values()))
    except JobqueueError:
        states = {}
    rest = [job for job in jobs.values() if job not in states]
    if rest:
        try:  # fails where Slurm keeps no accounting: squeue's answer is then all
            listed = batch_command(["sacct", "-n", "-X", "-P", "-j", ",".join(rest),
                                    "-o", "JobID,State"])
        except JobqueueError:
            listed = ""
        for line in listed.splitlines():
            job, _, state = line.partition("|")
            if job in rest and state:
                states[job] = (state.split()[0], "")
    return states


def lost_at_walltime(client: Any, names: list[str]) -> tuple[str, str]:
    """`walltime_note` for the workers `names` the run lost, where `client` is to the
    run's own batch jobs (`start_jobqueue_cluster` keeps their walltimes on the
    cluster); ("", "") on any other cluster, or where the batch system does not say."""
    cluster = getattr(client, "cluster", None)
    limits = getattr(cluster, "hetcnn_walltimes", None)
    if not limits:
        return "", ""
    ids = {name: str(job.job_id) for name, job in cluster.workers.items()
           if name in names and getattr(job, "job_id", None)}
    system = cluster.job_cls.config_name
    return walltime_note(timed_out(job_states(system, ids), ids), names, limits, system)
