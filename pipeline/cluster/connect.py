"""Connect to a Dask cluster, or start the embedded one a config describes.

The embedded cluster (started by pipeline/cluster/embedded.py) is a `SpecCluster` (a
LocalCluster gives every worker the same resource tags) of nanny-managed worker
processes, one Dask thread each: a worker runs its tasks one at a time, and its torch
thread count comes from the config.

Finding the run's workers there (workers.py), setting them up (worker_setup.py) and
starting the linked cluster (linked.py) are modules of their own.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Iterator, Sequence
from urllib.parse import urlsplit

import torch
from distributed import Client

from pipeline.config.cluster_config import ClusterConfig, WorkerConfig
from pipeline.cluster.embedded import Progress, start_embedded_cluster
from pipeline.cluster.links import LinkedHosts
from pipeline.cluster.security import client_security, connection_problem, tls_problem
from pipeline.cluster.jobqueue import JobProgress, JobqueueError, open_jobqueue_client
from pipeline.cluster.linked import open_linked_cluster
from pipeline.cluster.workers import ClusterError, scheduler_address


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

