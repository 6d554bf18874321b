"""Learning-rate schedules in real runs: every strategy equals plain PyTorch under
torch's own schedulers, and a resumed run continues the schedule at its step.

Real worker processes, a real Zarr workspace and checkpoints (the shared cluster of
tests/conftest.py); the plain PyTorch side is tests/helpers.py's replays, whose
schedulers are torch.optim.lr_scheduler's, written out as a user would
(`tests.replica_replay.plain_scheduler`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.cluster.worker_setup import register_setup
from pipeline.cluster.workers import find_workers
from pipeline.run import run_training
from storage import checkpoints
from tests.helpers import max_relative_error, replay_in_pytorch, tiny_config
from tests.replica_replay import plain_scheduler

TOLERANCE = 1e-10  # float64, as tests/test_equality.py and tests/test_strategies.py

#: A warm-up then a step decay, and a warm-up then a cosine decay, over the tiny run's
#: 5 steps: every step's rate differs from the one before but one.
WARMUP_STEP = {"train.lr_warmup": 2, "train.lr_warmup_factor": 0.2,
               "train.lr_decay": "step", "train.lr_milestones": "[3, 4]",
               "train.lr_gamma": 0.5}
WARMUP_COSINE = {"train.lr_warmup": 2, "train.lr_decay": "cosine"}


def _run(tmp_path, cluster, dataset, **overrides):
    client, cluster_config = cluster
    config = tiny_config(tmp_path, dataset, **{"network.dtype": "float64", **overrides})
    if config.strategy == "reference":
        return config, run_training(config)
    config.cluster.workers = cluster_config.workers
    register_setup(client, config.cluster)
    return config, run_training(config, client=client,
                                offered=find_workers(client, config.cluster))


def torch_rates(config) -> list[float]:
    """The rate of each step as torch's schedulers give it to plain PyTorch's SGD."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.train.lr)
    scheduler = plain_scheduler(optimizer, config)
    rates = []
    for _ in range(config.train.steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("strategy,schedule,more", [
    ("reference", WARMUP_STEP, {}),
    ("single", WARMUP_COSINE, {}),
    ("kernel", WARMUP_STEP, {"train.steps_per_task": 3, "cluster.use_workers": 2}),
    ("data", WARMUP_COSINE, {"cluster.use_workers": 3}),
    ("hybrid", WARMUP_STEP, {"cluster.use_workers": 3, "network.hidden": "[12]"}),
])
def test_every_strategy_follows_the_schedule_as_plain_pytorch(
        tmp_path, three_worker_cluster, tiny_dataset_factory, strategy, schedule, more):
    dataset = tiny_dataset_factory("float64")
    config, result = _run(tmp_path, three_worker_cluster, dataset, strategy=strategy,
                          **schedule, **more)
    if "train.steps_per_task" in more:  # several steps in one task, each at its own rate
        assert max(result.record.task_steps.values) > 1
    trained = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
    expected, losses = replay_in_pytorch(config, dataset)
    error = max_relative_error(trained, expected)
    assert error <= TOLERANCE, f"max relative weight error {error:.3g}"
    np.testing.assert_allclose(result.record.loss.values, losses, rtol=TOLERANCE, atol=0)
    # the record keeps each step's rate: torch's, step by step
    rates = torch_rates(config)
    np.testing.assert_allclose(result.record.lr.values, rates, rtol=1e-12, atol=0)
    assert len(set(rates)) >= 4 and result.record.lr.attrs["units"] == "1"
    # a constant rate trains to other weights: the schedule mattered
    constant = tiny_config(tmp_path, dataset, strategy=strategy, **{"network.dtype": "float64"},
                           **more)
    assert max_relative_error(trained, replay_in_pytorch(constant, dataset)[0]) > 1e-3


def test_a_resumed_schedule_continues_at_its_step(tmp_path, three_worker_cluster,
                                                  tiny_dataset_factory):
    """7 steps straight equal 4 steps, a resume to 6 on workers (`kernel`, from step 4:
    past the warm-up and the first milestone) and a resume to 7 in plain PyTorch
    (`reference`, its schedulers stepped on to 6): weights, momentum and rates."""
    dataset = tiny_dataset_factory("float64")
    schedule = {**WARMUP_STEP, "train.lr_milestones": "[3, 5]", "train.checkpoint_every": 2,
                "cluster.use_workers": 2}
    straight, whole = _run(tmp_path / "straight", three_worker_cluster, dataset,
                           **schedule, **{"train.steps": 7})
    parts = tmp_path / "parts"
    for strategy, steps, resume in (("kernel", 4, False), ("kernel", 6, True),
                                    ("reference", 7, True)):
        resumed, result = _run(parts, three_worker_cluster, dataset, strategy=strategy,
                               **schedule, **{"train.steps": steps, "train.resume": resume})
    assert result.record.start.values.tolist() == [0] * 4 + [1] * 2 + [2]
    for kind in ("weights", "momentum"):
        error = max_relative_error(checkpoints.read_tensors(resumed.checkpoint_path, 7, kind),
                                   checkpoints.read_tensors(straight.checkpoint_path, 7, kind))
        assert error <= TOLERANCE, (kind, error)
    np.testing.assert_allclose(result.record.lr.values, whole.record.lr.values,
                               rtol=1e-12, atol=0)
    np.testing.assert_allclose(result.record.loss.values, whole.record.loss.values,
                               rtol=TOLERANCE, atol=0)
