"""Tied kernel splits: layers whose outputs a residual sum adds channel by channel share
one split. Pure functions, no cluster.

Why: a residual block adds its shortcut's output to its last conv's, channel by
channel, on the worker that owns the channels; both layers (and, for an identity
block, the block's input) must give every worker the same kernels, or a worker would
add channels it does not hold. `NetworkSpec.tied_groups` says which layers go
together. A split is chosen per group, not per layer: the group's layers are timed
apart as every layer is, their costs are summed (`group_costs`: at k kernels a
worker runs every layer of the group at k kernels), one row of counts is chosen for
the group from that sum, and the row is given to each of its layers
(`spread_rows`). `check_tied` refuses a split whose tied layers differ, naming them.
"""

from __future__ import annotations

from typing import Sequence

from pipeline.placement.split import (CALIBRATION_TOLERANCE, PlacementError, ShardCost,
                                      SplitChoice, calibrated_candidates, pick_fastest,
                                      predict_split)
from tasks.specs import NetworkSpec

Groups = list[list[int]]


def singleton_groups(layers: int) -> Groups:
    """Every layer on its own: the paper family's (no residual sums)."""
    return [[layer] for layer in range(layers)]


def group_costs(costs: Sequence[Sequence[ShardCost]], groups: Groups) -> list[list[ShardCost]]:
    """``costs[layer][worker]`` summed over each group: ``[group][worker]``. Tied
    layers hold the same number of kernels on a worker, so the group's shard at k
    kernels costs the sum of its layers' fixed parts plus k times their summed
    per-kernel costs."""
    return [[ShardCost(sum(costs[layer][d].fixed for layer in group),
                       sum(costs[layer][d].per_kernel for layer in group))
             for d in range(len(costs[group[0]]))]
            for group in groups]


def group_values(values: Sequence, groups: Groups) -> list:
    """One value per group (its first layer's): kernels or quanta, which tied layers
    share."""
    return [values[group[0]] for group in groups]


def spread_rows(group_rows: Sequence[Sequence[int]], groups: Groups) -> list[list[int]]:
    """Each group's row given to every layer of it: ``[layer][worker]``."""
    layers = sum(len(group) for group in groups)
    rows: list[list[int]] = [[] for _ in range(layers)]
    for group, row in zip(groups, group_rows):
        for layer in group:
            rows[layer] = list(row)
    return rows


def tied_mismatch(groups: Groups, counts: Sequence[Sequence[int]]) -> tuple[int, int] | None:
    """The first two layers of a group whose rows differ (None: all tied)."""
    for group in groups:
        for layer in group[1:]:
            if list(counts[layer]) != list(counts[group[0]]):
                return group[0], layer
    return None


def check_tied(network: NetworkSpec, counts: Sequence[Sequence[int]]) -> None:
    """Raise `PlacementError` in one line naming two layers a residual sum ties whose
    kernel counts per worker (``counts[layer][worker]``) differ."""
    pair = tied_mismatch(network.tied_groups(), counts)
    if pair is not None:
        first, other = pair
        names = network.conv_keys()
        raise PlacementError(
            f"conv layers {names[first]} and {names[other]} are added channel by channel "
            f"(a residual sum) and must share one kernel split, got {list(counts[first])} "
            f"and {list(counts[other])}")


def choose_tied(kernels: list[int], costs: list[list[ShardCost]], quanta: list[int],
                names: list[str], groups: Groups,
                tolerance: float = CALIBRATION_TOLERANCE) -> SplitChoice:
    """`choose_calibrated` with one row per tied group: the candidates (even,
    proportional, min-max, each worker alone) are made from each group's summed cost
    (`group_costs`), given to every layer of the group, and predicted on the layers'
    own costs (`predict_split`), so the recorded predictions are the layers'. With
    every layer its own group this is `choose_calibrated`."""
    grouped = calibrated_candidates(group_values(kernels, groups), group_costs(costs, groups),
                                    group_values(quanta, groups), names)
    candidates = {name: spread_rows(rows, groups) for name, rows in grouped.items()}
    predicted = {name: predict_split(costs, counts) for name, counts in candidates.items()}
    return pick_fastest(candidates, predicted, tolerance)


def tie_counts(network: NetworkSpec, costs: list[list[ShardCost]], quanta: list[int],
               names: list[str], tolerance: float = CALIBRATION_TOLERANCE) -> SplitChoice:
    """The calibrated choice for `network` from each layer's shard costs per worker
    (``costs[layer][worker]``), its tied layers sharing one row (`choose_tied`)."""
    return choose_tied([layer.kernels for layer in network.conv], costs, quanta, names,
                       network.tied_groups(), tolerance)
