"""Which of `cluster.jobqueue`'s batch jobs a run holds: on a shared cluster a job
that holds its allocation idle for the whole run costs the user's share (and others'
wait) for nothing.

Before submission (`jobs_to_submit`, pure): where the config alone says which workers
the run uses, only their jobs are submitted: the first `cluster.use_workers` in the
order the run takes its workers (by tag, then name: `tagged_workers`), with the master
where it is named outside them; and for a strategy that trains on one worker
(`single`) without `use_workers`, the master's job alone. After placement
(`release_idle_jobs`): a run that turns out to train on one worker (`auto` picking
`single`, or `single` with `use_workers`) cancels the jobs of the workers it will not
use. A sweep keeps its jobs for its other points (it submits them itself).
"""

from __future__ import annotations

from typing import Any, Callable

from pipeline.cluster.jobqueue import release_jobs, worker_names
from pipeline.cluster.workers import ClusterWorker, tagged_workers
from pipeline.config.cluster_config import ClusterConfig


def job_table(config: ClusterConfig) -> dict[str, dict[str, Any]]:
    """Every job's worker as the scheduler will list it (name, tags), by name."""
    jobqueue = config.jobqueue
    assert jobqueue is not None
    groups = jobqueue.group_list(config.tags()[0])
    return {name: {"name": name, "resources": group.resources}
            for group, names in zip(groups, worker_names(jobqueue.system, groups))
            for name in names}


def _master(wanted: str | None, offered: list[str], table: dict[str, dict[str, Any]]
            ) -> str | None:
    """The master's worker name as `add_master` will find it: the first of `offered`
    (unset), the first of them named or tagged `wanted`, else the first of all by
    name; None where no job's worker is."""
    if wanted is None:
        return offered[0] if offered else None

    def fits(name: str) -> bool:
        return name == wanted or table[name]["resources"].get(wanted, 0) >= 1

    return next((n for n in offered if fits(n)), None) or next(
        (n for n in sorted(table) if fits(n)), None)


def jobs_to_submit(config: ClusterConfig, one_worker: bool, strategy: str
                   ) -> tuple[list[str] | None, str]:
    """The workers (jobs) a run of `config` submits, and the line that says why fewer
    than `cluster.jobqueue` asks for; (None, "") where it submits them all (also
    where no job would be the master named: the run then says so as before)."""
    table = job_table(config)
    ordered = [str(info["name"]) for _, info, _ in tagged_workers(table, config.tags())]
    offered = ordered[:config.use_workers] if config.use_workers else ordered
    master = _master(config.master, offered, table)
    if master is None:
        return None, ""
    keep = [] if one_worker and not config.use_workers else list(offered)
    keep += [] if master in keep else [master]
    if len(keep) >= len(table):
        return None, ""
    why = (f"strategy {strategy} trains on one worker" if not config.use_workers
           else f"cluster.use_workers is {config.use_workers}")
    system, idle = config.jobqueue.system, len(table) - len(keep)  # type: ignore[union-attr]
    return keep, (f"{why}: submitting {len(keep)} of the {len(table)} {system} jobs "
                  f"cluster.jobqueue asks for ({idle} more would be idle for the whole run)")


def release_idle_jobs(cluster: Any, say: Callable[[str], None]
                      ) -> Callable[[Any, list[ClusterWorker], list[ClusterWorker]],
                                    list[ClusterWorker]]:
    """What the run calls once its work is placed (`Startup.placed`): given its
    strategy, the workers it trains on and those it was offered, it cancels the jobs
    of every other worker where the strategy trains on one worker, says so in one line,
    and returns the offered workers left."""

    def release(strategy: Any, used: list[ClusterWorker], offered: list[ClusterWorker]
                ) -> list[ClusterWorker]:
        if not strategy.one_worker:
            return offered
        keep = {w.name for w in used}
        released = release_jobs(cluster, keep)
        if released:
            system = cluster.job_cls.config_name
            say(f"strategy {strategy.name} trains on one worker ({', '.join(sorted(keep))}): "
                f"cancelled the {len(released)} other {system} job(s) "
                f"({', '.join(released)}), which would be idle for the whole run")
        return [w for w in offered if w.name not in released]

    return release
