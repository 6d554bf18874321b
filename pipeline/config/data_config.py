"""The `data` section of a run config: which images a run trains and is scored on, and
how its training images are augmented (`augment`); read by `pipeline.config.run_config`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipeline.config.schema import FieldError, check_range, described
from tasks.augment import Augmentation


@dataclass
class DataConfig:
    source: str = described("synthetic", "`synthetic` (a deterministic, learnable set of "
                            "`image_size` images), a folder of images with one sub-folder "
                            "per class (PNG, JPEG, BMP, PPM or WebP; `train/` and `test/` "
                            "or `val/` sub-folders, if present, are the splits), or a path "
                            "to `cifar-10-python.tar.gz` / its extracted folder")
    path: str | None = described(
        None, "the dataset's Zarr store, built on first use (null: `data/<source name>"
        "[-<digest of its path>][-<train>-<test>][-s<seed>][-<side>px]-<dtype>.zarr`: the "
        "digest for all but synthetic, the counts and seed always for synthetic, else where "
        "set, the side where not 32)")
    image_size: int | None = described(
        None, "the images' side in pixels, 8 to 512 (the zoo's largest, ImageNet's 224, "
        "and room for higher-resolution recipes): synthetic images are drawn at it, "
        "and an image folder's are resized (shorter side, bilinear) and centre-cropped to "
        "it (null: 32; CIFAR-10's is 32, and no other value is taken for it)")
    train_samples: int | None = described(None, "training images (null: 5000 synthetic, or "
                                          "all of CIFAR-10 or the image folder)")
    test_samples: int | None = described(
        None, "test images (null: 1000 synthetic, or all of CIFAR-10 or of an image "
        "folder's test/ or val/; a folder without them holds out this many images, drawn "
        "with `seed`, else a sixth of them)")
    seed: int = described(0, "the seed of the synthetic set, and of the order (and, "
                          "without test/, the split) of an image folder's images, 0 to "
                          "2^64 - 1 (as `train.seed`; it names the store's file)")
    augment: Literal["none", "crop_flip"] = described(
        "none", "training-time augmentation of each step's training images (the test "
        "images that score accuracy never): `none`, or `crop_flip`, He et al.'s CIFAR-10 "
        "recipe: a random `image_size` crop of the image zero-padded by `augment_padding` "
        "on every side, then a left-right flip with probability 1/2, drawn from "
        "(`train.seed`, step, sample index), so every strategy, worker, resume and "
        "recovery trains on the same images (tasks/augment.py)")
    augment_padding: int = described(
        4, "`augment: crop_flip`: pixels of zeros (in the store's normalised values: the "
        "mean colour) around each image, 0 (flips only) to `image_size` - 1")

    SYNTHETIC_DEFAULTS = (5000, 1000)
    DEFAULT_IMAGE_SIZE = 32
    MIN_IMAGE_SIZE = 8
    #: The largest side: past ImageNet's 224 (the zoo's largest networks) with room
    #: for higher-resolution recipes; 100000 passed and then asked for terabytes.
    MAX_IMAGE_SIZE = 512

    def __post_init__(self) -> None:
        if not self.source:
            raise FieldError("source", "expected 'synthetic', a folder of images or a path to "
                             "CIFAR-10, got ''")
        check_range(self, "train_samples", low=1)
        check_range(self, "test_samples", low=1)
        check_range(self, "image_size", low=self.MIN_IMAGE_SIZE, high=self.MAX_IMAGE_SIZE)
        check_range(self, "seed", low=0, high=2**64 - 1)
        check_range(self, "augment_padding", low=0)
        side = self.image_side()
        if self.augment == "crop_flip" and self.augment_padding >= side:
            raise FieldError("augment_padding", f"{self.augment_padding} pixels of padding let "
                             f"a crop of a {side}x{side} image miss the image altogether: "
                             f"use 0 to {side - 1} (He et al.: 4 for 32)")

    def sample_counts(self) -> tuple[int | None, int | None]:
        """(train, test) samples to build the store with."""
        if self.source == "synthetic":
            train, test = self.SYNTHETIC_DEFAULTS
            return self.train_samples or train, self.test_samples or test
        return self.train_samples, self.test_samples

    def image_side(self) -> int:
        """The images' height and width (CIFAR-10's is the default)."""
        return self.image_size or self.DEFAULT_IMAGE_SIZE

    def augmentation(self, seed: int) -> Augmentation:
        """How the training images are augmented, drawn from the run's seed `seed`."""
        return Augmentation(self.augment, self.augment_padding, seed)
