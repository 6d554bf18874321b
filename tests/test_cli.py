"""The command line as a user meets it: real processes, real exit codes and messages."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence

import pytest
import xarray as xr
import yaml
from distributed import Client, Security

from pipeline.cluster import worker_limits, worker_setup
from pipeline.cluster.connect import check_handshake, check_scheduler_answers
from pipeline.cluster.workers import SchedulerUnreachable
from pipeline.config.cluster_config import ClusterConfig
from pipeline.cluster.security import PLAIN_PEER, connection_problem
from pipeline.probe.machine import machine_identity
from tests.helpers import error_lines_of, run_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def tiny_args(tmp_path, dataset: str) -> list[str]:
    return [os.path.join(ROOT, "configs", "small.yaml"), f"output={tmp_path / 'run'}",
            f"data.path={dataset}", "data.train_samples=512", "data.test_samples=128",
            "train.steps=3", "train.batch=16", "train.eval_samples=32", "progress=false",
            "network.conv.0.kernels=8", "network.conv.1.kernels=8"]


class CliCluster:
    """Processes started the way a user starts them by hand: each in a terminal of its
    own, in a directory of their own (`tmp_path`), not the run's. `dashboards` False
    starts them with `--no-dashboard`, as a user may: each dashboard imports bokeh (a
    third of a second of CPU a process), which nothing reads where a test passes it."""

    def __init__(self, tmp_path, dashboards: bool = True) -> None:
        self.dashboards = dashboards
        self.directory = tmp_path
        self.scheduler_file = tmp_path / "scheduler.json"
        self.logs = open(tmp_path / "cluster.log", "w")
        self.processes: list[subprocess.Popen] = []

    def start_scheduler(self) -> str:
        self.processes.append(subprocess.Popen(
            [os.path.join(BIN, "dask"), "scheduler", "--scheduler-file",
             str(self.scheduler_file), "--host", "127.0.0.1", "--port", "0",
             *self.dashboard()],
            stdout=self.logs, stderr=self.logs, cwd=self.directory, env=self.env()))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the file appears before its text is written
            text = self.scheduler_file.read_text() if self.scheduler_file.exists() else ""
            if text.strip():
                return json.loads(text)["address"]
            time.sleep(0.2)
        self.stop()  # a fixture whose setup fails is not torn down: leave no scheduler
        raise TimeoutError(f"no scheduler file at {self.scheduler_file} after 60 s")

    def stop(self) -> None:
        """Workers first, then the scheduler, SIGKILLed: a test cluster holds nothing to
        save, and a graceful `dask worker` shutdown takes seconds (SIGKILL is what
        tests/test_faults.py's clusters get too)."""
        for process in reversed(self.processes):
            process.kill()
        for process in self.processes:
            process.wait()
        self.logs.close()

    def start_worker(self, *extra: str, prefix: Sequence[str] = ()) -> subprocess.Popen:
        """A `dask worker` with `extra` arguments, its command after `prefix` (e.g.
        ``["taskset", "-c", "0"]``: pinned to one core)."""
        process = subprocess.Popen(
            [*prefix, os.path.join(BIN, "dask"), "worker", "--scheduler-file", str(self.scheduler_file),
             "--nthreads", "1", "--resources", "CPU=1", "--host", "127.0.0.1",
             *self.dashboard(), *extra],
            stdout=self.logs, stderr=self.logs, cwd=self.directory, env=self.env())
        self.processes.append(process)
        return process

    def dashboard(self) -> list[str]:
        """A server's dashboard option: on loopback only, as the project's own, or none."""
        # without a dashboard a server still serves HTTP, on every interface unless placed
        loopback = ["--dashboard-address", "127.0.0.1:0"]
        return loopback if self.dashboards else ["--no-dashboard", *loopback]

    @staticmethod
    def env() -> dict[str, str]:
        """This tree's code for the servers, unless the test names other code: an
        installed copy elsewhere is other code, which the run refuses."""
        return {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or ROOT}


@pytest.fixture(scope="module")
def cli_cluster(tmp_path_factory):
    """`dask scheduler` and two `dask worker --resources CPU=1` as subprocesses, shared
    by the module's tests that train on them (some add a worker of their own). One
    worker has its nanny, as `dask worker` starts by default, the other none (`--no-nanny`,
    as batch systems start them): the runs train on both kinds, and a nanny is a second
    interpreter that imports torch. The servers are quiet (tests/test_faults.py's
    `QUIET_SERVERS`: no profiler, slower ticks) and have no dashboard, which nothing
    here reads."""
    from tests.test_faults import quiet_servers

    cluster = CliCluster(tmp_path_factory.mktemp("cli"), dashboards=False)
    try:
        with pytest.MonkeyPatch.context() as patch:  # the servers' environment, not the runs'
            quiet_servers(patch)
            address = cluster.start_scheduler()
            cluster.start_worker()
            cluster.start_worker("--no-nanny")
        with Client(address, timeout="30s", set_as_default=False) as client:
            client.wait_for_workers(2, timeout=60)  # a test may count them
        yield address
    finally:
        cluster.stop()


def test_trains_on_cli_started_scheduler_and_workers(tmp_path, cli_cluster,
                                                     tiny_dataset_factory):
    dataset = tiny_dataset_factory("float32")
    # even placement: calibrating two alike workers on a loaded machine may give one
    # no kernels of a layer, and this test is about CLI workers, not placement. The
    # command's `main` in this process: the workers are the processes here (a real
    # `python -m pipeline.train` is tests/test_bad_input.py's and test_worker_code.py's)
    status, lines, out = run_main("train", [*tiny_args(tmp_path, dataset), "placement=even",
                                            "--scheduler", cli_cluster])
    assert status == 0, lines
    assert "strategy kernel" in out and "step time" in out
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
    (an embedded cluster's workers would be named cpu-0, cpu-1; these are unnamed);
    the command's `main` in this process, the workers CLI processes."""
    monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", cli_cluster)
    status, lines, _out = run_main("train", [*tiny_args(tmp_path / "env", tiny_dataset_factory(
        "float32")), "train.steps=2", "placement=even"])
    assert status == 0, lines
    workers = xr.open_zarr(tmp_path / "env" / "run" / "record.zarr").worker.values
    assert len(workers) == 2 and not any(str(w).startswith("cpu-") for w in workers), workers
    assert not [line for line in lines if "other client" in line], lines  # nobody else


def test_a_tls_address_of_a_plain_scheduler_is_said_to_be_one(cli_cluster):
    """A tls:// address of a tcp:// scheduler: the scheduler's plain handshake arrives
    before TLS's (tornado's "IOStream is not idle", a traceback in 2 of 5 tries), or
    TLS's handshake fails on it ("cannot reach ... is `dask scheduler` running
    there?" of a running one). Either way the line says what it is."""
    address = cli_cluster.replace("tcp://", "tls://")
    for _ in range(3):
        with pytest.raises(OSError) as error:
            check_handshake(address, Security.temporary(), 10)
        assert connection_problem(address, error.value) == (
            f"the Dask scheduler at {address} does not speak TLS ({PLAIN_PEER}); if it "
            f"serves plain TCP, name it {cli_cluster} without cluster.tls")


def test_an_address_from_the_environment_is_said_to_come_from_it(monkeypatch):
    """A leftover DASK_SCHEDULER_ADDRESS, where the user expects an embedded cluster:
    the line says where the address came from."""
    monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", "tcp://127.0.0.1:1")
    with pytest.raises(SchedulerUnreachable) as refused:
        check_scheduler_answers(ClusterConfig())
    assert str(refused.value).endswith("(the address $DASK_SCHEDULER_ADDRESS gives)")
    with pytest.raises(SchedulerUnreachable) as refused:
        check_scheduler_answers(ClusterConfig(scheduler="tcp://127.0.0.1:1"))
    assert "DASK_SCHEDULER_ADDRESS" not in str(refused.value)


def test_sweep_points_wanting_more_workers_than_found_fail_at_once(tmp_path, cli_cluster,
                                                                   tiny_dataset_factory):
    """Two workers offer CPU: the 3-worker point waits `cluster.wait_timeout` and fails;
    the 4-worker point failed alike after waiting as long again (30 s a point by
    default); now it fails at once, saying why, and the 1-worker point runs."""
    from tests.test_sweep import write_sweep

    config = write_sweep(tmp_path, tiny_dataset_factory("float32"),
                         {"cluster.workers": [1, 3, 4]},
                         base={"cluster": {"wait_timeout": 3}})
    store = tmp_path / "short.zarr"
    status, _lines, _out = run_main("sweep", [config, "--out", str(store),
                                              "--scheduler", cli_cluster])
    assert status == 1
    ds = xr.open_zarr(store)
    assert [str(s) for s in ds.failure.values[:, 0]][0] == ""
    three, four = (str(f) for f in ds.failure.values[1:, 0])
    assert "only 2 of the 3 workers needed offer resource 'CPU' after 3 s" in three, three
    assert four.endswith("only 2 of the 4 workers needed offer resource 'CPU' (an earlier "
                         "point of this sweep waited 3 s for more; add workers and run the "
                         "same command again)"), four
    assert float(ds.wall_time.values[2, 0]) < 1.0 <= 3 <= float(ds.wall_time.values[1, 0])


def test_a_worker_frozen_before_the_run_is_removed_and_the_run_goes_on(
        tmp_path, cli_cluster, tiny_dataset_factory, monkeypatch):
    """A `dask worker` SIGSTOPped before the run connects: setting the workers up
    waits on every worker, and so waited for ever. Now the setup has a limit
    (`SETUP_S`), after which the workers that do not answer a direct call (`PROBE_S`)
    are removed from the cluster, said, and the run trains on the others (both limits
    shortened here). The frozen worker joins the module's cluster (its two workers
    train), and goes after."""
    monkeypatch.setattr(worker_setup, "SETUP_S", 3.0)
    monkeypatch.setattr(worker_setup, "PROBE_S", 2.0)
    monkeypatch.setattr(worker_limits, "ASK_WORKERS_S", 2.0)
    frozen = subprocess.Popen(
        [os.path.join(BIN, "dask"), "worker", cli_cluster, "--no-nanny", "--name", "frozen",
         "--nthreads", "1", "--resources", "CPU=1", "--host", "127.0.0.1",
         "--no-dashboard", "--dashboard-address", "127.0.0.1:0"],
        cwd=tmp_path, env=CliCluster.env(), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    client = Client(cli_cluster, timeout="30s", set_as_default=False)
    try:
        client.wait_for_workers(3, timeout=60)
        names = client.run_on_scheduler(lambda dask_scheduler: {  # a lambda: sent by value
            address: worker.name for address, worker in dask_scheduler.workers.items()})
        (frozen_address,) = [address for address, name in names.items() if name == "frozen"]
        os.kill(frozen.pid, signal.SIGSTOP)
        ran: list = []
        run = threading.Thread(target=lambda: ran.append(run_main("train", [
            *tiny_args(tmp_path, tiny_dataset_factory("float32")), "train.steps=2",
            "placement=even", "--scheduler", cli_cluster])), daemon=True)
        run.start()
        run.join(120)  # a run that waits on the frozen worker never ends
    finally:
        frozen.kill()  # stopped or not
        frozen.wait()
        deadline = time.monotonic() + 30  # the module's two workers, for the next test
        while client.run_on_scheduler(lambda dask_scheduler: len(
                dask_scheduler.workers)) > 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        client.close()
    assert ran, "the run waited on the frozen worker"
    status, lines, _out = ran[0]
    assert status == 0, lines
    said = [line for line in lines if line.startswith("warning: setting up the workers: ")]
    assert len(said) == 1 and said[0].startswith(
        f"warning: setting up the workers: {frozen_address} did not answer within 3 s"), lines
    assert xr.open_zarr(tmp_path / "run" / "record.zarr").sizes["worker"] == 2


def test_another_client_with_work_on_the_scheduler_is_said_and_recorded(
        tmp_path, cli_cluster, tiny_dataset_factory):
    """A second client (another run, a notebook) holding tasks on the same scheduler:
    its work would share the run's workers, so the run says so, as it starts and as
    its steps end, and its record's notes keep both lines. Its task here asks for a
    resource no worker has, so it waits and slows nothing."""
    with Client(cli_cluster, timeout="30s", set_as_default=False) as other:
        held = other.submit(sum, [1, 2], resources={"NOWHERE": 1}, pure=False)
        status, lines, _out = run_main("train", [
            *tiny_args(tmp_path, tiny_dataset_factory("float32")), "train.steps=2",
            "placement=even", "--scheduler", cli_cluster])
        other.cancel(held)
    assert status == 0, lines
    said = [line for line in lines if "other client" in line]
    assert said == [f"warning: {when}, 1 other client holds tasks on the Dask scheduler at "
                    f"{cli_cluster} (another run or sweep?): their work shares this run's "
                    "workers, so its step times include it"
                    for when in ("as the run starts", "as its steps ended")], lines
    notes = json.loads(xr.open_zarr(tmp_path / "run" / "record.zarr").attrs["notes"])
    assert [note for note in notes if "other client" in note] == said


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


def test_a_worker_whose_python_lacks_the_project_is_named(tmp_path, tiny_dataset_factory):
    """A `dask worker` whose Python has Dask and torch but not this project (here: the
    venv's packages without its .pth files, `python -S`, so the editable install is
    not found): the run stops at the workers' setup in one line that names it; before,
    the line said only that some worker lacked the module."""
    import site
    cluster = CliCluster(tmp_path, dashboards=False)
    try:
        address = cluster.start_scheduler()
        bare = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
        cluster.processes.append(subprocess.Popen(
            [sys.executable, "-S", os.path.join(BIN, "dask"), "worker", address, "--name",
             "bare", "--nthreads", "1", "--resources", "CPU=1", "--host", "127.0.0.1",
             *cluster.dashboard(), "--no-nanny"], stdout=cluster.logs, stderr=cluster.logs,
            cwd=tmp_path, env={**bare, "PYTHONPATH": site.getsitepackages()[0]}))
        cluster.start_worker("--name", "full", "--no-nanny")  # one with it, not named
        with Client(address, timeout="30s", set_as_default=False) as client:
            client.wait_for_workers(2, timeout=60)
        status, said, _out = run_main("train", [
            *tiny_args(tmp_path, tiny_dataset_factory("float32")), "--scheduler", address])
    finally:
        cluster.stop()
    lines = error_lines_of("\n".join(said))
    assert status == 1 and len(lines) == 1, said
    assert "setting up the workers failed" in lines[0] and "No module named" in lines[0]
    assert lines[0].endswith("install this project on every worker's Python "
                             "(pip install -e .): it lacks it on bare"), lines[0]


def test_resource_no_worker_has_fails_fast_naming_it(tmp_path, tiny_dataset_factory):
    """The command's `main` in this process (about the refusal, not the process: the
    first test runs `python -m pipeline.train` as one)."""
    dataset = tiny_dataset_factory("float32")
    started = time.monotonic()
    status, said, _out = run_main("train", [*tiny_args(tmp_path, dataset),
                                            "cluster.resource=GPU"])
    assert time.monotonic() - started < 15  # named before any cluster starts
    stderr = "\n".join(said)
    assert status == 2
    assert "cluster.resource: no worker of the embedded cluster offers 'GPU' (they " \
        "offer: CPU)" in stderr and "Traceback" not in stderr
    assert len(error_lines_of(stderr)) == 1, stderr
    assert not (tmp_path / "run").exists()  # nothing written


def test_trains_from_a_cifar10_archive(tmp_path):
    """CIFAR-10's python archive format, imported on first use, then trained on by the
    shipped recipe (configs/resnet20_cifar10.yaml: augmented images, a step decay),
    shortened. The command's `main` in this process (about the archive and the recipe,
    not the process: the other tests here run `python -m pipeline.train` as one)."""
    from tests.test_datasets import _cifar_batches, _write_archive

    archive = _write_archive(tmp_path / "cifar-10-python.tar.gz", _cifar_batches())
    store = tmp_path / "cifar.zarr"
    status, lines, _out = run_main("train", [
        os.path.join(ROOT, "configs", "resnet20_cifar10.yaml"), f"data.source={archive}",
        f"data.path={store}", f"output={tmp_path / 'run'}", "train.steps=3",
        "train.lr_milestones=[1,2]", "train.batch=8", "train.eval_samples=8",
        "progress=false", "network.width=0.25", "strategy=kernel",
        "cluster.workers=1", "placement=even"])  # about the archive, not placement
    assert status == 0, lines
    record = xr.open_zarr(tmp_path / "run" / "record.zarr")
    assert record.attrs["dataset_source"].endswith("cifar-10-python.tar.gz")
    assert record.sizes["step"] == 3
    assert record.lr.values == pytest.approx([0.1, 0.01, 0.001], rel=1e-12)
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert config["data"]["augment"] == "crop_flip"
    # which machine gave the figures (its CPU, not only its name: pipeline/probe/machine.py)
    assert record.attrs["machine"] == machine_identity()


def unused_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_files(output) -> dict[str, float]:
    """Every file of a run directory with its modification time."""
    return {str(path): path.stat().st_mtime_ns for path in output.rglob("*") if path.is_file()}


def test_relative_paths_reach_workers_started_elsewhere(tmp_path, cli_cluster, monkeypatch):
    """The scheduler and workers run in a directory of their own (`CliCluster`); the
    run, started in another, names its output and dataset relatively. The client hands
    the workers absolute paths: they read the dataset the client built and write the
    checkpoints where it reads them. Resumed once finished, the run says it is
    complete in one line, exit 0, and changes nothing."""
    from tests.test_faults import FAULTS
    assert FAULTS["scheduler and workers started in another directory, relative "
                  "paths"] == "survived"
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    args = [*tiny_args(tmp_path, "data/tiny.zarr"), "output=runs/relative", "placement=even",
            "--scheduler", cli_cluster]
    status, lines, _out = run_main("train", args)
    assert status == 0, lines
    output = project / "runs" / "relative"
    record = xr.open_zarr(output / "record.zarr")
    assert record.sizes["worker"] == 2 and record.sizes["step"] == 3
    assert record.attrs["dataset"] == str(project / "data" / "tiny.zarr")
    assert not list(tmp_path.glob("cli*/runs")) and not list(tmp_path.glob("cli*/data"))
    before = run_files(output)
    status, lines, out = run_main("train", [*args, "train.resume=true"])
    assert (status, lines) == (0, []), lines
    assert out.splitlines() == [f"small: the run in {output} is complete (its checkpoints "
                                "reach step 3); nothing to resume, nothing changed; to train "
                                "on, raise train.steps"]
    assert run_files(output) == before


def test_a_run_refused_before_its_first_step_leaves_nothing_in_the_way(
        tmp_path, cli_cluster, tiny_dataset_factory):
    """Refused because its scheduler is unreachable, or because no worker offers its
    tag: one line, exit 1, and the corrected command runs (the initial weights a
    refused run wrote are no earlier results). `--check` says what the run would:
    fine here, and, once the run has finished, the same refusal."""
    from tests.test_faults import FAULTS
    assert FAULTS["run refused: scheduler unreachable, then the corrected command"] == "clean"
    assert FAULTS["run refused: no worker offers its tag, then the corrected command"] == \
        "clean"
    args = [*tiny_args(tmp_path, tiny_dataset_factory("float32")), "placement=even"]
    unreachable = f"tcp://127.0.0.1:{unused_port()}"
    status, lines, _out = run_main("train", [*args, "--scheduler", unreachable])
    assert status == 1 and len(lines) == 1 and unreachable in lines[0], lines
    status, lines, _out = run_main("train", [*args, "--scheduler", cli_cluster,
                                             "cluster.resource=NONE", "cluster.wait_timeout=1"])
    assert status == 1 and len(lines) == 1 and "NONE" in lines[0], lines
    corrected = [*args, "--scheduler", cli_cluster]
    status, lines, out = run_main("train", [*corrected, "--check"])
    assert status == 0 and "config and paths are fine" in out, lines
    status, lines, _out = run_main("train", corrected)
    assert status == 0, lines
    refusals = [run_main("train", [*corrected, *check]) for check in (["--check"], [])]
    assert refusals[0][:2] == refusals[1][:2], refusals
    status, lines, _out = refusals[0]
    assert status == 2 and "already holds an earlier run's results" in lines[0], lines


def test_a_worker_that_does_not_see_the_output_is_named(tmp_path, cli_cluster,
                                                        tiny_dataset_factory):
    """A worker in a mount namespace of its own, where a tmpfs hides the run's output
    directory (a host without the shared disk): the run stops before its first step
    with one line naming the worker and the folder, exit 1."""
    from tests.test_faults import FAULTS
    assert FAULTS["a worker does not see the output directory"] == "clean"
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a worker in its own mount namespace")
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    worker = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f"mount -t tmpfs hidden {shlex.quote(str(hidden))} && exec "
         f"{shlex.quote(os.path.join(BIN, 'dask'))} worker {cli_cluster} --no-nanny "
         "--name elsewhere --nthreads 1 --resources ELSEWHERE=1 --host 127.0.0.1 "
         "--no-dashboard --dashboard-address 127.0.0.1:0"],
        cwd=tmp_path, env=CliCluster.env(), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        status, lines, _out = run_main("train", [
            *tiny_args(hidden, tiny_dataset_factory("float32")), "placement=even",
            "--scheduler", cli_cluster, "cluster.resource=ELSEWHERE"])
    finally:
        worker.kill()
        worker.wait()
    assert status == 1 and len(lines) == 1, lines
    assert lines[0].startswith("error: worker elsewhere (tcp://127.0.0.1:") and \
        f"does not see the run's output directory {hidden / 'run'}:" in lines[0], lines
    assert not list((hidden / "run").glob(".hetcnn-seen-*"))


def test_the_first_worker_missing_a_folder_is_named():
    """`first_unseen`: the run's first worker (in its order) that misses a folder, and
    which; an answer that is not True (a worker's error) counts as missing, but no
    answer at all (a closed comm: an OSError, which `os.path.exists` never raises) is
    said as such, not as a missing folder."""
    from pipeline.cluster.workers import ClusterWorker
    from pipeline.cluster.shared_paths import first_unseen

    workers = [ClusterWorker(f"tcp://h{i}:1", f"w{i}", "CPU", 1, 1.0) for i in range(3)]
    shown = {"dataset store": "/d/x.zarr", "output directory": "/runs/x"}
    everywhere = {w.address: True for w in workers}
    assert first_unseen({what: everywhere for what in shown}, workers, shown) is None
    seen = {"dataset store": {**everywhere, "tcp://h2:1": False},
            "output directory": {**everywhere, "tcp://h1:1": OSError("gone")}}
    line = first_unseen(seen, workers, shown)
    assert line == ("worker w1 (tcp://h1:1) did not answer whether it sees the run's output "
                    "directory /runs/x (OSError: gone)"), line
    seen["output directory"]["tcp://h1:1"] = ValueError("its own error")
    line = first_unseen(seen, workers, shown)
    assert line.startswith("worker w1 (tcp://h1:1) does not see the run's output directory "
                           "/runs/x: "), line


#: The `python -m` commands the README and docs give, each a module or a package.
DOCUMENTED_MODULES = ["pipeline.train", "experiments.sweep", "experiments.report",
                      "experiments.report.trace_plot", "experiments.sweep.reference",
                      "storage.datasets"]

#: Runs each module named on its command line as `python -m NAME --help` does (a
#: package's __main__), one after the other in this one interpreter (so that torch and
#: Dask are imported once, not once a module); prints a JSON object of each name's exit
#: code and the first line it printed.
HELP_ALL = """
import contextlib, io, json, runpy, sys, traceback, warnings
warnings.simplefilter("ignore", RuntimeWarning)  # runpy: "found in sys.modules"
answers = {}
for name in sys.argv[1:]:
    sys.argv, printed, code = [name, "--help"], io.StringIO(), None
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        code = "returned without exiting"
    except SystemExit as done:
        code = done.code or 0
    except BaseException:
        code = traceback.format_exc().strip().splitlines()[-1]
    answers[name] = [code, (printed.getvalue().splitlines() or [""])[0]]
print(json.dumps(answers))
"""


def test_the_documented_commands_start_as_modules():
    """Each `python -m ...` the README and docs give starts (its package's __main__ for a
    folder) and answers --help with its own usage line; the tests call most mains in
    their own process, which would not notice a broken __main__.py."""
    result = subprocess.run([sys.executable, "-c", HELP_ALL, *DOCUMENTED_MODULES], cwd=ROOT,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    answers = json.loads(result.stdout.strip().splitlines()[-1])
    assert sorted(answers) == sorted(DOCUMENTED_MODULES)
    for module, (code, first_line) in answers.items():
        assert code == 0, (module, code)
        assert f"python -m {module}" in first_line, (module, first_line)


def test_workers_offering_other_than_one_unit_of_the_tag_train_as_plain_pytorch(
        tmp_path, tiny_dataset_factory):
    """`dask worker --nthreads 2 --resources CPU=2` beside one with `CPU=0.5`: each task
    of the run asks for all its worker offers of the tag, so the two-unit worker runs
    one of the run's tasks at a time (asking for one unit, it ran two at once, out of
    the step graph's order: "the writer is already at step 1 while this reader wants
    step 0"), and the half-unit worker is one of the run's (it was never found: "no
    worker offers resource 'CPU'"). float64 weights equal plain PyTorch's, for the
    kernel and the data strategies."""
    from tests.test_faults import quiet_servers
    from pipeline.config.run_config import load_run_config
    from storage import checkpoints
    from tests.helpers import max_relative_error, replay_in_pytorch

    dataset = tiny_dataset_factory("float64")
    cluster = CliCluster(tmp_path, dashboards=False)
    try:
        with pytest.MonkeyPatch.context() as patch:
            quiet_servers(patch)
            address = cluster.start_scheduler()
            cluster.start_worker("--name", "two", "--nthreads", "2", "--resources", "CPU=2")
            cluster.start_worker("--name", "half", "--no-nanny", "--resources", "CPU=0.5")
        with Client(address, timeout="30s", set_as_default=False) as client:
            client.wait_for_workers(2, timeout=60)
        for strategy in ("kernel", "data"):
            out = tmp_path / strategy
            status, lines, _out = run_main("train", [
                *tiny_args(out, dataset), "network.dtype=float64", "train.steps=4",
                f"strategy={strategy}", "placement=even", "--scheduler", address])
            assert status == 0, (strategy, lines)
            record = xr.open_zarr(out / "run" / "record.zarr")
            assert sorted(map(str, record.worker.values)) == ["half", "two"]
            config = load_run_config(str(out / "run" / "config.yaml"))
            trained = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
            expected, _ = replay_in_pytorch(config, dataset)
            assert max_relative_error(trained, expected) <= 1e-10, strategy
    finally:
        cluster.stop()
