"""Helpers for tests: configs for tiny runs and a plain PyTorch re-run of a training."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pipeline.config import RunConfig, build_run_config
from storage import checkpoints
from storage.datasets import read_batch


def tiny_config(tmp_path, dataset: str, **overrides) -> RunConfig:
    """A small, fast run: conv 10 and 12 kernels, batch 16, 5 steps."""
    data = {
        "name": "tiny", "strategy": "kernel", "placement": "even", "progress": False,
        "output": str(tmp_path / "run"),
        "network": {"conv": [{"kernels": 10}, {"kernels": 12}], "dtype": "float32"},
        "data": {"path": dataset, "train_samples": 512, "test_samples": 128},
        "train": {"steps": 5, "batch": 16, "lr": 0.05, "momentum": 0.9,
                  "weight_decay": 0.001, "eval_samples": 64, "checkpoint_every": 0},
        "workspace": {"channel_quantum": 4},
    }
    overrides = [f"{k}={v}" for k, v in overrides.items()]
    return build_run_config(data, overrides)


def plain_pytorch_sequential(conv_widths: list[int], classes: int, dtype: torch.dtype,
                             image_hw: int = 32) -> nn.Sequential:
    """The network written out by hand, as a user of plain PyTorch would."""
    modules: list[nn.Module] = []
    channels, size = 3, image_hw
    for width in conv_widths:
        modules += [nn.Conv2d(channels, width, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2)]
        channels, size = width, size // 2
    modules += [nn.Flatten(), nn.Linear(channels * size * size, classes)]
    return nn.Sequential(*modules).to(dtype)


def replay_in_pytorch(config: RunConfig, dataset: str) -> tuple[dict, list[float]]:
    """Re-run a training in plain single-process PyTorch from its step-0 checkpoint.

    Uses the checkpoint's recorded sample indices, so the batches are the same.
    Returns the final state_dict (numpy) and the per-step losses.
    """
    dtype = getattr(torch, config.network.dtype)
    model = plain_pytorch_sequential([c.kernels for c in config.network.conv],
                                     config.network.classes, dtype)
    initial = checkpoints.read_tensors(config.checkpoint_path, 0)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in initial.items()})
    t = config.train
    optimizer = torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum,
                                weight_decay=t.weight_decay)
    indices = checkpoints.read_sample_indices(config.checkpoint_path)
    losses = []
    for step in range(t.steps):
        images, labels = read_batch(dataset, "train", indices[step])
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(torch.from_numpy(images)),
                                           torch.from_numpy(labels))
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}, losses


def max_relative_error(state: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> float:
    """Largest per-tensor ||a - b|| / ||b|| over all tensors (keys must match)."""
    assert set(state) == set(expected), (sorted(state), sorted(expected))
    return max(float(np.linalg.norm(state[k] - expected[k]) / np.linalg.norm(expected[k]))
               for k in expected)
