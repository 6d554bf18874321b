"""Seeded dropout (tasks/network.py): the mask of a step is drawn again by anyone who
knows the run's seed, the step and the dense layer, in blocks of rows, so that a
replica or a hybrid part draws only its own rows and gets those rows of the whole
batch's mask bit for bit."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from tasks.network import (MASK_BLOCK_ROWS, SeededDropout, batch_rows, dropout_block_seeds,
                           dropout_mask, set_dropout)

B = MASK_BLOCK_ROWS


def test_a_module_given_the_whole_batch_draws_the_whole_batch_mask():
    module = SeededDropout(0.5, layer=1)
    set_dropout(module, seed=3, step=7)  # no rows: the batch it is given
    x = torch.ones(6, 10, dtype=torch.float64)
    expected = dropout_mask(3, 7, 1, (6, 10), 0.5, torch.float64)
    assert torch.equal(module(x), expected)
    assert 0 < int((expected == 0).sum()) < 60


def test_rows_of_a_batch_take_the_whole_batch_mask_row_for_row():
    module = SeededDropout(0.5, layer=0)
    whole = dropout_mask(3, 7, 0, (6, 10), 0.5, torch.float64)
    set_dropout(module, 3, 7, slice(2, 5), 6)
    assert torch.equal(module(torch.ones(3, 10, dtype=torch.float64)), whole[2:5])
    set_dropout(module, 3, 7, [0, 4, 5], 6)  # a part of hybrid's scheme (c)
    assert torch.equal(module(torch.ones(3, 10, dtype=torch.float64)), whole[[0, 4, 5]])


@pytest.mark.parametrize("batch", [4 * B, 3 * B + 5, B - 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_drawn_alone_equal_the_whole_masks_rows(batch, dtype):
    """Slices inside a block, across block edges, to the batch's ragged end, and row
    lists in any order: each equals the whole mask's rows bit for bit."""
    whole = dropout_mask(11, 4, 2, (batch, 33), 0.4, dtype)
    rng = np.random.default_rng(0)
    asked = [slice(0, batch), slice(1, 3), slice(B - 2, B + 3), slice(batch - 4, batch),
             slice(2, None, 3), slice(None, None, -1), slice(0, 0),
             [batch - 1, 0, batch // 2], np.array([-1, -batch]),
             rng.permutation(batch)[:batch // 2], rng.integers(0, batch, 9)]
    for rows in asked:
        alone = dropout_mask(11, 4, 2, (batch, 33), 0.4, dtype, rows)
        expected = whole[np.arange(batch)[rows].tolist()]  # as numpy indexes
        assert alone.dtype == dtype and torch.equal(alone, expected), rows


def test_rows_drawn_alone_equal_the_whole_masks_rows_in_more_dimensions():
    whole = dropout_mask(1, 2, 0, (3 * B, 4, 5), 0.5, torch.float32)
    assert torch.equal(dropout_mask(1, 2, 0, (3 * B, 4, 5), 0.5, torch.float32,
                                    slice(B - 1, 2 * B + 1)), whole[B - 1:2 * B + 1])


def test_masks_differ_between_steps_layers_seeds_and_blocks():
    def mask(seed: int = 0, step: int = 0, layer: int = 0) -> torch.Tensor:
        return dropout_mask(seed, step, layer, (2 * B, 64), 0.5, torch.float32)

    base = mask()
    for other in (mask(step=1), mask(layer=1), mask(seed=1)):
        assert not torch.equal(base, other)
    assert not torch.equal(base[:B], base[B:])  # each block its own generator
    assert torch.equal(base, mask())  # and the same arguments draw the same mask


def test_a_blocks_seed_does_not_depend_on_the_other_blocks_asked():
    """Numpy's SeedSequence state, whose word b seeds block b, is the same however many
    words are generated: what lets a replica seed its blocks alone."""
    every = dropout_block_seeds(3, 1, 0, np.arange(40))
    assert dropout_block_seeds(3, 1, 0, np.array([37, 5])).tolist() == [every[37], every[5]]
    assert len(set(every.tolist())) == 40 and int(every.max()) < 2 ** 63


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_the_drop_rate_is_p_and_kept_units_are_scaled(p):
    mask = dropout_mask(5, 9, 1, (64 * B, 1000), p, torch.float64)
    dropped = float((mask == 0).double().mean())
    assert abs(dropped - p) < 0.005  # over 512,000 units: about 8 standard deviations
    assert set(torch.unique(mask).tolist()) == {0.0, 1.0 / (1.0 - p)}
    per_block = (mask == 0).double().reshape(64, B * 1000).mean(dim=1)
    assert float(per_block.min()) > p - 0.05 and float(per_block.max()) < p + 0.05


def test_a_replica_draws_its_own_rows_not_the_whole_batch():
    """A replica of 8 rows of a batch of 8192 draws about 1/1000 of the whole mask:
    far quicker (the bound leaves a factor 20 for a busy machine)."""
    width, batch = 512, 8192
    module = SeededDropout(0.5, layer=0)

    def seconds(rows: slice) -> float:
        set_dropout(module, 0, 1, rows, batch)
        x = torch.ones(len(range(batch)[rows]), width)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            module(x)
            times.append(time.perf_counter() - start)
        return min(times)

    assert seconds(slice(B, 2 * B)) < seconds(slice(0, batch)) / 20


def test_rows_outside_the_batch_are_refused():
    with pytest.raises(IndexError):
        batch_rows([0, 8], 8)
    with pytest.raises(IndexError):
        dropout_mask(0, 0, 0, (8, 4), 0.5, torch.float32, [-9])
