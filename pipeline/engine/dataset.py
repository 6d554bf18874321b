"""The run's dataset store: opened, or built first (synthetic, CIFAR-10 or an image
folder) if missing.

Its own module because both the run (`pipeline.run`) and the model's probe of a
cluster (`pipeline.prediction`) train on it, and the run itself records a prediction.
"""

from __future__ import annotations

import os

from pipeline.config.run_config import DataConfig, RunConfig
from pipeline.config.schema import ConfigError
from storage.datasets import DatasetInfo, ensure_dataset, image_folder_classes, source_kind
from storage.space import writing


def check_data_source(config: RunConfig) -> None:
    """What the source fixes, against the config, before anything is imported:
    CIFAR-10's images are 32x32, and an image folder has its own number of classes."""
    source = config.data.source
    if source == "synthetic" or not os.path.exists(source):
        return  # a missing source is preflight's to name (its store may outlive it)
    kind = source_kind(source)
    side = config.data.image_size
    if kind == "cifar10" and side not in (None, DataConfig.DEFAULT_IMAGE_SIZE):
        raise ConfigError(f"data.image_size: {side}, but CIFAR-10's images are "
                          f"{DataConfig.DEFAULT_IMAGE_SIZE}x{DataConfig.DEFAULT_IMAGE_SIZE} "
                          f"(leave it unset or {DataConfig.DEFAULT_IMAGE_SIZE})")
    if kind == "image_folder":
        classes = image_folder_classes(source)
        if len(classes) != config.network.classes:
            raise ConfigError(f"network.classes: {config.network.classes}, but the image "
                              f"folder {source} has {len(classes)} classes "
                              f"({', '.join(classes)})")


def prepare_dataset(config: RunConfig) -> DatasetInfo:
    """Open the run's dataset store, building it from its source if missing."""
    check_data_source(config)
    train_samples, test_samples = config.data.sample_counts()
    with writing("dataset store", config.dataset_path):  # a full disk: one clear line
        return ensure_dataset(config.data.source, config.dataset_path,
                              train_samples=train_samples, test_samples=test_samples,
                              seed=config.data.seed, dtype=config.network.dtype,
                              image_size=config.data.image_size)
