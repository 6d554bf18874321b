"""Which samples each step trains on: deterministic from the seed and step alone.

Resuming at step N must reproduce the batches an uninterrupted run would have used,
so indices are a pure function of (seed, step): a fresh permutation per epoch.
"""

from __future__ import annotations

import numpy as np


def step_indices(seed: int, step: int, batch: int, samples: int) -> np.ndarray:
    """The sample indices of one step (batches never straddle two epochs' orders)."""
    if batch > samples:
        raise ValueError(f"batch {batch} is larger than the {samples} training samples")
    per_epoch = samples // batch
    epoch, position = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(samples)
    return order[position * batch:(position + 1) * batch].astype(np.int64)
