"""The run's dataset store: opened, or built first (synthetic, CIFAR-10 or an image
folder) if missing.

Its own module because both the run (`pipeline.run`) and the model's probe of a
cluster (`pipeline.prediction`) train on it, and the run itself records a prediction.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Callable

from pipeline.config.run_config import DataConfig, RunConfig
from pipeline.config.schema import ConfigError
from storage.datasets import (DatasetError, DatasetInfo, ensure_dataset, list_image_folder,
                              open_dataset_info, source_kind)
from storage.datasets.image_folder import ImageFolderSplits
from storage.datasets.store import SampleCountError
from storage.datasets.cifar10 import CIFAR10_CLASSES
from storage.datasets.synthetic import SYNTHETIC_CLASSES
from storage.space import writing


def check_data_source(config: RunConfig) -> None:
    """What the source fixes, against the config, before anything is imported:
    CIFAR-10's images are 32x32, and an image folder has its own number of classes,
    images in every class and as many images as the sample counts ask (`listed_folder`)."""
    source = config.data.source
    if source == "synthetic" or not os.path.exists(source):
        return  # a missing source is preflight's to name (its store may outlive it)
    kind = source_kind(source)
    if kind == "cifar10" and os.path.isfile(source) and not tarfile.is_tarfile(source):
        raise ConfigError(f"data.source: {source} is a file but no tar archive: expected "
                          "'synthetic', a folder of images, or CIFAR-10's "
                          "cifar-10-python.tar.gz or its extracted folder")
    side = config.data.image_size
    if kind == "cifar10" and side not in (None, DataConfig.DEFAULT_IMAGE_SIZE):
        raise ConfigError(f"data.image_size: {side}, but CIFAR-10's images are "
                          f"{DataConfig.DEFAULT_IMAGE_SIZE}x{DataConfig.DEFAULT_IMAGE_SIZE} "
                          f"(leave it unset or {DataConfig.DEFAULT_IMAGE_SIZE})")
    if kind == "image_folder":
        classes = listed_folder(config).classes
        if len(classes) != config.network.classes:
            raise ConfigError(f"network.classes: {config.network.classes}, but the image "
                              f"folder {source} has {len(classes)} classes "
                              f"({', '.join(classes)})")


def listed_folder(config: RunConfig) -> ImageFolderSplits:
    """The images an import of the config's image folder would store, from a listing
    alone (no image decoded): a class without images, or a sample count larger than
    the folder holds, is refused as the import would refuse it, naming the field."""
    data = config.data
    train, test = data.sample_counts()
    try:
        return list_image_folder(data.source, data.seed, train, test)
    except SampleCountError as error:
        raise ConfigError(f"data.{error.split}_samples: {error.asked}, but the image folder "
                          f"{data.source} holds {error.holds}") from None


def expected_dataset(config: RunConfig) -> tuple[int | None, int | None]:
    """(classes, training samples) of the store the run will train on, known from
    files alone, without building it; None for what only the build would tell.

    Why not the store's own metadata: a store built from other arguments is rebuilt
    (`ensure_dataset`), so what the source and the config fix is what the run gets.
    Only a store whose source is gone (it outlived its archive or folder) speaks for
    itself."""
    source = config.data.source
    train_samples = config.data.sample_counts()[0]
    if source == "synthetic":
        return SYNTHETIC_CLASSES, train_samples
    if not os.path.exists(source):
        try:
            info = open_dataset_info(config.dataset_path)
        except DatasetError:
            return None, None  # no source and no store: preflight names the source
        return info.classes, info.train_samples
    if source_kind(source) == "cifar10":
        return CIFAR10_CLASSES, train_samples  # None: all of CIFAR-10's, more than a batch
    listed = listed_folder(config)
    return len(listed.classes), len(listed.train)


def check_dataset_fits(config: RunConfig, classes: int | None,
                       train_samples: int | None) -> None:
    """The network's classes are the dataset's, and a batch fits in its training
    samples (None: not known, not checked). One function for both callers so that
    `--check` (with `expected_dataset`) and the run (with the store it opened) refuse
    in the same words."""
    if classes is not None and config.network.classes != classes:
        raise ConfigError(f"network.classes: {config.network.classes}, but the dataset has "
                          f"{classes} classes")
    if train_samples is not None and config.train.batch > train_samples:
        raise ConfigError(f"train.batch: {config.train.batch} is larger than the "
                          f"{train_samples} training samples")


def prepare_dataset(config: RunConfig, say: Callable[[str], None] | None = None
                    ) -> DatasetInfo:
    """Open the run's dataset store, building it from its source if missing; `say`
    hears of a wait for another process's build and of half-built stores removed, and
    of a build. A sample count the source cannot give is refused naming its field, as
    `--check` refuses it where a listing can tell (an image folder's); a CIFAR-10
    archive's counts are known only once it is read."""
    check_data_source(config)
    train_samples, test_samples = config.data.sample_counts()
    try:
        with writing("dataset store", config.dataset_path):  # a full disk: one clear line
            return ensure_dataset(config.data.source, config.dataset_path,
                                  train_samples=train_samples, test_samples=test_samples,
                                  seed=config.data.seed, dtype=config.network.dtype,
                                  image_size=config.data.image_size, say=say)
    except SampleCountError as error:
        raise ConfigError(f"data.{error.split}_samples: {error.asked}, but "
                          f"{config.data.source} holds {error.holds}") from None
