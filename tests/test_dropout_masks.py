"""Seeded dropout (tasks/network.py): the mask of a step is the whole batch's, drawn
again by anyone who knows the run's seed, the step and the dense layer."""

from __future__ import annotations

import torch

from tasks.network import SeededDropout, dropout_mask, set_dropout


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
