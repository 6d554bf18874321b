"""A run's training batch as plain PyTorch augments it: image by image, `F.pad`, a
slice and `torch.flip` at the draws tasks/augment.py gives each sample, which the
replays of tests/helpers.py and tests/replica_replay.py train on (what the run's
vectorised gather must equal)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.config.run_config import RunConfig
from tasks.augment import crop_flip_draws


def augmented_batch(config: RunConfig, images: np.ndarray, indices: np.ndarray,
                    step: int) -> torch.Tensor:
    """`images` (of sample indices `indices`) as step `step` of `config`'s run trains on
    them; `data.augment: none` leaves them as read."""
    x = torch.from_numpy(images)
    if config.data.augment == "none":
        return x
    padding = config.data.augment_padding
    rows, columns, flips = crop_flip_draws(config.train.seed, step, indices, padding)
    height, width = x.shape[2:]
    out = []
    for k, image in enumerate(x):
        crop = F.pad(image, (padding,) * 4)[:, rows[k]:rows[k] + height,
                                            columns[k]:columns[k] + width]
        out.append(torch.flip(crop, dims=[2]) if flips[k] else crop)
    return torch.stack(out)
