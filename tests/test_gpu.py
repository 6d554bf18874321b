"""GPU path: workers on CUDA (`cluster.devices`) still equal plain PyTorch.

The paper family under `kernel` and `single` (where `single` keeps every tensor on the
device); the zoo under `kernel` (batch norm, residual sums, max and average pooling and
dropout on the GPU) on two GPU workers and on a GPU worker beside a CPU worker, with
uneven tied splits; `data` and `hybrid` on resnet20 over three GPU replicas (batch
norm's statistics over the whole batch); and the GPU side-by-side's yardstick, plain
PyTorch on the GPU (benchmarks/side_by_side.py `--devices`). Every run is float64 and
is checked against a plain single-process PyTorch replay on the CPU (tests/helpers.py):
weights, batch norm's running statistics and the losses, within 1e-10. Two workers on
``cuda:0`` are two processes sharing the one GPU.

Skipped where torch sees no CUDA device (CI has none); on a GPU machine run
``pytest tests/test_gpu.py`` (benchmarks/device_session.sh runs it on the device
machine, docs/benchmarks.md "CPUs and GPUs in one run").
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from benchmarks.side_by_side import TORCH_GPU, loop_contender
from pipeline.run import run_training
from storage import checkpoints
from tasks.zoo import build_preset
from tests.helpers import (assert_equal_within_rounding, max_relative_error, replay_in_pytorch,
                           tiny_config)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TOLERANCE = 1e-10
#: Workers by device; a run orders GPU workers first and names them gpu-0, cpu-1, ...
TWO_GPUS = ["cuda:0", "cuda:0"]
GPU_AND_CPU = ["cuda:0", "cpu"]
THREE_GPUS = ["cuda:0", "cuda:0", "cuda:0"]
#: The zoo's test sizes at 32x32 (channel counts of 4 and up).
ZOO_WIDTH = {"resnet20": 0.25, "vgg11_bn": 1 / 16}
#: Small enough for uneven splits of 4-channel layers.
QUANTUM = 2


def _devices(devices: list[str]) -> str:
    return "[" + ", ".join(devices) + "]"


@pytest.mark.parametrize("strategy,shards", [("kernel", 2), ("single", 1)])
def test_gpu_workers_equal_plain_pytorch(tmp_path, tiny_dataset_factory, strategy, shards):
    dataset = tiny_dataset_factory("float64")
    config = tiny_config(tmp_path, dataset, strategy=strategy, **{
        "network.dtype": "float64", "cluster.devices": _devices(TWO_GPUS)})
    result = run_training(config)
    assert [len(layer) for layer in result.summary["kernel_split"]] == [shards, shards]
    assert list(result.record.device.values) == TWO_GPUS[:shards]
    assert result.summary["master"] == "gpu-0"
    if strategy == "single":  # everything stayed on the device: no workspace traffic
        assert (result.record.workspace_bytes == 0).all()
    trained = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
    expected, _ = replay_in_pytorch(config, dataset)
    assert max_relative_error(trained, expected) <= TOLERANCE


def _train_and_compare(tmp_path, dataset: str, **overrides):
    """Train 3 steps of 16 in float64 with `overrides`; the last checkpoint (weights,
    batch norm's running statistics and counters) and the losses must equal the plain
    PyTorch replay's. Returns the run's result."""
    config = tiny_config(tmp_path, dataset, **{"network.dtype": "float64", "train.steps": 3,
                                               **overrides})
    result = run_training(config)
    trained = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
    expected, losses = replay_in_pytorch(config, dataset)
    assert_equal_within_rounding(trained, expected, TOLERANCE)
    np.testing.assert_allclose(result.record.loss.values, losses, rtol=TOLERANCE, atol=0)
    return result


@pytest.mark.parametrize("preset,devices", [
    ("resnet20", TWO_GPUS), ("vgg11_bn", TWO_GPUS), ("resnet20", GPU_AND_CPU),
], ids=["resnet20-gpu-gpu", "vgg11_bn-gpu-gpu", "resnet20-gpu-cpu"])
def test_kernel_trains_a_zoo_network_on_gpu_workers_as_plain_pytorch(
        tmp_path, tiny_dataset_factory, preset, devices):
    """Each layer split [all but one quantum, one quantum]: uneven, and the same row for
    layers of the same kernels, so every tied group (a residual sum's layers, which have
    the same channels) shares one split. The dense head runs on the first GPU worker."""
    width = ZOO_WIDTH[preset]
    network = build_preset(preset, (3, 32, 32), 10, "float64", width)
    split = [[layer.kernels - QUANTUM, QUANTUM] for layer in network.conv]
    assert any(first != second for first, second in split)
    result = _train_and_compare(tmp_path, tiny_dataset_factory("float64"), **{
        "network.preset": preset, "network.width": width, "cluster.devices": _devices(devices),
        "workspace.channel_quantum": QUANTUM, "placement": "recorded",
        "split_from": json.dumps(split)})
    assert result.summary["kernel_split"] == split
    assert list(result.record.device.values) == devices
    assert result.summary["master"] == "gpu-0"


@pytest.mark.parametrize("strategy", ["data", "hybrid"])
def test_replicas_on_gpu_workers_train_resnet20_as_plain_pytorch(tmp_path, tiny_dataset_factory,
                                                                 strategy):
    """Three GPU replicas, uneven shares of the batch of 16, replicas checked identical
    every step; batch norm over the whole batch, so the replay is SGD on the whole batch."""
    result = _train_and_compare(tmp_path, tiny_dataset_factory("float64"), strategy=strategy, **{
        "network.preset": "resnet20", "network.width": ZOO_WIDTH["resnet20"],
        "cluster.devices": _devices(THREE_GPUS), "train.check_replicas": True})
    shares = result.summary["batch_split"]
    assert sum(shares) == 16 and len(shares) == 3 and len(set(shares)) > 1
    assert list(result.record.device.values) == THREE_GPUS


def test_the_side_by_sides_plain_pytorch_on_the_gpu_trains_as_the_replay(tmp_path,
                                                                       tiny_dataset_factory):
    """benchmarks/side_by_side.py's `torch-gpu` (the reference's loop on cuda:0, what
    the GPU side-by-side divides by) is the replay's arithmetic, only on the GPU."""
    dataset = tiny_dataset_factory("float64")
    config = tiny_config(tmp_path, dataset, strategy="reference", **{
        "network.dtype": "float64", "network.preset": "resnet20",
        "network.width": ZOO_WIDTH["resnet20"], "train.steps": 3, "train.eval_samples": 0})
    contender = loop_contender(TORCH_GPU, config, device="cuda:0")
    try:
        contender.burst(3)
    finally:
        contender.close()
    assert contender.trainer.devices == ["cuda:0"]
    trained = checkpoints.read_tensors(config.checkpoint_path, 3)
    expected, losses = replay_in_pytorch(config, dataset)
    assert_equal_within_rounding(trained, expected, TOLERANCE)
    np.testing.assert_allclose([contender.recorder.steps[s]["loss"] for s in range(3)], losses,
                               rtol=TOLERANCE, atol=0)
