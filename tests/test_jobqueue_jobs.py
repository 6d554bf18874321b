"""How many batch jobs a run on `cluster.jobqueue` submits, against a real one-node
Slurm (tests/slurm_cluster.py, as tests/test_jobqueue.py; root and `slurm-wlm`/`munge`
needed, else skipped with the reason): `cluster.workers` and `cluster.threads` are the
jobs' count and cores unless `cluster.jobqueue` gives them (a contradiction is refused,
tests/test_jobqueue.py), and the whole config then says the jobs' figures; a run whose
strategy trains on one worker (`single`) submits one job, not one idle beside it,
and one that `cluster.use_workers` limits submits only the jobs it uses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading

import pytest

from pipeline.cluster.job_choice import jobs_to_submit
from pipeline.cluster.jobqueue import open_jobqueue_client
from pipeline.config.run_config import load_run_config
from pipeline.config.schema import ConfigError
from tests.helpers import run_main
from tests.slurm_cluster import LocalSlurm
from tests.test_cli import ROOT
from tests.test_jobqueue_stops import _two_job_args


def test_the_workers_asked_for_are_the_jobs_submitted(tmp_path, slurm: LocalSlurm):
    """`cluster.workers=3` (no `cluster.jobqueue.jobs`) submits three jobs, each of
    `cluster.threads` cores: three workers join, with 2 threads each."""
    config = load_run_config(os.path.join(ROOT, "configs", "small.yaml"), [
        "cluster.workers=3", "cluster.threads=2", "cluster.jobqueue.memory=1GB",
        "cluster.wait_timeout=60", f"cluster.jobqueue.directory={tmp_path}"])
    assert (config.cluster.jobqueue.jobs, config.cluster.jobqueue.cores) == (3, 2)
    with open_jobqueue_client(config.cluster) as client:
        names = sorted(info["name"] for info in client.scheduler_info()["workers"].values())
        assert names == ["slurm-0", "slurm-1", "slurm-2"]
        assert sorted(client.nthreads().values()) == [2, 2, 2]
    assert slurm.left_behind(str(tmp_path)) == []


def test_the_jobs_given_are_the_configs_workers():
    """`cluster.jobqueue.jobs` and `cores` given, `cluster.workers` and `threads` left
    at their defaults: the config counts the jobs' workers and threads (a sweep's dry
    run and report read `cluster.workers`)."""
    config = load_run_config(os.path.join(ROOT, "configs", "small.yaml"), [
        "cluster.jobqueue.jobs=4", "cluster.jobqueue.cores=2"])
    assert (config.cluster.workers, config.cluster.threads) == (4, 2)
    assert len(config.cluster.worker_list()) == 4


def test_workers_left_out_are_told_from_workers_written():
    """`cluster.workers` and `threads` left out take the jobs' figures (else 2 and 1, as
    on the embedded cluster); written, even at the embedded cluster's defaults, they
    must agree with the jobs; with groups, `workers` is the groups' total."""
    small = os.path.join(ROOT, "configs", "small.yaml")
    assert (load_run_config(small).cluster.workers, load_run_config(small).cluster.threads) \
        == (2, 1)
    config = load_run_config(small, ["cluster.jobqueue.memory=1GB"]).cluster
    assert (config.workers, config.threads, config.jobqueue.jobs) == (2, 1, 2)
    config = load_run_config(small, ["cluster.workers=3", "cluster.jobqueue.jobs=3"]).cluster
    assert dataclasses.replace(config, use_workers=None).workers == 3
    config = load_run_config(small, ["cluster.jobqueue.groups=[{jobs: 1}, {cores: 2}]"])
    assert (config.cluster.workers, config.cluster.jobqueue.job_count()) == (3, 3)
    assert dataclasses.replace(config.cluster, use_workers=None).workers == 3
    for wrong in (["cluster.workers=2", "cluster.jobqueue.jobs=4"],
                  ["cluster.threads=1", "cluster.jobqueue.cores=2"]):
        with pytest.raises(ConfigError, match=f"{wrong[0].split('=')[0]}: "):
            load_run_config(small, wrong)


def _submitted(*overrides: str, one_worker: bool = False) -> tuple[list[str] | None, str]:
    config = load_run_config(os.path.join(ROOT, "configs", "small.yaml"), list(overrides))
    return jobs_to_submit(config.cluster, one_worker, config.strategy)


def test_only_the_jobs_a_run_will_use_are_submitted():
    """Where the config says which workers the run uses, only their jobs are
    submitted, in the order the run takes its workers (tag, then name), with a master
    named outside them; all of them where it does not say (a master no job is)."""
    assert _submitted("cluster.jobqueue.jobs=3") == (None, "")
    assert _submitted("cluster.jobqueue.jobs=3", one_worker=True) == (
        ["slurm-0"], "strategy kernel trains on one worker: submitting 1 of the 3 slurm jobs "
                     "cluster.jobqueue asks for (2 more would be idle for the whole run)")
    assert _submitted("cluster.jobqueue.jobs=12", "cluster.use_workers=3") == (
        ["slurm-0", "slurm-1", "slurm-10"], "cluster.use_workers is 3: submitting 3 of the 12 "
        "slurm jobs cluster.jobqueue asks for (9 more would be idle for the whole run)")
    assert _submitted("cluster.jobqueue.jobs=4", "cluster.use_workers=2",
                      "cluster.master=slurm-3")[0] == ["slurm-0", "slurm-1", "slurm-3"]
    assert _submitted("cluster.jobqueue.jobs=4", "cluster.master=slurm-2",
                      one_worker=True)[0] == ["slurm-2"]
    assert _submitted("cluster.jobqueue.jobs=4", "cluster.master=nobody",
                      one_worker=True) == (None, "")
    groups = ["cluster.resources=[GPU, CPU]", "cluster.jobqueue.groups=[{queue: gpu, jobs: 1, "
              "resources: {GPU: 1}}, {queue: cpu, jobs: 3, resources: {CPU: 1}}]"]
    assert _submitted(*groups, "cluster.use_workers=2")[0] == ["slurm-gpu-0", "slurm-cpu-0"]
    assert _submitted(*groups, one_worker=True)[0] == ["slurm-gpu-0"]
    assert _submitted(*groups, "cluster.master=CPU", one_worker=True)[0] == ["slurm-cpu-0"]
    assert _submitted(*groups, "cluster.use_workers=4") == (None, "")


def test_a_single_run_holds_only_its_masters_job(tmp_path, slurm: LocalSlurm,
                                                 tiny_dataset_factory):
    """`strategy=single` with `cluster.use_workers=2` on a config of three jobs: one
    line says two jobs are submitted (`squeue` never lists slurm-2), and once the work
    is placed, one more says slurm-1's job is cancelled: it leaves the queue while the
    run trains on slurm-0. Without this the idle jobs held their allocation for the
    whole run (as they did after `auto` picked `single`, which releases them alike)."""
    args = _two_job_args(tmp_path, tiny_dataset_factory(), "strategy=single",
                         "train.steps=40", "cluster.use_workers=2") + [
                             "cluster.jobqueue.jobs=3"]
    seen: list[set[str]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append({line.split()[1] for line in slurm.jobs(str(tmp_path))
                         if line.split()[2] in ("PENDING", "RUNNING")})
            done.wait(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        status, lines, _ = run_main("train", args)
    finally:
        done.set()
        watcher.join(30)
    assert status == 0, lines
    assert "cluster.use_workers is 2: submitting 2 of the 3 slurm jobs cluster.jobqueue asks " \
           "for (1 more would be idle for the whole run)" in lines, lines
    assert "strategy single trains on one worker (slurm-0): cancelled the 1 other slurm " \
           "job(s) (slurm-1), which would be idle for the whole run" in lines, lines
    assert set().union(*seen) == {"hetcnn-slurm-0", "hetcnn-slurm-1"}, seen
    last = max(index for index, names in enumerate(seen) if "hetcnn-slurm-1" in names)
    assert {"hetcnn-slurm-0"} in seen[last + 1:], seen  # slurm-1 gone while the run ran
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["split_workers"] == ["slurm-0"], summary
    assert slurm.left_behind(str(tmp_path)) == []


def test_jobs_auto_leaves_idle_are_cancelled(tmp_path, slurm: LocalSlurm, tiny_dataset_factory):
    """`strategy=auto` on two jobs: where the model picks `single` (the tiny network,
    here), the other job is cancelled in one line once it has, and the run trains on
    the master alone; where it picks a strategy of several workers, none is."""
    args = _two_job_args(tmp_path, tiny_dataset_factory(), "strategy=auto", "train.steps=8")
    status, lines, _ = run_main("train", args)
    assert status == 0, lines
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    released = [line for line in lines if "cancelled the" in line]
    if summary["strategy"] == "single":
        master = summary["split_workers"][0]
        assert released == [f"strategy single trains on one worker ({master}): cancelled the "
                            f"1 other slurm job(s) ({({'slurm-0', 'slurm-1'} - {master}).pop()}),"
                            " which would be idle for the whole run"], lines
    else:
        assert released == [], lines
    assert slurm.left_behind(str(tmp_path)) == []
