"""Training-time augmentation: a random crop of the zero-padded image and a random
horizontal flip (He et al. 2016's CIFAR-10 recipe), as a pure function of the rows'
images, their sample indices, the run's seed and the step.

Every worker reads only some rows of a step's batch (a `data` replica its own, a
`hybrid` replica its part, every `kernel` shard all of them), a resumed run or a
recovery replays steps, and the in-process `reference` reads the whole batch: they
all see one augmented batch because each image's draw depends on (seed, step, its
sample index) alone, never on which rows are read with it or in what order. The
draws come from a counter-based hash (`crop_flip_draws`), so a worker draws only its
own rows' at the cost of a few integer operations each; the crop and flip are then
one gather over the batch (`crop_flip`), with no loop over images.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

#: The first word of each step's key, so that the augmentation's draws are a stream of
#: their own beside the dropout masks' (`tasks.network.dropout_block_seeds`).
_STREAM = 0x41554731  # "AUG1"
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class Augmentation:
    """How a run's training images are augmented (config `data.augment`,
    `data.augment_padding`) and the seed its draws come from (the run's `train.seed`).
    The test images that score accuracy are never augmented."""

    kind: Literal["none", "crop_flip"] = "none"
    padding: int = 4
    seed: int = 0

    def apply(self, images: np.ndarray, indices: np.ndarray, step: int) -> np.ndarray:
        """`images` (the rows of sample indices `indices`) as step `step` trains on them."""
        if self.kind == "none":
            return images
        return crop_flip(images, indices, self.seed, step, self.padding)


def _mix(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: every bit of the result depends on every bit of `values`
    (uint64, wrapping)."""
    z = values.copy()
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def crop_flip_draws(seed: int, step: int, indices: np.ndarray, padding: int,
                    flip: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each sample's crop offsets (rows, columns; each in [0, 2 * padding]) into its
    padded image and whether it is flipped, at `step` of a run seeded `seed`: a hash of
    (seed, step, sample index), so the same sample gets the same draw whoever asks and
    whatever else they ask with it. A flip has probability 1/2, each offset 1/(2p+1)
    (up to 2^-43 of the hash's range)."""
    key = np.random.SeedSequence([_STREAM, seed, step]).generate_state(1, np.uint64)
    samples = np.asarray(indices, dtype=np.int64).astype(np.uint64).reshape(-1)
    hashed = _mix(key + (samples + np.uint64(1)) * _GOLDEN)
    choices = np.uint64(2 * padding + 1)
    rows = (hashed % choices).astype(np.intp)
    columns = ((hashed >> np.uint64(21)) % choices).astype(np.intp)
    flips = (hashed >> np.uint64(63)).astype(bool) if flip else np.zeros(len(samples), bool)
    return rows, columns, flips


def crop_flip(images: np.ndarray, indices: np.ndarray, seed: int, step: int, padding: int,
              flip: bool = True) -> np.ndarray:
    """`images` (N, C, H, W), the rows of sample indices `indices`, each cropped to H x W
    from itself zero-padded by `padding` on every side, at the offsets
    `crop_flip_draws` gives it, then mirrored left to right where it draws a flip. A new
    array of the same dtype; `images` is not changed. One gather over the batch
    through a strided view of the padded images."""
    count, channels, height, width = images.shape
    if len(indices) != count:
        raise ValueError(f"{count} images but {len(indices)} sample indices")
    if padding < 0:
        raise ValueError(f"padding must be >= 0, got {padding}")
    rows, columns, flips = crop_flip_draws(seed, step, indices, padding, flip)
    if padding:
        padded = np.zeros((count, channels, height + 2 * padding, width + 2 * padding),
                          images.dtype)
        padded[:, :, padding:padding + height, padding:padding + width] = images
        windows = sliding_window_view(padded, (height, width), axis=(2, 3))
        out = windows[np.arange(count), :, rows, columns]  # (N, C, H, W), a copy
    else:
        out = images.copy()
    if flips.any():
        out[flips] = out[flips, :, :, ::-1]
    return out
