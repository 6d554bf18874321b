"""Training behaviour: learning on the synthetic set, resume, the reference strategy."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import xarray as xr

from pipeline import preflight
from pipeline.cluster.workers import find_workers
from pipeline.cluster.worker_setup import register_setup
from pipeline.config.run_config import load_run_config
from pipeline.config.schema import ConfigError
from pipeline.run import run_training
from storage import checkpoints
from tests.helpers import max_relative_error, run_main, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHANCE = 0.1


def _run(config, cluster):
    client, cluster_config = cluster
    config.cluster.workers = cluster_config.workers
    register_setup(client, config.cluster)
    return run_training(config, client=client, offered=find_workers(client, config.cluster))


def test_default_small_run_learns_far_above_chance(tmp_path, three_worker_cluster):
    """The shipped small config (batch 64, synthetic data, `kernel`) for 30 of its 60
    steps. Here 30 steps reach about 0.65 test accuracy (0.66 after 60) and a loss at
    0.56 of the start (0.51 after 60), clear of the bounds below; 20 steps would not
    pass (loss at 0.72 of the start), so the bounds still ask for real learning. One
    strategy is enough: `kernel` and `single` both equal plain PyTorch step for step
    (tests/test_equality.py), so what one learns the other does. Placed evenly: the
    kernel split changes no arithmetic, and calibration is tests/test_devices.py's."""
    config = load_run_config("configs/small.yaml", [f"output={tmp_path / 'run'}",
                                                    "progress=false",
                                                    "cluster.use_workers=2",
                                                    "train.steps=30",
                                                    "placement=even"])
    result = _run(config, three_worker_cluster)
    assert result.summary["test_accuracy"] > 3 * CHANCE, result.summary
    assert result.record.attrs["test_accuracy"] == result.summary["test_accuracy"]
    losses = result.record.loss.values
    assert losses[-5:].mean() < 0.7 * losses[:5].mean()


def test_resume_continues_exactly(tmp_path, three_worker_cluster, tiny_dataset_factory):
    """4 steps then resume to 7 equals 7 uninterrupted steps (weights and momentum)."""
    dataset = tiny_dataset_factory("float32")
    straight = tiny_config(tmp_path / "a", dataset, **{"train.steps": 7,
                                                      "cluster.use_workers": 2})
    _run(straight, three_worker_cluster)
    resumed = tiny_config(tmp_path / "b", dataset, **{"train.steps": 4,
                                                     "train.checkpoint_every": 2,
                                                     "cluster.use_workers": 2})
    _run(resumed, three_worker_cluster)
    assert checkpoints.latest_complete_step(resumed.checkpoint_path) == 4
    resumed = tiny_config(tmp_path / "b", dataset, **{"train.steps": 7,
                                                     "train.checkpoint_every": 2,
                                                     "train.resume": True,
                                                     "cluster.use_workers": 2})
    result = _run(resumed, three_worker_cluster)
    assert list(result.record.step.values) == list(range(7))  # both starts' steps
    assert list(result.record.start.values) == [0] * 4 + [1] * 3
    for kind in ("weights", "momentum"):
        error = max_relative_error(
            checkpoints.read_tensors(resumed.checkpoint_path, 7, kind),
            checkpoints.read_tensors(straight.checkpoint_path, 7, kind))
        assert error < 1e-5, (kind, error)
    np.testing.assert_array_equal(checkpoints.read_sample_indices(resumed.checkpoint_path),
                                  checkpoints.read_sample_indices(straight.checkpoint_path))


def test_a_resume_with_nothing_to_resume_starts_over_and_says_so(tmp_path,
                                                                 tiny_dataset_factory):
    """A resume into a folder with no checkpoint (a mistyped output) starts at step 0,
    saying so in one line rather than silently."""
    from pipeline.engine.checkpointing import prepare_checkpoints
    from storage.datasets import open_dataset_info
    dataset = tiny_dataset_factory("float32")
    config = tiny_config(tmp_path / "typo", dataset, **{"train.resume": True})
    said: list[str] = []
    network = config.network_spec(open_dataset_info(dataset).image_shape)
    assert prepare_checkpoints(config, network, said.append) == 0
    assert said == [f"train.resume: no complete checkpoint in {config.checkpoint_path} to "
                    "resume from; starting at step 0"]
    said.clear()
    assert prepare_checkpoints(config, network, said.append) == 0  # step 0's checkpoint
    assert said == []  # is there now, to resume from


def test_reference_strategy_matches_kernel(tmp_path, three_worker_cluster,
                                           tiny_dataset_factory):
    dataset = tiny_dataset_factory("float32")
    kernel = tiny_config(tmp_path / "k", dataset, **{"cluster.use_workers": 2})
    _run(kernel, three_worker_cluster)
    reference = tiny_config(tmp_path / "r", dataset, strategy="reference")
    result = run_training(reference)
    assert result.record.sizes["worker"] == 1
    assert max_relative_error(
        checkpoints.read_tensors(reference.checkpoint_path, 5),
        checkpoints.read_tensors(kernel.checkpoint_path, 5)) < 1e-4


def test_the_command_line_checks_its_run_once_and_says_when_its_medians_include_warm_up(
        tmp_path, monkeypatch):
    """`python -m pipeline.train` leaves the checks to the run, which makes them once
    (the output folder's is one of them). And `train.warmup_steps` at or past
    `train.steps` leaves no step to measure: the medians take every step, and the
    summary and the closing line say so (one run checks both)."""
    checked: list[str] = []
    writable = preflight.check_writable_dir

    def counted(path: str, field: str) -> None:
        if field == "output":
            checked.append(path)
        writable(path, field)

    monkeypatch.setattr(preflight, "check_writable_dir", counted)
    output = str(tmp_path / "run")
    status, lines, out = run_main("train", [
        os.path.join(ROOT, "configs", "small.yaml"), "strategy=reference",
        f"output={output}", f"data.path={tmp_path / 'data'}", "data.train_samples=128",
        "data.test_samples=32", "train.steps=2", "train.warmup_steps=5",
        "train.eval_samples=0", "progress=false"])
    assert status == 0, lines
    assert checked == [output]
    # no test images evaluated: no accuracy in the record, as the summary's is null
    assert "test_accuracy" not in xr.open_zarr(os.path.join(output, "record.zarr")).attrs
    summary = json.loads(open(os.path.join(output, "summary.json")).read())
    assert summary["warmup_included"] and summary["measured_steps"] == 2
    assert "over 2 measured steps" in out and "warm-up included: train.warmup_steps" in out
    # plain PyTorch in this process: no scheduler shares the client's core
    assert "of a core: the client)" in out and "scheduler" not in out


def test_a_library_run_refuses_what_the_command_line_refuses(tmp_path):
    """`run_training(config)` starting its own cluster checks its workers' tags before
    it starts them (as `--check` does): one ConfigError, nothing written."""
    config = tiny_config(tmp_path, str(tmp_path / "data"),
                         **{"cluster.resource": "GPU", "cluster.wait_timeout": 5})
    with pytest.raises(ConfigError, match="cluster.resource: no worker of the embedded"):
        run_training(config)
    assert not (tmp_path / "run").exists()
