"""The linked cluster: a scheduler on the links' bridge and one `dask worker` per
configured worker, each on its own host behind a shaped link (pipeline/cluster/links.py),
the run's directories mounted there.

Apart from connect.py because starting workers behind links (commands, TLS files,
the workspace root pinned, the S3 server) is a job of its own; connect.py only opens it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from typing import Iterator, Sequence

import dask
from distributed import Client, Scheduler, SpecCluster

from pipeline.config.cluster_config import ClusterConfig, WorkerConfig
from pipeline.cluster.embedded import (QUIET, PrivateScratchCluster, private_scratch,
                                       quiet_dashboard_errors)
from pipeline.cluster.links import Host, LinkError, LinkedHosts
from pipeline.cluster.security import TlsConfig, run_security, tls_flags, write_credentials
from pipeline.cluster.object_store import client_options, start_server, worker_environment
from pipeline.cluster.workers import ClusterError
from storage.private import default_workspace_root


def worker_command(scheduler: str, host: Host, worker: WorkerConfig,
                   scratch: str | None = None) -> list[str]:
    """A `dask worker` process as the embedded cluster's: one Dask thread, the
    worker's name and tags, no memory limit, listening on its host's address only
    (`--no-dashboard` still serves HTTP, on every interface unless placed: loopback);
    its scratch in `scratch` where given (pipeline/cluster/embedded.py: why not
    Dask's default)."""
    tags = ",".join(f"{tag}={amount:g}" for tag, amount in (worker.resources or {}).items())
    place = ["--local-directory", scratch] if scratch else []
    return [sys.executable, "-m", "distributed.cli.dask_worker", scheduler,
            "--host", host.address, "--name", str(worker.name), "--nthreads", "1",
            "--resources", tags, "--memory-limit", "0", "--no-nanny", "--no-dashboard",
            "--dashboard-address", "127.0.0.1:0", *place]


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
        host, security, scratch = links.bridge_address, run_security(), private_scratch()
        quiet_dashboard_errors()
        scheduler = {"cls": Scheduler,
                     "options": {"host": host, "dashboard_address": f"{host}:0",
                                 "protocol": "tls", "security": security,
                                 "local_directory": scratch}}
        with dask.config.set(QUIET):
            cluster = PrivateScratchCluster(scratch, workers={}, scheduler=scheduler,
                                            silence_logs=logging.ERROR, security=security)
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


def _start_linked_workers(cluster: PrivateScratchCluster, links: LinkedHosts, config: ClusterConfig,
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
                                worker_command(cluster.scheduler_address, host, worker,
                                               cluster.scratch)
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

