"""A Dask scheduler and workers as processes of their own, for the tests that kill,
stop or add one under a run (tests/test_faults.py, tests/test_scheduler_faults.py).

Each server is a process forked from this process's fork server
(pipeline/cluster/fork_server.py, which imported distributed and the task modules,
torch among them, once), not a `dask scheduler` or `dask worker` command: such a
command imports Dask's command line, and then torch when the first task or graph
arrives, about 2.3 s of CPU a process, more than the runs under test take. To the
run a forked server is the same: a separate process at a TCP address, which a
SIGKILL ends and a SIGSTOP freezes. Servers started by the commands themselves, as
a user starts them, are tests/test_cli.py's.

The processes are daemonic: killed when this process exits, whatever happened.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import time
from pathlib import Path

import dask.config

from pipeline.cluster.fork_server import start_fork_server


def _serve(kind: str, settings: dict, folder: str, options: dict) -> None:
    """A forked process's life: one scheduler or worker with `options`, under Dask's
    `settings`, until it is closed or killed."""
    from distributed import Scheduler, Worker

    logging.getLogger("distributed").setLevel(logging.ERROR)  # as a run's own servers
    dask.config.set(settings)
    dask.config.set({"temporary-directory": folder})

    async def serve() -> None:
        server = (Scheduler if kind == "scheduler" else Worker)(**options)
        async with server:
            await server.finished()

    asyncio.run(serve())


class ForkedCluster:
    """A scheduler and its workers (`start_scheduler`, `start_worker`), each a forked
    process under Dask's `settings` (module doc), with their files in `folder`."""

    def __init__(self, folder: Path, settings: dict | None = None) -> None:
        self.folder = folder
        self.scheduler_file = folder / "scheduler.json"
        self.settings = dict(settings or {})
        self.processes: list[multiprocessing.Process] = []  # the scheduler first

    def _start(self, kind: str, options: dict) -> multiprocessing.Process:
        start_fork_server()
        process = multiprocessing.get_context("forkserver").Process(
            target=_serve, args=(kind, self.settings, str(self.folder), options),
            name=f"forked {kind}", daemon=True)
        process.start()
        self.processes.append(process)
        return process

    def start_scheduler(self) -> str:
        """Start the scheduler on loopback; its address, once it listens."""
        process = self._start("scheduler", {"host": "127.0.0.1", "port": 0, "dashboard": False,
                                            # its HTTP server, which runs without a
                                            # dashboard too: loopback, not every interface
                                            "dashboard_address": "127.0.0.1:0",
                                            "scheduler_file": str(self.scheduler_file)})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the file appears before its text is written
            text = self.scheduler_file.read_text() if self.scheduler_file.exists() else ""
            if text.strip():
                return json.loads(text)["address"]
            if not process.is_alive():
                break
            time.sleep(0.05)
        self.stop()  # a fixture whose setup fails is not torn down: leave no scheduler
        raise TimeoutError(f"no scheduler file at {self.scheduler_file} after 60 s")

    def start_worker(self, name: str | None = None) -> multiprocessing.Process:
        """A worker of one thread offering CPU=1 (as tests/test_cli.py's `dask worker
        --no-nanny`), named `name` if given; returns at once, before it joins."""
        address = json.loads(self.scheduler_file.read_text())["address"]
        options = {"scheduler_ip": address, "nthreads": 1, "resources": {"CPU": 1},
                   "host": "127.0.0.1", "local_directory": str(self.folder),
                   "dashboard": False, "dashboard_address": "127.0.0.1:0"}
        if name is not None:
            options["name"] = name
        return self._start("worker", options)

    @property
    def scheduler(self) -> multiprocessing.Process:
        return self.processes[0]

    def stop(self) -> None:
        """Workers first, then the scheduler, SIGKILLed: a test cluster holds nothing to
        save."""
        for process in reversed(self.processes):
            process.kill()
        for process in self.processes:
            process.join(30)
