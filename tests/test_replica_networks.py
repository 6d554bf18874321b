"""`data` and `hybrid` on the zoo's networks equal plain single-process PyTorch.

docs/methods.md §2 and §3: with sync batch norm (the default) the replicas normalise by
the whole batch's statistics, so a run is SGD on the whole batch, batch norm's
running statistics included; with ``batch_norm: local`` each replica normalises by
its own rows, as DDP does, and the run equals a replay that does the same
(tests/replica_replay.py). Dropout's masks are the whole batch's, row for row, in a
replica and in hybrid's dense slices. Real worker processes (three, uneven batch
shares), a real Zarr workspace, float64, replicas checked identical every step.
"""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.cluster.worker_setup import register_setup
from pipeline.cluster.workers import find_workers
from pipeline import run as run_module
from pipeline.run import run_training
from storage import checkpoints
from storage.datasets import create_synthetic_dataset
from storage.datasets.store import open_dataset_info
from tasks.layout import exchange_slots, workspace_bytes
from tasks.replica_layout import DataLayout, HybridLayout
from tests.helpers import max_relative_error, tiny_config
from tests.replica_replay import Replay, replay_network

TOLERANCE = 1e-10
SHARES = [6, 4, 2]  # of a batch of 12
RESNET20 = {"network.preset": "resnet20", "network.width": 0.25}


@pytest.fixture(scope="module")
def images_64(tmp_path_factory) -> str:
    """64x64 synthetic images: AlexNet's strides need a side of at least 64."""
    path = str(tmp_path_factory.mktemp("data") / "tiny-64.zarr")
    create_synthetic_dataset(path, train_samples=64, test_samples=16, image_shape=(3, 64, 64),
                             dtype="float64")
    return path


@pytest.fixture
def alexnet_dataset(images_64, monkeypatch) -> str:
    """`images_64` as the run's dataset store, as the test built it (a run builds
    synthetic stores of CIFAR's size)."""
    monkeypatch.setattr(run_module, "prepare_dataset",
                        lambda config, *_: open_dataset_info(images_64))
    return images_64


def _run(tmp_path, cluster, dataset, **overrides):
    client, cluster_config = cluster
    config = tiny_config(tmp_path, dataset, **{
        "train.check_replicas": True, "network.dtype": "float64", "train.batch": 12,
        "train.steps": 2, "placement": "recorded", "split_from": f"[{SHARES}]",
        "train.eval_samples": 0, **overrides})
    config.cluster.workers = cluster_config.workers
    register_setup(client, config.cluster)
    result = run_training(config, client=client, offered=find_workers(client, config.cluster))
    assert result.summary["batch_split"] == SHARES
    return config, result


def _assert_equal(config, result, expected: Replay) -> None:
    """Weights, batch norm's running statistics, momentum and losses of the last
    checkpoint equal the replay's."""
    steps = config.train.steps
    trained = checkpoints.read_tensors(config.checkpoint_path, steps)
    error = max_relative_error(trained, expected.weights)
    assert error <= TOLERANCE, f"max relative weight error {error:.3g}"
    momentum = checkpoints.read_tensors(config.checkpoint_path, steps, "momentum",
                                        keys=expected.momentum)  # the parameters'
    assert max_relative_error(momentum, expected.momentum) <= TOLERANCE
    initial = checkpoints.read_tensors(config.checkpoint_path, 0)
    assert max_relative_error(initial, expected.weights) > 1e-3  # training did move them
    np.testing.assert_allclose(result.record.loss.values, expected.losses, rtol=TOLERANCE,
                               atol=0)


def _rows() -> list[tuple[int, int]]:
    starts = np.cumsum([0, *SHARES])
    return list(zip(starts[:-1], starts[1:]))


@pytest.mark.parametrize("strategy,scheme,scaling", [("data", "a", "none"),
                                                     ("hybrid", "b", "linear"),
                                                     ("hybrid", "c", "none")])
def test_sync_batch_norm_equals_sgd_on_the_whole_batch(tmp_path, three_worker_cluster,
                                                      tiny_dataset_factory, strategy, scheme,
                                                      scaling):
    """ResNet-20's 21 batch norms over the replicas. Hybrid's trunk is the same whatever
    the scheme; schemes (b) and (c) feed its dense part in parts ((a), one part, runs on
    AlexNet below): a resnet20 run costs about 5 s here, most of it creating its 128
    tensors' checkpoint arrays. (b) with the conv layers' learning rate (batch norms'
    included) scaled by the workers."""
    dataset = tiny_dataset_factory("float64")
    config, result = _run(tmp_path, three_worker_cluster, dataset, strategy=strategy,
                          **RESNET20, **{"hybrid.scheme": scheme,
                                         "hybrid.conv_lr_scaling": scaling})
    assert result.record.attrs["batch_norm"] == result.summary["batch_norm"] == "sync"
    scale = {"none": 1.0, "linear": 3.0}[scaling]
    _assert_equal(config, result, replay_network(config, dataset, conv_lr_scale=scale))
    names = tuple(result.record.worker.values)
    layout = (DataLayout(names, tuple(SHARES)) if strategy == "data" else
              HybridLayout(names, tuple(SHARES),
                           tuple(map(tuple, result.summary["dense_split"])), scheme))
    network = config.network_spec((3, 32, 32))
    slots = exchange_slots(layout, network, 12)
    norms = sum(layer.batch_norm for layer in network.conv)  # 19 convs', 2 shortcuts'
    assert sum(s.name.startswith("bn-") for s in slots) == norms * 2 * 3 == 21 * 6
    # every byte the formula says, batch norm's sums included
    expected_bytes = sum(r + w for r, w in workspace_bytes(layout, network, 12, 8))
    np.testing.assert_array_equal(result.record.workspace_bytes.sum("worker"), expected_bytes)


def test_local_batch_norm_equals_replicas_with_their_own_statistics(
        tmp_path, three_worker_cluster, tiny_dataset_factory):
    """Each replica's rows through its own statistics (DDP's batch norm); the first
    worker's running statistics in the checkpoint. `hybrid` (scheme b, a dense part per
    replica) runs `data`'s replicas' trunk, and its own dense part besides."""
    dataset = tiny_dataset_factory("float64")
    config, result = _run(tmp_path, three_worker_cluster, dataset, strategy="hybrid",
                          **RESNET20, **{"train.batch_norm": "local", "hybrid.scheme": "b"})
    assert result.summary["batch_norm"] == "local"
    _assert_equal(config, result, replay_network(config, dataset, replicas=_rows()))
    whole = replay_network(config, dataset)  # sync's arithmetic is another
    trained = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
    assert max_relative_error(trained, whole.weights) > 1e-6


@pytest.mark.parametrize("strategy,scheme,dense_batch", [
    ("data", "a", "full"), ("hybrid", "a", "full"), ("hybrid", "c", "worker")])
def test_alexnet_with_dropout_equals_plain_pytorch(tmp_path, three_worker_cluster,
                                                   alexnet_dataset, strategy, scheme,
                                                   dense_batch):
    """AlexNet's dense layers (dropout 0.5 on the first two's inputs), in replicas, or
    split by neurons under `hybrid`: the whole batch at once (a), or scheme (c)'s parts
    (rows of every replica, the masks' rows with them) with a dense update per part,
    replayed part by part."""
    config, result = _run(tmp_path, three_worker_cluster, alexnet_dataset, strategy=strategy,
                          **{"network.preset": "alexnet", "network.width": 1 / 32,
                             "network.dropout": 0.5, "hybrid.scheme": scheme,
                             "hybrid.dense_batch": dense_batch})
    parts = None
    if dense_batch == "worker":
        layout = HybridLayout(("a", "b", "c"), tuple(SHARES), ((1,) * 3,) * 3, scheme,
                              dense_batch)
        parts = [[r for _e, a, b in part for r in range(a, b)] for part in layout.parts()]
    _assert_equal(config, result, replay_network(config, alexnet_dataset, parts=parts))
