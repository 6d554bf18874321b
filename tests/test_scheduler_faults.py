"""A scheduler address that answers but is not a Dask scheduler, a scheduler that
stops answering mid-run, and one killed mid-run: each ends in one line and exit 1
within its limit, never a silent wait.

Real listeners (a socket that accepts and stays silent, an HTTP server: a dashboard's
port) and a real Dask scheduler process SIGSTOPped, the run or sweep as its own
process, so that a thread or event loop left behind would show as a process that
does not exit. One scheduler with two workers serves the tests that stop or
kill it (`SharedCliCluster`): each wakes it after, the next waits until the earlier
run is gone from it, and a killed one is started again.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Iterator

import pytest
import xarray as xr
from distributed import Client

from pipeline.cluster.connect import NotAScheduler, check_handshake
from storage import checkpoints
from tests.helpers import error_lines_of
from tests.forked_servers import ForkedCluster
from tests.test_cli import ROOT, tiny_args
from tests.test_faults import (FAULTS, QUIET_SERVERS, killed_after_checkpoint,
                               wait_for_checkpoint)
from tests.test_sweep import write_sweep

#: cluster.connect_timeout in these tests (the default is 10 s).
CONNECT_S = 2


class SilentListener:
    """A loopback port that accepts connections and never sends a byte (a stopped
    process's socket, a service that waits for its client to speak first)."""

    def __init__(self) -> None:
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.socket.settimeout(0.2)
        self.address = f"tcp://127.0.0.1:{self.socket.getsockname()[1]}"
        self.accepted: list[float] = []  # monotonic times of accepted connections
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self.socket.accept()
            except OSError:
                continue
            self.accepted.append(time.monotonic())
            self._held.append(connection)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for connection in self._held:
            connection.close()
        self.socket.close()


@pytest.fixture
def silent_listener() -> Iterator[SilentListener]:
    listener = SilentListener()
    try:
        yield listener
    finally:
        listener.close()


@pytest.fixture
def http_server() -> Iterator[str]:
    """An HTTP server on loopback, as a scheduler's dashboard port is."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_service_that_answers_in_another_protocol_is_named_as_not_dask():
    """A service that answers Dask's handshake with its own bytes (an HTTP 400): Dask
    reads them as a frame count and fails to allocate it; the line said "its reply is
    not Dask's: MemoryError", a memory problem that was none."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def answer() -> None:
        connection, _ = server.accept()
        held.append(connection)
        connection.recv(1024)
        connection.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    address = f"tcp://127.0.0.1:{server.getsockname()[1]}"
    try:
        with pytest.raises(NotAScheduler) as refused:
            check_handshake(address, None, 5)
    finally:
        thread.join(10)
        for connection in held:
            connection.close()
        server.close()
    assert str(refused.value) == (
        f"{address} answered but is not a Dask scheduler (its reply is not in Dask's message "
        "format); is this the dashboard port? the scheduler's port is usually 8786")


def _command(kind: str, tmp_path, dataset: str, address: str) -> list[str]:
    if kind == "train":
        return [sys.executable, "-m", "pipeline.train", *tiny_args(tmp_path, dataset),
                "--scheduler", address, f"cluster.connect_timeout={CONNECT_S}"]
    sweep = write_sweep(tmp_path, dataset, {"train.batch": [8, 16]})
    return [sys.executable, "-m", "experiments.sweep", sweep, "--out",
            str(tmp_path / "sweep.zarr"), "--scheduler", address,
            f"cluster.connect_timeout={CONNECT_S}"]


@pytest.mark.parametrize("kind, listener", [("train", "silent"), ("sweep", "http")])
def test_an_address_that_is_not_a_scheduler_is_one_line_within_the_limit(
        kind, listener, tmp_path, tiny_dataset_factory, request, monkeypatch):
    """Before: Dask's connect timeout covered the TCP connect, not the handshake, and
    the process waited for ever with no output."""
    monkeypatch.setenv("PYTHONPATH", ROOT)
    monkeypatch.setenv("CNN_PREDICT_PROBE", "never")
    if listener == "silent":
        silent = request.getfixturevalue("silent_listener")
        address = silent.address
    else:
        address = request.getfixturevalue("http_server")
    started = time.monotonic()
    result = subprocess.run(_command(kind, tmp_path, tiny_dataset_factory("float32"), address),
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    ended = time.monotonic()
    lines = error_lines_of(result.stderr)
    assert result.returncode == 1, result.stderr
    assert lines == [f"error: {address} answered but is not a Dask scheduler (no handshake "
                     f"within {CONNECT_S} s); is this the dashboard port? the scheduler's "
                     "port is usually 8786"], result.stderr
    assert "Traceback" not in result.stderr
    if listener == "silent":  # from the connection to the exit: the limit and the unwind
        assert silent.accepted and ended - silent.accepted[0] < CONNECT_S + 15, (
            ended - silent.accepted[0])
    assert ended - started < 90


def test_a_signal_while_connecting_says_there_is_nothing_to_continue(
        tmp_path, tiny_dataset_factory, silent_listener, monkeypatch):
    """SIGTERM while the run waits for a handshake: the run never trained, so its line
    says to run the same command again, not to resume from step 0 (its initial
    weights); and it stops at once, not at the connect limit."""
    monkeypatch.setenv("PYTHONPATH", ROOT)
    command = _command("train", tmp_path, tiny_dataset_factory("float32"),
                       silent_listener.address)[:-1] + ["cluster.connect_timeout=60"]
    run = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        deadline = time.monotonic() + 90
        while not silent_listener.accepted:
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()
            time.sleep(0.05)
        time.sleep(0.5)
        run.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        _out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 128 + signal.SIGTERM, err
    assert error_lines_of(err) == [
        "interrupted (SIGTERM) before the first checkpoint; run the same command again to "
        "start over"], err
    assert time.monotonic() - signalled < 30


#: cluster.scheduler_timeout in the frozen-scheduler tests (the default is 300 s).
SCHEDULER_S, PLACING_S = 8, 4


def _train(tmp_path, dataset: str, address: str, *overrides: str) -> subprocess.Popen:
    """A tiny run on the scheduler at `address`, as its own process."""
    return subprocess.Popen([sys.executable, "-m", "pipeline.train",
                             *tiny_args(tmp_path, dataset), "--scheduler", address, *overrides],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


#: The module of the run's tasks, which a scheduler imports (torch with it) when it
#: takes the first graph that names them (`SharedCliCluster`).
TASK_MODULES = "tasks.step_task"


class SharedCliCluster:
    """A scheduler and two workers, each a process of its own (tests/forked_servers.py:
    forked from a process that imported torch, not `dask scheduler` and `dask worker`
    commands, which import it each: their starts cost about as much as the runs
    themselves), shared by the tests that stop or kill the scheduler under a run.
    Started again where a test killed the scheduler. Its servers run with
    tests/test_faults.py's `QUIET_SERVERS` (idle, a third of the CPU); the runs under
    test, `python -m pipeline.train --scheduler` processes, with Dask's defaults.

    A scheduler imports `TASK_MODULES` before any test's run: one that had not
    imports them when the first graph that names them arrives, its event loop blocked
    meanwhile (3.6 s here on a quiet machine, 15 s with the load at 10 on 2 cores),
    longer than these tests' 4-s `cluster.scheduler_timeout`, so the first run on a
    fresh scheduler was lost before its stop on a loaded machine ("asking for the
    workers: lost the Dask scheduler"). A forked scheduler has them from the process
    it was forked from; a test must not depend on being the second either way."""

    def __init__(self, tmp_path_factory) -> None:
        self._folders = tmp_path_factory
        self.cluster: ForkedCluster | None = None
        self.address = ""

    def ready(self) -> tuple[ForkedCluster, str]:
        """The cluster, awake, with its two workers and nothing of an earlier test's
        run (whose client a stopped scheduler let go only once woken)."""
        fresh = self.cluster is None or not self.cluster.scheduler.is_alive()
        if fresh:
            self.close()  # killed by a test: its workers go too
            self.cluster = ForkedCluster(self._folders.mktemp("stopped"), QUIET_SERVERS)
            self.address = self.cluster.start_scheduler()
            for _ in range(2):
                self.cluster.start_worker()
        os.kill(self.cluster.scheduler.pid, signal.SIGCONT)  # woken, whatever came before
        # no task, no client but this one and the scheduler's own (`fire-and-forget`);
        # a lambda, sent by value: the scheduler does not import the tests
        idle = lambda dask_scheduler: not dask_scheduler.tasks and len(  # noqa: E731
            dask_scheduler.clients) <= 2
        with Client(self.address, timeout="30s", set_as_default=False) as client:
            client.wait_for_workers(2, timeout=60)
            if fresh:  # (a lambda, as `idle` below)
                client.run_on_scheduler(lambda: bool(__import__(TASK_MODULES)))
            deadline = time.monotonic() + 60
            while not client.run_on_scheduler(idle):
                assert time.monotonic() < deadline, "an earlier run is still on the scheduler"
                time.sleep(0.1)
        return self.cluster, self.address

    def close(self) -> None:
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            cluster.stop()


@pytest.fixture(scope="module")
def shared_cli_cluster(tmp_path_factory) -> Iterator[SharedCliCluster]:
    shared = SharedCliCluster(tmp_path_factory)
    try:
        yield shared
    finally:
        shared.close()


@pytest.fixture
def scheduler(shared_cli_cluster) -> tuple[ForkedCluster, str]:
    """(cluster, scheduler address) of the module's cluster, ready for a run."""
    return shared_cli_cluster.ready()


def _stop_scheduler_after(cluster: ForkedCluster, run: subprocess.Popen, path: str,
                          step: int) -> tuple[str, str, float]:
    """SIGSTOP the scheduler once checkpoint `step` is complete; the run's stdout and
    stderr, and the seconds from the stop to its exit."""
    wait_for_checkpoint(path, step, run)
    os.kill(cluster.scheduler.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    out, err = run.communicate(timeout=90)
    return out, err, time.monotonic() - stopped


def _wake(cluster: ForkedCluster, run: subprocess.Popen) -> None:
    """After a stopped-scheduler test: the scheduler woken, the run killed if it is
    still there (the module's cluster stays for the next test)."""
    os.kill(cluster.scheduler.pid, signal.SIGCONT)
    if run.poll() is None:
        run.kill()
        run.wait()


def test_a_stopped_scheduler_is_said_then_lost_within_its_limit(tmp_path, tiny_dataset_factory,
                                                                  scheduler, monkeypatch):
    """A scheduler process SIGSTOPped mid-run. Before: the run waited silently for as
    long as it was stopped (its questions to the scheduler had no time limit), then
    went on. Now: a warning once it has been silent for half the limit, then the lost
    scheduler's line, exit 1, the checkpoints kept."""
    monkeypatch.setenv("PYTHONPATH", ROOT)
    cluster, address = scheduler
    try:
        run = _train(tmp_path, tiny_dataset_factory("float32"), address,
                     "train.checkpoint_every=4", "train.steps=100000", "train.eval_samples=0",
                     "placement=even", f"cluster.scheduler_timeout={SCHEDULER_S}")
        path = str(tmp_path / "run" / "checkpoints.zarr")
        _out, err, took = _stop_scheduler_after(cluster, run, path, 4)
    finally:
        _wake(cluster, run)
    lines = error_lines_of(err)
    assert run.returncode == 1, err
    # on a loaded machine the scheduler may answer late before the stop: each such
    # wait is said, then its end; the stop's are the last two lines
    earlier, lines = lines[:-2], lines[-2:]
    assert len(earlier) % 2 == 0 and all(
        line.startswith("warning: the Dask scheduler") if index % 2 == 0 else
        " answers again, after " in line for index, line in enumerate(earlier)), err
    assert re.fullmatch(rf"warning: the Dask scheduler at {re.escape(address)} has not answered "
                        r"for \d+ s \(stopped, or its host frozen\?\); the run waits for it up "
                        rf"to cluster.scheduler_timeout \({SCHEDULER_S} s\) in all", lines[0]), err
    # stopped in the step loop, or (just after the checkpoint) while the run asks
    # whether workers joined: both are watched
    assert re.fullmatch(rf"error: steps? [\d-]+: (asking whether workers joined: )?lost the "
                        rf"Dask scheduler at {re.escape(address)} \(it "
                        rf"did not answer for \d+ s \(cluster.scheduler_timeout: {SCHEDULER_S} "
                        r"s\)\); the run stopped \(its checkpoints are kept\); start the run "
                        r"again with train.resume=true .*", lines[1]), err
    assert took < SCHEDULER_S + 30, took  # the limit, a question's slice, the unwind
    assert (checkpoints.latest_complete_step(path) or 0) >= 4  # what was saved is kept



def test_a_scheduler_stopped_while_the_run_places_its_work_is_lost_within_its_limit(
        tmp_path, tiny_dataset_factory, scheduler, monkeypatch):
    """Outside the step loop (finding the workers, placing the work, a join check, a
    recovery) the run's questions to the scheduler have no limit of their own. Before:
    a scheduler process SIGSTOPped while the run calibrated its placement held the run
    for as long as it was stopped. Now the run's guard closes its client at the limit,
    and the line names what the run was doing."""
    monkeypatch.setenv("PYTHONPATH", ROOT)
    cluster, address = scheduler  # two workers: one worker's placement needs no calibration
    try:
        # a batch of 512 makes the calibration last about 2.5 s here; the phase's line
        # comes 1 s into it
        run = _train(tmp_path, tiny_dataset_factory("float32"), address, "progress=true",
                     "placement=calibrated", "train.batch=512", "network.conv.0.kernels=32",
                     "network.conv.1.kernels=32", f"cluster.scheduler_timeout={PLACING_S}")
        err, stopped = [], None
        for line in run.stderr:
            err.append(line)
            if "placing the work on 2 worker(s)" in line:
                os.kill(cluster.scheduler.pid, signal.SIGSTOP)
                stopped = time.monotonic()
                break
        assert stopped is not None, "".join(err)
        err.append(run.communicate(timeout=90)[1])
        took = time.monotonic() - stopped
    finally:
        _wake(cluster, run)
    err = "".join(err)
    lines = error_lines_of(err)
    assert run.returncode == 1, err
    assert lines[-2].startswith(f"warning: the Dask scheduler at {address} has not "
                                "answered for "), err
    assert re.fullmatch(rf"error: placing the work: lost the Dask scheduler at "
                        rf"{re.escape(address)} \(it did not answer for \d+ s "
                        rf"\(cluster.scheduler_timeout: {PLACING_S} s\)\); the run stopped "
                        r"\(its checkpoints are kept\); nothing was trained yet: run the same "
                        r"command again to start over", lines[-1]), err
    assert took < PLACING_S + 20, took  # the limit, a question's slice, the unwind


def test_a_scheduler_stopped_after_the_last_step_costs_the_prediction_only(
        tmp_path, tiny_dataset_factory, scheduler, monkeypatch):
    """A scheduler process SIGSTOPped once the last checkpoint is complete, while the
    run closes its engine and the model probes the cluster. Before: both asked the
    scheduler without a limit, and the finished run waited for as long as it was
    stopped. Now the run's results are written, without a prediction, and the note
    says why; exit 0 (every step is done), within the limit and the unwind."""
    monkeypatch.setenv("PYTHONPATH", ROOT)
    monkeypatch.setenv("CNN_PROBE_CACHE", str(tmp_path / "probes"))  # a probe to run
    cluster, address = scheduler
    try:
        run = _train(tmp_path, tiny_dataset_factory("float32"), address, "placement=even",
                     "prediction=auto", f"cluster.scheduler_timeout={PLACING_S}")
        out, err, took = _stop_scheduler_after(cluster, run,
                                               str(tmp_path / "run" / "checkpoints.zarr"), 3)
    finally:
        _wake(cluster, run)
    assert run.returncode == 0, err
    assert re.search(r"^  predicted   none: the Dask scheduler (at \S+ )?stopped answering ",
                     out, re.M), out
    assert (tmp_path / "run" / "record.zarr").is_dir()
    # the limit once, then the unwind (the engine's close waited out 10 s for the
    # workers to free the run, and the question for other clients the limit again:
    # 14.6 s here, where the warning says "up to 4 s in all"; now 5.5 s)
    assert took < PLACING_S + 8, took


def test_a_scheduler_killed_mid_run_is_one_line_and_exit_1(tmp_path, tiny_dataset_factory,
                                                           scheduler, monkeypatch):
    """A scheduler process SIGKILLed after checkpoint 4: one line naming the lost
    scheduler and how to resume, exit 1, the checkpoints and the record of its steps
    kept. (The module's cluster
    is started again for any test after it.)"""
    assert FAULTS["scheduler SIGKILLed mid-run"] == "clean"
    monkeypatch.setenv("PYTHONPATH", ROOT)
    cluster, address = scheduler
    run = _train(tmp_path, tiny_dataset_factory("float32"), address, "train.checkpoint_every=4",
                 "train.steps=100000", "train.eval_samples=0", "placement=even")
    path = str(tmp_path / "run" / "checkpoints.zarr")
    err = killed_after_checkpoint(run, path, 4, cluster.scheduler.kill)  # the scheduler
    assert run.returncode == 1
    assert len(error_lines_of(err)) == 1, err
    assert "lost the Dask scheduler" in err and "train.resume=true" in err
    assert checkpoints.latest_complete_step(path) >= 4  # what was saved is kept
    # and the record of the steps it ran, as a stop by a signal or lost workers keeps it
    # (a resume said they were missing: the start that ran them wrote none)
    record = xr.open_zarr(tmp_path / "run" / "record.zarr")
    assert list(record.step.values) == list(range(record.sizes["step"]))
    assert record.sizes["step"] >= 4
    assert json.loads(record.attrs["starts"])[-1]["ended"] == "scheduler lost"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["ended"] == "scheduler lost" and summary["predicted_step_time"] is None
