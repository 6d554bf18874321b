"""GPU path: shards and the dense head on CUDA workers (tagged GPU=1) still equal plain
PyTorch, and `single` on a GPU keeps every tensor on the device.

Skipped where torch sees no CUDA device (CI has none); run on a GPU machine with
``pytest tests/test_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.run import run_training
from storage import checkpoints
from tests.helpers import max_relative_error, replay_in_pytorch, tiny_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPU_WORKERS = "[{name: gpu-0, resources: {GPU: 1}}, {name: gpu-1, resources: {GPU: 1}}]"


@pytest.mark.parametrize("strategy,shards", [("kernel", 2), ("single", 1)])
def test_gpu_workers_equal_plain_pytorch(tmp_path, tiny_dataset_factory, strategy, shards):
    dataset = tiny_dataset_factory("float64")
    config = tiny_config(tmp_path, dataset, strategy=strategy, **{
        "network.dtype": "float64", "cluster.resource": "GPU", "cluster.workers": GPU_WORKERS})
    result = run_training(config)
    assert [len(layer) for layer in result.summary["kernel_split"]] == [shards, shards]
    assert list(result.record.device.values) == ["cuda"] * shards
    assert result.summary["master"] == "gpu-0"
    if strategy == "single":  # everything stayed on the device: no workspace traffic
        assert (result.record.workspace_bytes == 0).all()
    trained = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
    expected, _ = replay_in_pytorch(config, dataset)
    assert max_relative_error(trained, expected) <= 1e-10
