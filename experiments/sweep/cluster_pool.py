"""The cluster a sweep's points run on: `ClusterPool` keeps at most one client open
(an external scheduler's, an embedded cluster's, or batch jobs') and replaces it only
when a point needs another worker set.

Why apart from the run loop (experiments/sweep/run.py): which cluster serves a point,
when its workers are restarted and when batch jobs are submitted again is its own
job, and tests drive it alone.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from contextlib import ExitStack
from typing import Any, Callable

from experiments.sweep.points import Point
from pipeline.cluster.connect import open_client
from pipeline.cluster.embedded import restart_workers
from pipeline.cluster.job_ends import lost_at_walltime
from pipeline.cluster.job_ends import submitting_line
from pipeline.cluster.scheduler_guard import guarded
from pipeline.cluster.startup import start_batch, usable_cores
from pipeline.cluster.worker_setup import run_workers_set_up, setup_scope
from pipeline.cluster.workers import ClusterError
from pipeline.config.run_config import RunConfig


def sweep_directories(config: RunConfig) -> list[str]:
    """What the workers of a point's cluster read and write, for every point it serves:
    the workspace root, the dataset's folder and the folder of the points' output
    directories (mounted over the link where the workers sit behind `cluster.link`)."""
    workspace, dataset, output = config.shared_directories()
    return [workspace, dataset, os.path.dirname(output)]


class ClusterPool:
    """At most one open client: the external scheduler's, or the embedded cluster of
    the current worker set, replaced when a point needs another set. Batch jobs that
    did not give their workers (still queued after `cluster.wait_timeout`, never to
    start, refused) are not submitted again for the next points of the same jobs:
    those fail at once with the same reason, rather than each queue (and wait) anew."""

    def __init__(self, echo: Callable[[str], None]) -> None:
        self.echo = echo
        self.key: str | None = None
        self.scope: Any = None  # which workers its setup serves (`setup_scope`)
        self.client: Any = None
        self._stack: ExitStack | None = None
        self._jobs_failed: dict[str, str] = {}  # why, by cluster key
        self._said: set[str] = set()  # the clusters described so far (`_describe`)

    def client_for(self, point: Point) -> Any:
        if point.cluster_key is None:
            return None
        scope = setup_scope(point.config.cluster)  # another: set up again, on a new client
        if self.client is not None and (self.key, self.scope) == (point.cluster_key, scope):
            if self._renew_workers(point):
                return self.client
        self.close()
        if point.cluster_key in self._jobs_failed:
            raise ClusterError(f"{self._jobs_failed[point.cluster_key]} (for an earlier point "
                               "of the same jobs; not submitted again: run the sweep again "
                               "to retry)")
        stack = ExitStack()
        workers, cluster = point.config.cluster.worker_list(), point.config.cluster
        jobqueue = cluster.jobqueue
        if jobqueue is not None:  # every job, whatever this point's use_workers: the
            cluster = dataclasses.replace(cluster, use_workers=None)  # set's points share them
        if jobqueue is not None:
            self.echo(f"{submitting_line(jobqueue, jobqueue.job_count())} ...")
        elif point.cluster_key != "external":  # minutes, for many workers on few cores
            self.echo(f"starting an embedded cluster of {len(workers)} worker(s) ...")
        try:
            client = stack.enter_context(open_client(
                cluster, sweep_directories(point.config),
                batch=start_batch(len(workers), usable_cores())))
            with guarded(client, point.config.cluster.scheduler_timeout,
                         "setting up the workers"):
                stack.enter_context(run_workers_set_up(client, point.config.cluster,
                                                       self.echo))
        except BaseException as error:
            stack.close()
            if jobqueue is not None and isinstance(error, ClusterError):
                self._jobs_failed[point.cluster_key] = " ".join(str(error).split())
            raise
        self._stack, self.client, self.key, self.scope = stack, client, point.cluster_key, scope
        described = self._describe(point, client)
        if described not in self._said:  # a scheduler you started, connected to again
            self._said.add(described)    # after a failed point: said once
            self.echo(described)
        return client

    def _renew_workers(self, point: Point) -> bool:
        """Before a point that reuses an embedded cluster, its workers replaced by fresh
        ones (`restart_workers`: each point starts from the workers a standalone run
        has); False where that failed and the cluster must be started again. An
        external scheduler's workers and workers behind links are left as they are
        (not this sweep's to restart, or not measured); so are batch jobs, unless a
        worker of them is gone (its job ended: said at its walltime, `lost_at_walltime`):
        then fresh jobs."""
        cluster = point.config.cluster
        if cluster.jobqueue is not None:
            wanted = cluster.use_workers or cluster.jobqueue.job_count()
            up = len(self.client.nthreads())
            if up < wanted:
                why, _fields = lost_at_walltime(self.client, self._gone_jobs())
                self.echo(f"{wanted - up} of {wanted} {cluster.jobqueue.system} job(s) "
                          f"ended since the last point{f': {why}' if why else ''}; "
                          "starting them again")
            return up >= wanted
        if point.cluster_key == "external" or cluster.link_rates() is not None:
            return True
        try:
            restart_workers(self.client)
        except Exception as error:  # noqa: BLE001 - any failure: start the cluster again
            why = ("they did not all come back in time" if isinstance(error, TimeoutError)
                   else " ".join(str(error).split()) or repr(error))
            self.echo(f"restarting the workers failed ({why}); starting the cluster again")
            return False
        return True

    def _gone_jobs(self) -> list[str]:
        """Names of the batch jobs whose workers are no longer in the cluster."""
        jobs = getattr(getattr(self.client, "cluster", None), "workers", {}) or {}
        up = {str(w.get("name")) for w in self.client.scheduler_info()["workers"].values()}
        return [str(name) for name in jobs if str(name) not in up]

    @staticmethod
    def _describe(point: Point, client: Any) -> str:
        jobqueue = point.config.cluster.jobqueue
        if point.cluster_key == "external":
            where = f"scheduler {client.scheduler.address}"
        elif jobqueue is not None:
            names = sorted(str(w["name"]) for w in client.scheduler_info()["workers"].values())
            where = f"{len(names)} {jobqueue.system} job(s) [{' '.join(names)}]"
        else:
            workers = point.config.cluster.worker_list()
            where = (f"embedded cluster of {len(workers)} worker(s) "
                     f"[{' '.join(w.name or '' for w in workers)}]")
        if importlib.util.find_spec("bokeh") is None:
            return f"{where}; dask dashboard: not served (pip install bokeh>=3.1 for it)"
        return f"{where}; dask dashboard: {client.dashboard_link}"

    def discard(self) -> None:
        """Drop the cluster after a failed point: a worker may be dead or hold state."""
        self.close()

    def close(self) -> None:
        if self._stack is not None:
            stack, self._stack, self.client, self.key = self._stack, None, None, None
            stack.close()
