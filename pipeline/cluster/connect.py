"""Connect to a Dask cluster, or start the embedded one a config describes.

The embedded cluster (started by pipeline/cluster/embedded.py) is a `SpecCluster` (a
LocalCluster gives every worker the same resource tags) of nanny-managed worker
processes, one Dask thread each: a worker runs its tasks one at a time, and its torch
thread count comes from the config.

Finding the run's workers there (workers.py), setting them up (worker_setup.py) and
starting the linked cluster (linked.py) are modules of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, Coroutine, Iterator, Sequence

import torch
from distributed import Client, Security
from distributed.comm import Comm, parse_address, registry
from distributed.comm.core import FatalCommClosedError

from pipeline.config.cluster_config import ClusterConfig, WorkerConfig
from pipeline.cluster.embedded import Progress, start_embedded_cluster
from pipeline.cluster.links import LinkedHosts
from pipeline.cluster.security import (PLAIN_PEER, client_security, connection_problem,
                                       tls_problem)
from pipeline.cluster.jobqueue import JobProgress, JobqueueError, open_jobqueue_client
from pipeline.cluster.linked import open_linked_cluster
from pipeline.cluster.workers import ClusterError, SchedulerUnreachable, scheduler_address


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
        security = client_security(config.tls)
        check_scheduler_answers(config)
        try:
            client = Client(address, timeout=config.connect_timeout, set_as_default=False,
                            security=security)
        except (OSError, TimeoutError) as error:
            raise SchedulerUnreachable(connection_problem(address, error)) from None
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
def open_jobqueue(config: ClusterConfig, progress: JobProgress | None = None,
                  only: list[str] | None = None) -> Iterator[Client]:
    """`open_jobqueue_client`, its refusals (all made before the block runs) as
    ClusterError."""
    try:
        with open_jobqueue_client(config, progress, only) as client:
            yield client
    except JobqueueError as error:
        raise ClusterError(str(error)) from None


def device_problem(workers: list[WorkerConfig]) -> str | None:
    """Why this machine cannot host one of the embedded `workers` (a CUDA device it
    lacks), or None: `--check` says it as the config's error, a run's start as its."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for worker in workers:
        if worker.device.startswith("cuda"):
            index = int(worker.device.partition(":")[2] or 0)
            if index >= gpus:
                return (f"worker {worker.name} wants {worker.device}, but this machine has "
                        f"{gpus} CUDA device(s)")
    return None


def check_scheduler_answers(config: ClusterConfig) -> None:
    """Raise `SchedulerUnreachable`, in the run's words, unless the scheduler the config
    names (or $DASK_SCHEDULER_ADDRESS) sends Dask's handshake within
    `cluster.connect_timeout`: what a run's start asks first, and `--check` asks alone."""
    address = scheduler_address(config)
    if not address:
        return
    try:
        check_handshake(address, client_security(config.tls), config.connect_timeout)
    except (OSError, TimeoutError) as error:
        source = "" if config.scheduler else " (the address $DASK_SCHEDULER_ADDRESS gives)"
        raise SchedulerUnreachable(connection_problem(address, error) + source) from None


def check_devices(workers: list[WorkerConfig]) -> None:
    """Refuse, before anything starts, an embedded CUDA worker this machine cannot host."""
    problem = device_problem(workers)
    if problem:
        raise ClusterError(f"cluster: {problem}")


def check_handshake(address: str, security: Security | None, seconds: float) -> None:
    """Raise unless a Dask peer at `address` connects and sends its handshake, each
    within `seconds`.

    Dask's `Client(timeout=...)` bounds the TCP (and TLS) connect only: its first read,
    the peer's handshake, has no limit, so an address that accepts but never speaks
    Dask (a dashboard's HTTP port, a stopped process) held the client for ever. This
    probe, in a thread and event loop of its own that end with it, bounds both steps:
    a connect that fails or times out raises OSError (the caller's usual line); a peer
    that accepted but sent no handshake in time, or something that is not one, raises
    NotAScheduler."""
    try:
        protocol, location = parse_address(address)
        connector = registry.get_backend(protocol).get_connector()
    except ValueError:  # not an address Dask knows: its own message says so
        return
    arguments = (security or Security()).get_connection_args("client")

    async def probe() -> None:
        try:
            comm = await asyncio.wait_for(
                connector.connect(location, deserialize=False, **arguments), seconds)
        except asyncio.TimeoutError:
            raise OSError(f"timed out connecting to {address} after {seconds:g} s") from None
        except ValueError:  # tornado's "IOStream is not idle": the peer spoke first
            if protocol != "tls":
                raise
            raise OSError(PLAIN_PEER) from None
        except FatalCommClosedError as error:  # Dask's, for any SSLError, often bare
            cause = error.__cause__
            if protocol != "tls" or str(error) or cause is None:
                raise
            if "WRONG_VERSION" in str(cause) or "record layer" in str(cause).lower():
                raise OSError(PLAIN_PEER) from None
            raise OSError(f"TLS: {type(cause).__name__}: {cause}") from None
        try:
            reply = await asyncio.wait_for(_exchange(comm), seconds)
        except asyncio.TimeoutError:
            raise NotAScheduler(address, f"no handshake within {seconds:g} s") from None
        except OSError as error:
            text = str(error).lower()
            # a TLS scheduler meeting tcp:// (reset), or refusing this client's
            # certificate (an SSL alert at the first read): `connection_problem` says so
            if "reset" in text or "ssl" in text or "certificate" in text:
                raise
            if protocol == "tls":  # the alert may come as a bare close: said as TLS's
                raise OSError("TLS: the peer closed the connection after TLS's own "
                              "handshake (it refuses this client's certificate, or is not "
                              "a Dask scheduler)") from None
            raise NotAScheduler(address, "it closed the connection instead of a "
                                "handshake") from None
        except Exception:  # noqa: BLE001 - bytes Dask cannot decode (an HTTP reply's
            # first bytes read as a frame count ask for a huge allocation: MemoryError)
            raise NotAScheduler(address, "its reply is not in Dask's message format") \
                from None
        finally:
            comm.abort()
        if not isinstance(reply, dict):
            raise NotAScheduler(address, "its reply is not Dask's handshake")

    _run_apart(probe())


def _run_apart(probe: Coroutine[Any, Any, None]) -> None:
    """Run `probe` to its end in an event loop and thread of its own (a caller's own
    running loop, in a notebook, is left alone); a signal that stops the caller
    (Ctrl-C, SIGTERM) cancels it rather than wait for its deadline."""
    loop = asyncio.new_event_loop()
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            loop.run_until_complete(probe)
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            outcome.append(error)
        finally:
            loop.close()

    thread = threading.Thread(target=run, name="scheduler-probe", daemon=True)
    thread.start()
    try:
        thread.join()
    except BaseException:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(lambda: [t.cancel() for t in asyncio.all_tasks(loop)])
        raise
    if outcome:
        raise outcome[0]


async def _exchange(comm: Comm) -> Any:
    """Dask's handshake, as `distributed.comm.connect` makes it: ours, then the peer's."""
    await comm.write(comm.handshake_info())
    return await comm.read()


class NotAScheduler(SchedulerUnreachable):
    """Something at the scheduler's address accepted the connection but does not speak
    Dask (a dashboard's HTTP port, another service, a stopped process)."""

    def __init__(self, address: str, why: str) -> None:
        super().__init__(f"{address} answered but is not a Dask scheduler ({why}); is this "
                         "the dashboard port? the scheduler's port is usually 8786")
