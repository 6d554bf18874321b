"""Kernel splits as pure functions (no cluster)."""

from __future__ import annotations

import pytest

from pipeline.placement import (PlacementError, calibration_kernels, rough_seconds,
                                shard_ranges, split_calibrated, split_even, split_proportional)
from tasks.specs import ConvLayerSpec, ShardRange


def test_proportional_split_sums_and_keeps_whole_quanta():
    counts = split_proportional(64, [1.0, 0.5], 4)
    assert sum(counts) == 64 and all(k % 4 == 0 for k in counts)
    assert counts == [44, 20]  # 16 units: 10.67 and 5.33, largest remainder
    assert split_proportional(10, [1.0, 1.0, 1.0], 4) == [4, 4, 2]  # the short unit last
    assert split_even(32, 3, 4) == [12, 12, 8]
    assert split_proportional(16, [1.0, 0.01], 4) == [12, 4]  # every worker one unit
    with pytest.raises(PlacementError):
        split_proportional(8, [1.0, 1.0, 1.0], 4)  # two units for three workers


def test_calibration_noise_keeps_the_even_split():
    """Equal workers measured 13.6 % apart (seen here between two alike CPU workers):
    proportional moves a unit for a slowest shard only 1 % faster, within the
    tolerance, so the even split stands."""
    assert split_proportional(64, [1.0, 1 / 1.136], 4) == [36, 28]
    assert split_calibrated(64, [1.0, 1.136], 4) == [32, 32]
    assert split_calibrated(64, [1.136, 1.0], 4) == [32, 32]


def test_transient_differences_within_the_tolerance_keep_it_too():
    """Seen here: alike workers 31 % apart for a whole calibration (80 vs 105 ms)."""
    assert split_proportional(64, [1 / 80, 1 / 105], 4) == [36, 28]
    assert split_calibrated(64, [80 / 32, 105 / 32], 4) == [32, 32]


def test_truly_unequal_workers_get_a_proportional_split():
    assert split_calibrated(64, [1.0, 2.0], 4) == [44, 20]  # half speed: a third, rounded
    assert split_calibrated(1500, [1.0, 1.0, 3.0], 50) == split_proportional(
        1500, [1.0, 1.0, 1 / 3], 50)


def test_calibration_measures_the_even_share_within_a_time_budget():
    small = ConvLayerSpec(32, 64, in_height=16, in_width=16)  # the small net's layer 2
    assert calibration_kernels(small, 128, 2, 4) == 32  # the whole share, a fraction of a s
    paper = ConvLayerSpec(500, 1500, in_height=16, in_width=16)  # the paper net's layer 2
    k = calibration_kernels(paper, 32, 2, 47)
    assert 47 <= k < 750 and rough_seconds(paper, 32, k) <= 0.5
    assert rough_seconds(paper, 32, 2 * k) > 0.5  # halved no further than needed
    assert calibration_kernels(paper, 32, 2, 750) == 750  # never below a quantum


def test_shard_ranges_are_contiguous_in_worker_order():
    assert shard_ranges(1, [4, 0, 6]) == [ShardRange(1, 0, 4), ShardRange(1, 4, 4),
                                          ShardRange(1, 4, 10)]
