"""The training-time augmentation (tasks/augment.py) as a pure function: each image's
crop is a slice of it zero-padded, its flip torch's, and its draw a function of (seed,
step, sample index) alone, so any worker reading any rows sees the same batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tasks.augment import Augmentation, crop_flip, crop_flip_draws


def _images(count: int = 32, dtype=np.float32, side: int = 8) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((count, 3, side, side)).astype(dtype)


def test_each_image_is_a_slice_of_it_zero_padded_flipped_as_torch_flips():
    images, indices, padding = _images(), np.arange(100, 132), 3
    out = crop_flip(images, indices, 7, 5, padding)
    rows, columns, flips = crop_flip_draws(7, 5, indices, padding)
    for k in range(len(images)):  # written out image by image, in torch
        padded = F.pad(torch.from_numpy(images[k]), (padding,) * 4)
        crop = padded[:, rows[k]:rows[k] + 8, columns[k]:columns[k] + 8]
        expected = torch.flip(crop, dims=[2]) if flips[k] else crop
        assert torch.equal(torch.from_numpy(out[k]), expected), k
    assert 0 < flips.sum() < len(flips)  # both kinds drawn
    assert len(set(zip(rows.tolist(), columns.tolist()))) > 10  # offsets spread
    assert rows.min() >= 0 and max(rows.max(), columns.max()) <= 2 * padding


def test_any_subset_in_any_order_sees_the_same_images():
    """What a replica, a hybrid part or a shard reads of one batch: the same rows."""
    images, indices = _images(), np.arange(500, 532)
    whole = crop_flip(images, indices, 1, 9, 4)
    for rows in (np.arange(5, 12), np.array([31, 0, 17, 3]), np.arange(32)[::-1]):
        np.testing.assert_array_equal(crop_flip(images[rows], indices[rows], 1, 9, 4),
                                      whole[rows])
    assert np.array_equal(Augmentation("crop_flip", 4, 1).apply(images, indices, 9), whole)


def test_other_steps_and_seeds_draw_other_images():
    images, indices = _images(), np.arange(32)
    first = crop_flip(images, indices, 0, 0, 4)
    assert not np.array_equal(crop_flip(images, indices, 0, 1, 4), first)
    assert not np.array_equal(crop_flip(images, indices, 1, 0, 4), first)
    np.testing.assert_array_equal(crop_flip(images, indices, 0, 0, 4), first)  # and again


def test_padding_zero_without_flips_is_the_identity_and_none_changes_nothing():
    images = _images()
    np.testing.assert_array_equal(crop_flip(images, np.arange(32), 3, 4, 0, flip=False),
                                  images)
    flipped = crop_flip(images, np.arange(32), 3, 4, 0)  # flips only
    _rows, _columns, flips = crop_flip_draws(3, 4, np.arange(32), 0)
    np.testing.assert_array_equal(flipped[flips], images[flips][..., ::-1])
    np.testing.assert_array_equal(flipped[~flips], images[~flips])
    assert Augmentation().apply(images, np.arange(32), 4) is images
    empty = crop_flip(images[:0], np.arange(0), 3, 4, 4)  # a replica with no rows
    assert empty.shape == (0, 3, 8, 8) and empty.dtype == images.dtype


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_dtype_is_kept_and_the_input_left_alone(dtype):
    images = _images(dtype=dtype)
    before = images.copy()
    out = crop_flip(images, np.arange(32), 0, 0, 4)
    assert out.dtype == dtype and out.shape == images.shape and out.flags.c_contiguous
    np.testing.assert_array_equal(images, before)


def test_a_sample_repeated_in_a_batch_gets_one_draw_and_bad_calls_are_refused():
    images = np.repeat(_images(1), 4, axis=0)
    out = crop_flip(images, np.array([3, 3, 3, 3]), 0, 2, 4)
    assert all(np.array_equal(out[0], out[k]) for k in range(4))
    with pytest.raises(ValueError, match="4 images but 3 sample indices"):
        crop_flip(images, np.arange(3), 0, 0, 4)
    with pytest.raises(ValueError, match="padding must be >= 0"):
        crop_flip(images, np.arange(4), 0, 0, -1)
