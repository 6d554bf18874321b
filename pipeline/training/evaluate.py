"""Test accuracy of a set of weights, scored in plain PyTorch on the master.

The weights come from the run's final checkpoint, which every strategy writes, so
the score is of exactly what was trained.
"""

from __future__ import annotations

import numpy as np
import torch

from storage.datasets import read_batch
from storage.datasets.store import DatasetError
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


def accuracy_or_why(network: NetworkSpec, weights: dict[str, np.ndarray], dataset: str,
                    samples: int, identity: str = "") -> tuple[float | None, str | None]:
    """`test_accuracy`, and None; or None and why, where the test images cannot be read
    (the store rebuilt with other images since the run began, damaged, gone). Why not
    an error: the run's steps are done by then, and its record and summary are worth
    writing without the score rather than losing."""
    try:
        return test_accuracy(network, weights, dataset, samples, identity=identity), None
    except (DatasetError, OSError) as error:
        return None, f"test accuracy none: {error}"
