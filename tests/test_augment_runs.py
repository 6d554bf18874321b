"""Runs with `data.augment: crop_flip` equal plain single-process PyTorch on the same
augmented batches, under every strategy, across a resume, and score the test set as
it is.

Each strategy's workers read their own rows of a batch (a `kernel` shard all of them,
a `data` or `hybrid` replica its share, the in-process `reference` the whole batch)
and augment them where they read them; the replay (tests/helpers.py) reads the whole
batch and augments it image by image in torch (tests/augment_replay.py). Real worker
processes, a real Zarr workspace and checkpoints, float64.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.cluster.worker_setup import register_setup
from pipeline.cluster.workers import find_workers
from pipeline.run import run_training
from storage import checkpoints
from storage.datasets import open_dataset_info, read_batch
from tasks.augment import crop_flip
from tasks.network import load_model
from tests.helpers import max_relative_error, replay_in_pytorch, tiny_config

TOLERANCE = 1e-10
AUGMENTED = {"network.dtype": "float64", "data.augment": "crop_flip"}


def _run(config, cluster):
    """`config` on the shared cluster's workers, or in process for `reference`."""
    if config.strategy == "reference":
        return run_training(config)
    client, cluster_config = cluster
    config.cluster.workers = cluster_config.workers
    register_setup(client, config.cluster)
    return run_training(config, client=client, offered=find_workers(client, config.cluster))


@pytest.mark.parametrize("strategy", ["reference", "single", "kernel", "data", "hybrid"])
def test_every_strategy_trains_as_plain_pytorch_on_the_augmented_batches(
        tmp_path, three_worker_cluster, tiny_dataset_factory, strategy):
    dataset = tiny_dataset_factory("float64")
    config = tiny_config(tmp_path, dataset, strategy=strategy, **AUGMENTED,
                         **{"cluster.use_workers": 3, "train.steps": 4,
                            "train.check_replicas": strategy in ("data", "hybrid")})
    result = _run(config, three_worker_cluster)
    if strategy in ("data", "hybrid"):
        assert len(set(result.summary["batch_split"])) > 1  # 16 rows on 3: uneven parts
    trained = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
    expected, losses = replay_in_pytorch(config, dataset)
    error = max_relative_error(trained, expected)
    assert error <= TOLERANCE, f"max relative weight error {error:.3g}"
    np.testing.assert_allclose(result.record.loss.values, losses, rtol=TOLERANCE, atol=0)
    config.data.augment = "none"  # the same run on the images as read trains otherwise
    unaugmented, _ = replay_in_pytorch(config, dataset)
    assert max_relative_error(trained, unaugmented) > 1e-6


def test_a_resumed_augmented_run_equals_the_uninterrupted_one(tmp_path, three_worker_cluster,
                                                              tiny_dataset_factory):
    """4 steps in process, resumed on 2 workers (`kernel`) to 7: each step's images are
    drawn from its own number, not from the steps since the start."""
    dataset = tiny_dataset_factory("float64")
    straight = tiny_config(tmp_path / "a", dataset, strategy="reference", **AUGMENTED,
                           **{"train.steps": 7})
    _run(straight, three_worker_cluster)
    first = tiny_config(tmp_path / "b", dataset, strategy="reference", **AUGMENTED,
                        **{"train.steps": 4})
    _run(first, three_worker_cluster)
    resumed = tiny_config(tmp_path / "b", dataset, **AUGMENTED,
                          **{"train.steps": 7, "train.resume": True, "cluster.use_workers": 2})
    _run(resumed, three_worker_cluster)
    for kind in ("weights", "momentum"):
        error = max_relative_error(checkpoints.read_tensors(resumed.checkpoint_path, 7, kind),
                                   checkpoints.read_tensors(straight.checkpoint_path, 7, kind))
        assert error <= TOLERANCE, (kind, error)


def test_the_test_images_that_score_accuracy_are_not_augmented(tmp_path, tiny_dataset_factory):
    dataset = tiny_dataset_factory("float64")
    config = tiny_config(tmp_path, dataset, strategy="reference", **AUGMENTED,
                         **{"train.steps": 3, "train.eval_samples": 128})
    result = run_training(config)
    network = config.network_spec(open_dataset_info(dataset).image_shape)
    model = load_model(network, checkpoints.read_tensors(config.checkpoint_path, 3)).eval()
    images, labels = read_batch(dataset, "test", np.arange(128))

    def accuracy(x: np.ndarray) -> float:
        with torch.no_grad():
            return float((model(torch.from_numpy(x)).argmax(1).numpy() == labels).mean())

    assert result.summary["test_accuracy"] == accuracy(images)
    assert accuracy(crop_flip(images, np.arange(128), 0, 3, 4)) != accuracy(images)
