"""The exchange workspace in an object store, for workers behind links.

A multi-host user without a shared POSIX file system has an object store; this is
that transport (`cluster.link.workspace: s3`). A linked run starts an S3 server on
its own bridge address (the client's side of every link), and the exchange
workspace becomes ``s3://hetcnn-workspace/<run>.zarr``: every slot a worker writes
or reads, and every ready marker it polls, is an HTTP request across its link.

The server is moto's server mode, an *emulator* of Amazon S3 that keeps objects in
its memory: real S3 wire protocol (s3fs and Zarr cannot tell), but not Amazon's
latency, throughput or consistency, so the figures measured through it describe the
protocol's cost over a link, not a cloud service. It listens on the bridge address
only (no uplink: reachable from this machine and its namespaces only), on a free
port, per run; it is started as a process of the run's `LinkedHosts`, so closing the
links (or the next run's sweep of a killed run) ends it.

Endpoint and credentials (dummy ones: the emulator checks none) reach the workers as
fsspec's configuration variable ``FSSPEC_S3`` in their environment, and the client's
own fsspec configuration while the links are up; nothing else changes how a path is
opened. Dataset batches and checkpoint slices stay on the sftp mounts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from typing import Iterator

import fsspec

from pipeline.cluster.links import LinkedHosts, LinkError

BUCKET = "hetcnn-workspace"  # each run has a server of its own, so one name serves all
#: modules the transport needs (the server: moto and Flask; the clients: s3fs)
MODULES = ("s3fs", "moto", "flask", "flask_cors")
#: the emulator accepts any key; these only keep botocore from searching for real ones
DUMMY_CREDENTIALS = {"key": "hetcnn-emulated", "secret": "hetcnn-emulated"}


def object_store_problem() -> str | None:
    """Why the S3 transport cannot run here (None if it can)."""
    missing = [name for name in MODULES if importlib.util.find_spec(name) is None]
    if missing:
        return (f"s3 needs the Python packages {', '.join(missing)} "
                "(pip install -c constraints.txt -e '.[s3]')")
    return None


#: `python -m moto.server`, except that SIGTERM ends it at once: moto's own handler
#: exits through its threaded server's close, which waits for every open keep-alive
#: connection (the client's s3fs holds one), and so took the links' 5 s grace period
SERVER = ("import os, sys; from moto import server; "
          "server.signal_handler = lambda *_: os._exit(0); server.main(sys.argv[1:])")


def server_command(address: str, port: int) -> list[str]:
    """moto's S3 emulator in server mode, listening on `address` only."""
    return [sys.executable, "-c", SERVER, "-H", address, "-p", str(port)]


def storage_options(endpoint: str) -> dict[str, str]:
    """s3fs's options for the run's server."""
    return {"endpoint_url": endpoint, **DUMMY_CREDENTIALS}


def worker_environment(options: dict[str, str]) -> dict[str, str]:
    """Environment variables that give a process's fsspec these S3 options (fsspec
    reads ``FSSPEC_<PROTOCOL>`` as JSON when it is imported)."""
    return {"FSSPEC_S3": json.dumps(options, sort_keys=True)}


def workspace_url(run_id: str) -> str:
    """Where a run's exchange workspace goes on the object store."""
    return f"s3://{BUCKET}/{run_id}.zarr"


def start_server(links: LinkedHosts, timeout: float = 30.0) -> dict[str, str]:
    """Start the run's S3 server on the bridge address and create the bucket; its
    storage options. A server that exits or does not answer in `timeout` s fails
    with the end of its log."""
    with socket.socket() as probe:  # a free port on the bridge address
        probe.bind((links.bridge_address, 0))
        port = probe.getsockname()[1]
    log_path = os.path.join(links.directory, "s3-server.log")
    with open(log_path, "w", encoding="utf-8") as log:  # a session of its own: a Ctrl-C
        # at the terminal must leave it to serve the client's clean-up (links.close ends it)
        process = links.spawn(server_command(links.bridge_address, port), stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((links.bridge_address, port), timeout=1).close()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                with open(log_path, encoding="utf-8") as f:
                    tail = " | ".join(f.read().strip().splitlines()[-3:])
                state = (f"exited ({process.returncode})" if process.poll() is not None
                         else f"did not answer in {timeout:g} s")
                raise LinkError(f"the links' S3 server {state}: {tail}") from None
            time.sleep(0.05)
    options = storage_options(f"http://{links.bridge_address}:{port}")
    # s3fs's mkdir sends no location constraint unless given a region (moto then
    # refuses it as "not valid"); made once, not cached (the server lives one run)
    fsspec.filesystem("s3", skip_instance_cache=True, **options).mkdir(BUCKET)
    return options


@contextlib.contextmanager
def client_options(options: dict[str, str]) -> Iterator[None]:
    """This process's fsspec S3 defaults set to `options` while the block runs (the
    client creates, aborts and removes the workspace), restored after; none: no
    change."""
    if not options:
        yield
        return
    saved = fsspec.config.conf.get("s3")
    fsspec.config.conf["s3"] = {**(saved or {}), **options}
    try:
        yield
    finally:
        if saved is None:
            fsspec.config.conf.pop("s3", None)
        else:
            fsspec.config.conf["s3"] = saved
