"""`--check` refuses a recorded split (`placement: recorded`) that the run would, as far
as the config and files tell without a cluster, in the run's own words
(`check_recorded_split`): a negative count, a row that does not add up to its layer's
kernels (or the batch), another number of layers, and, where the config fixes the
workers (an embedded cluster), another number of workers or a recorded worker the run
lacks. Before, `--check` passed every literal split and the run refused it once its
cluster was up.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import assert_one_error_line, run_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = os.path.join(ROOT, "configs", "small.yaml")  # conv layers of 32 and 64 kernels

CASES = [
    (["split_from=[[-16, 48], [32, 32]]"],
     "split_from: [-16, 48] splits conv layer 0's 32 kernels: a negative count"),
    (["split_from=[[16, 16], [32, 33]]"],
     "split_from: [32, 33] splits conv layer 1's 64 kernels: they add up to 65"),
    (["split_from=[[16, 16, 0], [32, 32, 0]]", "cluster.workers=2"],
     "split_from: [16, 16, 0] splits conv layer 0's 32 kernels: 3 count(s), but this run "
     "has 2 worker(s)"),
    (["split_from=[[32, 0]]"], "split_from: 1 row(s), but this run splits 2: conv layer 0's "
     "32 kernels, conv layer 1's 64 kernels"),
    (["split_from={tmp}/three-layers"], "split_from: 3 row(s), but this run splits 2"),
    (["split_from={tmp}/other-workers"], "split_from: {tmp}/other-workers/summary.json gave "
     "work to z, which this run does not have (its workers: cpu-0, cpu-1)"),
    (["strategy=data", "train.batch=64", "split_from=[[30, 30]]"],
     "split_from: [30, 30] splits the batch's 64 samples: they add up to 60"),
    (["strategy=data", "train.batch=64", "cluster.workers=3", "split_from={tmp}/columns"],
     "split_from: {tmp}/columns/summary.json's batch_split has 3 count(s) for the 2 worker(s) "
     "of its split_workers (cpu-0, cpu-2): give the split itself"),
    (["--scheduler", "tcp://127.0.0.1:9", "split_from=[[16, -16], [32, 32]]"],
     "a negative count"),  # an external cluster: the workers are not known, the rest is
]


def write_summary(folder, rows: list[list[int]], workers: list[str]) -> None:
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps(
        {"strategy": "kernel", "kernel_split": rows, "split_workers": workers}))


@pytest.mark.parametrize("args, names", CASES, ids=[str(i) for i in range(len(CASES))])
def test_check_refuses_a_recorded_split_the_run_refuses(args, names, tmp_path, monkeypatch):
    monkeypatch.delenv("DASK_SCHEDULER_ADDRESS", raising=False)
    monkeypatch.setenv("CNN_PREDICT_PROBE", "never")
    write_summary(tmp_path / "three-layers", [[16, 16], [32, 32], [8, 8]], ["cpu-0", "cpu-1"])
    write_summary(tmp_path / "other-workers", [[16, 16], [32, 32]], ["cpu-0", "z"])
    (tmp_path / "columns").mkdir()  # a count per worker offered, not per worker named
    (tmp_path / "columns" / "summary.json").write_text(json.dumps(
        {"strategy": "data", "batch_split": [32, 0, 32], "split_workers": ["cpu-0", "cpu-2"]}))
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    status, lines, _out = run_main("train", [SMALL, "--check", f"output={tmp_path}/run",
                                             "placement=recorded", *argv])
    assert_one_error_line(status, lines, 2, names.replace("{tmp}", str(tmp_path)))


def test_check_passes_a_recorded_split_that_fits(tmp_path, monkeypatch):
    monkeypatch.delenv("DASK_SCHEDULER_ADDRESS", raising=False)
    write_summary(tmp_path / "fits", [[16, 16], [32, 32]], ["cpu-1", "cpu-0"])
    for split in ("split_from=[[16, 16], [32, 32]]", f"split_from={tmp_path}/fits"):
        status, lines, _out = run_main("train", [SMALL, "--check", f"output={tmp_path}/run",
                                                 "placement=recorded", split])
        assert status == 0 and not lines, lines
