"""More workers than cores on one host, as a new user meets it: a warning line at
once, a line while the workers start (and every few seconds after), and Ctrl-C,
sent by a terminal to every process of the run, stopping it with one line and no
worker's traceback, leaked semaphore or process left.

The warning and the start's lines are pure functions and a small printer, checked
here; the CLI test oversubscribes the cores with torch threads (two workers of as
many threads as this machine has cores) rather than with 64 processes, which would
take minutes (docs/reliability.md has that run, measured by hand).
"""

from __future__ import annotations

import io
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import psutil

from pipeline.config.cluster_config import WorkerConfig
from pipeline.cluster.startup import Startup, contention_warning, start_batch, usable_cores
from tasks.worker_state import _DropClosingHeartbeats
from tests.test_cli import ROOT, tiny_args
from tests.test_faults import FAULTS
from tests.helpers import wait_exited


def test_the_warning_comes_when_threads_outnumber_cores():
    assert contention_warning([WorkerConfig()] * 2, 2) is None
    assert contention_warning([WorkerConfig(threads=2)], 2) is None
    line = contention_warning([WorkerConfig()] * 64, 2)
    assert line.startswith("warning: cluster.workers: 64 worker process(es) with 64 torch "
                           "thread(s) in all on 2 CPU core(s): they take turns") and \
        "(at most 2 such worker(s) fit here)" in line and \
        "the model's prediction under-counts a worker's waits for a peer" in line
    line = contention_warning([WorkerConfig(threads=2)] * 2, 2)
    assert "2 worker process(es) with 4 torch thread(s)" in line and "at most 1 such" in line


def test_workers_start_a_few_at_a_time_when_they_do_not_fit():
    assert start_batch(2, 2) == 0 and start_batch(4, 2) == 0  # all at once
    assert start_batch(5, 2) == 4 and start_batch(64, 2) == 4 and start_batch(64, 16) == 32


def test_a_phase_says_it_began_how_far_it_got_and_when_it_ended():
    out = io.StringIO()
    startup = Startup("small", True, out, every=0.05, after=0.02)
    with startup.phase("starting 3 worker(s)", "3 worker(s) up") as phase:
        phase.update(1, 3)
        time.sleep(0.2)
    lines = out.getvalue().splitlines()
    assert lines[0] == "small: starting 3 worker(s) ..."
    assert lines[1].startswith("small: starting 3 worker(s): 1 of 3 up, ") and \
        lines[1].endswith(" s so far")
    assert lines[-1].startswith("small: 3 worker(s) up (") and len(lines) >= 3
    for quick in (Startup("small", True, out, every=0.01, after=5),  # over before `after`
                  Startup("small", False, out, every=0.01, after=0)):  # progress: false
        out.seek(0), out.truncate()
        with quick.phase("a", "b"):
            time.sleep(0.05)
        assert out.getvalue() == ""


def _reader(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)
    into.put(None)


def test_ctrl_c_to_the_process_group_while_workers_start_stops_cleanly(
        tmp_path, tiny_dataset_factory, monkeypatch):
    """Two workers of `cores` torch threads each: the warning and the start's first
    line come before any step; Ctrl-C to the whole process group (as a terminal
    sends it) while they start ends the run with exit 130 and one line after them."""
    assert FAULTS["Ctrl-C to the run's process group while its workers start"] == "clean"
    monkeypatch.setenv("PYTHONPATH", ROOT)
    cores = usable_cores()
    args = [*tiny_args(tmp_path, tiny_dataset_factory("float32")), "--fresh",
            "progress=true", "train.steps=100", "cluster.workers=2", f"cluster.threads={cores}"]
    started = time.monotonic()
    run = subprocess.Popen([sys.executable, "-m", "pipeline.train", *args], cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(run.stderr, lines), daemon=True).start()
    seen: list[str] = []
    try:
        while not any("starting 2 worker(s) on this machine ..." in s for s in seen):
            line = lines.get(timeout=max(1.0, 90 - (time.monotonic() - started)))
            assert line is not None, "".join(seen)
            seen.append(line)
        first_output_s = time.monotonic() - started
        children = psutil.Process(run.pid).children(recursive=True)
        os.killpg(run.pid, signal.SIGINT)
        assert run.wait(timeout=60) == 128 + signal.SIGINT
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    while (line := lines.get(timeout=10)) is not None:
        seen.append(line)
    text = "".join(seen)
    kept = [line for line in text.splitlines() if line.strip()]
    assert kept[0].startswith("warning: cluster.workers: 2 worker process(es) with "
                              f"{2 * cores} torch thread(s) in all on {cores} CPU core(s)"), text
    assert kept[1] == "small: starting 2 worker(s) on this machine ...", text
    # only the initial weights (step 0) were kept: the same command starts over
    assert kept[-1] == ("interrupted (SIGINT) before the first checkpoint; run the same "
                        "command again to start over"), text
    assert all(line.startswith("small: ") for line in kept[2:-1]), text  # progress lines only
    for noise in ("Traceback", "KeyboardInterrupt", "leaked", "Error"):
        assert noise not in text, text
    alive = wait_exited(children, timeout=10)
    assert not alive, alive
    assert first_output_s < 90


UNLINK = """
import multiprocessing, os, sys
from pipeline.cli import unlink_semaphores
lock = multiprocessing.get_context("spawn").Lock()  # named, as a nanny's queues' are
path = "/dev/shm/sem." + lock._semlock.name.lstrip("/")
there = os.path.exists(path)
unlink_semaphores()
print(there, os.path.exists(path), flush=True)
os._exit(0)  # as a second Ctrl-C's stop does: no unwinding
"""


def test_a_stop_without_unwinding_leaves_no_semaphore():
    """`unlink_semaphores` (run by a second Ctrl-C's `stop_now`) removes the process's
    named semaphores, so neither /dev/shm keeps them nor the resource tracker warns."""
    done = subprocess.run([sys.executable, "-c", UNLINK], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"], done.stdout + done.stderr
    assert "leaked" not in done.stderr, done.stderr


def test_embedded_workers_do_not_log_heartbeats_failing_while_the_run_closes_them():
    """64 workers on 2 cores logged a dozen "Failed to communicate with scheduler
    during heartbeat" tracebacks at the end of a run that went well: an embedded
    worker's scheduler is gone only once its run closes the cluster."""
    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("distributed.worker", logging.ERROR, __file__, 1, message,
                                 (), None)

    drop = _DropClosingHeartbeats()
    assert not drop.filter(record("Failed to communicate with scheduler during heartbeat."))
    assert drop.filter(record("Compute Failed\nKey: %s"))
