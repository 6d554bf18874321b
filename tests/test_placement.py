"""Kernel splits as pure functions (no cluster)."""

from __future__ import annotations

import json
import random

import pytest

from pipeline.config.run_config import build_run_config
from pipeline.config.schema import ConfigError
from pipeline.placement import split_choice
from pipeline.placement.calibrate import alike_groups, pool_points, shard_costs
from pipeline.placement.ties import (check_tied, choose_tied, group_costs, singleton_groups,
                                     tied_mismatch)
from pipeline.cluster.workers import ClusterWorker
from pipeline.placement.split import (Placement, PlacementError, ShardCost, calibration_kernels,
                                      choose_calibrated, fit_shard_cost, layer_seconds,
                                      predict_split, rough_seconds, split_even, split_minmax,
                                      split_proportional)
from pipeline.cluster.worker_setup import register_setup
from pipeline.cluster.workers import find_workers
from pipeline.records.summary import left_out_lines
from pipeline.run import run_training
from tests.helpers import tiny_config
from tasks.specs import ConvLayerSpec, NetworkSpec
from tasks.zoo import build_preset


def test_proportional_split_sums_and_keeps_whole_quanta():
    counts = split_proportional(64, [1.0, 0.5], 4)
    assert sum(counts) == 64 and all(k % 4 == 0 for k in counts)
    assert counts == [44, 20]  # 16 units: 10.67 and 5.33, largest remainder
    assert split_proportional(10, [1.0, 1.0, 1.0], 4) == [4, 4, 2]  # the short unit last
    assert split_even(32, 3, 4) == [12, 12, 8]
    assert split_proportional(16, [1.0, 0.01], 4) == [12, 4]  # every worker one unit
    with pytest.raises(PlacementError):
        split_proportional(8, [1.0, 1.0, 1.0], 4)  # two units for three workers


def calibrated(kernels: int, per_kernel: list[float], quantum: int) -> list[int]:
    """The calibrated choice for one layer whose shards cost `per_kernel` s a kernel."""
    names = [f"w{d}" for d in range(len(per_kernel))]
    return choose_calibrated([kernels], [[ShardCost(0.0, t) for t in per_kernel]], [quantum],
                             names).counts[0]


def test_calibration_noise_keeps_the_even_split():
    """Equal workers measured 13.6 % apart (seen here between two alike CPU workers):
    proportional moves a unit for a slowest shard only 1 % faster, within the
    tolerance, so the even split stands."""
    assert split_proportional(64, [1.0, 1 / 1.136], 4) == [36, 28]
    assert calibrated(64, [1.0, 1.136], 4) == [32, 32]
    assert calibrated(64, [1.136, 1.0], 4) == [32, 32]


def test_transient_differences_within_the_tolerance_keep_it_too():
    """Seen here: alike workers 31 % apart for a whole calibration (80 vs 105 ms)."""
    assert split_proportional(64, [1 / 80, 1 / 105], 4) == [36, 28]
    assert calibrated(64, [80 / 32, 105 / 32], 4) == [32, 32]


def test_truly_unequal_workers_get_a_proportional_split():
    assert calibrated(64, [1.0, 2.0], 4) == [44, 20]  # half speed: a third, rounded
    assert calibrated(1500, [1.0, 1.0, 3.0], 50) == split_proportional(
        1500, [1.0, 1.0, 1 / 3], 50)


def test_a_twenty_times_slower_worker_gets_nothing():
    """Its first unit alone (4 x 20) would outlast the fast worker doing all 64."""
    assert split_minmax(64, [ShardCost(0.0, 1.0), ShardCost(0.0, 20.0)], 4) == [64, 0]
    assert calibrated(64, [1.0, 20.0], 4) == [64, 0]
    assert calibrated(64, [20.0, 1.0], 4) == [0, 64]


def test_a_fixed_shard_cost_keeps_small_shares_off_a_fast_device():
    """A GPU-like worker (10 s per shard whatever its size, then 0.01 s a kernel)
    and a CPU-like one (1 s a kernel): the CPU takes only what it finishes within
    the GPU's time; proportional (by per-kernel speed) would give it one unit and the
    same slowest shard, and a 4-unit CPU share would be slower than the GPU alone."""
    gpu, cpu = ShardCost(10.0, 0.01), ShardCost(0.0, 1.0)
    counts = split_minmax(64, [gpu, cpu], 4)
    assert counts == [56, 8]
    assert layer_seconds([gpu, cpu], counts) < gpu.seconds(64)
    assert split_minmax(64, [ShardCost(10.0, 0.01), ShardCost(0.0, 3.0)], 4) == [64, 0]


def test_fit_shard_cost_separates_the_fixed_part():
    cost = fit_shard_cost([(4, 1.0), (16, 2.5)])
    assert cost.fixed == pytest.approx(0.5) and cost.per_kernel == pytest.approx(0.125)
    assert fit_shard_cost([(8, 2.0)]) == ShardCost(0.0, 0.25)  # one size: no fixed part
    assert fit_shard_cost([(4, 2.0), (16, 1.0)]).fixed == 0.0  # noise: slope < 0
    assert cost.seconds(0) == 0.0


def test_calibrated_choice_is_never_predicted_slower_than_the_best_single_device():
    rng = random.Random(7)
    for _ in range(300):
        workers = rng.randint(1, 5)
        layers = rng.randint(1, 3)
        kernels = [rng.choice([8, 10, 32, 64, 100]) for _ in range(layers)]
        quanta = [rng.choice([1, 4, 8]) for _ in range(layers)]
        costs = [[ShardCost(rng.uniform(0, 2) * rng.random() ** 3,
                            rng.uniform(0.01, 1) * rng.choice([1, 20]))
                  for _ in range(workers)] for _ in range(layers)]
        names = [f"w{d}" for d in range(workers)]
        choice = choose_calibrated(kernels, costs, quanta, names)
        best_single = min(t for name, t in choice.predicted.items() if name.startswith("single:"))
        assert choice.predicted[choice.chosen] <= best_single + 1e-12
        assert predict_split(costs, choice.counts) == choice.predicted[choice.chosen]
        for row, k, q in zip(choice.counts, kernels, quanta):
            assert sum(row) == k and min(row) >= 0
            holders = [c for c in row if c]
            assert all(c % q == 0 for c in holders[:-1])  # only the last shard short
        record = choice.record(names)
        assert record["predicted_best_single"] == best_single
        assert record["best_single_device"] in names


def test_more_workers_than_units_leaves_the_last_ones_out():
    assert split_even(8, 3, 4) == [4, 4, 0]
    assert split_even(10, 4, 4) == [4, 4, 2, 0]
    placement = Placement("even", [[4, 4, 0], [8, 0, 0]])
    assert placement.left_out(["a", "b", "c"]) == ["c"]
    assert placement.left_out(["a", "b", "c"], keep=2) == []


def test_calibration_measures_the_even_share_within_a_time_budget():
    small = ConvLayerSpec(32, 64, in_height=16, in_width=16)  # the small net's layer 2
    assert calibration_kernels(small, 128, 2, 4) == 32  # the whole share, a fraction of a s
    paper = ConvLayerSpec(500, 1500, in_height=16, in_width=16)  # the paper net's layer 2
    k = calibration_kernels(paper, 32, 2, 47)
    assert 47 <= k < 750 and rough_seconds(paper, 32, k) <= 0.5
    assert rough_seconds(paper, 32, 2 * k) > 0.5  # halved no further than needed
    assert calibration_kernels(paper, 32, 2, 750) == 750  # never below a quantum


def test_a_worker_left_out_is_said_in_one_line_with_its_speed_and_why():
    """Which worker, how much slower than the fastest it is predicted alone (its fixed
    costs included), and the best split giving it work against the one chosen
    without it; without predictions alone, the calibration's seconds per unit."""
    choice = {"workers": ["w0", "w1", "w2"], "chosen": "minmax", "predicted_step_time": 0.05,
              "alternatives": {
                  "minmax": {"split": [[8, 8, 0]], "predicted_step_time": 0.05},
                  "even": {"split": [[6, 5, 5]], "predicted_step_time": 0.31},
                  "proportional": {"split": [[7, 7, 2]], "predicted_step_time": 0.09},
                  "single:w0": {"split": [[16, 0, 0]], "predicted_step_time": 0.08},
                  "single:w1": {"split": [[0, 16, 0]], "predicted_step_time": 0.1},
                  "single:w2": {"split": [[0, 0, 16]], "predicted_step_time": 1.2}}}
    calibration = {"w0": [0.001, 0.002], "w1": [0.0012, 0.0024], "w2": [0.0031, 0.0062]}
    [line] = left_out_lines("calibrated", ["w2"], choice, calibration)
    assert line == ("worker w2 left out: measured 15.0x slower than w0 (1.2 against 0.08 "
                    "s/step predicted for it alone by the calibrated placement); giving it "
                    "kernels would lengthen the step ('minmax' without it is predicted "
                    "0.05 s/step, the fastest split with it, 'proportional', 0.09 s/step)")
    bare = {key: value for key, value in choice.items() if key != "alternatives"}
    assert left_out_lines("calibrated", ["w2"], bare, calibration) == [
        "worker w2 left out: measured 3.1x slower than w0 (0.0093 against 0.003 s per "
        "kernel, summed over conv layers)"]
    assert left_out_lines("recorded", ["w1"], {}, {}, "sample") == [
        "worker w1 left out: recorded placement gave it no work"]
    assert left_out_lines("calibrated", [], choice, calibration) == []


def test_a_worker_left_out_for_want_of_samples_is_said_so():
    """`data` at train.batch=1 on two alike workers: the one sample goes to one of
    them; the other is not slower (it said "measured 1.0x slower")."""
    alone = {"split": [[0, 1]], "predicted_step_time": 0.004}
    choice = {"workers": ["cpu-0", "cpu-1"], "chosen": "even", "predicted_step_time": 0.004,
              "split": [[1, 0]], "alternatives": {
                  "even": {"split": [[1, 0]], "predicted_step_time": 0.004},
                  "single:cpu-0": {"split": [[1, 0]], "predicted_step_time": 0.004},
                  "single:cpu-1": alone}}
    assert left_out_lines("calibrated", ["cpu-1"], choice, {}, "sample") == [
        "worker cpu-1 left out: the batch has 1 sample(s) for 2 workers, and a worker "
        "gets whole samples"]
    # 3 samples on a fast worker of 3: its speed is the reason, not the batch
    three = {**choice, "workers": ["a", "b", "c"], "split": [[3, 0, 0]]}
    assert "the batch has" not in left_out_lines("calibrated", ["b"], three, {}, "sample")[0]


def test_a_worker_left_out_for_want_of_kernel_units_is_said_so():
    """`kernel` with conv layers of 8 kernels (two units of 4) on four alike workers:
    two of them get nothing because no layer has a unit for them, not because they
    are slower (it said "measured 1.0x slower")."""
    two = [[4, 4, 0, 0], [4, 4, 0, 0]]
    choice = {"workers": ["cpu-0", "cpu-1", "cpu-2", "cpu-3"], "chosen": "even",
              "predicted_step_time": 0.0047, "split": two, "alternatives": {
                  "even": {"split": two, "predicted_step_time": 0.0047},
                  **{f"single:cpu-{i}": {"split": [[8 * (j == i) for j in range(4)]] * 2,
                                         "predicted_step_time": 0.0094} for i in range(4)}}}
    [line] = left_out_lines("calibrated", ["cpu-2"], choice, {})
    assert line.startswith("worker cpu-2 left out: no conv layer has kernels for more than 2 "
                           "of the 4 workers in whole units (workspace.channel_quantum); ")
    assert "slower than" not in line


def test_even_placement_says_a_worker_had_no_kernel_unit(tmp_path, three_worker_cluster,
                                                        tiny_dataset_factory):
    """`placement: even` over three real workers, conv layers of 8 kernels in units of
    4: the third worker holds nothing because no layer has a unit for it; the summary
    said only "even placement gave it no work". A batch of 2 over the three under
    `data` is the same for samples."""
    client, cluster = three_worker_cluster
    config = tiny_config(tmp_path, tiny_dataset_factory("float32"), **{
        "placement": "even", "network.conv.0.kernels": 8, "network.conv.1.kernels": 8,
        "train.steps": 1, "train.eval_samples": 0})
    config.cluster.workers = cluster.workers
    register_setup(client, config.cluster)
    result = run_training(config, client=client, offered=find_workers(client, config.cluster))
    assert json.loads(result.record.attrs["left_out"]) == ["cpu-2"]
    assert result.summary["left_out"] == [
        "worker cpu-2 left out: no conv layer has kernels for more than 2 of the 3 workers "
        "in whole units (workspace.channel_quantum)"]
    names = ["cpu-0", "cpu-1", "cpu-2"]
    assert left_out_lines("even", ["cpu-2"], {}, {}, "sample", names, [[1, 1, 0]]) == [
        "worker cpu-2 left out: the batch has 2 sample(s) for 3 workers, and a worker "
        "gets whole samples"]


def test_alike_workers_are_the_same_host_device_threads_and_speed():
    """Only which of them the scheduler ran tells alike workers apart: they share one
    cost. A worker elsewhere, on another device, with more threads or slowed is apart."""
    workers = [ClusterWorker(f"tcp://{host}:{port}", name, "CPU", 1, 1.0, "cpu")
               for name, host, port in [("a", "127.0.0.1", 1), ("b", "127.0.0.1", 2),
                                        ("c", "10.0.0.2", 1), ("d", "127.0.0.1", 3),
                                        ("e", "127.0.0.1", 4), ("f", "127.0.0.1", 5),
                                        ("g", "127.0.0.1", 6)]]
    kinds = {"a": ("cpu", 1, 1.0), "b": ("cpu", 1, 1.0), "c": ("cpu", 1, 1.0),
             "d": ("cuda:0", 1, 1.0), "e": ("cpu", 2, 1.0), "f": ("cpu", 1, 0.5),
             "g": ("cpu", 1, 1.0)}
    assert alike_groups(workers, kinds) == [["a", "b", "g"], ["c"], ["d"], ["e"], ["f"]]


def test_pooled_points_give_alike_workers_one_cost_and_keep_the_measured_ones():
    """Four alike workers on two cores, one timed fast by the scheduler's luck: apart,
    calibration gives it most of the kernels; pooled, the even split stands."""
    points = {"w0": [[[4, 0.010], [16, 0.025]]], "w1": [[[4, 0.020], [16, 0.060]]],
              "w2": [[[4, 0.021], [16, 0.062]]], "w3": [[[4, 0.019], [16, 0.058]]]}
    names = list(points)
    apart = choose_calibrated([64], shard_costs(points, names, 1), [4], names)
    assert apart.counts[0][0] > 16  # the lucky one's share
    pooled = pool_points(points, [names])
    costs = shard_costs(pooled, names, 1)
    assert len({(c.fixed, c.per_kernel) for c in costs[0]}) == 1
    assert choose_calibrated([64], costs, [4], names).counts == [[16, 16, 16, 16]]
    assert points["w0"] == [[[4, 0.010], [16, 0.025]]]  # the record keeps what was timed
    assert sorted(map(tuple, pooled["w2"][0])) == sorted(
        tuple(p) for name in names for p in points[name][0])
    # a group of one, and workers apart, keep their own points
    assert pool_points(points, [["w0"], ["w1", "w2"]])["w0"] == points["w0"]
    assert pool_points(points, [["w0"], ["w1", "w2"]])["w3"] == points["w3"]


# Tied splits: layers a residual sum adds channel by channel share one row --------------

def resnet20(width: float = 0.25) -> NetworkSpec:
    return build_preset("resnet20", (3, 32, 32), 10, "float32", width, 0.0)


def test_a_tied_group_of_three_layers_gets_one_row_from_its_summed_cost():
    """Layers 0, 1, 2 tied, worker w1 2x, 1x and 3x as slow on them: alone they would
    take 44/20, 32/32 and 48/16; summed (3 vs 6 per kernel) w1 is half as fast, so the
    group takes 44/20 everywhere. Layer 3, untied and equal, stays even."""
    costs = [[ShardCost(0.0, 1.0), ShardCost(0.0, c)] for c in (2.0, 1.0, 3.0, 1.0)]
    names = ["w0", "w1"]
    apart = choose_calibrated([64] * 4, costs, [4] * 4, names)
    assert len({tuple(row) for row in apart.counts[:3]}) > 1  # untied, they differ
    choice = choose_tied([64] * 4, costs, [4] * 4, names, [[0, 1, 2], [3]])
    assert choice.counts == [[44, 20], [44, 20], [44, 20], [32, 32]]
    # predicted on the layers' own costs, so the record's times are the layers'
    assert choice.predicted[choice.chosen] == predict_split(costs, choice.counts) == 44 + 44 + 60 + 32
    assert group_costs(costs, [[0, 1, 2], [3]]) == [[ShardCost(0.0, 3.0), ShardCost(0.0, 6.0)],
                                                    [ShardCost(0.0, 1.0), ShardCost(0.0, 1.0)]]
    # every layer its own group: the untied choice
    assert choose_tied([64] * 4, costs, [4] * 4, names, singleton_groups(4)) == apart


def test_check_tied_names_the_two_layers_that_differ():
    network = resnet20()
    even = [split_even(layer.kernels, 3, 4) for layer in network.conv]
    check_tied(network, even)  # an even split is tied: same kernels, same quantum
    untied = [list(row) for row in even]
    untied[2] = [0, 4, 0]  # layer1.0.conv2, tied to the stem conv1
    with pytest.raises(PlacementError, match=r"^conv layers conv1 and layer1.0.conv2 .*"
                                             r"\[4, 0, 0\] and \[0, 4, 0\]$"):
        check_tied(network, untied)


class FakeRunner:
    """A `TaskRunner` stand-in: the workers calibration times (on two hosts, so that
    no two are pooled as alike)."""

    def __init__(self, names: list[str]) -> None:
        self.workers = [ClusterWorker(f"tcp://10.0.0.{d + 1}:1", name, "CPU", 1, 1.0, "cpu")
                        for d, name in enumerate(names)]


def test_the_calibrated_split_of_resnet20_is_tied(monkeypatch):
    """resnet20 from fake timings whose speed ratio between the two workers differs
    layer by layer (as measured timings do): each layer's own choice would differ
    inside a residual group; the calibrated placement gives every group one row."""
    network = resnet20()
    names = ["w0", "w1"]
    rng = random.Random(3)
    rates = {"w0": [1e-3] * len(network.conv),
             "w1": [1e-3 * rng.choice([0.5, 1.0, 1.7, 3.0]) for _ in network.conv]}

    def fake_calibrate(runner, net, batch, sizes, round_name=""):
        points = {n: [[[k, 1e-4 + k * rates[n][layer]] for k in sizes[(n, layer)]]
                      for layer in range(len(net.conv))] for n in names}
        return points, {n: ("cpu", 1, 1.0) for n in names}

    monkeypatch.setattr(split_choice, "calibrate", fake_calibrate)
    quanta = [4] * len(network.conv)
    placement = split_choice.calibrated_kernel_split(FakeRunner(names), network, 16, quanta)
    groups = [g for g in network.tied_groups() if len(g) > 1]
    assert groups  # resnet20 has residual groups
    check_tied(network, placement.counts)
    for group in groups:
        assert len({tuple(placement.counts[layer]) for layer in group}) == 1
    assert any(len(set(row)) > 1 for row in placement.counts)  # not merely even
    costs = [[ShardCost(1e-4, rates[n][layer]) for n in names] for layer in range(len(quanta))]
    apart = choose_calibrated([s.kernels for s in network.conv], costs, quanta, names)
    assert tied_mismatch(network.tied_groups(), apart.counts) is not None  # ties mattered


def test_even_placement_is_tied_and_a_recorded_split_that_is_not_is_refused(tmp_path):
    network = resnet20()
    workers = FakeRunner(["w0", "w1", "w2"]).workers

    def config(**overrides):
        return build_run_config({"workspace": {"channel_quantum": 4},
                                 "network": {"preset": "resnet20", "width": 0.25}},
                                [f"{k}={v}" for k, v in overrides.items()])

    even = split_choice._kernel_split(None, config(placement="even"), network, workers, "r")
    check_tied(network, even.counts)
    recorded = [list(row) for row in even.counts]
    again = split_choice._kernel_split(None, config(placement="recorded",
                                                    split_from=json.dumps(recorded)),
                                       network, workers, "r")
    assert again.counts == recorded
    recorded[4] = [0, 4, 0]  # layer1.1.conv2 off its group's row (conv1's)
    with pytest.raises(ConfigError, match=r"^split_from: conv layers conv1 and layer1.1.conv2"):
        split_choice._kernel_split(None, config(placement="recorded",
                                                split_from=json.dumps(recorded)),
                                   network, workers, "r")


@pytest.mark.parametrize("counts, message", [
    ([[8, 8], [16, 17]], "split_from: [16, 17] splits conv layer 1's 32 kernels: they add up "
                         "to 33"),
    ([[8, 8, 0], [16, 16]], "split_from: [8, 8, 0] splits conv layer 0's 16 kernels: 3 "
                            "count(s), but this run has 2 worker(s)"),
    ([[20, -4], [16, 16]], "split_from: [20, -4] splits conv layer 0's 16 kernels: a "
                           "negative count"),
    ([[16, 0]], "split_from: 1 row(s), but this run splits 2: conv layer 0's 16 kernels, "
                "conv layer 1's 32 kernels"),
])
def test_a_recorded_split_that_does_not_fit_names_the_row_and_why(counts, message):
    rows = ["conv layer 0's 16 kernels", "conv layer 1's 32 kernels"]
    with pytest.raises(ConfigError) as refused:
        split_choice.check_recorded(counts, [16, 32], 2, rows)
    assert str(refused.value) == message
    assert split_choice.check_recorded([[6, 10], [0, 32]], [16, 32], 2, rows) == [[6, 10], [0, 32]]


def test_an_even_split_gives_the_short_unit_to_the_worker_with_fewer():
    """9 and 10 kernels in units of 4 on two workers split 8+1 and 8+2: the first
    worker took the odd whole unit and the second the short one. Now 4+5 and 4+6;
    whole units alone split as before (12: 8+4)."""
    assert split_even(9, 2, 4) == [4, 5] and split_even(10, 2, 4) == [4, 6]
    assert split_even(12, 2, 4) == [8, 4] and split_even(10, 3, 4) == [4, 4, 2]
    assert split_proportional(64, [1.0, 0.5], 4) == [44, 20]  # no tie: as before
