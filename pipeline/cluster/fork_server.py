"""The process the embedded cluster's workers are forked from.

A Dask nanny spawns its worker by default: a fresh interpreter that imports torch
(about 2.5 s of CPU) and, because multiprocessing re-imports the parent's main
module in a spawned child, the whole command again (for ``python -m pipeline.train``
the pipeline with xarray and pandas: a second of CPU and about 60 MB per worker that
the memory baselines of pipeline/records/memory.py do not count). Instead the embedded
cluster sets Dask's ``multiprocessing-method`` to ``forkserver``
(pipeline/cluster/embedded.py): one server process imports what a worker needs
(`tasks.memory.WORKER_MODULES`) once, and every worker is forked from it,
as Dask's own test suite starts its workers. Forking alone does not keep the parent's
main module out of a worker: multiprocessing prepares a forked child as it does a
spawned one. The server also preloads pipeline/cluster/forked_main.py, which stops that.
Measured here (docs/benchmarks.md):
8 workers up in 7.6-8.5 s instead of 14.3-14.5 s; 2 workers about as before (the
server's one import against two in parallel on two cores), with half the CPU.

Started before its own imports, a command could have the server import on the
second core meanwhile (a 3-step run went from 10-11 s to 7-8 s), but a command
that then needs no embedded cluster (bad input, a `reference` run, an external
scheduler) paid the import for nothing, on cores its own workers needed: the CLI
tests against a `dask worker` cluster ran 1.5x longer. So the server starts with
the first embedded cluster.

The server starts with the environment a spawned worker would have (Dask's
``distributed.nanny.pre-spawn-environ``, and one malloc arena), which glibc and
OpenMP read when a process starts and a forked worker inherits; and with Ctrl-C
blocked, which its workers inherit: a terminal's Ctrl-C reaches every process of
the group, and the run, not each worker, stops the workers (pipeline/cluster/embedded.py).
It ends by itself when this process does.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from multiprocessing import forkserver

import dask.config

from pipeline.cluster import forked_main
from pipeline.cluster.semaphores import start_resource_tracker
from pipeline.cluster.temp_folders import tag_temp_folder
from tasks.memory import WORKER_MODULES


def start_fork_server() -> None:
    """Start this process's fork server for the workers (module doc), if it has none
    running; returns at once, while the server imports `WORKER_MODULES`. Its
    environment is what Dask's config gives a spawned worker (``pre-spawn-environ``:
    distributed's defaults and pipeline/cluster/embedded.py's one malloc arena)."""
    configured = dask.config.get("distributed.nanny.pre-spawn-environ", default={}) or {}
    environment = {name: str(value) for name, value in configured.items()}
    environment[forked_main.PARENT_MAIN] = forked_main.parent_main()
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        [*WORKER_MODULES, forked_main.__name__])
    start_resource_tracker()  # starting it unblocks SIGINT in its caller: first
    tag_temp_folder()  # where the server's socket goes: named for the sweep of stale ones
    saved = {name: os.environ.get(name) for name in environment}
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    os.environ.update(environment)
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
