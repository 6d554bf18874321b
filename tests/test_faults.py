"""Faults injected into real processes: a worker SIGKILLed mid-run (the run recovers
by itself and ends where an uninterrupted run on the survivors ends), the scheduler
killed mid-run (one line, exit 1), the sweep process killed at random moments (the
store stays whole and finished points are never rerun).

`FAULTS` lists every fault these tests inject, with what must come of it; the
`## Faults` section of docs/reliability.md shows the same list and figures, and
`test_reliability_page_matches_the_faults_tested` keeps the two in step.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import xarray as xr
import yaml
import zarr

from experiments.results import DONE
from storage import checkpoints
from tests.helpers import max_relative_error
from tests.test_cli import ROOT, cli_processes, error_lines, tiny_args  # noqa: F401 - fixture

#: fault -> what must come of it: "survived" (the run finished with the right
#: result), or "clean" (one clear line, exit 1, nothing recorded lost).
FAULTS = {
    "worker SIGKILLed mid-run, kernel, float64": "survived",
    "worker SIGKILLed mid-run, data, float64": "survived",
    "worker SIGKILLed mid-run, kernel, float32": "survived",
    "scheduler SIGKILLed mid-run": "clean",
    "sweep process SIGKILLed, seed 1": "survived",
    "sweep process SIGKILLed, seed 2": "survived",
    "sweep process SIGKILLed, seed 3": "survived",
}
PAGE = os.path.join(ROOT, "docs", "reliability.md")


@pytest.fixture(autouse=True)
def this_code_everywhere(monkeypatch):
    """CLI workers, runs and sweeps started here import this tree's code."""
    monkeypatch.setenv("PYTHONPATH", ROOT)


def train_process(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipeline.train", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_checkpoint(path: str, step: int, run: subprocess.Popen,
                        timeout: float = 120) -> int:
    """Poll the checkpoint store until checkpoint `step` (or a later one) is complete."""
    deadline = time.monotonic() + timeout
    while True:
        latest = checkpoints.latest_complete_step(path) or 0
        if latest >= step:
            return latest
        assert run.poll() is None, run.communicate()
        assert time.monotonic() < deadline, f"no checkpoint {step} after {timeout} s"
        time.sleep(0.02)


@pytest.mark.parametrize("strategy, dtype, victim, tolerance", [
    ("kernel", "float64", 1, 1e-10),
    ("data", "float64", 0, 1e-10),
    ("kernel", "float32", 2, 1e-4),
])
def test_worker_killed_mid_run_is_survived(tmp_path, cli_processes, tiny_dataset_factory,
                                           strategy, dtype, victim, tolerance):
    """Three CLI workers, one SIGKILLed after checkpoint 4: the run re-places its share on
    the two survivors, replays from the last checkpoint, finishes by itself, records
    the recovery, and ends with the weights of an uninterrupted run on the survivors."""
    assert FAULTS[f"worker SIGKILLed mid-run, {strategy}, {dtype}"] == "survived"
    dataset = tiny_dataset_factory(dtype)
    address = cli_processes.start_scheduler()
    workers = [cli_processes.start_worker("--no-nanny", "--name", f"w{i}") for i in range(3)]
    steps = 40
    extra = ["--scheduler", address, f"strategy={strategy}", "placement=even",
             f"network.dtype={dtype}", "train.checkpoint_every=4", f"train.steps={steps}",
             "train.eval_samples=0", "network.conv.0.kernels=12", "network.conv.1.kernels=12"]
    run = train_process(*tiny_args(tmp_path / "recovered", dataset), *extra)
    path = str(tmp_path / "recovered" / "run" / "checkpoints.zarr")
    wait_for_checkpoint(path, 4, run)
    workers[victim].kill()
    killed = time.monotonic()
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    assert time.monotonic() - killed < 60
    summary = json.loads((tmp_path / "recovered" / "run" / "summary.json").read_text())
    (recovery,) = summary["recoveries"]
    assert recovery["lost_workers"] == [f"w{victim}"]
    assert set(recovery["workers"]) == {"w0", "w1", "w2"} - {f"w{victim}"}
    restored = recovery["restored_step"]
    assert restored >= 4 and restored % 4 == 0
    assert restored <= recovery["lost_at_step"] < steps
    assert recovery["replayed_steps"] == recovery["lost_at_step"] - restored
    split = recovery["split"]
    if strategy == "kernel":
        assert [sum(layer) for layer in split["kernel_split"]] == [12, 12]
        assert all(len(layer) == 2 for layer in split["kernel_split"])
    else:
        assert split["batch_split"] == [8, 8]
    record = xr.open_zarr(tmp_path / "recovered" / "run" / "record.zarr")
    assert list(record.step.values) == list(range(steps))  # each step once
    assert json.loads(record.attrs["recoveries"]) == summary["recoveries"]
    assert np.isfinite(record.loss.values).all()

    # The same training uninterrupted on the two survivors (the surviving split).
    again = subprocess.run([sys.executable, "-m", "pipeline.train",
                            *tiny_args(tmp_path / "plain", dataset), *extra],
                           cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stderr
    plain = json.loads((tmp_path / "plain" / "run" / "summary.json").read_text())
    assert plain["recoveries"] == []
    got = checkpoints.read_tensors(path, steps)
    expected = checkpoints.read_tensors(str(tmp_path / "plain" / "run" / "checkpoints.zarr"),
                                        steps)
    assert max_relative_error(got, expected) <= tolerance
