"""GPU path: shards on CUDA workers (tagged GPU=1) still equal plain PyTorch.

Skipped where torch sees no CUDA device (CI has none); run on a GPU machine with
``pytest tests/test_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_kernel_on_gpu_workers_equals_plain_pytorch(tmp_path, tiny_dataset_factory):
    from pipeline.train import run_training
    from storage import checkpoints
    from tests.helpers import max_relative_error, replay_in_pytorch, tiny_config

    dataset = tiny_dataset_factory("float64")
    config = tiny_config(tmp_path, dataset, **{
        "network.dtype": "float64", "cluster.resource": "GPU",
        "cluster.workers": "[{name: gpu-0, resources: {GPU: 1}}, "
                           "{name: gpu-1, resources: {GPU: 1}}]"})
    result = run_training(config)
    assert [len(layer) for layer in result.summary["kernel_split"]] == [2, 2]
    assert list(result.record.device.values) == ["cuda", "cuda"]
    trained = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
    expected, _ = replay_in_pytorch(config, dataset)
    assert max_relative_error(trained, expected) <= 1e-10
