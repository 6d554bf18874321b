"""`data` and `hybrid` on a real cluster equal plain single-process PyTorch.

docs/methods.md §2 and §3: data parallelism sums the replicas' gradients so the update is
SGD on the whole batch; the hybrid with one dense update a step is the same
arithmetic, and with a dense update after each part it equals that schedule written
out in plain PyTorch (tests/helpers.replay_hybrid_in_pytorch). Real worker
processes, a real Zarr workspace, replicas checked identical after every step.
"""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.cluster.worker_setup import register_setup
from pipeline.cluster.workers import find_workers
from pipeline.run import run_training
from storage import checkpoints
from tasks.layout import workspace_bytes
from tasks.replica_layout import DataLayout, HybridLayout
from tests.helpers import (max_relative_error, replay_hybrid_in_pytorch, replay_in_pytorch,
                           tiny_config)

TOLERANCE = {"float32": 1e-4, "float64": 1e-10}


def _run(tmp_path, cluster, dataset, **overrides):
    client, cluster_config = cluster
    config = tiny_config(tmp_path, dataset, **{"train.check_replicas": True, **overrides})
    config.cluster.workers = cluster_config.workers
    register_setup(client, config.cluster)
    result = run_training(config, client=client, offered=find_workers(client, config.cluster))
    return config, result


def _assert_equal(config, result, expected, losses):
    trained = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
    tolerance = TOLERANCE[config.network.dtype]
    error = max_relative_error(trained, expected)
    assert error <= tolerance, f"max relative weight error {error:.3g}"
    initial = checkpoints.read_tensors(config.checkpoint_path, 0)
    assert max_relative_error(initial, expected) > 1e-3  # training did move the weights
    np.testing.assert_allclose(result.record.loss.values, losses, rtol=tolerance, atol=0)


@pytest.mark.parametrize("workers,dtype", [(1, "float64"), (2, "float32"), (3, "float64")])
def test_data_parallel_equals_sgd_on_the_whole_batch(tmp_path, three_worker_cluster,
                                                     tiny_dataset_factory, workers, dtype):
    dataset = tiny_dataset_factory(dtype)
    config, result = _run(tmp_path, three_worker_cluster, dataset, strategy="data",
                          **{"cluster.use_workers": workers, "network.dtype": dtype})
    shares = result.summary["batch_split"]
    assert sum(shares) == config.train.batch and len(shares) == workers
    if workers == 3:
        assert len(set(shares)) > 1  # 16 samples over 3: uneven shares
    expected, losses = replay_in_pytorch(config, dataset)
    _assert_equal(config, result, expected, losses)
    names = list(result.record.worker.values)
    layout = DataLayout(tuple(names), tuple(shares))
    network = config.network_spec((3, 32, 32))
    itemsize = 4 if dtype == "float32" else 8
    for w, (read, written) in enumerate(workspace_bytes(layout, network, 16, itemsize)):
        np.testing.assert_array_equal(result.record.read_bytes.isel(worker=w), read)
        np.testing.assert_array_equal(result.record.write_bytes.isel(worker=w), written)


@pytest.mark.parametrize("scheme", ["a", "b", "c"])
def test_hybrid_with_one_dense_update_equals_sgd_on_the_whole_batch(
        tmp_path, three_worker_cluster, tiny_dataset_factory, scheme):
    dataset = tiny_dataset_factory("float64")
    config, result = _run(tmp_path, three_worker_cluster, dataset, strategy="hybrid",
                          **{"cluster.use_workers": 3, "network.dtype": "float64",
                             "network.hidden": "[12]", "hybrid.scheme": scheme})
    assert result.summary["dense_split"] == [[4, 4, 4], [4, 3, 3]]
    expected, losses = replay_in_pytorch(config, dataset)
    _assert_equal(config, result, expected, losses)
    names = list(result.record.worker.values)
    layout = HybridLayout(tuple(names), tuple(result.summary["batch_split"]),
                          ((4, 4, 4), (4, 3, 3)), scheme)
    expected_bytes = sum(r + w for r, w in workspace_bytes(
        layout, config.network_spec((3, 32, 32)), 16, 8))
    np.testing.assert_array_equal(result.record.workspace_bytes.sum("worker"), expected_bytes)


@pytest.mark.parametrize("scheme,scaling", [("b", "none"), ("b", "linear"), ("c", "sqrt")])
def test_hybrid_with_a_dense_update_per_part_equals_that_schedule(
        tmp_path, three_worker_cluster, tiny_dataset_factory, scheme, scaling):
    dataset = tiny_dataset_factory("float64")
    config, result = _run(tmp_path, three_worker_cluster, dataset, strategy="hybrid",
                          **{"cluster.use_workers": 3, "network.dtype": "float64",
                             "hybrid.scheme": scheme, "hybrid.dense_batch": "worker",
                             "hybrid.conv_lr_scaling": scaling})
    names = list(result.record.worker.values)
    layout = HybridLayout(tuple(names), tuple(result.summary["batch_split"]),
                          ((4, 3, 3),), scheme, "worker")
    parts = [[r for _e, a, b in part for r in range(a, b)] for part in layout.parts()]
    assert len(parts) == (1 if scheme == "a" else 3)
    scale = {"none": 1.0, "linear": 3.0, "sqrt": 3 ** 0.5}[scaling]
    expected, losses = replay_hybrid_in_pytorch(config, dataset, parts, scale)
    _assert_equal(config, result, expected, losses)
    if scheme != "a":  # per-part updates are not SGD on the whole batch
        sgd, _ = replay_in_pytorch(config, dataset)
        trained = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
        assert max_relative_error(trained, sgd) > 1e-6
