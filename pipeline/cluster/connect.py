"""Connect to a Dask cluster, or start the embedded one a config describes.

The embedded cluster (started by pipeline/cluster/embedded.py) is a `SpecCluster` (a
LocalCluster gives every worker the same resource tags) of nanny-managed worker
processes, one Dask thread each: a worker runs its tasks one at a time, and its torch
thread count comes from the config.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence
from urllib.parse import urlsplit

import psutil
import torch

import dask
from distributed import Client, Scheduler, SpecCluster

from pipeline.config.run_config import ClusterConfig, WorkerConfig
from pipeline.cluster.embedded import QUIET, Progress, start_embedded_cluster
from pipeline.cluster.links import Host, LinkError, LinkedHosts
from pipeline.cluster.security import (TlsConfig, client_security, connection_problem, run_security,
                                       tls_flags, tls_problem, write_credentials)
from pipeline.cluster.object_store import client_options, start_server, worker_environment
from pipeline.cluster.jobqueue import JobProgress, JobqueueError, open_jobqueue_client
from storage.private import default_workspace_root
from tasks.worker_state import WorkerSetup



class ClusterError(RuntimeError):
    """The cluster cannot serve this run (unreachable, missing tag, worker lost)."""


class WorkerLost(ClusterError):
    """Workers of the run left the cluster: their state (shards, replicas) is gone.

    Carries the lost workers' addresses, so that a recovery can re-place their
    share on the survivors (pipeline/training/recovery.py).
    """

    def __init__(self, message: str, addresses: list[str], labels: list[str],
                 stalled: bool = False, memory: bool = False) -> None:
        super().__init__(message)
        self.addresses = addresses
        self.labels = labels
        self.stalled = stalled  # still in the cluster but frozen: fenced off, not dead
        self.memory = memory  # lost at its memory limit: a resume would meet it again


class SchedulerLost(ClusterError):
    """The client lost its Dask scheduler: every task and worker of the run is gone."""


@dataclass(frozen=True)
class ClusterWorker:
    """A worker of the cluster as a run sees it: where it is, the tag it serves under,
    its torch threads and (embedded clusters) its emulated speed and device."""

    address: str
    name: str
    resource: str  # the tag it serves this run under (its tasks ask for one of it)
    threads: int
    emulated_speed: float  # 1.0 unless the worker emulates a slower device
    device: str = ""  # "cpu", "cuda:N" where the config says; "" (external) until set up

    @property
    def label(self) -> str:
        if self.emulated_speed < 1.0:
            return f"{self.name} (emulated {self.emulated_speed:g}x speed)"
        return self.name


def live_workers(client: Client, patience: float = 10.0) -> dict[str, dict]:
    """The scheduler's workers now, by address; SchedulerLost if it cannot say.

    Asks the scheduler itself: `Client.scheduler_info` answers from a cache when
    the scheduler is slow to respond, and that cache may list no workers at all,
    which would read as every worker lost. A busy scheduler is asked again for
    `patience` seconds.
    """
    deadline = time.monotonic() + patience
    while True:
        if client.status != "running":
            raise SchedulerLost(f"lost the Dask scheduler ({client.status})")
        try:
            return dict(client.sync(client.scheduler.identity, n_workers=-1)["workers"])
        except (OSError, TimeoutError) as error:
            if time.monotonic() > deadline:
                raise SchedulerLost(f"lost the Dask scheduler ({type(error).__name__})"
                                    ) from None
            time.sleep(0.5)


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


def worker_command(scheduler: str, host: Host, worker: WorkerConfig) -> list[str]:
    """A `dask worker` process as the embedded cluster's: one Dask thread, the
    worker's name and tags, no memory limit, listening on its host's address only
    (`--no-dashboard` still serves HTTP, on every interface unless placed: loopback)."""
    tags = ",".join(f"{tag}={amount:g}" for tag, amount in (worker.resources or {}).items())
    return [sys.executable, "-m", "distributed.cli.dask_worker", scheduler,
            "--host", host.address, "--name", str(worker.name), "--nthreads", "1",
            "--resources", tags, "--memory-limit", "0", "--no-nanny", "--no-dashboard",
            "--dashboard-address", "127.0.0.1:0"]


def _quiet_environment() -> dict[str, str]:
    """This process's environment (PYTHONPATH included) with `QUIET` as Dask variables."""
    env = dict(os.environ)
    for key, value in QUIET.items():
        env["DASK_" + key.upper().replace(".", "__").replace("-", "_")] = str(value)
    return env


def start_linked_cluster(config: ClusterConfig, directories: Sequence[str]
                         ) -> tuple[SpecCluster, LinkedHosts]:
    """A scheduler on the links' bridge address (the bridge has no uplink) and one
    `dask worker` per configured worker, each on its own host behind its link, the
    run's `directories` mounted there; returns once every worker has joined. With
    `cluster.link.workspace: s3`, an S3 server on the bridge address first."""
    links = LinkedHosts.start(config.link_rates() or {})
    try:
        if config.workspace_transport() == "s3":
            links.storage_options = start_server(links)
        host, security = links.bridge_address, run_security()
        scheduler = {"cls": Scheduler,
                     "options": {"host": host, "dashboard_address": f"{host}:0",
                                 "protocol": "tls", "security": security}}
        with dask.config.set(QUIET):
            cluster = SpecCluster(workers={}, scheduler=scheduler, silence_logs=logging.ERROR,
                                  security=security)
        try:
            credentials = write_credentials(security, links.directory)
            _start_linked_workers(cluster, links, config, list(directories), credentials)
        except BaseException:
            cluster.close()
            raise
    except BaseException:
        links.close()
        raise
    return cluster, links


def _start_linked_workers(cluster: SpecCluster, links: LinkedHosts, config: ClusterConfig,
                          directories: list[str], credentials: TlsConfig) -> None:
    """Start the workers on their hosts, with the cluster's TLS `credentials` (files
    only this user can read), and wait (`wait_timeout`) for all to join; a worker that
    exits first fails the start with the end of its log."""
    workers = config.worker_list()
    pin_workspace_root(links, directories)
    env, logs = _quiet_environment(), []
    if links.storage_options:
        env.update(worker_environment(links.storage_options))
    for worker, host in zip(workers, links.hosts):
        command = links.command(host, directories,
                                worker_command(cluster.scheduler_address, host, worker)
                                + tls_flags(credentials.ca_file, credentials.cert,
                                            credentials.key or credentials.cert))
        logs.append(os.path.join(links.directory, f"worker-{host.namespace}.log"))
        with open(logs[-1], "w", encoding="utf-8") as log:
            links.spawn(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + config.wait_timeout
    while len(cluster.scheduler_info.get("workers", {})) < len(workers):
        for process, log in zip(links.processes[-len(workers):], logs):
            if process.poll() is not None:
                with open(log, encoding="utf-8") as f:
                    tail = " | ".join(f.read().strip().splitlines()[-3:])
                raise LinkError(f"a linked worker exited ({process.returncode}): {tail}")
        if time.monotonic() > deadline:
            raise LinkError(f"the linked workers did not join in {config.wait_timeout:g} s")
        time.sleep(0.1)


def pin_workspace_root(links: LinkedHosts, directories: Sequence[str]) -> None:
    """Pin the default workspace root if the linked hosts mount it: other runs remove
    it when they find it empty, which would detach it from under the workers."""
    if default_workspace_root() in directories:
        links.pin(default_workspace_root())


@contextlib.contextmanager
def open_linked_cluster(config: ClusterConfig, directories: Sequence[str]
                        ) -> Iterator[tuple[Client, LinkedHosts]]:
    """A client to a fresh linked cluster (`start_linked_cluster`) and its links, whose
    byte counters stay readable until the block ends (and this process's fsspec set
    up for the run's S3 server, if it has one); everything is removed after."""
    try:
        cluster, links = start_linked_cluster(config, directories)
    except (LinkError, OSError) as error:
        raise ClusterError(f"could not start the linked cluster: {error}") from None
    try:
        with Client(cluster, set_as_default=False) as client:
            with client_options(links.storage_options):
                yield client, links
    finally:
        cluster.close()  # the scheduler closes its workers, then their hosts go
        links.close()


@contextlib.contextmanager
def open_client(config: ClusterConfig, directories: Sequence[str] = (),
                progress: Progress | None = None, batch: int = 0) -> Iterator[Client]:
    """A client to the named scheduler, or to a fresh embedded cluster (closed after,
    started `batch` workers at a time and told to `progress`: `start_embedded_cluster`)."""
    with open_run_client(config, directories, progress, batch) as (client, _links):
        yield client


@contextlib.contextmanager
def open_run_client(config: ClusterConfig, directories: Sequence[str] = (),
                    progress: Progress | None = None, batch: int = 0
                    ) -> Iterator[tuple[Client, LinkedHosts | None]]:
    """`open_client`, with the links of a linked cluster (None otherwise).

    With `cluster.link`, the embedded workers sit behind shaped links and reach the
    client's files only through `directories` (the run's `shared_directories`),
    mounted over the link. With `cluster.jobqueue`, the workers are batch jobs
    (`open_jobqueue`).
    """
    if config.jobqueue is not None:
        with open_jobqueue(config) as client:
            yield client, None
        return
    if config.link_rates() is not None:
        check_devices(config.worker_list())
        with open_linked_cluster(config, directories) as opened:
            yield opened
        return
    address = scheduler_address(config)
    problem = tls_problem(address, config.tls)
    if problem:
        raise ClusterError(problem)
    if address:
        try:
            _refused_at_once(address)
            client = Client(address, timeout="10s", set_as_default=False,
                            security=client_security(config.tls))
        except (OSError, TimeoutError) as error:
            raise ClusterError(connection_problem(address, error)) from None
        with client:
            yield client, None
        return
    check_devices(config.worker_list())
    try:
        cluster = start_embedded_cluster(config.worker_list(), progress, batch)
    except Exception as error:  # noqa: BLE001 - distributed wraps the cause in RuntimeError
        raise ClusterError(f"could not start the embedded cluster: {error}") from None
    try:
        with Client(cluster, set_as_default=False) as client:
            yield client, None
    finally:
        cluster.close()


@contextlib.contextmanager
def open_jobqueue(config: ClusterConfig, progress: JobProgress | None = None
                  ) -> Iterator[Client]:
    """`open_jobqueue_client`, its refusals (all made before the block runs) as
    ClusterError."""
    try:
        with open_jobqueue_client(config, progress) as client:
            yield client
    except JobqueueError as error:
        raise ClusterError(str(error)) from None


def check_devices(workers: list[WorkerConfig]) -> None:
    """Refuse, before anything starts, an embedded CUDA worker this machine cannot host."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for worker in workers:
        if worker.device.startswith("cuda"):
            index = int(worker.device.partition(":")[2] or 0)
            if index >= gpus:
                raise ClusterError(f"cluster: worker {worker.name} wants {worker.device}, but "
                                   f"this machine has {gpus} CUDA device(s)")


def _refused_at_once(address: str) -> None:
    """Raise at once if nothing listens at a tcp:// address (Dask would retry for its
    whole timeout); other protocols and any other outcome are left to Dask."""
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:  # not a number: Dask's own message names the address
        return
    if parts.scheme != "tcp" or not host or not port:
        return
    try:
        socket.create_connection((host, port), timeout=2).close()
    except ConnectionRefusedError:
        raise
    except OSError:
        pass


def setup_name(client: Client) -> str:
    """The name `register_setup` gives its plugin: one per client, so that a run that
    ends removes its own setup and never another run's on the same cluster."""
    return f"{WorkerSetup.name}-{client.id}"


def register_setup(client: Client, config: ClusterConfig) -> None:
    """Install `WorkerSetup` on every worker (threads, emulated speeds and devices by
    name, for the embedded cluster's workers). A failed install is taken back
    (`unregister_setup`): the scheduler keeps a plugin it could not install
    everywhere, and runs it again on every worker that joins, a restarted one too."""
    threads, speeds, devices = {}, {}, {}
    embedded = scheduler_address(config) is None
    if embedded:
        for worker in config.worker_list():
            threads[worker.name] = worker.threads
            speeds[worker.name] = worker.speed
            devices[worker.name] = worker.device
    try:
        client.register_plugin(WorkerSetup(threads, speeds, devices, embedded),
                               name=setup_name(client))
    except Exception as error:  # noqa: BLE001 - the workers' exception arrives as text
        unregister_setup(client)
        hint = ""
        if "No module named" in str(error):
            hint = "; install this project on every worker's Python (pip install -e .)"
        raise ClusterError(f"setting up the workers failed: {error}{hint}") from None


def unregister_setup(client: Client, timeout: float = 5.0) -> None:
    """Remove the client's `WorkerSetup` from the cluster, so that it does not outlive
    the run: a worker restarted later (by its nanny, for memory) would run it again,
    and with a limit too small for torch, be restarted for ever. The scheduler forgets
    the plugin as soon as it reads the request; telling the workers is given
    `timeout` seconds (a stopped worker never answers). Never raises."""
    if client.status != "running":
        return
    with contextlib.suppress(Exception):
        client.sync(client._unregister_worker_plugin, name=setup_name(client),
                    callback_timeout=timeout)


@contextlib.contextmanager
def workers_set_up(client: Client, config: ClusterConfig) -> Iterator[None]:
    """`register_setup` for the block, `unregister_setup` after it, however it ends."""
    register_setup(client, config)
    try:
        yield
    finally:
        unregister_setup(client)


def _cluster_worker(config: ClusterConfig, address: str, info: dict, tag: str) -> ClusterWorker:
    """A worker as the run sees it; speeds and torch threads are known only for the
    workers of an embedded cluster (external workers count as real, full speed)."""
    name = str(info.get("name"))
    embedded = {} if scheduler_address(config) else {w.name: w for w in config.worker_list()}
    worker = embedded.get(name)
    return ClusterWorker(address, name, tag,
                         worker.threads if worker else int(info["nthreads"]),
                         worker.speed if worker else 1.0, worker.device if worker else "")


def tagged_workers(workers: dict[str, dict], tags: list[str]) -> list[tuple[str, dict, str]]:
    """``(address, info, tag)`` of every worker offering one of `tags`, ordered by the
    first tag it offers (in the order listed), then by name: a pure function of the
    scheduler's worker table."""
    found = []
    for address, info in workers.items():
        offered = info.get("resources", {})
        tag = next((t for t in tags if offered.get(t, 0) >= 1), None)
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
            offered = sorted({t for info in workers.values() for t in info.get("resources", {})})
            tag = "' or '".join(tags)
            raise ClusterError(
                f"no worker offers resource '{tag}' "
                f"({len(tagged)} of {wanted} needed after {config.wait_timeout:g} s; "
                f"{len(workers)} worker(s) connected, offering: {', '.join(offered) or 'none'})"
            )
        time.sleep(0.2)


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
        if name == wanted or tags.get(wanted, 0) >= 1:
            tag = wanted if wanted in tags else next(
                (t for t in config.tags() if t in tags), next(iter(tags), config.resource))
            return offered + [_cluster_worker(config, address, info, tag)], len(offered)
    names = ", ".join(sorted(str(info.get("name")) for info in workers.values()))
    raise ClusterError(f"cluster.master: no worker is named or tagged '{wanted}' "
                       f"(workers: {names or 'none'})")
