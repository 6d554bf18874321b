"""The command line as a user meets it: real processes, real exit codes and messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import xarray as xr

from pipeline.probe.machine import machine_identity
from tests.helpers import error_lines_of, run_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def train(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.train", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def tiny_args(tmp_path, dataset: str) -> list[str]:
    return [os.path.join(ROOT, "configs", "small.yaml"), f"output={tmp_path / 'run'}",
            f"data.path={dataset}", "data.train_samples=512", "data.test_samples=128",
            "train.steps=3", "train.batch=16", "train.eval_samples=32", "progress=false",
            "network.conv.0.kernels=8", "network.conv.1.kernels=8"]


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return error_lines_of(result.stderr)


class CliCluster:
    """Processes started the way a user starts them by hand."""

    def __init__(self, tmp_path) -> None:
        self.scheduler_file = tmp_path / "scheduler.json"
        self.logs = open(tmp_path / "cluster.log", "w")
        self.processes: list[subprocess.Popen] = []

    def start_scheduler(self) -> str:
        self.processes.append(subprocess.Popen(
            [os.path.join(BIN, "dask"), "scheduler", "--scheduler-file",
             str(self.scheduler_file), "--host", "127.0.0.1", "--port", "0",
             "--dashboard-address", "127.0.0.1:0"],  # loopback only, as the project's own
            stdout=self.logs, stderr=self.logs))
        deadline = time.monotonic() + 60
        while not self.scheduler_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        return json.loads(self.scheduler_file.read_text())["address"]

    def stop(self) -> None:
        """Workers first, then the scheduler, SIGKILLed: a test cluster holds nothing to
        save, and a graceful `dask worker` shutdown takes seconds (SIGKILL is what
        tests/test_faults.py's clusters get too)."""
        for process in reversed(self.processes):
            process.kill()
        for process in self.processes:
            process.wait()
        self.logs.close()

    def start_worker(self, *extra: str) -> subprocess.Popen:
        process = subprocess.Popen(
            [os.path.join(BIN, "dask"), "worker", "--scheduler-file", str(self.scheduler_file),
             "--nthreads", "1", "--resources", "CPU=1", "--host", "127.0.0.1",
             "--dashboard-address", "127.0.0.1:0", *extra],
            stdout=self.logs, stderr=self.logs)
        self.processes.append(process)
        return process


@pytest.fixture(scope="module")
def cli_cluster(tmp_path_factory):
    """`dask scheduler` and two `dask worker --resources CPU=1` as subprocesses, shared
    by the module's tests that only train on them."""
    cluster = CliCluster(tmp_path_factory.mktemp("cli"))
    try:
        address = cluster.start_scheduler()
        for _ in range(2):
            cluster.start_worker()
        yield address
    finally:
        cluster.stop()


def test_trains_on_cli_started_scheduler_and_workers(tmp_path, cli_cluster,
                                                     tiny_dataset_factory):
    dataset = tiny_dataset_factory("float32")
    # even placement: calibrating two alike workers on a loaded machine may give one
    # no kernels of a layer, and this test is about CLI workers, not placement
    result = train(*tiny_args(tmp_path, dataset), "placement=even", "--scheduler", cli_cluster)
    assert result.returncode == 0, result.stderr
    assert "strategy kernel" in result.stdout and "step time" in result.stdout
    record = xr.open_zarr(tmp_path / "run" / "record.zarr")
    assert record.sizes == {"step": 3, "worker": 2, "layer": 2}
    assert (record.shard_compute_time > 0).all()
    assert (record.compute_time > 0).all()
    assert list(record.device.values) == ["cpu", "cpu"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [len(layer) for layer in summary["kernel_split"]] == [2, 2]


def test_the_scheduler_is_found_through_the_environment(tmp_path, cli_cluster,
                                                      tiny_dataset_factory, monkeypatch):
    """The same cluster found through DASK_SCHEDULER_ADDRESS instead of --scheduler
    (an embedded cluster would have had the 1 worker asked for here, not 2); the
    command's `main` in this process, the workers CLI processes."""
    monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", cli_cluster)
    status, lines, _out = run_main("train", [*tiny_args(tmp_path / "env", tiny_dataset_factory(
        "float32")), "train.steps=2", "cluster.workers=1", "placement=even"])
    assert status == 0, lines
    assert xr.open_zarr(tmp_path / "env" / "run" / "record.zarr").sizes["worker"] == 2


def test_data_and_hybrid_train_on_cli_started_workers(tmp_path, cli_cluster,
                                                     tiny_dataset_factory):
    """The command's `main` in this process (the first test runs it as a process),
    on the CLI workers."""
    dataset = tiny_dataset_factory("float32")
    for strategy in ("data", "hybrid"):
        out = tmp_path / strategy
        status, lines, stdout = run_main("train", [
            *tiny_args(out, dataset), f"strategy={strategy}", "placement=even",
            "--scheduler", cli_cluster])  # even: as above, not about placement
        assert status == 0, lines
        assert f"strategy {strategy}" in stdout
        summary = json.loads((out / "run" / "summary.json").read_text())
        assert sum(summary["batch_split"]) == 16 and len(summary["batch_split"]) == 2
        record = xr.open_zarr(out / "run" / "record.zarr")
        assert record.sizes["worker"] == 2
        assert (record.workspace_bytes > 0).all()  # the gradients were exchanged
        assert record.attrs["gradient_reduction"].startswith("workspace")


def test_resource_no_worker_has_fails_fast_naming_it(tmp_path, tiny_dataset_factory):
    dataset = tiny_dataset_factory("float32")
    started = time.monotonic()
    result = train(*tiny_args(tmp_path, dataset), "cluster.resource=GPU")
    assert time.monotonic() - started < 15  # named before any cluster starts
    assert result.returncode == 2
    assert "cluster.resource: no worker of the embedded cluster offers 'GPU' (they " \
        "offer: CPU)" in result.stderr and "Traceback" not in result.stderr
    assert len(error_lines(result)) == 1, result.stderr
    assert not (tmp_path / "run").exists()  # nothing written


def test_trains_from_a_cifar10_archive(tmp_path):
    """CIFAR-10's python archive format, imported on first use, then trained on."""
    from tests.test_datasets import _cifar_batches, _write_archive

    archive = _write_archive(tmp_path / "cifar-10-python.tar.gz", _cifar_batches())
    store = tmp_path / "cifar.zarr"
    result = train(os.path.join(ROOT, "configs", "small.yaml"), f"data.source={archive}",
                   f"data.path={store}", f"output={tmp_path / 'run'}", "train.steps=2",
                   "train.batch=8", "train.eval_samples=8", "progress=false",
                   "cluster.workers=1", "placement=even")  # about the archive, not placement
    assert result.returncode == 0, result.stderr
    record = xr.open_zarr(tmp_path / "run" / "record.zarr")
    assert record.attrs["dataset_source"].endswith("cifar-10-python.tar.gz")
    assert record.sizes["step"] == 2
    # which machine gave the figures (its CPU, not only its name: pipeline/probe/machine.py)
    assert record.attrs["machine"] == machine_identity()


def run_files(output) -> dict[str, float]:
    """Every file of a run directory with its modification time."""
    return {str(path): path.stat().st_mtime_ns for path in output.rglob("*") if path.is_file()}
