"""`cluster.jobqueue`: a run's workers as Slurm batch jobs, through dask-jobqueue.

The pure parts (the queue's word on pending jobs, the config's refusals, what a job
script holds) need no batch system. The rest runs against a real one-node Slurm that
the module starts (tests/slurm_cluster.py; root and `slurm-wlm`/`munge` needed, else
skipped with the reason): a run on two Slurm jobs ends with plain PyTorch's weights
(float64), a job `scancel`ed mid-run is recovered from, a job that cannot start yet
is reported with the queue's reason, one that never can stops the run at once, an
unknown partition is one line, and `squeue` lists nothing after any of them; the
Slurm's daemons listen on loopback only.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import stat
import subprocess
import sys
import threading
import time

import pytest
from distributed import Client

from pipeline.cluster import batch_queue, jobqueue
from pipeline.cluster.job_ends import job_states, timed_out
from pipeline.cluster.worker_setup import register_setup
from pipeline.config.jobqueue_config import JobGroupConfig, JobqueueConfig
from pipeline.config.run_config import load_run_config
from pipeline.cluster.jobqueue import open_jobqueue_client
from pipeline.run import run_training
from storage import checkpoints
from tests.helpers import (assert_one_error_line, max_relative_error, replay_in_pytorch,
                           run_main, tiny_config)
from tests.slurm_cluster import job_workers, listening
from tests.test_cli import ROOT, tiny_args
from tests.test_faults import FAULTS, wait_for_checkpoint
from tests.test_worker_code import project_copy

# Pure parts ---------------------------------------------------------------------------


def test_pending_jobs_are_counted_with_the_queue_reason():
    states = {"11": ("PENDING", "Resources"), "12": ("PENDING", "Resources"),
              "13": ("PENDING", "BeginTime"), "14": ("RUNNING", "None"),
              "15": ("FAILED", "NonZeroExitCode")}  # `squeue -t all` lists ended jobs too
    summary = batch_queue.pending_summary(states, ["11", "12", "13", "14", "15"])
    assert summary == "1 pending (BeginTime), 2 pending (Resources), 1 starting"
    assert batch_queue.pending_summary(states, []) == ""


def test_a_job_that_ended_or_left_the_queue_before_joining_is_named():
    states = {"11": ("PENDING", "Resources"), "12": ("FAILED", "NonZeroExitCode")}
    waiting = {"slurm-0": "11", "slurm-1": "12", "slurm-2": "13"}
    assert batch_queue.ended_jobs(states, waiting) == ["slurm-1", "slurm-2"]


def test_a_job_slurm_will_never_start_is_named_with_what_asks_for_it():
    states = {"11": ("PENDING", "Resources"), "12": ("PENDING", "PartitionTimeLimit"),
              "13": ("RUNNING", "PartitionConfig")}
    assert batch_queue.never_starting(states, {"slurm-0": "11", "slurm-2": "13"}) is None
    assert batch_queue.never_starting(states, {"slurm-0": "11", "slurm-1": "12"}) == (
        "cluster.jobqueue: slurm job 12 (slurm-1) will never start: Slurm keeps it pending "
        "(PartitionTimeLimit): it asks for more time than the partition allows: "
        "cluster.jobqueue.walltime")


def test_the_partitions_jobs_wait_in_are_named():
    states = {"11": ("PENDING", "Resources", "gpu"), "12": ("PENDING", "Priority", "cpu"),
              "13": ("PENDING", "Resources", "cpu")}
    assert batch_queue.partitions_of(states, ["11"]) == " in Slurm partition gpu"
    assert batch_queue.partitions_of(states, ["11", "12", "13"]) == (
        " in Slurm partitions cpu, gpu")
    assert batch_queue.partitions_of(states, ["14"]) == ""
    assert batch_queue.never_starting({"12": ("PENDING", "PartitionTimeLimit", "cpu")},
                                      {"slurm-1": "12"}) == (
        "cluster.jobqueue: slurm job 12 (slurm-1) will never start: Slurm keeps it pending "
        "(PartitionTimeLimit) in Slurm partition cpu: it asks for more time than the "
        "partition allows: cluster.jobqueue.walltime")


def test_held_jobs_are_told_to_be_released_not_waited_for():
    states = {"11": ("PENDING", "Resources"), "12": ("PENDING", "JobHeldUser"),
              "13": ("PENDING", "JobHeldAdmin")}
    assert batch_queue.wait_advice(states, {"slurm-0": "11"}) == (
        "raise cluster.wait_timeout if the queue is busy")
    assert batch_queue.wait_advice(states, {"slurm-0": "11", "slurm-1": "12",
                                            "slurm-2": "13"}) == (
        "job(s) 12, 13 are held: release them (scontrol release 12,13) and start the "
        "run again")


def test_groups_take_unset_fields_from_the_jobqueue_and_the_run_tag():
    config = JobqueueConfig(jobs=2, cores=2, queue="cpu", prologue=["source venv"], groups=[
        JobGroupConfig(jobs=1, queue="gpu", extra=["--gres=gpu:1"], resources={"GPU": 1}),
        JobGroupConfig(cores=4)])
    gpu, cpu = config.group_list("CPU")
    assert (gpu.jobs, gpu.cores, gpu.queue, gpu.resources) == (1, 2, "gpu", {"GPU": 1})
    assert (cpu.jobs, cpu.cores, cpu.queue, cpu.resources) == (2, 4, "cpu", {"CPU": 1.0})
    assert gpu.prologue == cpu.prologue == ["source venv"]
    assert config.job_count() == 3
    assert jobqueue.worker_names("slurm", [gpu, cpu]) == [
        ["slurm-gpu-0"], ["slurm-cpu-0", "slurm-cpu-1"]]


@pytest.mark.parametrize("overrides, names", [
    (["--scheduler", "tcp://127.0.0.1:8786"], "cluster.jobqueue: the run starts its own "
                                              "scheduler for its batch jobs: unset "
                                              "cluster.scheduler"),
    (["cluster.jobqueue.resources={GPU: 1}"], "cluster.jobqueue.resources: its workers offer "
                                              "['GPU'], none of the run's tags (CPU)"),
    (["cluster.jobqueue.system=lsf"], "cluster.jobqueue.system"),
    (["cluster.jobqueue.memory=lots"], "cluster.jobqueue.memory"),
    (["cluster.use_workers=3"], "cluster.use_workers: 3, but cluster.jobqueue submits 2 "
                                "job(s) of one worker each"),
    (["cluster.workers=3"], "cluster.workers: 3, but cluster.jobqueue.jobs is 2 (under "
                            "cluster.jobqueue, cluster.workers is the number of jobs): set "
                            "one of them"),
    (["cluster.threads=2", "cluster.jobqueue.cores=1"], "cluster.threads: 2, but "
                                                        "cluster.jobqueue.cores is 1"),
    (["cluster.jobqueue.jobs=4", "cluster.workers=2"], "cluster.workers: 2, but "
                                                       "cluster.jobqueue.jobs is 4"),
    (["cluster.threads=1", "cluster.jobqueue.cores=2"], "cluster.threads: 1, but "
                                                        "cluster.jobqueue.cores is 2"),
    (["cluster.workers=2", "cluster.jobqueue.groups=[{jobs: 1}, {jobs: 2}]"],
     "cluster.workers: 2, but cluster.jobqueue.groups give 3 job(s)"),
    (["cluster.workers=[{speed: 0.5}, {}]"], "cluster.workers: a list describes the embedded "
                                             "cluster's workers (emulated speeds"),
    (["cluster.devices=[cpu, cpu]"], "cluster.devices: lists the embedded cluster's devices"),
])
def test_jobqueue_config_mistakes_are_one_line(tmp_path, tiny_dataset_factory, overrides,
                                               names):
    args = tiny_args(tmp_path, tiny_dataset_factory()) + ["cluster.jobqueue.jobs=2"]
    status, lines, _ = run_main("train", args + overrides)
    assert_one_error_line(status, lines, 2, names)


def test_missing_dask_jobqueue_or_sbatch_is_one_line(tmp_path, tiny_dataset_factory,
                                                     monkeypatch):
    args = tiny_args(tmp_path, tiny_dataset_factory()) + ["cluster.jobqueue.jobs=1"]
    real = jobqueue.importlib.util.find_spec
    monkeypatch.setattr(jobqueue.importlib.util, "find_spec",
                        lambda name: None if name == "dask_jobqueue" else real(name))
    status, lines, _ = run_main("train", args)
    assert_one_error_line(status, lines, 2, "pip install -c constraints.txt -e '.[slurm]'")
    monkeypatch.setattr(jobqueue.importlib.util, "find_spec", real)
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    if real("dask_jobqueue") is not None:
        status, lines, _ = run_main("train", args)
        assert_one_error_line(status, lines, 2, "its `sbatch` is not on this machine's PATH")


def test_a_jobs_folder_that_is_not_one_is_named_by_check_and_run(tmp_path,
                                                                 tiny_dataset_factory):
    """`cluster.jobqueue.directory` missing: `--check` passed, and the run ended with
    `[Errno 2] No such file or directory: '.../.hetcnn-jobqueue-...'` (exit 1)."""
    pytest.importorskip("dask_jobqueue")
    args = tiny_args(tmp_path, tiny_dataset_factory()) + ["cluster.jobqueue.jobs=1"]
    missing, a_file = tmp_path / "nope", tmp_path / "a-file"
    a_file.write_text("")
    for path, why in ((missing, "does not exist"), (a_file, "is not a folder")):
        for check in (["--check"], []):
            status, lines, _ = run_main("train", args + [
                f"cluster.jobqueue.directory={path}", *check])
            assert_one_error_line(status, lines, 2,
                                  f"cluster.jobqueue.directory: {path} {why}")


def test_a_refused_submission_is_one_line(tmp_path, tiny_dataset_factory, monkeypatch):
    """`sbatch` failing (here a stand-in that fails as Slurm's does without a
    configuration): one line ending with its own last line of error, exit 1, and the
    run's credential folder removed."""
    pytest.importorskip("dask_jobqueue")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: fetch_config: DNS SRV "
                                    "lookup failed' >&2\necho 'sbatch: fatal: Could not "
                                    "establish a configuration source' >&2\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    args = tiny_args(tmp_path, tiny_dataset_factory()) + [
        "cluster.jobqueue.jobs=1", f"cluster.jobqueue.directory={tmp_path}"]
    status, lines, _ = run_main("train", args)
    assert_one_error_line(status, lines, 1, "cluster.jobqueue: submitting the slurm jobs "
                          "failed: sbatch: fatal: Could not establish a configuration source")
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".hetcnn-jobqueue")]


@pytest.mark.parametrize("where, names", [
    ("host=198.51.100.7", "cluster.jobqueue.host: the run's scheduler cannot listen on "
                          "198.51.100.7: [Errno 99] Cannot assign requested address"),
    ("interface=nope0", "cluster.jobqueue.interface: the run's scheduler cannot listen on "
                        "nope0: 'nope0' is not a valid network interface"),
])
def test_a_scheduler_address_not_on_this_machine_is_one_line(tmp_path, tiny_dataset_factory,
                                                             monkeypatch, where, names):
    """`host` an address this machine does not have (TEST-NET-2), or an `interface` it
    does not have: one line naming the field and why, exit 1, nothing submitted (a
    stand-in `sbatch` that would record a call) and the credential folder removed."""
    pytest.importorskip("dask_jobqueue")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\ntouch {tmp_path}/submitted\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    args = tiny_args(tmp_path, tiny_dataset_factory()) + [
        "cluster.jobqueue.jobs=1", f"cluster.jobqueue.directory={tmp_path}",
        f"cluster.jobqueue.{where}"]
    status, lines, _ = run_main("train", args)
    assert_one_error_line(status, lines, 1, names)
    assert not (tmp_path / "submitted").exists()
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".hetcnn-jobqueue")]


def one_job_credentials(tmp_path):
    """A one-job config, its credentials written to a private folder: (config, folder,
    security, the job group)."""
    config = load_run_config(tiny_args(tmp_path, "data.zarr")[0], ["cluster.jobqueue.jobs=1"])
    folder = str(tmp_path / "private")
    os.mkdir(folder, 0o700)
    security = jobqueue.file_security(jobqueue.write_credentials(jobqueue.run_security(),
                                                                  folder))
    return config, folder, security, config.cluster.jobqueue.group_list("CPU")[0]


def test_a_job_script_names_the_credential_files_never_the_key(tmp_path):
    dask_jobqueue = pytest.importorskip("dask_jobqueue")
    config, folder, security, group = one_job_credentials(tmp_path)
    job = dask_jobqueue.slurm.SLURMJob(scheduler="tls://127.0.0.1:1", name="slurm-0",
                                       config_name="slurm",
                                       **jobqueue.job_options(config.cluster.jobqueue, group,
                                                              security, folder))
    script = job.job_script()
    key_text = open(os.path.join(folder, "key.pem"), encoding="ascii").read()
    assert f"--tls-key {folder}/key.pem" in script and "PRIVATE KEY" not in script
    assert key_text.splitlines()[1] not in script
    assert "--host 127.0.0.1" in script and "--dashboard-address 127.0.0.1:0" in script
    for name in ("ca.pem", "cert.pem", "key.pem"):
        assert stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode) == 0o600


def test_the_close_drops_closed_comm_errors_only_while_it_closes(tmp_path):
    """The handler that keeps a closing cluster's comm errors off stderr is the loop's
    while the cluster closes, and the loop's own one after: the loop (its client's
    too) goes on serving, and an OSError of another client's is said, not dropped."""
    dask_jobqueue = pytest.importorskip("dask_jobqueue")
    config, folder, security, group = one_job_credentials(tmp_path)
    cluster = dask_jobqueue.SLURMCluster(
        n_workers=0, scheduler_options={"host": "127.0.0.1", "dashboard_address": ":0"},
        **jobqueue.job_options(config.cluster.jobqueue, group, security, folder))
    loop = cluster.loop.asyncio_loop
    said: list = []

    def own(_loop, context):
        said.append(context)

    cluster.loop.add_callback(loop.set_exception_handler, own)
    with Client(cluster, set_as_default=False, security=cluster.security) as client:
        client.sync(asyncio.sleep, 0)  # the handler is set on the loop's own thread
        with jobqueue.closing_quietly(cluster):
            assert loop.get_exception_handler() is jobqueue._closed_comms_unsaid
            jobqueue.close_jobqueue_cluster(cluster)
        assert loop.get_exception_handler() is own
        loop.call_soon_threadsafe(loop.call_exception_handler,
                                  {"message": "another client's", "exception": OSError()})
        client.sync(asyncio.sleep, 0.1)
    assert [context["message"] for context in said] == ["another client's"]


# Against a real Slurm -------------------------------------------------------------------


def test_the_test_slurm_listens_on_loopback_only(slurm):
    """What the tests start listens on loopback only, as what the project starts does:
    slurmctld and slurmd on the loopback address their host name resolves to
    (`NoCtldInAddrAny,NoInAddrAny`), munged on a unix socket in a folder only root
    can enter."""
    found = listening([process.pid for process in slurm.processes])
    for name in ("slurmctld", "slurmd"):
        assert found.get(name) and all(
            ipaddress.ip_address(where.rsplit(":", 1)[0]).is_loopback
            for where in found[name]), found
    assert found["munged"] == [f"{slurm.folder}/munge/socket (700)"], found


def slurm_config(tmp_path, dataset: str, **overrides):
    """`tiny_config` in float64 on two Slurm jobs of one core and 1 GB each, the job
    folders in `tmp_path`."""
    return tiny_config(tmp_path, dataset, **{
        "network.dtype": "float64", "cluster.jobqueue.jobs": 2,
        "cluster.jobqueue.memory": "1GB", "cluster.wait_timeout": 60,
        "cluster.jobqueue.directory": str(tmp_path), **overrides})


@pytest.fixture(scope="module")
def two_slurm_jobs(slurm, tmp_path_factory):
    """A client to two workers as Slurm jobs (slurm-0, slurm-1), set up as a run sets
    its workers up, shared by the module's runs on them; the jobs' folder (credentials,
    logs) is yielded too, and must be gone after."""
    folder = tmp_path_factory.mktemp("jobs")
    config = slurm_config(folder, "unused.zarr")
    with open_jobqueue_client(config.cluster) as client:
        register_setup(client, config.cluster)
        yield client, str(folder)
    assert slurm.left_behind(str(folder)) == []
    assert not [name for name in os.listdir(folder) if name.startswith(".hetcnn-jobqueue")]


def test_a_run_on_two_slurm_jobs_equals_plain_pytorch(tmp_path, two_slurm_jobs,
                                                      tiny_dataset_factory):
    """Two workers as Slurm jobs (named slurm-0, slurm-1), the scheduler and both on
    loopback over TLS, train the tiny network to single-process PyTorch's weights and
    losses (float64)."""
    client, folder = two_slurm_jobs
    assert client.scheduler.address.startswith("tls://127.0.0.1:")
    scratch = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.local_directory)
    assert os.path.basename(os.path.dirname(os.path.dirname(scratch))).startswith(
        ".hetcnn-jobqueue-") and scratch.startswith(folder), scratch  # not a shared /tmp
    assert "127.0.0.1" in client.dashboard_link
    workers = client.scheduler_info()["workers"]
    assert all(address.startswith("tls://127.0.0.1:") for address in workers)
    dataset = tiny_dataset_factory("float64")
    config = slurm_config(tmp_path, dataset)
    result = run_training(config, client=client)
    assert result.summary["split_workers"] == ["slurm-0", "slurm-1"]
    weights = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
    expected, losses = replay_in_pytorch(config, dataset)
    assert max_relative_error(weights, expected) <= 1e-10
    assert list(result.record.loss.values) == pytest.approx(losses, rel=1e-10)


def test_a_slurm_job_cancelled_mid_run_is_survived(tmp_path, slurm, tiny_dataset_factory):
    """`scancel` of slurm-1's job after checkpoint 4: the run (which submits its own
    jobs) recovers on slurm-0 from the last checkpoint and ends with plain PyTorch's
    weights (float64); its jobs and their folder are gone after."""
    assert FAULTS["Slurm job scancelled mid-run, kernel, float64"] == "survived"
    dataset = tiny_dataset_factory("float64")
    config = slurm_config(tmp_path, dataset, **{"train.steps": 40,
                                                "train.checkpoint_every": 4,
                                                "train.steps_per_task": 1,
                                                "train.eval_samples": 0})
    outcome: list = []
    run = threading.Thread(target=lambda: outcome.append(_run_or_error(config)))
    run.start()
    try:
        wait_for_checkpoint(config.checkpoint_path, 4, _Alive(run), timeout=120)
        (victim,) = [process.environ()["SLURM_JOB_ID"] for process in job_workers(str(tmp_path))
                     if "--name slurm-1 " in " ".join(process.cmdline())]
        slurm.command("scancel", victim)
    finally:
        run.join(180)
    (result,) = outcome
    assert not isinstance(result, BaseException), result
    (recovery,) = result.summary["recoveries"]
    assert recovery["lost_workers"] == ["slurm-1"] and recovery["workers"] == ["slurm-0"]
    weights = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
    expected, _ = replay_in_pytorch(config, dataset)
    assert max_relative_error(weights, expected) <= 1e-10
    assert slurm.left_behind(str(tmp_path)) == []
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".hetcnn-jobqueue")]


def test_a_job_that_cannot_start_is_reported_with_the_queue_reason(tmp_path, slurm,
                                                                   tiny_dataset_factory):
    """A job held until an hour from now: the run waits `cluster.wait_timeout`, then
    stops with one line giving the queue's reason and the partition it waits in; the
    job is cancelled."""
    assert FAULTS["Slurm job held in the queue past cluster.wait_timeout"] == "clean"
    args = tiny_args(tmp_path, tiny_dataset_factory()) + [
        "cluster.jobqueue.jobs=1", "cluster.wait_timeout=2", "cluster.jobqueue.memory=1GB",
        f"cluster.jobqueue.directory={tmp_path}", "cluster.jobqueue.extra=[--begin=now+3600]"]
    status, lines, _ = run_main("train", args)
    assert_one_error_line(status, lines, 1, "0 of 1 worker(s) up after 2 s (1 pending "
                                            "(BeginTime) in Slurm partition debug)")
    assert slurm.left_behind(str(tmp_path)) == []


def test_a_job_slurm_will_never_start_stops_the_run_at_once(tmp_path, slurm,
                                                           tiny_dataset_factory):
    """A job asking for more cores than the node has: Slurm accepts it and keeps it
    pending (PartitionConfig) for ever; the run stops with one line naming it and
    the field, without waiting out `cluster.wait_timeout`, and cancels it."""
    args = tiny_args(tmp_path, tiny_dataset_factory()) + [
        "cluster.jobqueue.jobs=1", "cluster.jobqueue.memory=1GB", "cluster.wait_timeout=300",
        f"cluster.jobqueue.directory={tmp_path}", "cluster.jobqueue.cores=64"]
    started = time.monotonic()
    status, lines, _ = run_main("train", args)
    assert_one_error_line(status, lines, 1, "(slurm-0) will never start: Slurm keeps it "
                                            "pending (PartitionConfig) in Slurm partition debug: "
                                            "it asks for more than "
                                            "the partition's nodes have: "
                                            "cluster.jobqueue.cores, memory or extra")
    assert time.monotonic() - started < 60
    assert slurm.left_behind(str(tmp_path)) == []


def test_a_job_that_fails_before_its_worker_joins_is_one_line(tmp_path, slurm,
                                                              tiny_dataset_factory):
    """A job whose script fails at once: the run stops with one line giving its state
    and the end of its log, without waiting out `cluster.wait_timeout`."""
    args = tiny_args(tmp_path, tiny_dataset_factory()) + [
        "cluster.jobqueue.jobs=1", "cluster.jobqueue.memory=1GB", "cluster.wait_timeout=60",
        f"cluster.jobqueue.directory={tmp_path}",
        "cluster.jobqueue.prologue=[echo no such venv >&2, exit 3]"]
    started = time.monotonic()
    status, lines, _ = run_main("train", args)
    assert_one_error_line(status, lines, 1, "before its worker joined; its log: no such venv")
    # its state as Slurm gives it (`squeue -t all`: plain `squeue -j` hides ended jobs)
    assert "slurm job" in lines[0] and "(slurm-0) ended (FAILED) before" in lines[0]
    assert time.monotonic() - started < 30
    assert slurm.left_behind(str(tmp_path)) == []


def test_a_job_on_other_code_stops_the_run_before_its_first_step(tmp_path, slurm,
                                                                 tiny_dataset_factory):
    """A job's worker that imports another version of the project (here its prologue
    points PYTHONPATH at a changed copy, from a folder without the project, which
    `python -m` would put first; on a cluster, a copy edited while the job queued) is named before the first step, as a hand-started worker is
    (tests/test_worker_code.py): one line, exit 1, and no job left behind."""
    copy = project_copy(tmp_path, "edited while the job queued")
    args = tiny_args(tmp_path, tiny_dataset_factory()) + [
        "cluster.jobqueue.jobs=1", "cluster.jobqueue.memory=1GB", "cluster.wait_timeout=60",
        f"cluster.jobqueue.directory={tmp_path}",
        f"cluster.jobqueue.prologue=[cd {tmp_path}, export PYTHONPATH={copy}]"]
    status, lines, _ = run_main("train", args)
    assert_one_error_line(status, lines, 1, f"runs other code than this run: the project "
                                            f"at {copy}, this run's at {ROOT}")
    assert "worker slurm-0 (tls://127.0.0.1:" in lines[0], lines
    assert slurm.left_behind(str(tmp_path)) == []


def test_jobs_of_a_killed_client_end_by_themselves(tmp_path, slurm):
    """The run's process SIGKILLed while its job runs (nothing of it can cancel the
    job): the worker loses its scheduler and exits, and its job ends with it."""
    code = ("import sys, time\n"
            "from pipeline.config.run_config import load_run_config\n"
            "from pipeline.cluster.jobqueue import open_jobqueue_client\n"
            "config = load_run_config(sys.argv[1], sys.argv[2:])\n"
            "with open_jobqueue_client(config.cluster):\n"
            "    print('up', flush=True)\n"
            "    time.sleep(600)\n")
    client = subprocess.Popen(
        [sys.executable, "-c", code, os.path.join(ROOT, "configs", "small.yaml"),
         "cluster.jobqueue.jobs=1", "cluster.jobqueue.memory=1GB",
         f"cluster.jobqueue.directory={tmp_path}"], cwd=ROOT, stdout=subprocess.PIPE,
        text=True)
    try:
        assert client.stdout.readline().strip() == "up"
        assert [line.split()[1:3] for line in slurm.jobs(str(tmp_path))] == [
            ["hetcnn-slurm-0", "RUNNING"]]
    finally:
        client.kill()
        client.wait()
    assert slurm.left_behind(str(tmp_path)) == []


def test_an_unknown_partition_is_one_line(tmp_path, slurm, tiny_dataset_factory):
    args = tiny_args(tmp_path, tiny_dataset_factory()) + [
        "cluster.jobqueue.jobs=1", "cluster.jobqueue.queue=nope",
        f"cluster.jobqueue.directory={tmp_path}"]
    status, lines, _ = run_main("train", args)
    assert_one_error_line(status, lines, 2, "cluster.jobqueue.queue: Slurm has no partition "
                                            "'nope' (partitions: debug)")
    assert slurm.jobs(str(tmp_path)) == []


class _Alive:
    """A thread as `wait_for_checkpoint` asks of a process (`poll`, `communicate`)."""

    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread

    def poll(self) -> int | None:
        return None if self.thread.is_alive() else 0

    def communicate(self) -> tuple[str, str]:
        return "", "the run ended before the checkpoint"


def _run_or_error(config):
    try:
        return run_training(config)
    except BaseException as error:  # noqa: BLE001 - handed to the test's thread
        return error


def test_an_ended_jobs_state_is_read_and_no_walltime_end_unless_it_is(slurm):
    """What the lost-worker line reads of a job that ended (pipeline/cluster/job_ends.py):
    Slurm's state for it once it ended, which is no walltime end for a job that failed
    (a walltime end, TIMEOUT, takes a minute at least: tests/test_job_ends.py covers
    its words)."""
    job = slurm.command("sbatch", "--parsable", "-o", "/dev/null", "--wrap", "exit 3").strip()
    deadline = time.monotonic() + 30
    while (states := job_states("slurm", {"slurm-0": job})).get(job, ("",))[0] != "FAILED":
        assert time.monotonic() < deadline, states
        time.sleep(0.2)
    assert states[job][:2] == ("FAILED", "NonZeroExitCode")
    assert timed_out(states, {"slurm-0": job}) == []
