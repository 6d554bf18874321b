"""Test accuracy of a set of weights, scored in plain PyTorch on the master.

The weights come from the run's final checkpoint, which every strategy writes, so
the score is of exactly what was trained.
"""

from __future__ import annotations

import numpy as np
import torch

from storage.datasets import read_batch
from tasks.network import load_model
from tasks.specs import NetworkSpec


def test_accuracy(network: NetworkSpec, weights: dict[str, np.ndarray], dataset: str,
                  samples: int, batch: int = 250, identity: str = "") -> float:
    """Fraction of the first `samples` test images classified correctly (of the store
    whose content is `identity`, if given: `storage.datasets.read_batch`)."""
    model = load_model(network, weights).eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, samples, batch):
            indices = np.arange(start, min(samples, start + batch))
            images, labels = read_batch(dataset, "test", indices, identity)
            predicted = model(torch.from_numpy(images)).argmax(dim=1).numpy()
            correct += int((predicted == labels).sum())
    return correct / samples
