"""A `dask worker` runs the code of this project it imported, from its own Python's
path, for as long as it lives. One started from another copy, or before the
project's files changed (a `git pull` between two runs), computed the run's tasks
with other code: a task's AttributeError deep in step 0 at best, silently other
arithmetic at worst. The run now asks each of its workers which code it loaded
(tasks/code_identity.py) and stops before its first step, one line naming the
worker, exit 1; an identical copy at another path (another host's) is the same code.

Real processes: `dask scheduler` and `dask worker`s started by hand, one of them
from a changed copy of the project, and the run as `python -m pipeline.train`; the
run's side of the check (which worker, and why) on the session's embedded workers.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from dataclasses import replace

import dask
import pytest
from distributed import Client, Worker
from distributed.comm.core import CommClosedError

from pipeline.cluster import shared_paths
from pipeline.cluster.shared_paths import check_workers_code, other_code
from pipeline.cluster.workers import ClusterError, ClusterWorker, find_workers
from pipeline.config.run_config import build_run_config
from pipeline.training.recovery import joined
from storage import checkpoints
from tasks import code_identity
from tasks.code_identity import PACKAGES, source_digest
from tests.helpers import run_main
from tests.test_cli import CliCluster, tiny_args
from tests.test_faults import quiet_servers
from tests.test_sweep import write_sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def project_copy(folder: Path, change: str | None = None) -> Path:
    """A copy of the project's packages in `folder`/project, with `change` appended
    to one module as a comment (another version of the code) if given."""
    copy = folder / "project"
    for package in PACKAGES:
        shutil.copytree(os.path.join(ROOT, package), copy / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    if change is not None:
        network = copy / "tasks" / "network.py"
        network.write_text(network.read_text() + f"\n# {change}\n")
    return copy


def test_a_copy_elsewhere_is_the_same_code_and_a_changed_file_is_not(tmp_path):
    """The digest is of the files, not of where they are: an identical copy at
    another path (another host's) is the same code; one changed line is not."""
    assert source_digest(str(project_copy(tmp_path / "same"))) == source_digest(ROOT)
    assert source_digest(str(project_copy(tmp_path / "changed", "changed"))) != \
        source_digest(ROOT)


def test_each_worker_on_other_code_is_named_with_why(three_worker_cluster, monkeypatch):
    """The run's side of the check on real workers (they answer with their own
    code): the same code passes; where this process's code differs, each worker is
    named, as files changed since one imported them (the same folder) or as another
    copy (another folder), and the run stops on the first (ClusterError)."""
    client, config = three_worker_cluster
    workers = find_workers(client, config)
    assert other_code(client, workers) == {}
    monkeypatch.setattr(code_identity, "DIGEST", "a-later-version")  # this process only
    said = other_code(client, workers)
    assert sorted(said) == sorted(w.address for w in workers)
    assert all(why.startswith("runs other code than this run: the project's files at "
                              f"{ROOT} changed since it or this process imported them")
               for why in said.values()), said
    monkeypatch.setattr(code_identity, "ROOT", "/elsewhere/project")
    said = other_code(client, workers)
    assert all(why == f"runs other code than this run: the project at {ROOT}, this run's "
               "at /elsewhere/project" for why in said.values()), said
    with pytest.raises(ClusterError, match=rf"^worker {workers[0].name} \("):
        check_workers_code(client, workers)


def test_a_worker_on_other_code_that_joins_mid_run_is_left_out(tmp_path, monkeypatch,
                                                               tiny_dataset_factory):
    """A worker that joins a cluster you started is used from the next checkpoint on
    (docs/training.md); one that runs other code is left out, said once, and the run
    goes on with its own workers; a run that starts with it stops before its first
    step, one line naming it, exit 1. The run's process is SIGSTOPped from the moment its
    work is placed until the newcomer is in the cluster, so that the join falls before
    the run's end (tests/test_faults.py's join test does the same)."""
    copy = project_copy(tmp_path, "another version of the project")
    monkeypatch.delenv("PYTHONPATH", raising=False)  # the scheduler and w1: this tree
    quiet_servers(monkeypatch)  # its servers (and the run) as the project's own
    (tmp_path / "cluster").mkdir()
    cluster = CliCluster(tmp_path / "cluster", dashboards=False)
    client = None
    try:
        address = cluster.start_scheduler()
        cluster.start_worker("--no-nanny", "--name", "w1")  # one process a worker: the
        # code it imported is its own either way (the dry run's test below keeps a nanny)
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
                cluster.start_worker("--no-nanny", "--name", "w2")
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

        # a run that starts with w2 among its workers is refused before its first step
        monkeypatch.setenv("CNN_PREDICT_PROBE", "never")
        status, lines, _out = run_main("train", [
            *tiny_args(tmp_path, tiny_dataset_factory("float32")), "placement=even",
            f"output={tmp_path / 'refused'}", "--scheduler", address,
            "cluster.use_workers=2"])
        assert status == 1 and len(lines) == 1, lines
        assert lines[0].startswith("error: worker w2 (tcp://127.0.0.1:") and \
            f"runs other code than this run: the project at {copy}, this run's at {ROOT}" \
            in lines[0], lines
        assert not (tmp_path / "refused" / "record.zarr").exists()  # refused before it trained
    finally:
        if client is not None:
            client.close()
        cluster.stop()


def test_a_newcomer_that_does_not_say_its_code_in_time_is_left_out_for_now(
        three_worker_cluster, monkeypatch, capsys):
    """At a checkpoint the run asks a worker that joined which code it runs; one that
    did not answer in time (busy, stopped) stopped the whole run with a ClusterError.
    It is now left out at this checkpoint, said, and asked again at the next."""
    client, cluster = three_worker_cluster
    workers = find_workers(client, cluster)
    config = replace(build_run_config({}), cluster=cluster)
    refused: set[str] = set()
    monkeypatch.setattr(shared_paths, "ANSWER_S", 1e-6)  # no answer can come in time
    assert joined(client, config, workers[:2], refused) == []
    assert refused == set()
    assert f"worker(s) {workers[2].name} joined the cluster but did not say" \
        in capsys.readouterr().err
    monkeypatch.setattr(shared_paths, "ANSWER_S", 30.0)
    assert {w.address for w in joined(client, config, workers[:2], refused)} == \
        {w.address for w in workers}


def test_a_newcomer_that_cannot_be_reached_once_is_asked_again_at_the_next_checkpoint(
        three_worker_cluster, capsys):
    """A worker that joined but that the scheduler cannot reach when the run asks which
    code it runs (its connection refused, dropped, or not made in time) has said nothing
    about its code, as a slow one. It was refused for the rest of the run ("could not
    say which code it runs (OSError: ...)"); it is now left out at this checkpoint,
    said, and asked again at the next. A real newcomer in this process: a worker whose
    listener is stopped, so that the scheduler's connections to it are refused."""
    client, cluster = three_worker_cluster
    workers = find_workers(client, cluster)
    config = replace(build_run_config({}), cluster=cluster)

    async def join() -> Worker:
        return await Worker(client.scheduler.address, security=client.security, nthreads=1,
                            name="unreached", resources={"CPU": 1}, host="127.0.0.1")

    newcomer = client.sync(join)
    try:
        async def stop_listening() -> None:
            newcomer.listener.stop()

        client.sync(stop_listening)
        refused: set[str] = set()
        with dask.config.set({"distributed.comm.timeouts.connect": "2s"}):
            assert joined(client, config, workers, refused) == []
        assert refused == set()  # asked again at the next checkpoint
        err = capsys.readouterr().err
        assert "warning: worker(s) unreached joined the cluster but did not say which code " \
            f"they run (worker unreached ({newcomer.address}) could not be reached: " in err, err
        assert err.rstrip().endswith("the run goes on without them for now"), err
    finally:
        client.sync(newcomer.close)


def test_only_no_answer_counts_as_unreached_not_an_error_the_worker_raised():
    """`unreached_for_code`: a connection error (refused, closed, a connect timeout) or
    no answer at all is no answer; a worker's own error (it cannot import this
    project) and an identity are answers."""
    workers = [ClusterWorker(f"tcp://h:{port}", f"w{port}", "CPU", 1, 1.0)
               for port in (1, 2, 3, 4, 5)]
    answers = {"tcp://h:1": ("/p", "d"), "tcp://h:2": CommClosedError("in <TCP>: closed"),
               "tcp://h:3": OSError("Timed out trying to connect"),
               "tcp://h:4": ModuleNotFoundError("No module named 'tasks'")}
    assert shared_paths.unreached_for_code(answers, workers) == {
        "tcp://h:2": "CommClosedError: in <TCP>: closed",
        "tcp://h:3": "OSError: Timed out trying to connect", "tcp://h:5": "no answer"}


def test_a_sweeps_dry_run_probes_no_worker_that_runs_other_code(tmp_path, monkeypatch,
                                                                tiny_dataset_factory):
    """A sweep's dry run (`mode: predict` too) on a cluster you started probes its
    workers where no probe is cached (CNN_PREDICT_PROBE=auto). It probed a worker
    started from another copy of the project and printed, and cached, the figures of
    other code; the probe now refuses it as a run does: one warning line naming the
    worker, no prediction, nothing cached."""
    copy = project_copy(tmp_path, "another version of the project")
    (tmp_path / "cluster").mkdir()
    cluster = CliCluster(tmp_path / "cluster", dashboards=False)
    try:
        address = cluster.start_scheduler()
        monkeypatch.setenv("PYTHONPATH", str(copy))
        cluster.start_worker("--name", "other")
        monkeypatch.delenv("PYTHONPATH")
        with Client(address, set_as_default=False, timeout="30s") as client:
            client.wait_for_workers(1, timeout=120)
        monkeypatch.setenv("CNN_PREDICT_PROBE", "auto")
        monkeypatch.setenv("CNN_PROBE_CACHE", str(tmp_path / "probes"))
        sweep = write_sweep(tmp_path, tiny_dataset_factory("float32"), {"train.batch": [16]})
        status, lines, out = run_main("sweep", [sweep, "--out", str(tmp_path / "sweep.zarr"),
                                                "--dry-run", "--scheduler", address])
    finally:
        cluster.stop()
    assert status == 0, lines
    said = [line for line in lines if line.startswith("warning: the model's probe")]
    assert len(said) == 1 and said[0].startswith(
        "warning: the model's probe of this cluster failed: worker other (tcp://127.0.0.1:"), \
        lines
    assert f"runs other code than this run: the project at {copy}, this run's at {ROOT}" \
        in said[0], said
    point = out.splitlines()[-1].split()
    assert point[0] == "1" and point[-1] == "-", out  # no prediction
    probes = tmp_path / "probes"
    assert not probes.exists() or not any(probes.iterdir())
