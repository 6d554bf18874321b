"""The image-folder importer: a folder of images, one sub-folder per class, into a store.

The layout is torchvision's ImageFolder: the classes are the sorted names of the
folder's sub-folders (hidden ones, starting with '.', left out), a label is a class's
index in that order, and a class's images are the files below its sub-folder whose
extension is one of `IMAGE_EXTENSIONS` (any case), sorted by path. If the folder holds
``train/`` and ``test/`` (or ``val/``) sub-folders, each is such a folder and gives
its split; otherwise one seeded random share of the images is the test split.

Every image is opened with Pillow, converted to RGB, resized so that its shorter side
is the store's side (bilinear) and centre-cropped to a square, as torchvision's
``Resize(side)`` and ``CenterCrop(side)`` do; the store holds it normalised like
CIFAR-10's (`writer.pixel_statistics`). All images are decoded before anything is
written, so a file that is not a readable image stops the import with one line
naming it and leaves no store behind.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from storage.datasets.store import DatasetError, DatasetInfo, SampleCountError
from storage.datasets.writer import (base_attrs, check_counts, check_dtype, check_target,
                                     keep_first, normalised_pixels, pixel_statistics,
                                     write_store)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".webp")
TEST_FOLDERS = ("test", "val")  # the first present, beside train/, is the test split
DEFAULT_TEST_SHARE = 1 / 6  # of a folder without train/ and test/: CIFAR-10's share
IMAGE_FOLDER_GENERATOR_VERSION = 1
_ORDER_CODES = {"train": 1, "test": 2, "split": 3}

#: A split's images as (file path, label), in the order the store holds them.
Samples = list[tuple[str, int]]


@dataclass(frozen=True)
class ImageFolderSplits:
    """What an image folder holds: its classes and both splits' samples, in store order."""

    source: str
    classes: list[str]
    train: Samples
    test: Samples


def _class_folders(folder: str) -> list[str]:
    """The sorted names of a folder's visible sub-folders (its classes)."""
    try:
        entries = list(os.scandir(folder))
    except OSError as exc:
        raise DatasetError(f"cannot read image folder {folder!r}: "
                           f"{exc.strerror or exc}") from None
    return sorted(entry.name for entry in entries
                  if entry.is_dir() and not entry.name.startswith("."))


def _images_below(folder: str) -> list[str]:
    """Every image file below `folder` (links followed), sorted by path; DatasetError
    for a link to a folder the walk is already in (above it, or one a link on the way
    led to: `cat/more -> ../dog` with `dog/more -> ../cat`), which would list every
    image below it again and again (until the system's limit on links in a path)."""
    found = []
    inside = {folder: [os.path.realpath(folder)]}  # each folder walked: the real folders
    for directory, folders, files in os.walk(folder, followlinks=True):  # it is within
        chain = inside.pop(directory)
        for name in folders:
            target = os.path.realpath(os.path.join(directory, name))
            above = next((real for real in chain if real == target or real.startswith(
                target.rstrip(os.sep) + os.sep)), None)
            if above == chain[-1]:
                raise DatasetError(f"image folder {folder!r}: "
                                   f"{os.path.join(directory, name)} links to {target}, a "
                                   "folder above it (a loop): remove the link")
            if above is not None:
                raise DatasetError(f"image folder {folder!r}: "
                                   f"{os.path.join(directory, name)} links to {target}, a "
                                   "folder the listing is already in, through the links "
                                   "before it (a loop): remove the link")
            inside[os.path.join(directory, name)] = chain + [target]
        found += [os.path.join(directory, name) for name in files
                  if name.lower().endswith(IMAGE_EXTENSIONS)]
    return sorted(found)


def _split_folder(folder: str) -> tuple[str, str] | None:
    """(train, test) sub-folders of a folder that is split already, else None."""
    names = set(_class_folders(folder))
    test = next((name for name in TEST_FOLDERS if name in names), None)
    if "train" not in names or test is None:
        return None
    return os.path.join(folder, "train"), os.path.join(folder, test)


def _classes_of(folder: str) -> list[str]:
    """The class names of one class folder; DatasetError if it has fewer than 2."""
    classes = _class_folders(folder)
    if len(classes) < 2:
        raise DatasetError(f"image folder {folder!r} has {len(classes)} class sub-folder"
                           f"{'' if len(classes) == 1 else 's'}; at least 2 are needed (one "
                           "sub-folder of images per class)")
    return classes


def _labelled_images(folder: str) -> tuple[list[str], Samples]:
    """(class names, every image with its label, sorted by path) of one class folder;
    DatasetError if it has fewer than 2 classes or a class without images."""
    classes = _classes_of(folder)
    samples: Samples = []
    for label, name in enumerate(classes):
        images = _images_below(os.path.join(folder, name))
        if not images:
            raise DatasetError(f"image folder {folder!r}: class {name!r} holds no images "
                               f"({' '.join(IMAGE_EXTENSIONS)})")
        samples += [(path, label) for path in images]
    return classes, samples


def image_folder_classes(source: str) -> list[str]:
    """The class names of an image folder (of its train/ split if it has one), without
    reading any image: what a config's class count is checked against."""
    folder = os.path.abspath(source)
    split = _split_folder(folder)
    return _classes_of(split[0] if split else folder)


def _shuffled(samples: Samples, seed: int, what: str) -> Samples:
    """`samples` in a random order that depends only on (seed, what)."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, _ORDER_CODES[what]]))
    return [samples[i] for i in rng.permutation(len(samples))]


def list_image_folder(source: str, seed: int = 0, train_samples: int | None = None,
                      test_samples: int | None = None) -> ImageFolderSplits:
    """The images an import of `source` stores, in the order it stores them.

    Each split is in a random order drawn from `seed`, so that a cap (the first N,
    as for CIFAR-10) keeps a random subset of every class. A folder without train/
    and test/ sub-folders is split first: `test_samples` images (default: a sixth,
    rounded down) drawn with `seed` are the test split, the rest the train split.
    """
    folder = os.path.abspath(source)
    if not os.path.isdir(folder):
        raise DatasetError(f"image folder not found: {source!r}")
    split = _split_folder(folder)
    if split:
        classes, train = _labelled_images(split[0])
        test_classes, test = _labelled_images(split[1])
        if test_classes != classes:
            raise DatasetError(f"image folder {folder!r}: the classes of {split[1]!r} "
                               f"({', '.join(test_classes)}) are not those of {split[0]!r} "
                               f"({', '.join(classes)})")
    else:
        classes, every = _labelled_images(folder)
        held_out = int(len(every) * DEFAULT_TEST_SHARE) if test_samples is None \
            else test_samples
        if not 0 <= held_out < len(every):
            raise SampleCountError("test", held_out, f"{len(every)} images, and at least one "
                                   "must be left to train on", folder)
        every = _shuffled(every, seed, "split")
        test, train = every[:held_out], every[held_out:]
    train = _shuffled(train, seed, "train")
    test = _shuffled(test, seed, "test")
    return ImageFolderSplits(
        folder, classes, train[:keep_first(len(train), train_samples, "train", folder)],
        test[:keep_first(len(test), test_samples, "test", folder)])


def load_image(path: str, side: int) -> np.ndarray:
    """One image file as uint8 (3, side, side): RGB, its shorter side resized to `side`
    (bilinear), centre-cropped; DatasetError naming the file if it is not readable."""
    try:
        with Image.open(path) as opened:
            image = opened.convert("RGB")  # decodes the whole file
    except Exception as exc:  # Pillow raises many types on damaged or foreign files
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise DatasetError(f"{path}: not a readable image ({reason})") from None
    width, height = image.size
    if width <= height:
        size = (side, int(side * height / width))
    else:
        size = (int(side * width / height), side)
    resized = image.resize(size, Image.Resampling.BILINEAR)
    left, top = round((size[0] - side) / 2), round((size[1] - side) / 2)
    square = resized.crop((left, top, left + side, top + side))
    return np.asarray(square, dtype=np.uint8).transpose(2, 0, 1)


def _load_split(samples: Samples, side: int) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images (n, 3, side, side) and int64 labels of a split's samples."""
    images = np.empty((len(samples), 3, side, side), dtype=np.uint8)
    for row, (path, _) in enumerate(samples):
        images[row] = load_image(path, side)
    return images, np.array([label for _, label in samples], dtype=np.int64)


def folder_fingerprint(source: str) -> str:
    """A digest of every image file's path, size, modification and status-change time
    below `source`: a store built from the folder before a file was added, removed or
    changed differs. Why the change time too: a file replaced by one of the same size
    with its modification time set back (``touch -r``, ``rsync -a``, ``cp -p``) keeps
    those two, but no user can set the change time back."""
    digest = hashlib.sha256()
    folder = os.path.abspath(source)
    for path in _images_below(folder):
        status = os.stat(path)
        digest.update(f"{os.path.relpath(path, folder)}\0{status.st_size}\0"
                      f"{status.st_mtime_ns}\0{status.st_ctime_ns}\n"
                      .encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def image_folder_build(source: str, image_size: int, train_samples: int | None,
                       test_samples: int | None, seed: int, dtype: str,
                       fingerprint: str) -> dict[str, Any]:
    """The 'build' attribute of an image-folder store: what `ensure_dataset` compares
    to decide whether a store at a path was made from the same request."""
    return {"kind": "image_folder", "source": os.path.abspath(source),
            "image_size": image_size, "train_samples": train_samples,
            "test_samples": test_samples, "seed": seed, "dtype": dtype,
            "files": fingerprint, "generator_version": IMAGE_FOLDER_GENERATOR_VERSION}


def import_image_folder(source: str, path: str, image_size: int = 32,
                        train_samples: int | None = None, test_samples: int | None = None,
                        seed: int = 0, dtype: str = "float32",
                        overwrite: bool = False) -> DatasetInfo:
    """Import the image folder `source` (see the module) into a store at `path` of
    images (3, image_size, image_size), normalised with the kept train images' statistics.
    """
    dtype = check_dtype(dtype)
    if image_size < 1:
        raise ValueError(f"image_size must be at least 1, got {image_size}")
    check_target(os.path.abspath(path), overwrite)
    splits = list_image_folder(source, seed, train_samples, test_samples)
    fingerprint = folder_fingerprint(source)
    check_counts(len(splits.train), len(splits.test))
    train = _load_split(splits.train, image_size)
    test = _load_split(splits.test, image_size)
    mean, std = pixel_statistics(train[0])
    shape = (3, image_size, image_size)
    attrs = base_attrs("image_folder", splits.source, len(splits.classes), shape,
                       len(splits.train), len(splits.test), dtype, mean, std, 1.0 / 255.0,
                       image_folder_build(source, image_size, train_samples, test_samples,
                                          seed, dtype, fingerprint))
    attrs["class_names"] = splits.classes
    return write_store(path, overwrite, attrs, shape, dtype,
                       {"train": (len(splits.train), normalised_pixels(*train, mean, std)),
                        "test": (len(splits.test), normalised_pixels(*test, mean, std))})
