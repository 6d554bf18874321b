"""How a run on batch jobs (`cluster.jobqueue`) stops: Ctrl-C, and its jobs' walltime.

The import of dask-jobqueue must leave the run's signal handlers alone (a fresh
interpreter, no batch system needed). The rest runs against a real one-node Slurm
(tests/slurm_cluster.py, as tests/test_jobqueue.py; root and `slurm-wlm`/`munge`
needed, else skipped with the reason): Ctrl-C mid-run stops it as it stops a run on
the embedded cluster (one `interrupted (SIGINT)` line, exit 130, its record written,
no job left), jobs that reach their walltime together end the run with one line
saying how to resume, its record kept for the resume, jobs that end while the work is
placed (before any step) end it with one line saying to run the same command again, a
stop while the scheduler waits on the workers' answers closes without a traceback, and
a sweep whose jobs ended between points starts fresh ones for the next, while one
whose jobs did not start does not queue them again for each point.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import xarray as xr

from experiments.sweep.config import load_sweep
from experiments.sweep.cluster_pool import ClusterPool
from pipeline.cluster.jobqueue import open_jobqueue_client
from pipeline.cluster.shared_paths import check_workers_code, check_workers_see
from pipeline.cluster.workers import ClusterError, find_workers
from pipeline.config.run_config import load_run_config
from storage import checkpoints
from tests.slurm_cluster import LocalSlurm, job_workers
from tests.test_cli import ROOT, tiny_args
from tests.helpers import run_main
from tests.test_faults import FAULTS, wait_for_checkpoint
from tests.test_sweep import write_sweep


def test_importing_dask_jobqueue_keeps_the_signal_handlers():
    """dask-jobqueue's import sets SIGINT to `sys.exit()` (a Ctrl-C would end the run
    with exit 0) and fails outside the main thread; through the project it does
    neither. Nor does importing the project's cluster code import torch (its fork
    server's module list comes from tasks/memory.py, which imports it only for a GPU)."""
    pytest.importorskip("dask_jobqueue")
    code = ("import signal, sys, threading\n"
            "from pipeline.cluster import jobqueue\n"
            "print('torch' in sys.modules)\n"
            "def mine(*_): pass\n"
            "signal.signal(signal.SIGINT, mine)\n"
            "errors = []\n"
            "def load():\n"
            "    try:\n"
            "        jobqueue.import_dask_jobqueue()\n"
            "    except Exception as error:\n"
            "        errors.append(repr(error))\n"
            "thread = threading.Thread(target=load)\n"
            "thread.start(); thread.join()\n"
            "print(errors, signal.getsignal(signal.SIGINT) is mine,\n"
            "      jobqueue.import_dask_jobqueue().SLURMCluster.__name__,\n"
            "      signal.getsignal(signal.SIGINT) is mine, signal.signal is not None)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "[]", "True", "SLURMCluster", "True", "True"], \
        done.stdout


def _two_job_args(tmp_path, dataset: str, *more: str) -> list[str]:
    """A tiny run on two Slurm jobs of 1 GB, a checkpoint every 4 steps, a task a step
    (so that a stop lands between steps), its job logs in `tmp_path`."""
    return tiny_args(tmp_path, dataset) + [
        "cluster.jobqueue.jobs=2", "cluster.jobqueue.memory=1GB", "cluster.wait_timeout=60",
        f"cluster.jobqueue.directory={tmp_path}", "train.checkpoint_every=4",
        "train.steps_per_task=1", *more]


def test_ctrl_c_stops_a_run_on_slurm_jobs_as_any_run(tmp_path, slurm: LocalSlurm,
                                                      tiny_dataset_factory):
    """SIGINT to the run's process group (what Ctrl-C sends) after checkpoint 4: one
    `interrupted (SIGINT)` line naming the checkpoint, exit 130, the record of the
    steps it ran written, and no job or worker left."""
    assert FAULTS["Ctrl-C to the process group of a run on Slurm jobs, mid-run"] == "clean"
    args = _two_job_args(tmp_path, tiny_dataset_factory(), "train.steps=400")
    path = str(tmp_path / "run" / "checkpoints.zarr")
    run = subprocess.Popen([sys.executable, "-m", "pipeline.train", *args], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        wait_for_checkpoint(path, 4, run)
        os.killpg(run.pid, signal.SIGINT)
        signalled = time.monotonic()
        _out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.communicate()
    lines = [line for line in err.splitlines() if line.strip()]
    assert run.returncode == 130, lines
    assert time.monotonic() - signalled < 30
    assert lines[-1].startswith("interrupted (SIGINT): the last complete checkpoint is step "
                                f"{checkpoints.latest_complete_step(path)} "), lines
    record = xr.open_zarr(tmp_path / "run" / "record.zarr")
    assert len(record.step) >= 4 and record.attrs["name"] == "small"
    assert slurm.left_behind(str(tmp_path)) == []


def test_jobs_that_end_together_stop_the_run_with_its_record_kept(tmp_path, slurm: LocalSlurm,
                                                                   tiny_dataset_factory):
    """Every job of the run ending at once mid-run (here `scancel` of both after
    checkpoint 4; the same SIGTERM, then SIGKILL, that jobs submitted together get when
    their walltime ends together): one line, exit 1, saying no worker is left and how
    to resume; the record of the steps it ran is written (`ended`: workers lost), so
    the resume, on fresh jobs, ends with every step recorded once and none missing."""
    assert FAULTS["every Slurm job of a run ended mid-run, then resumed"] == "clean"
    args = _two_job_args(tmp_path, tiny_dataset_factory(), "train.eval_samples=0")
    path = str(tmp_path / "run" / "checkpoints.zarr")
    run = subprocess.Popen([sys.executable, "-m", "pipeline.train", *args, "train.steps=400"],
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_checkpoint(path, 4, run)
        jobs = [line.split()[0] for line in slurm.jobs(str(tmp_path))]
        assert len(jobs) == 2, jobs
        slurm.command("scancel", *jobs)
        _out, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    lines = [line for line in err.splitlines() if line.strip()]
    assert run.returncode == 1, lines
    # both jobs end within a moment: the run names where it was (a step, or the
    # checkpoint after step 4 where the machine is loaded), those it saw leave by the
    # time it stopped (one or both), and says no worker is left and how to resume
    assert re.search(r"^error: (step \d+|checkpoint): (worker slurm-[01] left the "
                     r"cluster; its|workers slurm-0, slurm-1 left the cluster; their) work "
                     r"in the run is lost, and no worker of the run is left to continue on; "
                     r"start the run again with train\.resume=true", lines[-1]), lines
    record = xr.open_zarr(tmp_path / "run" / "record.zarr")
    ran = [int(step) for step in record.step.values]
    assert ran == list(range(len(ran))) and len(ran) >= 4
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["ended"] == \
        "workers lost"
    assert slurm.left_behind(str(tmp_path)) == []
    last = checkpoints.latest_complete_step(path)
    status, lines, _ = run_main("train", args + [f"train.steps={last + 4}",
                                                 "train.resume=true"])
    assert status == 0, lines
    assert not [line for line in lines if "missing from the record" in line], lines
    record = xr.open_zarr(tmp_path / "run" / "record.zarr")
    assert list(record.step.values) == list(range(last + 4))
    assert json.loads(record.attrs["starts"])[0]["ended"] == "workers lost"
    assert slurm.left_behind(str(tmp_path)) == []


def test_jobs_that_end_while_the_work_is_placed_say_to_run_again(tmp_path, slurm: LocalSlurm,
                                                                 tiny_dataset_factory):
    """Every job's worker killed once the run says it is placing the work (a placement
    long enough to be announced after its first second and killed in: 192 kernels a
    layer, a batch of 256; at 96 and 128, 7 s here under load but under a second on
    the quiet AMD EPYC, where it was never announced): one line, exit 1,
    naming the workers lost and saying that nothing was trained and the same command
    starts over (it did not say how to go on, and was no lost-worker error a sweep
    reruns); the same command is then accepted, and no job is left."""
    assert FAULTS["every Slurm job's worker killed while the run places its work"] == "clean"
    args = _two_job_args(tmp_path, tiny_dataset_factory(), "progress=true",
                         "network.conv.0.kernels=192", "network.conv.1.kernels=192",
                         "train.batch=256", "train.steps=40")
    run = subprocess.Popen([sys.executable, "-m", "pipeline.train", *args], cwd=ROOT,
                           stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    placing = threading.Event()

    def read() -> None:
        for line in run.stderr:
            lines.append(line.rstrip())
            if "placing the work on 2 worker(s)" in line:
                placing.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert placing.wait(120), lines
        killed = job_workers(str(tmp_path))
        assert len(killed) == 2, killed
        for process in killed:
            process.kill()
        run.wait(120)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        reader.join(30)
    assert run.returncode == 1, lines
    # the start names the jobs' walltime, and that it is the default
    assert "small: starting 2 slurm job(s) for the workers, walltime 01:00:00 (the default " \
           "of cluster.jobqueue.walltime) ..." in lines, lines
    assert re.fullmatch(r"error: calibration: (worker slurm-[01] left the cluster; its|workers "
                        r"slurm-0, slurm-1 left the cluster; their) work in the run is lost, "
                        r"and no worker of the run is left to place its work on; nothing was "
                        r"trained yet: run the same command again to start over \(on fresh "
                        r"workers\)", lines[-1]), lines
    assert slurm.left_behind(str(tmp_path)) == []
    status, again, _ = run_main("train", args + ["--check"])
    assert status == 0, again


def test_a_stop_while_the_workers_answer_closes_without_a_traceback(tmp_path, slurm: LocalSlurm):
    """Ctrl-C (SIGINT) while the scheduler waits on a job's worker (a `client.run` it
    has not answered, as while the workers are set up or their folders checked) closes
    the cluster with the stop alone: before, the scheduler logged `broadcast to ...
    failed: CommClosedError` and a `CancelledError` traceback of the worker's stream
    (and asyncio, in a sweep, `Future exception was never retrieved`); no job is left."""
    assert FAULTS["Ctrl-C while the scheduler waits on a Slurm job's worker"] == "clean"
    code = ("import os, signal, sys, threading, time\n"
            "from pipeline.config.run_config import load_run_config\n"
            "from pipeline.cluster.jobqueue import open_jobqueue_client\n"
            "config = load_run_config(sys.argv[1], sys.argv[2:])\n"
            "try:\n"
            "    with open_jobqueue_client(config.cluster) as client:\n"
            "        print('up', flush=True)\n"
            "        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
            "        client.run(time.sleep, 5)\n"
            "except KeyboardInterrupt:\n"
            "    print('interrupted', flush=True)\n"
            "import gc; gc.collect()\n")
    done = subprocess.run(
        [sys.executable, "-c", code, os.path.join(ROOT, "configs", "small.yaml"),
         "cluster.jobqueue.jobs=1", "cluster.jobqueue.memory=1GB", "cluster.wait_timeout=60",
         f"cluster.jobqueue.directory={tmp_path}"], cwd=ROOT, capture_output=True,
        text=True, timeout=120)
    assert done.stdout.split() == ["up", "interrupted"], (done.stdout, done.stderr)
    assert done.stderr.strip() == "", done.stderr
    assert slurm.left_behind(str(tmp_path)) == []


def test_a_job_that_ends_before_its_folders_are_checked_is_no_folder_problem(
        tmp_path, slurm: LocalSlurm, tiny_dataset_factory):
    """slurm-1's job ends after the run found its workers and before it asked them
    whether they see its dataset store and output directory (its walltime, a
    `scancel`; here its worker killed): the checks pass over the worker that left (the
    placement after finds it gone and goes on without it, or stops with the
    lost-worker line). Before, the run stopped blaming the disk: `worker slurm-1 ...
    does not see the run's dataset store ...: every worker needs the dataset store and
    the output directory at the same path (a shared disk ...)`."""
    config = load_run_config(os.path.join(ROOT, "configs", "small.yaml"), [
        "cluster.jobqueue.jobs=2", "cluster.jobqueue.memory=1GB", "cluster.wait_timeout=60",
        f"cluster.jobqueue.directory={tmp_path}"])
    with open_jobqueue_client(config.cluster) as client:
        offered = find_workers(client, config.cluster)
        assert [w.name for w in offered] == ["slurm-0", "slurm-1"]
        (victim,) = [process for process in job_workers(str(tmp_path))
                     if "--name slurm-1 " in " ".join(process.cmdline())]
        victim.kill()
        deadline = time.monotonic() + 30
        while len(client.nthreads()) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(client.nthreads()) == 1
        check_workers_see(client, offered, tiny_dataset_factory(), str(tmp_path))
        check_workers_code(client, offered)
    assert slurm.left_behind(str(tmp_path)) == []


def test_a_sweep_starts_fresh_jobs_where_its_jobs_ended_between_points(
        tmp_path, slurm: LocalSlurm, tiny_dataset_factory):
    """A sweep keeps its batch jobs from point to point; where they ended in between
    (their walltime; here `scancel`), the next point gets fresh jobs, said in one
    line, instead of waiting `cluster.wait_timeout` for workers that are gone and
    failing."""
    config = write_sweep(tmp_path, tiny_dataset_factory("float32"),
                         {"strategy": ["single", "kernel"]}, base={"cluster": {
                             "jobqueue": {"jobs": 1, "memory": "1GB",
                                          "directory": str(tmp_path)}}})
    points = load_sweep(config, out=str(tmp_path / "sweep.zarr")).points
    assert points[0].cluster_key == points[1].cluster_key
    lines: list[str] = []
    pool = ClusterPool(lines.append)
    try:
        client = pool.client_for(points[0])
        assert pool.client_for(points[0]) is client  # its jobs still run: kept
        (job,) = [line.split()[0] for line in slurm.jobs(str(tmp_path))]
        slurm.command("scancel", job)
        deadline = time.monotonic() + 60
        while client.nthreads() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not client.nthreads()
        again = pool.client_for(points[1])
        assert again is not client and len(again.nthreads()) == 1
        # cancelled, not at its walltime: the line does not guess one
        assert "1 of 1 slurm job(s) ended since the last point; starting them again" \
            in lines, lines
        assert lines.count("starting 1 slurm job(s) for the workers, walltime 01:00:00 (the "
                           "default of cluster.jobqueue.walltime) ...") == 2, lines
    finally:
        pool.close()
    assert slurm.left_behind(str(tmp_path)) == []


def test_a_sweep_does_not_queue_jobs_again_for_each_point_once_they_did_not_start(
        tmp_path, slurm: LocalSlurm, tiny_dataset_factory):
    """A sweep's jobs still queued after `cluster.wait_timeout` (held until an hour from
    now): its first point fails with the queue's word, and the next point of the same
    jobs fails at once with the same reason, nothing submitted again (slurmctld's log
    counts one submission); before, each point queued fresh jobs and waited anew (on a
    busy cluster, hours, losing the queue's place each time)."""
    config = write_sweep(tmp_path, tiny_dataset_factory("float32"),
                         {"strategy": ["single", "kernel"]}, base={"cluster": {
                             "wait_timeout": 2, "jobqueue": {
                                 "jobs": 1, "memory": "1GB", "directory": str(tmp_path),
                                 "extra": ["--begin=now+3600"]}}})
    points = load_sweep(config, out=str(tmp_path / "sweep.zarr")).points
    log = os.path.join(slurm.folder, "slurmctld.log")

    def submitted() -> int:
        with open(log, encoding="utf-8", errors="replace") as handle:
            return handle.read().count("_slurm_rpc_submit_batch_job")

    before = submitted()
    pool = ClusterPool(lambda line: None)
    try:
        with pytest.raises(ClusterError) as first:
            pool.client_for(points[0])
        assert "0 of 1 worker(s) up after 2 s (1 pending (BeginTime)" in str(first.value)
        started = time.monotonic()
        with pytest.raises(ClusterError) as second:
            pool.client_for(points[1])
        assert time.monotonic() - started < 1.5
        assert str(second.value) == (f"{first.value} (for an earlier point of the same jobs; "
                                     "not submitted again: run the sweep again to retry)")
    finally:
        pool.close()
    assert submitted() - before == 1
    assert slurm.left_behind(str(tmp_path)) == []


def test_a_sweep_waits_for_all_its_jobs_whatever_its_first_points_use_workers(
        tmp_path, slurm: LocalSlurm, tiny_dataset_factory):
    """A sweep over `cluster.use_workers` (1, 2) on two jobs, the second slower to start
    (its prologue sleeps): the jobs are the set's, so the pool waits for both before
    the first point; before, it waited for the first point's one, and the second
    point, finding one worker up, said `1 of 2 slurm job(s) ended since the last point
    (their walltime?)` of a job still starting, cancelled both and queued them again."""
    config = write_sweep(tmp_path, tiny_dataset_factory("float32"),
                         {"cluster.use_workers": [1, 2]}, base={"cluster": {
                             "wait_timeout": 60, "jobqueue": {
                                 "memory": "1GB", "directory": str(tmp_path), "groups": [
                                     {"jobs": 1}, {"jobs": 1, "prologue": ["sleep 3"]}]}}})
    points = load_sweep(config, out=str(tmp_path / "sweep.zarr")).points
    assert points[0].config.cluster.use_workers == 1
    lines: list[str] = []
    pool = ClusterPool(lines.append)
    try:
        client = pool.client_for(points[0])
        assert len(client.nthreads()) == 2
        assert pool.client_for(points[1]) is client
        assert not [line for line in lines if "ended since the last point" in line], lines
    finally:
        pool.close()
    assert slurm.left_behind(str(tmp_path)) == []
