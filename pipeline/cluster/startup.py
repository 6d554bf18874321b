"""A run's own cluster started (`start_cluster`), and what the run says before its
first step: too many workers for the cores, and how far the start has got.

Every worker of an embedded cluster is a process of its own that imports torch
(about 2.5 s of CPU each) and, with `placement: calibrated`, times its shards
while all the others do too. 64 workers on 2 cores took minutes before the first
line of output (docs/reliability.md). So a run that starts its own workers warns,
in one line, when their torch threads outnumber this machine's cores
(`contention_warning`), and with `progress: true` says what it is doing
(`Startup.phase`): a line once a phase has taken a second, one every `HEARTBEAT_S`
seconds while it lasts (with its count, where known), and one when it is done.
`start_cluster` is where the run starts (or connects to) its cluster and says so.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Any, Callable, Iterator, Sequence, TextIO

from distributed import Client

from pipeline.cluster.scheduler_guard import guarded
from pipeline.cluster.workers import ClusterWorker, scheduler_address
from pipeline.cluster.connect import open_jobqueue, open_run_client
from pipeline.cluster.job_choice import jobs_to_submit, release_idle_jobs
from pipeline.cluster.job_ends import submitting_line
from pipeline.cluster.worker_setup import register_setup, run_workers_set_up
from pipeline.cluster.links import LinkedHosts
from pipeline.config.run_config import RunConfig
from pipeline.config.cluster_config import WorkerConfig
from tasks.machine import usable_cores

#: Seconds between the lines of a phase that goes on.
HEARTBEAT_S = 15.0


def contention_warning(workers: Sequence[WorkerConfig], cores: int) -> str | None:
    """One line when the embedded workers' torch threads outnumber `cores`: they then
    take turns on the cores, so starting and calibrating them is slow, their step
    times measure the contention as well as the strategy, and the performance model,
    which times each op as the probe saw it and prices waits for a peer from the
    spread of the probe's op times, still under-counts the waits for a peer the host
    is not running (docs/model.md, "Uneven steps").
    None when they fit."""
    threads = sum(worker.threads for worker in workers)
    if threads <= cores:
        return None
    count = len(workers)
    fit = max(1, cores // max(1, min(w.threads for w in workers)))
    return (f"warning: cluster.workers: {count} worker process(es) with {threads} torch "
            f"thread(s) in all on {cores} CPU core(s): they take turns, so starting and "
            "calibrating them is slow, step times measure the contention as well as "
            "the strategy, and the model's prediction under-counts a worker's waits for "
            f"a peer that is not running (at most {fit} such worker(s) fit here)")


def start_batch(workers: int, cores: int) -> int:
    """How many embedded workers to start at once: all of them when they fit twice
    over on the cores, else twice the cores (0: all). Each start is mostly CPU
    (torch's import); started all at once on too few cores, none is up until nearly
    all are (64 on 2 cores: the first after 48-78 s at once, 3-4 s in batches of 4,
    all of them in about the same time)."""
    return 0 if workers <= 2 * cores else 2 * cores


class Phase:
    """One phase of the start; `update` sets the count its next lines show."""

    def __init__(self) -> None:
        self.status = ""

    def update(self, done: int, total: int, detail: str = "") -> None:
        """`done` of `total` up, and what keeps the rest (a batch queue's word)."""
        self.status = f"{done} of {total} up" + (f", {detail}" if detail else "")


class Startup:
    """Prints the start's phases to `out` (stderr) when `enabled`; silent otherwise.

    A phase says nothing until it has taken `after` seconds: a quick one (an even
    placement, a warm start) adds no line, a slow one is announced within a second.
    """

    def __init__(self, name: str, enabled: bool, out: TextIO | None = None,
                 every: float = HEARTBEAT_S, after: float = 1.0) -> None:
        self.name, self.enabled, self.every, self.after = name, enabled, every, after
        self.out = out or sys.stderr
        #: set by `start_cluster` for the run's own batch jobs (`release_idle_jobs`)
        self.release: Callable[..., list[ClusterWorker]] | None = None

    def placed(self, strategy: Any, used: list[ClusterWorker], offered: list[ClusterWorker]
               ) -> list[ClusterWorker]:
        """`offered` less the workers whose batch jobs the run, its work placed on
        `used`, cancelled as idle (pipeline/cluster/job_choice.py); `offered` as it is
        on any other cluster."""
        return self.release(strategy, used, offered) if self.release else offered

    def say(self, line: str) -> None:
        if self.enabled:
            print(f"{self.name}: {line}", file=self.out, flush=True)

    @contextlib.contextmanager
    def phase(self, doing: str, done: str) -> Iterator[Phase]:
        """``doing ...`` once the block has run `after` seconds, ``doing: <count>, N s
        so far`` every `every` seconds after that, and ``done (N s)`` when a block so
        announced ends without an error."""
        phase, stop, said = Phase(), threading.Event(), threading.Event()
        started = time.monotonic()

        def heartbeat() -> None:
            if stop.wait(self.after):
                return
            self.say(f"{doing} ...")
            said.set()
            while not stop.wait(self.every):
                count = f"{phase.status}, " if phase.status else ""
                self.say(f"{doing}: {count}{time.monotonic() - started:.0f} s so far")

        beat = threading.Thread(target=heartbeat, name="startup-heartbeat", daemon=True)
        if self.enabled:
            beat.start()
        try:
            yield phase
        finally:
            stop.set()
            if beat.is_alive():
                beat.join()
        if said.is_set():
            self.say(f"{done} ({time.monotonic() - started:.1f} s)")


@contextlib.contextmanager
def start_cluster(config: RunConfig, startup: Startup, say: Callable[[str], None],
                  one_worker: bool = False) -> Iterator[tuple[Client, LinkedHosts | None]]:
    """A client to the run's own cluster (the embedded one, or `cluster.scheduler`'s),
    its workers set up, and the links they sit behind (None without `cluster.link`).
    Before starting embedded workers, warns when they outnumber the cores
    (`contention_warning`); while they start, tells `startup` how many are up. Batch
    jobs are those the run will use where the config says which (`jobs_to_submit`: a
    strategy that trains on `one_worker`, its master's), said in a line; those its
    placement leaves idle are cancelled then (`Startup.placed`)."""
    with contextlib.ExitStack() as stack:
        jobqueue = config.cluster.jobqueue
        if jobqueue is not None:  # batch jobs: the phase counts them, with the queue's word
            only, why = jobs_to_submit(config.cluster, one_worker, config.strategy)
            if why:
                say(why)
            jobs = len(only) if only else jobqueue.job_count()
            with startup.phase(submitting_line(jobqueue, jobs),  # names their walltime
                               f"{jobs} worker(s) up") as phase:
                client = stack.enter_context(open_jobqueue(config.cluster, phase.update, only))
                register_setup(client, config.cluster)
            startup.release = release_idle_jobs(client.cluster, say)
            yield client, None
            return
        if scheduler_address(config.cluster) is not None:
            client, links = stack.enter_context(open_run_client(
                config.cluster, config.shared_directories()))
            with guarded(client, config.cluster.scheduler_timeout, "setting up the workers"):
                stack.enter_context(run_workers_set_up(client, config.cluster, say))
            yield client, links
            return
        workers = config.cluster.worker_list()
        warning = contention_warning(workers, usable_cores())
        if warning:
            say(warning)
        with startup.phase(f"starting {len(workers)} worker(s) on this machine",
                           f"{len(workers)} worker(s) up") as phase:
            client, links = stack.enter_context(open_run_client(
                config.cluster, config.shared_directories(), phase.update,
                start_batch(len(workers), usable_cores())))
            register_setup(client, config.cluster)  # goes with the embedded cluster
        yield client, links
