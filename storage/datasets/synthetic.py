"""The synthetic dataset maker: a learnable, CIFAR-shaped stand-in for real data.

Tests, benchmarks and the cost-model probes need a dataset that exists without a
download, is the same bytes for the same arguments, and is hard enough that a small
CNN has to learn something. Each class is a fixed random smooth (low-frequency,
periodic) colour pattern. Every image shows its class pattern shifted by a few
pixels, maybe mirrored, with its own contrast and brightness, on top of a random
smooth "clutter" field of another kind and per-pixel noise. No single pixel tells the
class, but a small CNN learns the patterns in about a hundred SGD steps (see the
module tests and the build report).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from storage.datasets.store import SPLITS, DatasetInfo
from storage.datasets.writer import (BlockSource, base_attrs, check_counts, check_dtype,
                                     check_target, safe_std, shard_rows, write_store)

SYNTHETIC_GENERATOR_VERSION = 1
SYNTHETIC_MAX_FREQUENCY = 3  # cycles per image, for patterns and clutter
SYNTHETIC_MAX_SHIFT = 4  # pixels, each axis
SYNTHETIC_CONTRAST = (0.6, 1.4)
SYNTHETIC_BRIGHTNESS_STD = 0.5
SYNTHETIC_CLUTTER = 0.8  # clutter amplitude relative to the (unit-std) pattern
SYNTHETIC_NOISE = 1.5  # per-pixel noise std relative to the pattern
_SPLIT_CODES = {"train": 1, "test": 2}


class _SyntheticGenerator:
    """Deterministic synthetic images; blocks depend only on (seed, split, block)."""

    def __init__(self, seed: int, classes: int, image_shape: tuple[int, int, int]) -> None:
        self.seed = seed
        self.classes = classes
        self.image_shape = image_shape
        _, height, width = image_shape
        fy = np.fft.fftfreq(height) * height
        fx = np.fft.rfftfreq(width) * width
        self.low_pass = (np.abs(fy)[:, None] <= SYNTHETIC_MAX_FREQUENCY) & (
            fx[None, :] <= SYNTHETIC_MAX_FREQUENCY)
        # phase ramps for integer shifts: multiplying by them rolls the image exactly
        self.fy, self.fx = fy, fx
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0]))
        patterns = self._smooth_fields(rng, classes)
        self.pattern_spectra = np.fft.rfft2(patterns)

    def _smooth_fields(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """`count` random low-frequency fields (count, C, H, W), each with unit std."""
        channels, height, width = self.image_shape
        # draw only the low-frequency coefficients: the rest of the spectrum is zero
        coefficients = rng.standard_normal((2, count, channels, int(self.low_pass.sum())))
        spectrum = np.zeros((count, channels, height, width // 2 + 1), dtype=complex)
        spectrum[..., self.low_pass] = coefficients[0] + 1j * coefficients[1]
        fields = np.fft.irfft2(spectrum, s=(height, width))
        fields -= fields.mean(axis=(1, 2, 3), keepdims=True)
        fields /= fields.std(axis=(1, 2, 3), keepdims=True) + 1e-12
        return fields

    def labels(self, split: str, samples: int) -> np.ndarray:
        """Balanced labels (counts differ by at most one), in a seeded random order."""
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, _SPLIT_CODES[split], 0]))
        return rng.permutation(np.arange(samples, dtype=np.int64) % self.classes)

    def block(self, split: str, block: int, labels: np.ndarray) -> np.ndarray:
        """Raw (unnormalised) float64 images for one block, given its labels."""
        rng = np.random.default_rng(
            np.random.SeedSequence([self.seed, _SPLIT_CODES[split], 1, block]))
        count = len(labels)
        channels, height, width = self.image_shape
        shift_y, shift_x = rng.integers(-SYNTHETIC_MAX_SHIFT, SYNTHETIC_MAX_SHIFT + 1, (2, count))
        ramp = np.exp(-2j * np.pi * (shift_y[:, None, None] * self.fy[None, :, None] / height
                                     + shift_x[:, None, None] * self.fx[None, None, :] / width))
        shown = np.fft.irfft2(self.pattern_spectra[labels] * ramp[:, None], s=(height, width))
        mirror = rng.random(count) < 0.5
        shown[mirror] = shown[mirror][..., ::-1]
        contrast = rng.uniform(*SYNTHETIC_CONTRAST, count)[:, None, None, None]
        brightness = rng.normal(0.0, SYNTHETIC_BRIGHTNESS_STD, count)[:, None, None, None]
        clutter = SYNTHETIC_CLUTTER * self._smooth_fields(rng, count)
        noise = SYNTHETIC_NOISE * rng.standard_normal(shown.shape)
        return contrast * shown + brightness + clutter + noise


def synthetic_build(train_samples: int, test_samples: int, image_shape: tuple[int, ...],
                    classes: int, seed: int, dtype: str) -> dict[str, Any]:
    """The 'build' attribute of a synthetic store: what `ensure_dataset` compares to
    decide whether a store at a path was made from the same request."""
    return {"kind": "synthetic", "train_samples": train_samples, "test_samples": test_samples,
            "image_shape": list(image_shape), "classes": classes, "seed": seed, "dtype": dtype,
            "generator_version": SYNTHETIC_GENERATOR_VERSION}


#: The classes of a synthetic store a run builds (runs never pass `classes`): named so
#: that a run's checks can know them before the store exists (pipeline/engine/dataset.py).
SYNTHETIC_CLASSES = 10


def create_synthetic_dataset(path: str, train_samples: int = 5000, test_samples: int = 1000,
                             image_shape: tuple[int, int, int] = (3, 32, 32),
                             classes: int = SYNTHETIC_CLASSES,
                             seed: int = 0, dtype: str = "float32",
                             overwrite: bool = False) -> DatasetInfo:
    """Build a learnable, CIFAR-shaped synthetic dataset at `path`.

    The same arguments give the same bytes: every block of images is drawn from its
    own seed (seed, split, block), so nothing depends on how the build is chunked.
    """
    dtype = check_dtype(dtype)
    check_counts(train_samples, test_samples)
    if classes < 2:
        raise ValueError(f"classes must be at least 2, got {classes}")
    image_shape = tuple(int(v) for v in image_shape)  # type: ignore[assignment]
    if len(image_shape) != 3 or min(image_shape) < 1:
        raise ValueError(f"image_shape must be (C, H, W) of positive sizes, got {image_shape}")
    check_target(os.path.abspath(path), overwrite)  # fail before generating anything
    generator = _SyntheticGenerator(seed, classes, image_shape)
    counts = {"train": train_samples, "test": test_samples}
    labels = {split: generator.labels(split, n) for split, n in counts.items()}

    def raw_blocks(split: str) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        shard = shard_rows(counts[split])
        for block, start in enumerate(range(0, counts[split], shard)):
            block_labels = labels[split][start:start + shard]
            yield start, generator.block(split, block, block_labels), block_labels

    # First pass: per-channel statistics of the raw train images (regenerated in the
    # second pass instead of being held: 50 000 images would be 1.2 GB of float64).
    total = np.zeros(image_shape[0])
    total_sq = np.zeros(image_shape[0])
    for _, images, _ in raw_blocks("train"):
        total += images.sum(axis=(0, 2, 3))
        total_sq += np.square(images).sum(axis=(0, 2, 3))
    values = train_samples * image_shape[1] * image_shape[2]
    mean = total / values
    std = safe_std(total_sq / values - mean**2)

    def normalised(split: str) -> BlockSource:
        def blocks() -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
            for start, images, block_labels in raw_blocks(split):
                yield start, (images - mean[:, None, None]) / std[:, None, None], block_labels
        return blocks

    build = synthetic_build(train_samples, test_samples, image_shape, classes, seed, dtype)
    attrs = base_attrs("synthetic", "synthetic", classes, image_shape, train_samples,
                       test_samples, dtype, mean, std, 1.0, build)
    return write_store(path, overwrite, attrs, image_shape, dtype,
                       {split: (counts[split], normalised(split)) for split in SPLITS})
