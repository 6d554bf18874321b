"""The run's workers as the scheduler lists them: who is there now, which offer the
run's tags, which one is the master, which no longer answer; and the errors a cluster
raises.

Apart from connecting (connect.py) because every layer that holds workers (the engine,
placement, probes, strategies) needs these and nothing of how a cluster was started.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

import psutil
from distributed import Client, SpecCluster

from pipeline.config.cluster_config import ClusterConfig

#: Seconds one question to a watched scheduler may take (`SchedulerWatch`), and the
#: most seconds of its silence before the run says so.
ASK_S, WARN_S = 5.0, 30.0



class ClusterError(RuntimeError):
    """The cluster cannot serve this run (unreachable, missing tag, worker lost)."""


class TooFewWorkers(ClusterError):
    """Fewer workers than the run wants offer its tags after `cluster.wait_timeout`:
    `found` of `wanted`, for `tags` (a sweep's later points that want as many or more
    fail at once rather than wait again)."""

    def __init__(self, message: str, tags: list[str], found: int, wanted: int) -> None:
        super().__init__(message)
        self.tags, self.found, self.wanted = tuple(tags), found, wanted


class WorkerLost(ClusterError):
    """Workers of the run left the cluster: their state (shards, replicas) is gone.

    Carries the lost workers' addresses, so that a recovery can re-place their
    share on the survivors (pipeline/training/recovery.py).
    """

    def __init__(self, message: str, addresses: list[str], labels: list[str],
                 stalled: bool = False, memory: bool = False, walltime: str = "") -> None:
        super().__init__(message)
        self.addresses = addresses
        self.labels = labels
        self.stalled = stalled  # still in the cluster but frozen: fenced off, not dead
        self.memory = memory  # lost at its memory limit: a resume would meet it again
        # their batch jobs reached their walltime: the field(s) that set it
        # (pipeline/cluster/job_ends.py), "" otherwise
        self.walltime = walltime

    def reworded(self, message: str) -> "WorkerLost":
        """The same loss said as `message` (what the run adds: no worker left, the
        recoveries used up), its workers and causes kept."""
        return WorkerLost(message, self.addresses, self.labels, memory=self.memory,
                          walltime=self.walltime)


class SchedulerUnreachable(ClusterError):
    """The scheduler a run was given cannot be connected to (nothing listens, the TLS
    handshake failed, or what answers is not a Dask scheduler): no run can start there
    until the address is mended, so a sweep stops rather than fail every point."""


class SchedulerLost(ClusterError):
    """The client lost its Dask scheduler: every task and worker of the run is gone."""


@dataclass(frozen=True)
class ClusterWorker:
    """A worker of the cluster as a run sees it: where it is, the tag it serves under,
    its torch threads and (embedded clusters) its emulated speed and device."""

    address: str
    name: str
    resource: str  # the tag it serves this run under
    threads: int
    emulated_speed: float  # 1.0 unless the worker emulates a slower device
    device: str = ""  # "cpu", "cuda:N" where the config says; "" (external) until set up
    # how much of `resource` the worker offers: each task of the run asks for all of it,
    # so the worker runs one of the run's tasks at a time (the step graph's order)
    amount: float = 1.0

    @property
    def label(self) -> str:
        if self.emulated_speed < 1.0:
            return f"{self.name} (emulated {self.emulated_speed:g}x speed)"
        return self.name


class SchedulerSilent(SchedulerLost):
    """The scheduler's process is there (its connection open) but has not answered for
    `cluster.scheduler_timeout` seconds: stopped (SIGSTOP), or its host frozen."""

    def __init__(self, seconds: float, limit: float) -> None:
        super().__init__(f"it did not answer for {seconds:.0f} s (cluster.scheduler_timeout: "
                         f"{limit:g} s)")
        self.seconds, self.limit = seconds, limit


class SchedulerWatch:
    """How long a run waits for a scheduler that stops answering.

    Dask's client never times out a question on an open connection, so a stopped
    scheduler held a run silently until it woke. With a watch, `live_workers` asks in
    slices of `ask_s`; after `warn_s` without an answer the run says so (once), and
    after `limit` it counts the scheduler as lost (`SchedulerSilent`). The limit is
    generous by default: a busy scheduler answers late, a stopped one never."""

    def __init__(self, limit: float | None, address: str,
                 say: Callable[[str], None] = lambda line: print(line, file=sys.stderr)
                 ) -> None:
        self.limit, self.address, self.say = limit, address, say
        self.silent_since: float | None = None
        self.warned = False

    def ask_s(self) -> float:
        """Seconds one question has: `ASK_S`, or a quarter of a short limit (so that
        the warning comes before it)."""
        return ASK_S if self.limit is None else min(ASK_S, self.limit / 4)

    def warn_s(self) -> float:
        """Seconds of silence before the warning: `WARN_S`, or half the limit."""
        return WARN_S if self.limit is None else min(WARN_S, self.limit / 2)

    def unanswered(self) -> None:
        """A question went unanswered: warn once, or raise past the limit."""
        now = time.monotonic()
        self.silent_since = self.silent_since or now - self.ask_s()
        silent = now - self.silent_since
        if self.limit is not None and silent >= self.limit:
            raise SchedulerSilent(silent, self.limit)
        if not self.warned and silent >= self.warn_s():
            self.warned = True
            until = ("for ever (cluster.scheduler_timeout: null)" if self.limit is None else
                     f"up to cluster.scheduler_timeout ({self.limit:g} s) in all")
            self.say(f"warning: the Dask scheduler at {self.address} has not answered for "
                     f"{silent:.0f} s (stopped, or its host frozen?); the run waits for it "
                     f"{until}")

    def answered(self) -> None:
        if self.warned:
            self.say(f"the Dask scheduler at {self.address} answers again, after "
                     f"{time.monotonic() - (self.silent_since or 0):.0f} s")
        self.silent_since, self.warned = None, False


def live_workers(client: Client, patience: float = 10.0,
                 watch: SchedulerWatch | None = None) -> dict[str, dict]:
    """The scheduler's workers now, by address; SchedulerLost if it cannot say.

    Asks the scheduler itself: `Client.scheduler_info` answers from a cache when
    the scheduler is slow to respond, and that cache may list no workers at all,
    which would read as every worker lost. A busy scheduler is asked again for
    `patience` seconds. With a `watch`, each question has `watch.ask_s()`, and a
    scheduler that answers none counts as lost after the watch's limit.
    """
    deadline = time.monotonic() + patience
    while True:
        if client.status != "running":
            raise SchedulerLost(f"lost the Dask scheduler ({client.status})")
        try:
            workers = dict(client.sync(client.scheduler.identity, n_workers=-1,
                                       callback_timeout=watch.ask_s() if watch else None)["workers"])
        except OSError as error:
            if watch is not None and isinstance(error, TimeoutError):  # none in time
                watch.unanswered()
                continue
            if time.monotonic() > deadline:
                raise SchedulerLost(f"lost the Dask scheduler ({type(error).__name__})"
                                    ) from None
            time.sleep(0.5)
        else:
            if watch is not None:
                watch.answered()
            return workers


def abandon_client(client: Client) -> None:
    """Close `client` towards a scheduler that stopped answering, giving it `ASK_S`:
    its connection stays open to a silent peer, so what the run's unwinding asks of
    it (releasing futures, unregistering its setup) would wait for ever; a closed
    client refuses them at once, as after a scheduler that died."""
    try:
        client.sync(client._close, fast=True, callback_timeout=ASK_S)
    except Exception:  # noqa: BLE001 - closing a client to a frozen peer: best effort
        pass


def unresponsive(client: Client, addresses: list[str], timeout: float = 5.0) -> list[str]:
    """Those of `addresses` whose worker does not answer a direct `identity` call
    within `timeout` seconds (a stopped or frozen process: its kernel still accepts
    the connection, but nothing replies). A busy worker answers: its event loop runs
    beside its task thread."""

    async def answers(address: str) -> bool:
        try:
            await asyncio.wait_for(client.rpc(address).identity(), timeout)
            return True
        except (asyncio.TimeoutError, OSError):
            return False

    async def probe() -> list[bool]:
        return await asyncio.gather(*(answers(a) for a in addresses))

    replies = client.sync(probe)
    return [address for address, answered in zip(addresses, replies) if not answered]


def fence_workers(client: Client, addresses: list[str]) -> None:
    """Remove workers from the cluster, so that a frozen one that wakes up gets no task
    of the run again: the scheduler forgets it (its queued tasks are released, and it
    is told to close, which it does once it runs), and `live_workers` no longer lists
    it. Nested so that cloudpickle sends it by value: the scheduler's Python need not
    have this project."""

    async def remove(dask_scheduler: Any) -> None:
        for address in addresses:
            await dask_scheduler.remove_worker(address, stimulus_id="run-fenced-stalled-worker",
                                               close=True)

    client.run_on_scheduler(remove)


def all_local(offered: list[ClusterWorker]) -> bool:
    """Whether every worker runs on this host (so /dev/shm is shared with them)."""
    local = {"127.0.0.1", "::1", "localhost", socket.gethostname()}
    for addresses in psutil.net_if_addrs().values():
        local.update(a.address.split("%")[0] for a in addresses)
    return all(urlsplit(worker.address).hostname in local for worker in offered)


def scheduler_in_process(client: Client) -> bool:
    """Whether the client's scheduler runs in this process (an embedded or linked
    cluster started here): then its work per task is this process's CPU."""
    return isinstance(getattr(client, "cluster", None), SpecCluster)


def scheduler_address(config: ClusterConfig) -> str | None:
    """The scheduler to use: the config's, else $DASK_SCHEDULER_ADDRESS, else None.

    None with `cluster.link`: links shape only the embedded cluster a run starts."""
    if config.link_rates() is not None:
        return None
    return config.scheduler or os.environ.get("DASK_SCHEDULER_ADDRESS") or None


def started_elsewhere(config: ClusterConfig) -> bool:
    """Whether the cluster's workers were started by another process than this one: by
    hand (a scheduler named) or as batch jobs (which may start after an edit made while
    they queued). Only such workers can run other code than this process, or miss its
    folders (pipeline/cluster/shared_paths.py)."""
    return scheduler_address(config) is not None or config.jobqueue is not None


def _cluster_worker(config: ClusterConfig, address: str, info: dict, tag: str) -> ClusterWorker:
    """A worker as the run sees it; speeds and torch threads are known only for the
    workers of an embedded cluster (external workers count as real, full speed)."""
    name = str(info.get("name"))
    embedded = {} if scheduler_address(config) else {w.name: w for w in config.worker_list()}
    worker = embedded.get(name)
    return ClusterWorker(address, name, tag,
                         worker.threads if worker else int(info["nthreads"]),
                         worker.speed if worker else 1.0, worker.device if worker else "",
                         float(info.get("resources", {}).get(tag) or 1.0))


def tagged_workers(workers: dict[str, dict], tags: list[str]) -> list[tuple[str, dict, str]]:
    """``(address, info, tag)`` of every worker offering one of `tags` (any amount above
    0: `--resources CPU=0.5` too), ordered by the first tag it offers (in the order
    listed), then by name: a pure function of the scheduler's worker table."""
    found = []
    for address, info in workers.items():
        offered = info.get("resources", {})
        tag = next((t for t in tags if offered.get(t, 0) > 0), None)
        if tag is not None:
            found.append((address, info, tag))
    return sorted(found, key=lambda item: (tags.index(item[2]), str(item[1].get("name"))))


def workers_of(config: ClusterConfig, tagged: list[tuple[str, dict, str]]
               ) -> list[ClusterWorker]:
    """The run's workers among `tagged_workers`: the first `use_workers` (all if unset)."""
    chosen = tagged[: config.use_workers] if config.use_workers else tagged
    return [_cluster_worker(config, address, info, tag) for address, info, tag in chosen]


def current_workers(client: Client, config: ClusterConfig) -> list[ClusterWorker]:
    """The workers a run of this config would take now (no waiting)."""
    return workers_of(config, tagged_workers(live_workers(client), config.tags()))


def find_workers(client: Client, config: ClusterConfig) -> list[ClusterWorker]:
    """Wait (at most `wait_timeout` s) for workers offering the config's tags.

    Returns `use_workers` of them (all, if unset), ordered by tag, then by name.
    Raises a ClusterError naming the tags if too few appear in time: never waits
    silently.
    """
    tags = config.tags()
    wanted = config.use_workers or 1
    deadline = time.monotonic() + config.wait_timeout
    while True:
        workers = live_workers(client)
        tagged = tagged_workers(workers, tags)
        if len(tagged) >= wanted:
            return workers_of(config, tagged)
        if time.monotonic() > deadline:
            raise TooFewWorkers(too_few_workers(tags, len(tagged), wanted,
                                                config.wait_timeout, workers),
                                tags, len(tagged), wanted)
        time.sleep(0.2)


def too_few_workers(tags: list[str], found: int, wanted: int, waited_s: float,
                    workers: dict[str, dict]) -> str:
    """What a run says when fewer than `wanted` workers offer its `tags` after
    `waited_s` seconds: none, or only some; `workers` is the scheduler's table."""
    offered = sorted({t for info in workers.values() for t in info.get("resources", {})})
    tag = "' or '".join(tags)
    connected = (f"{len(workers)} connected, offering: {', '.join(offered) or 'none'}")
    if found == 0:
        return (f"no worker offers resource '{tag}' after {waited_s:g} s ({wanted} needed; "
                f"{connected})")
    return (f"only {found} of the {wanted} workers needed offer resource '{tag}' after "
            f"{waited_s:g} s ({connected})")


def add_master(client: Client, config: ClusterConfig, offered: list[ClusterWorker]
               ) -> tuple[list[ClusterWorker], int]:
    """The run's workers and the index of its master (the worker with the dense head).

    `cluster.master` names a worker or a resource tag; unset, the master is the first
    worker of the run (every CPU worker is alike; the head is a small part of a step).
    A master outside `offered` (another tag, or beyond `use_workers`) joins the run as
    a worker that holds no kernels.
    """
    wanted = config.master
    if wanted is None:
        return offered, 0
    for index, worker in enumerate(offered):
        if worker.name == wanted or worker.resource == wanted:
            return offered, index
    workers = live_workers(client)
    for address, info in sorted(workers.items(), key=lambda item: str(item[1].get("name"))):
        name, tags = str(info.get("name")), info.get("resources", {})
        if name == wanted or tags.get(wanted, 0) > 0:
            tag = wanted if wanted in tags else next(
                (t for t in config.tags() if t in tags), next(iter(tags), config.resource))
            return offered + [_cluster_worker(config, address, info, tag)], len(offered)
    names = ", ".join(sorted(str(info.get("name")) for info in workers.values()))
    raise ClusterError(f"cluster.master: no worker is named or tagged '{wanted}' "
                       f"(workers: {names or 'none'})")
