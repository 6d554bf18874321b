"""An external Dask cluster on simulated hosts: real machines' commands, on this one.

`cluster.link` shapes the embedded cluster a run starts itself. On real machines a
user starts the cluster instead: `dask scheduler` on one host, `dask worker` on each
of the others (docs/multihost.md), and the run connects to it as a client, over TLS
across untrusted networks. `external_hosts` does exactly that on `LinkedHosts`: the
scheduler on a host of its own and each worker on its own, each a network namespace
behind a shaped link, started with the very command lines docs/multihost.md gives
(plus `--tls-*` when TLS is asked for), the run's directories mounted on the
workers' hosts over their links as on linked runs. Tests and benchmarks use it to
check what the page promises: a run through `cluster.scheduler` (and `cluster.tls`)
trains as on one machine, and nothing listens beyond each host's own address.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Iterator, Sequence

from distributed import Client

from pipeline.cluster.embedded import QUIET
from pipeline.cluster.linked import pin_workspace_root, worker_command
from pipeline.config.cluster_config import WorkerConfig
from pipeline.cluster.links import LinkError, LinkedHosts
from pipeline.cluster.security import TlsConfig, client_security, tls_flags

SCHEDULER = "scheduler"  # the scheduler's host's name (workers may not take it)
PORT = 8786  # Dask's default: the scheduler has its host's network to itself


@dataclass(frozen=True)
class ClusterTls:
    """The certificates of a TLS cluster: one CA, and a (certificate, key) per role."""

    ca_file: str
    scheduler: tuple[str, str]
    worker: tuple[str, str]
    client: tuple[str, str]

    def client_config(self) -> TlsConfig:
        """What a run's `cluster.tls` says to connect to this cluster."""
        return TlsConfig(self.ca_file, *self.client)


@dataclass
class ExternalHosts:
    """A started external cluster: its scheduler's address and the hosts it runs on."""

    address: str
    links: LinkedHosts
    log: str  # the scheduler's and workers' output
    tls: ClusterTls | None


def scheduler_command(host: str, protocol: str, tls: ClusterTls | None) -> list[str]:
    """`dask scheduler` on `host`'s address only (its HTTP server on loopback)."""
    flags = tls_flags(tls.ca_file, *tls.scheduler) if tls else []
    return [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", host,
            "--port", str(PORT), "--protocol", protocol, "--no-dashboard",
            "--dashboard-address", "127.0.0.1:0", *flags]


@contextlib.contextmanager
def external_hosts(workers: list[WorkerConfig], rate: str, directories: Sequence[str],
                   log_dir: str, tls: ClusterTls | None = None, env: dict | None = None,
                   timeout: float = 60.0) -> Iterator[ExternalHosts]:
    """A `dask scheduler` and one `dask worker` per entry of `workers` (its name and
    resource tags, one Dask thread), each on a host of its own behind a `rate` link,
    speaking `tls://` if `tls` is given; `directories` are mounted on the workers'
    hosts. Yields once every worker has joined; everything is gone after the block."""
    names = [str(w.name) for w in workers]
    if SCHEDULER in names or len(set(names)) != len(names):
        raise LinkError(f"external hosts need distinct worker names other than "
                        f"'{SCHEDULER}', got {names}")
    protocol = "tls" if tls else "tcp"
    env = {**os.environ, **_quiet_variables(), **(env or {})}
    links = LinkedHosts.start({SCHEDULER: rate, **{name: rate for name in names}})
    log = os.path.join(log_dir, f"external-{links.run_id}.log")
    spawned = []
    try:
        pin_workspace_root(links, directories)
        with open(log, "w", encoding="utf-8") as out:
            own, *hosts = links.hosts
            address = f"{protocol}://{own.address}:{PORT}"
            spawned.append(links.spawn(links.command(
                own, [], scheduler_command(own.address, protocol, tls)),
                env=env, stdout=out, stderr=out))
            for worker, host in zip(workers, hosts):
                command = worker_command(address, host, worker)
                command += tls_flags(tls.ca_file, *tls.worker) if tls else []
                spawned.append(links.spawn(links.command(host, list(directories), command),
                                           env=env, stdout=out, stderr=out))
        security = client_security(tls.client_config() if tls else None)
        with Client(address, security=security, timeout="30s", set_as_default=False) as client:
            try:
                client.wait_for_workers(len(workers), timeout=timeout)
            except TimeoutError:
                with open(log, encoding="utf-8") as f:
                    tail = " | ".join(f.read().strip().splitlines()[-3:])
                raise LinkError(f"the external workers did not join in {timeout:g} s: "
                                f"{tail}") from None
        yield ExternalHosts(address, links, log, tls)
    finally:
        for process in reversed(spawned):  # nothing to save: no graceful close needed
            process.kill()
            process.wait()
        links.close()


def _quiet_variables() -> dict[str, str]:
    """`QUIET` as Dask's environment variables (no profiler, errors only in the log)."""
    return {"DASK_" + key.upper().replace(".", "__").replace("-", "_"): str(value)
            for key, value in QUIET.items()}
