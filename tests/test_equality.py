"""Kernel-parallel and single training equal plain single-process PyTorch.

docs/methods.md §1: the arithmetic is that of single-device SGD with the same batch, so
the weights after N steps must match up to float summation order. Runs on a real
Dask cluster of worker processes with a real Zarr workspace and checkpoints.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.cluster.worker_setup import register_setup
from pipeline.cluster.workers import find_workers
from pipeline.run import run_training
from storage import checkpoints
from tests.helpers import max_relative_error, replay_in_pytorch, shared_workers, tiny_config

TOLERANCE = {"float32": 1e-4, "float64": 1e-10}


def _run(tmp_path, cluster, dataset, **overrides):
    client, cluster_config = cluster
    config = tiny_config(tmp_path, dataset, **overrides)
    config.cluster.workers = cluster_config.workers
    register_setup(client, config.cluster)
    offered = find_workers(client, config.cluster)
    result = run_training(config, client=client, offered=offered)
    return config, result


@pytest.mark.parametrize("strategy,workers,dtype", [
    ("kernel", 1, "float64"), ("kernel", 2, "float64"), ("kernel", 3, "float64"),
    ("kernel", 3, "float32"), ("single", 3, "float64"), ("single", 3, "float32")])
def test_weights_and_losses_equal_plain_pytorch(tmp_path, three_worker_cluster,
                                                tiny_dataset_factory, dtype, strategy,
                                                workers):
    """Each split at float64's tolerance; float32 on each strategy's widest split (its
    summation order the furthest from plain PyTorch's), not again on every split: a
    split's arithmetic is the same in either dtype."""
    dataset = tiny_dataset_factory(dtype)
    config, result = _run(tmp_path, three_worker_cluster, dataset, strategy=strategy,
                          **{"network.dtype": dtype, "cluster.use_workers": workers})
    split = result.summary.get("kernel_split")
    expected_shards = 1 if strategy == "single" else workers
    assert [len(layer) for layer in split] == [expected_shards] * 2
    if expected_shards > 1:  # 10 and 12 kernels in units of 4: uneven shares
        assert any(len(set(layer)) > 1 for layer in split), split
    trained = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
    expected, losses = replay_in_pytorch(config, dataset)
    error = max_relative_error(trained, expected)
    assert error <= TOLERANCE[dtype], f"max relative weight error {error:.3g}"
    initial = checkpoints.read_tensors(config.checkpoint_path, 0)
    assert max_relative_error(initial, expected) > 1e-3  # training did move the weights
    np.testing.assert_allclose(result.record.loss.values, losses,
                               rtol=TOLERANCE[dtype], atol=0)


def test_calibrated_split_on_emulated_slow_worker_still_exact(tmp_path, shared_cluster,
                                                              tiny_dataset_factory):
    """An emulated tenth-speed worker gets fewer kernels in all (none, if its shards'
    fixed cost outweighs them: then it leaves the run); the arithmetic is unchanged.
    The shared cluster's cpu-0 and cpu-1, cpu-1 set up at 0.1x speed. The tiny
    layers' shards cost about as much in fixed task costs as in compute, so on a
    loaded machine one layer's split may come out even: the check is on the total."""
    client, cluster = shared_workers(shared_cluster, "PROBE", {"cpu-1": {"speed": 0.1}})
    dataset = tiny_dataset_factory("float32")
    config = tiny_config(tmp_path, dataset, placement="calibrated",
                         **{"network.conv.0.kernels": 16,
                            "network.conv.1.kernels": 24,
                            "workspace.channel_quantum": 2})
    config.cluster = cluster
    register_setup(client, cluster)
    try:
        result = run_training(config, client=client)
    finally:  # the shared workers back at full speed
        register_setup(client, shared_cluster[1])
    choice = json.loads(result.record.attrs["placement_choice"])
    assert choice["workers"] == ["cpu-0", "cpu-1"]
    fast, slow = np.array(choice["split"]).T
    assert fast.sum() > slow.sum(), choice["split"]
    if slow.any():
        assert "cpu-1 (emulated 0.1x speed)" in result.summary["workers"]
        assert float(result.record.emulated_time.sel(worker="cpu-1").sum()) > 0
    else:
        assert json.loads(result.record.attrs["left_out"]) == ["cpu-1"]
        assert result.summary["workers"] == ["cpu-0"]
    trained = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
    expected, _ = replay_in_pytorch(config, dataset)
    assert max_relative_error(trained, expected) <= TOLERANCE["float32"]
