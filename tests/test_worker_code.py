"""A `dask worker` runs the code of this project it imported, from its own Python's
path, for as long as it lives. One started from another copy, or before the
project's files changed (a `git pull` between two runs), computed the run's tasks
with other code: a task's AttributeError deep in step 0 at best, silently other
arithmetic at worst. The run now asks each of its workers which code it loaded
(tasks/code_identity.py) and stops before its first step, one line naming the
worker, exit 1; an identical copy at another path (another host's) is the same code.

Real processes: `dask scheduler` and `dask worker`s started by hand, the project
copied to a folder of their own, and the run as `python -m pipeline.train`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

from distributed import Client

from storage import checkpoints
from tasks.code_identity import PACKAGES
from tests.helpers import error_lines_of, run_main
from tests.test_cli import CliCluster, tiny_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_from(copy: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m pipeline.train` importing the project from `copy`."""
    return subprocess.run([sys.executable, "-m", "pipeline.train", *args], cwd=copy,
                          env={**os.environ, "PYTHONPATH": copy, "CNN_PREDICT_PROBE": "never"},
                          capture_output=True, text=True, timeout=240)


def test_workers_on_other_code_stop_the_run_before_its_first_step(tmp_path, monkeypatch,
                                                                  tiny_dataset_factory):
    copy = tmp_path / "project"
    for package in PACKAGES:
        shutil.copytree(os.path.join(ROOT, package), copy / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setenv("PYTHONPATH", str(copy))  # the scheduler and workers import the copy
    monkeypatch.setenv("CNN_PREDICT_PROBE", "never")
    (tmp_path / "cluster").mkdir()
    cluster = CliCluster(tmp_path / "cluster")
    try:
        address = cluster.start_scheduler()
        cluster.start_worker("--name", "w1")
        args = [*tiny_args(tmp_path, tiny_dataset_factory("float32")), "strategy=single",
                "--scheduler", address, "cluster.wait_timeout=120"]
        # the same code, the run's from the copy too: it trains
        first = train_from(str(copy), *args)
        assert first.returncode == 0, first.stderr
        assert (tmp_path / "run" / "summary.json").exists()

        # the copy's files change (a pull) while w1 keeps what it imported
        network = copy / "tasks" / "network.py"
        network.write_text(network.read_text() + "\n# changed after w1 imported it\n")
        again = train_from(str(copy), *args, "--fresh")
        lines = error_lines_of(again.stderr)
        assert again.returncode == 1 and len(lines) == 1, again.stderr
        assert lines[0].startswith("error: worker w1 (tcp://127.0.0.1:") and \
            f"runs other code than this run: the project's files at {copy} changed since " \
            "it or this process imported them" in lines[0], lines
        assert not (tmp_path / "run" / "record.zarr").exists()  # refused before it trained

        # a worker started from the changed copy, the run from this tree (identical to
        # what w1 loaded): w1 is this run's code, w2 is not
        cluster.start_worker("--name", "w2")
        monkeypatch.delenv("PYTHONPATH")
        status, lines, _out = run_main("train", [*args, "cluster.use_workers=2", "--fresh"])
        assert status == 1 and len(lines) == 1, lines
        assert lines[0].startswith("error: worker w2 (tcp://127.0.0.1:") and \
            f"runs other code than this run: the project at {copy}, this run's at {ROOT}" \
            in lines[0], lines
    finally:
        cluster.stop()


def test_a_worker_on_other_code_that_joins_mid_run_is_left_out(tmp_path, monkeypatch,
                                                               tiny_dataset_factory):
    """A worker that joins a cluster you started is used from the next checkpoint on
    (docs/training.md); one that runs other code is left out, said once, and the run
    goes on with its own workers. The run's process is SIGSTOPped from the moment its
    work is placed until the newcomer is in the cluster, so that the join falls before
    the run's end (tests/test_faults.py's join test does the same)."""
    copy = tmp_path / "project"
    for package in PACKAGES:
        shutil.copytree(os.path.join(ROOT, package), copy / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    network = copy / "tasks" / "network.py"
    network.write_text(network.read_text() + "\n# another version of the project\n")
    monkeypatch.delenv("PYTHONPATH", raising=False)  # the scheduler and w1: this tree
    (tmp_path / "cluster").mkdir()
    cluster = CliCluster(tmp_path / "cluster")
    client = None
    try:
        address = cluster.start_scheduler()
        cluster.start_worker("--name", "w1")
        client = Client(address, set_as_default=False, timeout="30s")
        client.wait_for_workers(1, timeout=120)
        steps = 60
        run = subprocess.Popen(
            [sys.executable, "-m", "pipeline.train",
             *tiny_args(tmp_path, tiny_dataset_factory("float32")), "placement=even",
             "train.checkpoint_every=10", f"train.steps={steps}", "train.eval_samples=0",
             "--scheduler", address], cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": ROOT, "CNN_PREDICT_PROBE": "never"})
        try:
            deadline = time.monotonic() + 120
            while not client.run_on_scheduler(lambda dask_scheduler: len(
                    dask_scheduler.tasks)):  # the run has placed its work and started
                assert run.poll() is None and time.monotonic() < deadline, run.communicate()
                time.sleep(0.02)
            run.send_signal(signal.SIGSTOP)
            try:
                monkeypatch.setenv("PYTHONPATH", str(copy))
                cluster.start_worker("--name", "w2")
                client.wait_for_workers(2, timeout=120)
                stopped_at = checkpoints.latest_complete_step(
                    str(tmp_path / "run" / "checkpoints.zarr")) or 0
            finally:
                run.send_signal(signal.SIGCONT)
            assert stopped_at < steps - 10, f"the run reached step {stopped_at} unstopped"
            _out, err = run.communicate(timeout=120)
        finally:
            if run.poll() is None:
                run.kill()
        assert run.returncode == 0, err
        said = [line for line in err.splitlines() if "joined the cluster but" in line]
        assert len(said) == 1 and said[0].startswith("warning: worker w2 (tcp://127.0.0.1:"), err
        assert f"runs other code than this run: the project at {copy}, this run's at " \
            f"{ROOT}" in said[0] and said[0].endswith("the run goes on without it"), said
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert summary["joins"] == [] and summary["workers"] == ["w1"], summary
    finally:
        if client is not None:
            client.close()
        cluster.stop()
