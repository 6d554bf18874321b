"""The run's dataset store: opened, or built first (synthetic or CIFAR-10) if missing.

Its own module because both the run (`pipeline.run`) and the model's probe of a
cluster (`pipeline.prediction`) train on it, and the run itself records a prediction.
"""

from __future__ import annotations

from pipeline.config.run_config import RunConfig
from storage.datasets import DatasetInfo, ensure_dataset
from storage.space import writing


def prepare_dataset(config: RunConfig) -> DatasetInfo:
    """Open the run's dataset store, building it (synthetic or CIFAR-10) if missing."""
    train_samples, test_samples = config.data.sample_counts()
    with writing("dataset store", config.dataset_path):  # a full disk: one clear line
        return ensure_dataset(config.data.source, config.dataset_path,
                              train_samples=train_samples, test_samples=test_samples,
                              seed=config.data.seed, dtype=config.network.dtype)
