"""Faults injected into real processes: a worker SIGKILLed mid-run (the run recovers
by itself and ends with plain PyTorch's weights, as an uninterrupted run does), a
worker joining mid-run, the sweep process killed at random moments (the store stays
whole and finished points are never rerun).

`FAULTS` lists every fault these tests inject, with what must come of it; the
`## Faults` section of docs/reliability.md shows the same list and figures, and
`test_reliability_page_matches_the_faults_tested` keeps the two in step.
"""

from __future__ import annotations

import glob
import json
import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import xarray as xr
from distributed import Client

from experiments.sweep.results import PointResult, ResultStore
from experiments.sweep.store_layout import ADDED_LATER, DONE, FAILED, build_template
from experiments.sweep.run import one_line
from experiments.sweep.config import load_sweep
from pipeline.cluster.embedded import QUIET
from pipeline.cluster.workers import ClusterWorker, SchedulerLost, WorkerLost
from pipeline.engine.runner import FETCH_ASK_S, TaskRunner
from storage import checkpoints
from tests.helpers import error_lines_of, max_relative_error, replay_in_pytorch, run_main
from pipeline.config.run_config import load_run_config
from tests.forked_servers import ForkedCluster
from tests.test_cli import ROOT, tiny_args
from tests.test_sweep import write_sweep

#: fault -> what must come of it: "survived" (the run finished with the right
#: result), or "clean" (one clear line, exit 1, nothing recorded lost).
FAULTS = {
    "worker SIGKILLed mid-run, kernel, float64": "survived",
    "worker SIGKILLed mid-run, data, float64": "survived",
    "worker SIGKILLed mid-run, recovery off, then resumed": "clean",
    "worker SIGKILLed in a sweep's point, no checkpoint but step 0": "clean",
    "worker dies while the run sets the workers up": "survived",
    # tests/test_scheduler_faults.py
    "scheduler SIGKILLed mid-run": "clean",
    "scheduler SIGSTOPped mid-run, limit 8 s": "clean",
    "worker joins mid-run, kernel, float64": "survived",
    # tests/test_stalls.py
    "worker SIGSTOPped mid-run, woken later, kernel, float64": "survived",
    "worker SIGSTOPped mid-run, woken later, data, float64": "survived",
    "worker SIGSTOPped mid-run, woken later, hybrid, float64": "survived",
    # tests/test_link_faults.py (workers behind cluster.link)
    "store's server (sshd) SIGSTOPped mid-run, 3 workers": "clean",
    "worker's link cut mid-run, restored after, kernel, float64": "survived",
    "worker SIGSTOPped in its namespace mid-run, kernel, float64": "survived",
    # tests/test_signals.py
    "run SIGTERMed mid-run, then resumed": "clean",
    "sweep SIGTERMed mid-sweep, then run again": "clean",
    "run Ctrl-Ced while the model probes, after its last step, then resumed": "clean",
    # tests/test_cli.py (a cluster started by hand)
    "scheduler and workers started in another directory, relative paths": "survived",
    "run refused: scheduler unreachable, then the corrected command": "clean",
    "run refused: no worker offers its tag, then the corrected command": "clean",
    "a worker does not see the output directory": "clean",
    # tests/test_full_disk.py
    "disk full mid-run (checkpoints on a small tmpfs)": "clean",
    "disk full mid-sweep, then run again with room": "clean",
    # tests/test_many_workers.py
    "Ctrl-C to the run's process group while its workers start": "clean",
    "sweep process SIGKILLed, seed 1": "survived",
    "sweep process SIGKILLed, seed 2": "survived",
    "sweep process SIGKILLed, seed 3": "survived",
    # tests/test_jobqueue.py (workers as Slurm batch jobs)
    "Slurm job scancelled mid-run, kernel, float64": "survived",
    "Slurm job held in the queue past cluster.wait_timeout": "clean",
    # tests/test_jobqueue_stops.py
    "Ctrl-C to the process group of a run on Slurm jobs, mid-run": "clean",
    "every Slurm job of a run ended mid-run, then resumed": "clean",
    "every Slurm job's worker killed while the run places its work": "clean",
    "Ctrl-C while the scheduler waits on a Slurm job's worker": "clean",
}
PAGE = os.path.join(ROOT, "docs", "reliability.md")


@pytest.fixture(scope="module")
def this_code_everywhere():
    """CLI workers, runs and sweeps started here import this tree's code."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", ROOT)
        yield


#: Dask's settings that cost CPU and that nothing under test reads, as the project
#: sets them on the servers it starts itself (pipeline/cluster/embedded.py's `QUIET`):
#: no statistical profiler (it samples each worker's stacks every 10 ms), no GIL
#: monitor, the event-loop health check every 500 ms instead of 20, the system monitor
#: every 2 s instead of 0.5. A kill, a join, a lost connection are seen as before.
QUIET_SERVERS = {key: QUIET[key] for key in (
    "distributed.worker.profile.enabled", "distributed.admin.system-monitor.gil.enabled",
    "distributed.admin.tick.interval", "distributed.admin.system-monitor.interval")}


def quiet_servers(patch: pytest.MonkeyPatch) -> None:
    """`QUIET_SERVERS` as Dask's environment variables, for the servers (and runs) this
    process starts from here on: on a module's shared cluster, over a run of a minute
    or more, most of its CPU when idle."""
    for key, value in QUIET_SERVERS.items():
        patch.setenv("DASK_" + key.upper().replace(".", "__").replace("-", "_"), str(value))


@pytest.fixture(scope="module")
def three_cli_workers(tmp_path_factory, this_code_everywhere):
    """A scheduler and three workers named w0, w1, w2, each a process of its own
    (tests/forked_servers.py: forked, not `dask worker` commands, which import torch
    each), shared by the module (`QUIET_SERVERS`); the runs under test are
    `python -m pipeline.train --scheduler` processes, as against a cluster started by
    hand. A test that kills a worker starts its replacement (`replace`)."""
    cluster = ForkedCluster(tmp_path_factory.mktemp("cli"), QUIET_SERVERS)
    address = cluster.start_scheduler()
    workers = {f"w{i}": cluster.start_worker(f"w{i}") for i in range(3)}
    try:
        client = Client(address, set_as_default=False, timeout="30s")
    except BaseException:
        cluster.stop()
        raise
    try:
        client.wait_for_workers(3, timeout=120)
        yield CliWorkers(cluster, address, workers, client)
    finally:
        client.close()
        cluster.stop()


@dataclass
class CliWorkers:
    cluster: ForkedCluster
    address: str
    workers: dict[str, multiprocessing.Process]
    client: Client

    def kill(self, name: str) -> None:
        self.workers[name].kill()
        self.workers[name].join(30)

    def replace(self, name: str) -> None:
        """Start a worker under a killed one's name; return once the cluster has three."""
        self.workers[name] = self.cluster.start_worker(name)
        self.client.wait_for_workers(3, timeout=120)


def train_process(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipeline.train", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def killed_after_checkpoint(run: subprocess.Popen, path: str, step: int,
                            kill: Callable[[], None]) -> str:
    """Once checkpoint `step` of the run's store `path` is complete, `kill` (a worker,
    the scheduler); the run's stderr once it has ended, within 30 s of the kill. The
    run is killed if the test fails first."""
    try:
        wait_for_checkpoint(path, step, run)
        kill()
        killed = time.monotonic()
        _out, err = run.communicate(timeout=60)
        assert time.monotonic() - killed < 30
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    return err


def complete_from(path: str, step: int) -> int:
    """The checkpoint store's latest complete step once a checkpoint of step `step` or
    later has a folder in it, else 0: a poll that lists one folder (microseconds) while
    there is none, instead of the store, whose listing reads every checkpoint's
    metadata (about 1.5 ms of CPU: polled every 20 ms, 7% of a core for the wait)."""
    try:
        names = os.listdir(os.path.join(path, "step"))
    except FileNotFoundError:
        return 0
    if not any(name.isdigit() and int(name) >= step for name in names):
        return 0
    return checkpoints.latest_complete_step(path) or 0


def wait_for_checkpoint(path: str, step: int, run: subprocess.Popen,
                        timeout: float = 120) -> int:
    """Poll the checkpoint store until checkpoint `step` (or a later one) is complete."""
    deadline = time.monotonic() + timeout
    while True:
        latest = complete_from(path, step)
        if latest >= step:
            return latest
        assert run.poll() is None, run.communicate()
        assert time.monotonic() < deadline, f"no checkpoint {step} after {timeout} s"
        time.sleep(0.02)


#: The networks a killed worker is survived on: the paper family's, and ResNet-20's
#: tied splits with batch norm's running statistics replayed, trained on augmented
#: images under a warm-up and cosine decay (the replay after the loss draws each step's
#: crops and flips again, at each step's rate).
NETWORKS = {"paper family": ["network.conv.0.kernels=12", "network.conv.1.kernels=12"],
            "resnet20": ["network.preset=resnet20", "network.width=0.25",
                         "data.augment=crop_flip", "train.lr_warmup=2",
                         "train.lr_decay=cosine"]}


@pytest.mark.parametrize("strategy, dtype, victim, tolerance, network", [
    ("data", "float64", "w0", 1e-10, "paper family"),
    ("kernel", "float64", "w2", 1e-10, "resnet20"),  # kernel's re-placed shards, tied
])  # resnet20 under a learning-rate schedule: the replay takes each step's rate
def test_worker_killed_mid_run_is_survived(tmp_path, three_cli_workers, tiny_dataset_factory,
                                           strategy, dtype, victim, tolerance, network):
    """Three worker processes, one SIGKILLed after checkpoint 4: the run re-places its share on
    the two survivors, replays from the last checkpoint, finishes by itself, records
    the recovery, and ends with plain PyTorch's weights (as an uninterrupted run on the
    survivors does)."""
    assert FAULTS[f"worker SIGKILLed mid-run, {strategy}, {dtype}"] == "survived"
    cluster = three_cli_workers
    dataset = tiny_dataset_factory(dtype)
    steps, every = (16, 4) if network == "paper family" else (6, 3)
    args = tiny_args(tmp_path / "recovered", dataset) + [
        f"strategy={strategy}", "placement=even", f"network.dtype={dtype}",
        f"train.checkpoint_every={every}", f"train.steps={steps}", "train.eval_samples=0",
        *NETWORKS[network]]
    run = train_process(*args, "--scheduler", cluster.address)
    path = str(tmp_path / "recovered" / "run" / "checkpoints.zarr")
    try:
        wait_for_checkpoint(path, every, run)
        cluster.kill(victim)
        killed = time.monotonic()
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
        assert time.monotonic() - killed < 60
        summary = json.loads((tmp_path / "recovered" / "run" / "summary.json").read_text())
        (recovery,) = summary["recoveries"]
        assert recovery["lost_workers"] == [victim]
        assert f"recovered   {victim} lost at step {recovery['lost_at_step']}" in out  # said
        header = next(line for line in out.splitlines() if line.startswith("run "))
        assert header.endswith(f"; ended on {', '.join(recovery['workers'])} (below)")
        assert set(recovery["workers"]) == {"w0", "w1", "w2"} - {victim}
        restored = recovery["restored_step"]
        assert restored >= every and restored % every == 0
        assert restored <= recovery["lost_at_step"] < steps
        assert recovery["replayed_steps"] == recovery["lost_at_step"] - restored
        split = recovery["split"]
        if strategy == "kernel":
            if network == "paper family":
                assert [sum(layer) for layer in split["kernel_split"]] == [12, 12]
            assert all(len(layer) == 2 for layer in split["kernel_split"])
        else:
            assert split["batch_split"] == [8, 8]
        record = xr.open_zarr(tmp_path / "recovered" / "run" / "record.zarr")
        assert list(record.step.values) == list(range(steps))  # each step once
        assert json.loads(record.attrs["recoveries"]) == summary["recoveries"]
        # the timing figures are the placed set-up's (its split, its prediction): the
        # survivors' steps, the re-placement's warm-up first, are left out, and said
        assert summary["other_setup_steps_left_out"] == list(range(restored, steps))
        times = record.step_time.values
        assert summary["step_time_median"] == pytest.approx(np.median(times[1:restored]))
        assert (f"re-placed   the medians leave out steps 0 (each start's warm-up) and "
                f"steps {restored}-{steps - 1}") in out
        assert np.isfinite(record.loss.values).all()

        # plain single-process PyTorch on the run's batches (torchvision's ResNet for
        # resnet20): what an uninterrupted run on the survivors also equals
        # (tests/test_equality.py), without a second run on the cluster
        got = checkpoints.read_tensors(path, steps)
        expected, _ = replay_in_pytorch(load_run_config(args[0], args[1:]), dataset)
        assert max_relative_error(got, expected) <= tolerance
    finally:
        if run.poll() is None:
            run.kill()
        cluster.replace(victim)


#: Run on a worker (`client.run(exec, ...)`): its process ends as soon as a run's
#: `WorkerSetup` is installed there, as a worker whose host goes down as a run starts.
DIE_WHEN_SET_UP = ("import os, tasks.worker_state\n"
                   "tasks.worker_state.WorkerSetup.setup = lambda self, worker: os._exit(1)")


def test_a_worker_that_dies_while_the_run_sets_it_up_is_left_out(
        tmp_path, three_cli_workers, tiny_dataset_factory):
    """A worker whose process ends while the run installs its setup broke the setup's
    broadcast, and the run stopped: `setting up the workers failed: in <TCP (closed)
    ConnectionPool.register_worker_plugin ...>: Stream is closed`. The setup is now
    tried again on the others, with a warning naming the lost worker, and the run
    places its work over them, as it does for a worker lost before placement."""
    assert FAULTS["worker dies while the run sets the workers up"] == "survived"
    cluster = three_cli_workers
    (doomed,) = [address for address, info in cluster.client.scheduler_info(n_workers=-1)[
        "workers"].items() if info["name"] == "w1"]
    cluster.client.run(exec, DIE_WHEN_SET_UP, {}, workers=[doomed])
    args = tiny_args(tmp_path, tiny_dataset_factory("float32")) + [
        "placement=even", "train.eval_samples=0", "--scheduler", cluster.address]
    try:
        run = subprocess.run([sys.executable, "-m", "pipeline.train", *args], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    finally:
        cluster.workers["w1"].join(30)  # ended by itself
        cluster.replace("w1")
    assert run.returncode == 0, run.stderr
    assert ("warning: setting up the workers: w1 left the cluster meanwhile (its process "
            "ended?); setting up the others again") in run.stderr
    record = xr.open_zarr(tmp_path / "run" / "record.zarr")
    assert list(record.step.values) == [0, 1, 2]
    assert sorted(json.loads(record.attrs["starts"])[0]["workers"]) == ["w0", "w2"]


def test_worker_killed_with_recovery_off_stops_cleanly_then_resumes(
        tmp_path, three_cli_workers, tiny_dataset_factory):
    """`train.max_recoveries=0`: a SIGKILLed worker stops the run with one line (no
    hang), its checkpoints and the record of its steps kept, and a resumed run
    continues from the last one."""
    assert FAULTS["worker SIGKILLed mid-run, recovery off, then resumed"] == "clean"
    cluster = three_cli_workers
    args = [*tiny_args(tmp_path, tiny_dataset_factory("float32")), "--scheduler",
            cluster.address, "placement=even", "train.checkpoint_every=4",
            "train.max_recoveries=0"]
    run = train_process(*args, "train.steps=100000")
    path = str(tmp_path / "run" / "checkpoints.zarr")
    try:
        err = killed_after_checkpoint(run, path, 4, lambda: cluster.kill("w1"))
    finally:
        cluster.replace("w1")
    assert run.returncode == 1 and len(error_lines_of(err)) == 1, err
    assert "left the cluster" in err and "train.resume=true" in err
    last = checkpoints.latest_complete_step(path)
    assert last >= 4 and last % 4 == 0
    # resumed through the command's main in this process (a resume run as a process,
    # from the printed command: tests/test_signals.py)
    status, lines, _out = run_main("train", [*args, f"train.steps={last + 3}",
                                             "train.resume=true"])
    assert status == 0, lines
    record = xr.open_zarr(tmp_path / "run" / "record.zarr")
    # the stopped start wrote its record (as a signal's stop does): every step once
    assert list(record.step.values) == list(range(last + 3))
    assert json.loads(record.attrs["starts"])[0]["ended"] == "workers lost"
    assert not [line for line in lines if "missing from the record" in line], lines


def test_a_sweep_point_whose_every_step_ran_on_the_survivors_fails_not_stored(
        tmp_path, three_cli_workers, tiny_dataset_factory, monkeypatch):
    """Under `checkpoint_every: 0` a point's run that loses a worker recovers from
    checkpoint 0 and runs every step on the survivors. Those figures were stored as
    the point's (2 workers, "done", its split, its model error) with nothing said. The
    point now fails in one line naming the loss, no figure stored, its run's summary
    saying what its steps ran on; the same command runs it again."""
    assert FAULTS["worker SIGKILLed in a sweep's point, no checkpoint but step 0"] == "clean"
    cluster = three_cli_workers
    monkeypatch.setenv("CNN_PREDICT_PROBE", "never")  # no model probes: the point stays short
    # 200 steps (not 600): the kill, at the point's first task, still lands seconds before
    # its end, and the survivor, which then runs every step again, runs fewer
    config = write_sweep(tmp_path, tiny_dataset_factory("float32"), {"cluster.workers": [2]},
                         measure={"warmup_steps": 1, "steps": 200})
    store = tmp_path / "lost.zarr"
    command = ["--scheduler", cluster.address, "--out", str(store)]
    sweep = subprocess.Popen([sys.executable, "-m", "experiments.sweep", config, *command],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.monotonic() + 120
        while not any("step-" in str(key) or "steps-" in str(key)  # the steps have begun
                      for keys in cluster.client.processing().values() for key in keys):
            assert sweep.poll() is None and time.monotonic() < deadline, sweep.communicate()
            time.sleep(0.02)
        cluster.kill("w1")  # one of the point's two (use_workers: the first by name)
        out, err = sweep.communicate(timeout=120)
    finally:
        if sweep.poll() is None:
            sweep.kill()
        cluster.replace("w1")
    assert sweep.returncode == 1, err
    ds = xr.open_zarr(store).load()
    assert (ds.status == FAILED).all() and ds.step_time.isnull().all()
    reason = str(ds.failure.values.ravel()[0])
    assert reason.startswith("SetupNotMeasured: w1 lost at step ") and (
        "recovered from checkpoint 0: every step ran on w0, not on the point's workers"
        in reason), reason
    assert "1 point(s) failed" in out and "Run the same command again" in out
    (run,) = glob.glob(str(tmp_path / "lost.runs" / "*"))
    summary = json.loads(open(os.path.join(run, "summary.json")).read())
    assert summary["placed_setup_unmeasured"] and not summary["warmup_included"]
    assert summary["recoveries"][0]["restored_step"] == 0


def test_a_worker_joining_mid_run_is_used_from_the_next_checkpoint(
        tmp_path, three_cli_workers, tiny_dataset_factory):
    """Two worker processes train; a third starts once the run has placed its work: at a
    later checkpoint the run re-places over all three and goes on without restarting
    or replaying, and its float64 weights still equal plain single-process PyTorch's.

    The run's process is SIGSTOPped from the moment its work is placed until the third
    worker is in the cluster (its steps already submitted run on), so that the join
    falls before the run's end however long the worker takes to start: 200 steps
    running on through the start were once needed (100 were once done first on a
    loaded machine, and no join was seen), most of this test's time."""
    assert FAULTS["worker joins mid-run, kernel, float64"] == "survived"
    cluster = three_cli_workers
    cluster.kill("w2")
    dataset = tiny_dataset_factory("float64")
    # the join is seen at checkpoint 10, or a later one if this process is late to
    # stop the run: up to 40 steps late (over a second of steps, unloaded)
    steps, every = 60, 10
    args = tiny_args(tmp_path, dataset) + [
        "placement=even", "network.dtype=float64", f"train.checkpoint_every={every}",
        f"train.steps={steps}", "train.eval_samples=0",
        "network.conv.0.kernels=12", "network.conv.1.kernels=12"]
    run = train_process(*args, "--scheduler", cluster.address)
    path = str(tmp_path / "run" / "checkpoints.zarr")
    try:
        deadline = time.monotonic() + 120
        while not cluster.client.run_on_scheduler(lambda dask_scheduler: len(
                dask_scheduler.tasks)):  # the run has placed its work and started
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()
            time.sleep(0.02)
        run.send_signal(signal.SIGSTOP)
        try:
            stopped_at = checkpoints.latest_complete_step(path) or 0
            cluster.replace("w2")
        finally:
            run.send_signal(signal.SIGCONT)
        assert stopped_at < steps - every, f"the run reached step {stopped_at} unstopped"
        _out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
    finally:
        if run.poll() is None:
            run.kill()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    (join,) = summary["joins"]
    assert summary["recoveries"] == [] and join["joined_workers"] == ["w2"]
    assert join["workers"] == ["w0", "w1", "w2"] and 0 < join["at_step"] < steps
    assert join["at_step"] % every == 0 and join["split"]["kernel_split"] == [[4, 4, 4]] * 2
    assert summary["kernel_split"] == [[8, 4], [8, 4]]  # as placed at the start
    record = xr.open_zarr(tmp_path / "run" / "record.zarr")
    assert list(record.step.values) == list(range(steps))  # nothing replayed
    # the timing figures are those of the split the summary names (as placed): the
    # steps on three workers, the new placement's warm-up first, are left out
    at = join["at_step"]
    assert summary["other_setup_steps_left_out"] == list(range(at, steps))
    assert summary["step_time_median"] == pytest.approx(np.median(record.step_time.values[1:at]))
    after = record.compute_time.sel(worker="w2").isel(step=slice(join["at_step"], None))
    assert (after > 0).all()  # w2 computed every step after it joined
    config = load_run_config(args[0], args[1:])
    expected, _ = replay_in_pytorch(config, dataset)
    assert max_relative_error(checkpoints.read_tensors(path, steps), expected) <= 1e-10



def test_a_worker_that_leaves_holding_a_finished_result_is_named_within_seconds(
        three_cli_workers):
    """A task done, its worker frozen as the run fetches the result and then killed
    (as a batch job's end does): the fetch cannot finish (the task is pinned there),
    and the run names the lost worker at its next question to the scheduler, a second
    or two on. It waited out the whole fetch limit (10 s) before it asked."""
    cluster = three_cli_workers
    info = cluster.client.scheduler_info(n_workers=-1)["workers"]
    address = next(a for a, worker in info.items() if worker["name"] == "w2")
    runner = TaskRunner(cluster.client, [ClusterWorker(address, "w2", "CPU", 1, 1.0, "cpu")],
                        "held")
    future = runner.submit(sum, 0, [1, 2], name="held")
    assert future.result(timeout=30) == 3  # done, held by w2
    os.kill(cluster.workers["w2"].pid, signal.SIGSTOP)
    killer = threading.Timer(1.0, cluster.kill, args=("w2",))
    killer.start()
    try:
        started = time.monotonic()
        with pytest.raises(WorkerLost) as lost:
            runner.gather([future], "collecting")
        took = time.monotonic() - started
    finally:
        killer.join()
        cluster.replace("w2")
    assert "collecting: worker w2 left the cluster" in str(lost.value), str(lost.value)
    assert 1.0 <= took < 1.0 + 3 * FETCH_ASK_S + 2.0, took


def test_sweep_killed_at_random_moments_keeps_finished_points(tmp_path, this_code_everywhere,
                                                              tiny_dataset_factory, monkeypatch):
    """SIGKILL the sweep process at moments drawn from fixed seeds, restarting it after
    each: the store always opens, points finished before a kill keep their figures
    and are never rerun, and the last restart (the same command's `main`, in this
    process) completes the sweep."""
    seeds = [int(k.rsplit(" ", 1)[1]) for k in FAULTS if k.startswith("sweep process")]
    monkeypatch.setenv("CNN_PREDICT_PROBE", "never")  # no model probes: points stay short
    monkeypatch.setenv("CNN_PROBE_CACHE", str(tmp_path / "probes"))
    config = write_sweep(tmp_path, tiny_dataset_factory("float32"), {"train.batch": [8, 12, 16]},
                         repeats=2, base={"strategy": "reference"})
    store = tmp_path / "kills.zarr"
    command = [sys.executable, "-m", "experiments.sweep.cli", config, "--out", str(store)]
    finished: dict[int, tuple] = {}  # flat point index -> (run_id, step_time) once done
    for seed in seeds:
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        try:  # killed at that moment, unless it has finished by then (no need to wait on)
            process.wait(timeout=random.Random(seed).uniform(1.0, 10.0))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if not store.exists():
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ds = xr.open_zarr(store).load()  # opens cleanly, whatever the moment
        status = ds.status.values.ravel()
        run_ids, times = ds.run_id.values.ravel(), ds.step_time.values.ravel()
        for index, (run_id, step_time) in finished.items():
            assert status[index] == DONE and (run_ids[index], times[index]) == (run_id,
                                                                                step_time)
        finished.update({i: (run_ids[i], times[i]) for i in np.flatnonzero(status == DONE)})
    status, err_lines, out = run_main("sweep", command[3:])  # its main, in this process
    assert status == 0, err_lines
    assert f"{len(finished)} done before, {6 - len(finished)} to run" in out
    assert out.count("s/step") == 6 - len(finished)  # only those ran
    assert not os.path.exists(f"{store}.lock")  # the killed sweeps' lock was taken over
    ds = xr.open_zarr(store).load()
    assert (ds.status == DONE).all()
    assert json.loads(ds.attrs["sessions"])[-1]["interrupted"] is False
    for index, point in finished.items():
        assert (ds.run_id.values.ravel()[index], ds.step_time.values.ravel()[index]) == point
    assert (ds.recoveries == 0).all()  # reference runs keep no state on workers


@pytest.mark.parametrize("error", [
    SchedulerLost("step 3: lost the Dask scheduler at tcp://127.0.0.1:8786"),
    WorkerLost("step 3: worker w1 left the cluster", ["tcp://127.0.0.1:1"], ["w1"]),
])
def test_sweep_failure_reason_for_a_lost_cluster_says_how_to_retry(error):
    """A sweep records such a point as failed with advice that applies to sweeps (it
    reruns failed points), not the single run's `train.resume=true`."""
    reason = one_line(error)
    assert reason.startswith(type(error).__name__) and str(error) in reason
    assert "run the same sweep command again" in reason and "train.resume" not in reason


def test_reliability_page_matches_the_faults_tested():
    """docs/reliability.md's `## Faults` table and figures are this module's FAULTS."""
    with open(PAGE, encoding="utf-8") as handle:
        page = handle.read()
    section = page.split("## Faults", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| ([^|]+?) \| (survived|clean) \|$", section, re.M))
    assert rows == FAULTS
    figures = re.search(r"Faults injected: (\d+) · survived: (\d+) · stopped cleanly: "
                        r"(\d+) · results lost: (\d+)", section)
    assert figures, "the figures line is missing"
    outcomes = list(FAULTS.values())
    assert tuple(map(int, figures.groups())) == (
        len(FAULTS), outcomes.count("survived"), outcomes.count("clean"), 0)


def test_store_without_the_recovery_variables_still_takes_points(tmp_path):
    """Stores of format 2 written before `recoveries`/`recovery_log` existed resume: a
    point is written without them, and they stay absent."""
    sweep = load_sweep(write_sweep(tmp_path, "unused.zarr", {"train.batch": [8, 16]}))
    old = build_template(sweep, {"fingerprint": sweep.fingerprint}).drop_vars(ADDED_LATER)
    store = ResultStore(str(tmp_path / "old.zarr"))
    store.create(old)
    store.write_point((0, 0), PointResult({"step_time": 0.5, "recoveries": 1.0},
                                          {"recovery_log": "[{}]", "failure": ""}, {}))
    store.write_failure((1, 0), "ClusterError: gone", {}, {})
    ds = xr.open_zarr(store.path).load()
    assert list(ds.status.values.ravel()) == [DONE, FAILED]
    assert float(ds.step_time[0, 0]) == 0.5
    assert not set(ADDED_LATER) & set(ds.variables)
