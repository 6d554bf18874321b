"""How many batch jobs a run on `cluster.jobqueue` submits, against a real one-node
Slurm (tests/slurm_cluster.py, as tests/test_jobqueue.py; root and `slurm-wlm`/`munge`
needed, else skipped with the reason): `cluster.workers` and `cluster.threads` are the
jobs' count and cores unless `cluster.jobqueue` gives them (a contradiction is refused,
tests/test_jobqueue.py), and the whole config then says the jobs' figures; a run whose
strategy trains on one worker (`single`) submits one job, not one idle beside it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading

import pytest

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


def test_a_single_run_submits_only_its_masters_job(tmp_path, slurm: LocalSlurm,
                                                   tiny_dataset_factory):
    """`strategy=single` on a config of two jobs: one line says one job is submitted,
    `squeue` lists only `hetcnn-slurm-0` while the run runs, and it trains on slurm-0;
    without this the second job held its allocation idle for the whole run."""
    args = _two_job_args(tmp_path, tiny_dataset_factory(), "strategy=single",
                         "train.steps=6")
    seen: set[str] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.update(line.split()[1] for line in slurm.jobs(str(tmp_path)))
            done.wait(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        status, lines, _ = run_main("train", args)
    finally:
        done.set()
        watcher.join(30)
    assert status == 0, lines
    assert "strategy single trains on one worker: submitting 1 of the 2 slurm jobs " \
           "cluster.jobqueue asks for (1 more would be idle for the whole run)" in lines, lines
    assert seen == {"hetcnn-slurm-0"}, seen
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["split_workers"] == ["slurm-0"], summary
    assert slurm.left_behind(str(tmp_path)) == []
