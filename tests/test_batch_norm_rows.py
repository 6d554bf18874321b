"""Batch norm never trains on one value per channel: the rule (`tasks.specs.lone_batch_norm`),
the calibration's and the probe's row counts, and the batch split of replicas that
normalise over their own rows (``train.batch_norm: local``). No cluster here: the
runs are in tests/test_batch_norm_runs.py, the command lines in tests/test_bad_input.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeline.config.network_config import LayerConfig, NetworkConfig
from pipeline.config.run_config import build_run_config
from pipeline.config.schema import ConfigError
from pipeline.placement.calibrate import replica_rows, replica_sizes
from pipeline.placement.split import Placement, merge_short_shares
from pipeline.placement.split_choice import _batch_split, least_replica_rows, with_rows_merged
from pipeline.probe.runs import replica_plan
from pipeline.records.summary import left_out_lines
from tasks.specs import NetworkSpec, batch_norm_name, batch_norm_rows, lone_batch_norm

IMAGES = (3, 32, 32)


def preset(name: str, width: float = 0.125) -> NetworkSpec:
    return NetworkConfig(preset=name, width=width).spec(IMAGES)


def squeezed(block: str | None = None) -> NetworkSpec:
    """A tiny batch-norm network whose last batch norm sees 1x1 features: a conv, an
    adaptive average pool to 1x1, then a conv (or a residual block) with batch norm."""
    last = (LayerConfig(block=block, planes=2) if block
            else LayerConfig(conv=4, batch_norm=True))
    return NetworkConfig(layers=[LayerConfig(conv=4, batch_norm=True),
                                 LayerConfig(pool="adaptive_avg"), last]).spec(IMAGES)


# The rule ------------------------------------------------------------------------------


def test_resnet18_on_32_pixels_needs_two_rows_at_layer4():
    network = preset("resnet18")
    layer = lone_batch_norm(network, 1)
    assert layer is not None and network.conv[layer].bn_name == "layer4.0.bn1"
    assert network.conv[layer].conv_height == network.conv[layer].conv_width == 1
    assert batch_norm_name(network, layer) == (
        f"batch norm layer4.0.bn1 (after conv layer {layer}, on 1x1 features)")
    assert lone_batch_norm(network, 2) is None and batch_norm_rows(network) == 2


def test_a_bottleneck_names_its_first_batch_norm_on_1x1():
    """ResNet-50's layer4 and a user's bottleneck block after a 1x1 pool: the first
    batch norm whose input is 1x1 (a bottleneck's 1x1 conv1 at the block's input)."""
    network = preset("resnet50")
    assert network.conv[lone_batch_norm(network, 1)].bn_name == "layer4.0.bn2"
    custom = squeezed("bottleneck")
    layer = lone_batch_norm(custom, 1)
    assert layer == 1 and custom.conv[layer].bn_name.endswith("bn1")
    assert batch_norm_rows(custom) == 2


def test_networks_whose_batch_norms_see_more_than_1x1_take_one_row():
    """ResNet-20 ends at 8x8; the paper's family has no batch norm at all, whatever the
    size of its features; no rows run no batch norm."""
    assert lone_batch_norm(preset("resnet20", 0.25), 1) is None
    assert batch_norm_rows(preset("resnet20", 0.25)) == 1
    paper = NetworkConfig().spec((3, 4, 4))  # 32 then 64 kernels, pooled to 1x1
    assert paper.conv[-1].out_height == 1 and lone_batch_norm(paper, 1) is None
    assert lone_batch_norm(squeezed(), 0) is None


# Calibration and the probe -------------------------------------------------------------


def test_calibration_times_a_replica_on_at_least_two_rows_where_batch_norm_reaches_1x1():
    """A quarter of a 13-sample batch's even share over 3 workers is one row: timed
    on one, ResNet-18's layer4 batch norm failed on every worker."""
    network = preset("resnet18")
    assert replica_rows(network, 13, 3) == 5
    assert replica_sizes(network, 13, 3) == [2, 5]
    assert replica_sizes(network, 7, 2) == [2, 4]
    assert replica_sizes(network, 2, 3) == [2]  # a share of one is timed on two
    resnet20 = preset("resnet20", 0.25)
    assert replica_sizes(resnet20, 13, 3) == [1, 5]  # no batch norm on 1x1: as before


def test_the_probes_replica_plan_keeps_local_batch_norm_off_one_row():
    network = squeezed()
    assert replica_plan(network, 4, 3, "local") is None  # [2, 1, 1]: a replica of one
    assert replica_plan(network, 6, 3, "local").shares == [2, 2, 2]
    assert replica_plan(network, 4, 3, "sync").shares == [2, 1, 1]  # the whole batch's
    assert replica_plan(preset("resnet20", 0.25), 4, 3, "local").shares == [2, 1, 1]


# The batch split of local batch norm ---------------------------------------------------


@pytest.mark.parametrize("row,least,merged", [
    ([2, 1, 1], 2, [2, 2, 0]),  # two lone rows make a replica
    ([3, 1], 2, [4, 0]),
    ([5, 1, 1, 1], 2, [5, 0, 3, 0]),  # the last one left goes to the fewest
    ([1, 1, 1, 1], 2, [2, 0, 2, 0]),
    ([0, 1, 4, 0], 2, [0, 0, 5, 0]),
    ([2, 1, 1], 1, [2, 1, 1]),  # one row is enough: nothing moves
    ([6, 4, 2], 2, [6, 4, 2]),
])
def test_short_shares_are_merged(row, least, merged):
    assert merge_short_shares(row, least) == merged
    assert sum(merged) == sum(row)


def test_a_batch_of_fewer_rows_than_a_replica_needs_is_an_error():
    with pytest.raises(ValueError, match="1 sample"):
        merge_short_shares([1, 0], 2)


def _config(**overrides: str):
    data = {"strategy": "data", "network": {"layers": [
        {"conv": 4, "batch_norm": True}, {"pool": "adaptive_avg"},
        {"conv": 4, "batch_norm": True}]}}
    return build_run_config(data, [f"{k}={v}" for k, v in overrides.items()])


def test_only_local_batch_norm_on_1x1_needs_two_rows_a_replica():
    network = squeezed()
    assert least_replica_rows(_config(**{"train.batch_norm": "local"}), network) == 2
    assert least_replica_rows(_config(), network) == 1  # sync: over the whole batch
    assert least_replica_rows(_config(**{"train.batch_norm": "local"}),
                              preset("resnet20", 0.25)) == 1


def test_an_even_split_merges_lone_rows_and_records_why():
    workers = [SimpleNamespace(name=f"cpu-{d}") for d in range(3)]
    config = _config(**{"train.batch_norm": "local", "train.batch": "4",
                        "placement": "even"})
    placement = _batch_split(None, config, squeezed(), workers, "run", 2)
    assert placement.counts == [[2, 2, 0]]
    assert placement.left_out([w.name for w in workers]) == ["cpu-2"]
    [line] = left_out_lines("even", ["cpu-2"], placement.choice, {}, "sample")
    assert line == ("worker cpu-2 left out: its 1 sample(s) of the even split went to "
                    "another replica (train.batch_norm: local, and a batch norm's input is "
                    "1x1: a replica needs at least 2)")
    untouched = Placement("even", [[2, 2]])
    assert with_rows_merged(untouched, 2, ["a", "b"]) is untouched


def test_a_recorded_split_with_a_lone_row_is_refused_in_one_line():
    workers = [SimpleNamespace(name=f"cpu-{d}") for d in range(3)]
    config = _config(**{"train.batch_norm": "local", "train.batch": "4",
                        "placement": "recorded", "split_from": "[[2, 1, 1]]"})
    with pytest.raises(ConfigError, match=r"^split_from: \[2, 1, 1\] gives a replica 1 "
                       r"sample\(s\), but with train.batch_norm: local") as refused:
        _batch_split(None, config, squeezed(), workers, "run", 2)
    assert "\n" not in str(refused.value)
    config = _config(**{"train.batch_norm": "local", "train.batch": "4",
                        "placement": "recorded", "split_from": "[[2, 0, 2]]"})
    assert _batch_split(None, config, squeezed(), workers, "run", 2).counts == [[2, 0, 2]]
