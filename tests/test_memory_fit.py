"""The model's peak memory per device, and splits kept within each device's memory.

Pure functions (pipeline/costmodel/memory.py, pipeline/placement/memory_fit.py) apart from the
last tests, which train on two real workers of unequal memory limits and check the
split against the limits and the weights against plain PyTorch.
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace

import pytest

from pipeline import train as train_cli
from pipeline.config.cluster_config import ClusterConfig, WorkerConfig
from pipeline.config.run_config import load_run_config
from pipeline.costmodel import marques_cifar
from pipeline.costmodel.memory import (DEFAULT_CONSTANTS, MB, MIB, Footprint, Live, fmt_bytes,
                                       retained)
from pipeline.records.memory import machine_memory_constants, memory_baseline
from pipeline.placement.memory_fit import MemoryRefused, fits, move_to_fit, planned, split_peaks
from pipeline.placement.split import counts_from_shares, split_even
from pipeline.prediction import predict_memory
from pipeline.run import run_training
from pipeline.config.schema import FieldError
from pipeline.strategies import STRATEGIES, strategy_named
from storage import checkpoints
from tasks.memory import CLIENT_IMPORTS, WORKER_IMPORTS
from tasks.zoo import build_preset
from tests.helpers import max_relative_error, replay_in_pytorch, shared_workers, tiny_config

PAPER = marques_cifar()
#: What a worker that runs autograd holds whatever its network: its baseline and runtime.
FIXED = (DEFAULT_CONSTANTS.worker_baseline + DEFAULT_CONSTANTS.worker_runtime
         + DEFAULT_CONSTANTS.autograd_runtime)


def peak_memory(strategy: str, *args, **kwargs) -> Footprint:
    """The named strategy's memory count (`Strategy.peak_memory`)."""
    return strategy_named(strategy).peak_memory(*args, **kwargs)


def even(workers: int) -> list[list[int]]:
    return [split_even(layer.out_channels, workers, 4) for layer in PAPER.conv]


def test_live_tracks_the_peak_and_what_it_held():
    live = Live()
    live.alloc("a", "weights", 10)
    live.alloc("b", "activations", 5)
    live.free("b")
    live.transient("c", "workspace", 3)
    assert (live.total, live.peak) == (10, 15)
    assert live.at_peak == [("weights", 10), ("activations", 5)]


def test_every_parameter_is_held_once_over_the_kernel_devices():
    """Weights and momentum over the devices add up to the network's, the dense head on
    the master only; a shard's kernel gradients live from its backward to its SGD step
    right after, so at the peak a device holds one conv layer's of them, not all."""
    for workers in (1, 2, 3, 5):
        footprint = peak_memory("kernel", PAPER, 32, even(workers))
        held = sum(parts["weights"] for parts in footprint.parts)
        assert held == pytest.approx(PAPER.params() * 4)
        for parts in footprint.parts:
            assert parts["momentum"] == parts["weights"]
            assert 0 < parts["gradients"] < parts["weights"]  # both layers held, one's grads


def test_more_kernel_devices_hold_less_each_and_single_is_the_whole():
    single = peak_memory("single", PAPER, 32).per_device[0]
    peaks = [max(peak_memory("kernel", PAPER, 32, even(p)).per_device) for p in (1, 2, 3, 4)]
    assert peaks[0] == pytest.approx(single)
    assert peaks == sorted(peaks, reverse=True) and peaks[1] < peaks[0]


def test_a_tensor_above_the_mmap_threshold_loses_its_surplus_but_never_shrinks():
    """glibc hands a mapped tensor back when freed: its retention's surplus falls away
    above the threshold, a byte per byte, so a larger tensor never counts less."""
    threshold = 32 * MIB
    assert retained(10 * MIB, 1.5, threshold) == pytest.approx(15 * MIB)
    assert retained(threshold, 1.5, threshold) == pytest.approx(48 * MIB)
    assert retained(40 * MIB, 1.5, threshold) == pytest.approx(48 * MIB)  # 8 MiB of 16 gone
    assert retained(100 * MIB, 1.5, threshold) == pytest.approx(100 * MIB)
    sizes = [m * MIB / 4 for m in range(1, 400)]
    counted = [retained(n, 1.65, threshold) for n in sizes]
    assert counted == sorted(counted)


def test_a_kernel_device_never_holds_more_for_a_smaller_share():
    """Placement moves units off a device that would overflow on this promise, across
    the mmap threshold too (the paper network's layer 2 at batch 32 crosses it)."""
    for master in (True, False):
        peaks = []
        for units in range(1, 31):  # 50-kernel quanta of layer 2, layer 1 whole
            counts = [[PAPER.conv[0].out_channels, 0], [50 * units, 1500 - 50 * units]]
            peaks.append(peak_memory("kernel", PAPER, 32, counts, master=0 if master else 1)
                         .per_device[0])
        assert peaks == sorted(peaks), master


def test_replicas_hold_the_whole_network_and_less_with_fewer_rows():
    one = peak_memory("data", PAPER, 32, [[32]]).per_device[0]
    data = peak_memory("data", PAPER, 32, [[16, 16]])
    two = data.per_device
    assert two[0] == two[1] <= one
    assert two[0] - FIXED > 4 * PAPER.params() * 4  # weights, momentum, grads, flat
    hybrid = peak_memory("hybrid", PAPER, 32, [[16, 16]])
    # the dense layers are split (but hybrid keeps its trunk's .grad through the
    # reduction, where data frees it once flattened: its peak is not the smaller)
    assert hybrid.parts[0]["weights"] < data.parts[0]["weights"]
    assert hybrid.parts[0]["gradients"] >= PAPER.conv_params() * 4


def test_activations_grow_with_the_batch_and_the_element_size():
    small, large = (peak_memory("reference", PAPER, b).per_device[0] for b in (16, 64))
    assert large > small
    # without the allocator's retention, whose surplus falls away above the mmap
    # threshold (more of a float64 step's tensors are above it): the tensors alone
    tensors = replace(DEFAULT_CONSTANTS, retention=1.0)
    f32, f64 = (peak_memory("single", PAPER, 32, s=s, constants=tensors).per_device[0] - FIXED
                for s in (4, 8))
    assert 1.8 * f32 < f64 < 2 * f32  # the pool's int64 indices stay 8 bytes


def test_a_thousand_equal_devices_are_counted_fast():
    import time
    counts = [split_even(k, 1024, 1) for k in (4096, 4096)]
    from pipeline.costmodel import conv_net
    net = conv_net([4096, 4096])
    start = time.perf_counter()
    footprint = peak_memory("kernel", net, 256, counts)
    assert time.perf_counter() - start < 1.0
    assert len(footprint.per_device) == 1024


def test_which_strategies_have_a_memory_model_and_the_others_are_refused_by_name():
    """Each strategy says whether the count knows it; one it does not is refused in one
    line naming it, and left out of the checks (`predict_memory` gives None)."""
    counted = {name for name, strategy in STRATEGIES.items() if strategy.memory_model}
    assert counted == {"reference", "single", "kernel", "data", "hybrid"}
    with pytest.raises(ValueError, match="^no memory model for strategy 'auto'$"):
        peak_memory("auto", PAPER, 32)
    from pipeline.prediction import predict_memory
    assert predict_memory(load_run_config("configs/paper.yaml", ["strategy=auto"])) is None


def test_counts_from_shares_keep_the_short_unit_last():
    assert counts_from_shares(10, 4, [2, 1]) == [8, 2]
    assert counts_from_shares(10, 4, [1, 2]) == [4, 6]
    assert counts_from_shares(10, 4, [0, 3]) == [0, 10]


def test_even_split_within_capacity_is_kept():
    peaks = split_peaks(strategy_named("kernel"), PAPER, 32)
    counts = even(2)
    fit = move_to_fit(counts, [4, 4], [float("inf")] * 2, peaks)
    assert fit.counts == counts and fit.moved == 0
    assert fits(counts, [float("inf")] * 2, peaks)


def test_kernels_move_off_a_device_that_would_overflow():
    """Device 0 (the master) has room for about a quarter of the kernels: units move
    to device 1 until device 0 fits, and no further."""
    peaks = split_peaks(strategy_named("kernel"), PAPER, 32)
    quarter = [[k // 4, k - k // 4] for k in (500, 1500)]
    capacity = [peaks(quarter)[0] + 1 * MB, float("inf")]
    assert not fits(even(2), capacity, peaks)
    fit = move_to_fit(even(2), [4, 4], capacity, peaks)
    assert fits(fit.counts, capacity, peaks)
    assert [sum(row) for row in fit.counts] == [500, 1500]
    assert sum(row[0] for row in fit.counts) < sum(row[1] for row in fit.counts)
    assert all(row[0] % 4 == 0 for row in fit.counts)
    # no unit moved that did not have to: one unit back would overflow again
    assert fit.peaks[0] > capacity[0] - 40 * MB


def test_rows_move_off_a_replica_that_would_overflow():
    """At batch 256 a replica's activations outweigh its reduction: rows move to the
    device with room, one at a time, until the small one fits; a replica with no
    rows leaves the run and holds nothing."""
    peaks = split_peaks(strategy_named("data"), PAPER, 256, master=None)
    capacity = [peaks([[64, 192]])[0], float("inf")]
    fit = move_to_fit([[128, 128]], [1], capacity, peaks)
    assert fit.counts == [[64, 192]] and fit.moved == 64
    assert peaks([[0, 256]])[0] == 0


def test_a_config_that_fits_nowhere_is_refused_in_one_line():
    peaks = split_peaks(strategy_named("kernel"), PAPER, 32)
    with pytest.raises(MemoryRefused) as refused:
        move_to_fit(even(2), [4, 4], [500 * MB, 500 * MB], peaks, ["cpu-0", "cpu-1"])
    line = str(refused.value)
    assert "\n" not in line
    assert "worker cpu-0 needs" in line and "has 500 MB" in line


def test_the_margin_keeps_a_share_of_each_peak_free():
    """A capacity that holds the even split's peak but not the peak and its margin:
    with the margin, units move until the device has the margin free; where no move
    can give it that, the line says what the margin added."""
    peaks = split_peaks(strategy_named("kernel"), PAPER, 32)
    capacity = [peaks(even(2))[0] + 1 * MB, float("inf")]
    assert fits(even(2), capacity, peaks) and not fits(even(2), capacity, peaks, 0.15)
    assert move_to_fit(even(2), [4, 4], capacity, peaks).moved == 0
    fit = move_to_fit(even(2), [4, 4], capacity, peaks, margin=0.15)
    assert fit.moved > 0 and planned(fit.peaks[0], 0.15) <= capacity[0]
    assert sum(row[0] for row in fit.counts) < sum(row[0] for row in even(2))
    both = [peaks(even(2))[0] * 1.1] * 2  # fits at 10 %, not at 15 %, on either device
    move_to_fit(even(2), [4, 4], both, peaks, margin=0.1)
    with pytest.raises(MemoryRefused) as refused:
        move_to_fit(even(2), [4, 4], both, peaks, ["cpu-0", "cpu-1"], margin=0.15)
    assert "cluster.memory_margin's 15%" in str(refused.value)
    assert refused.value.needed > both[0] == refused.value.available


def test_the_margin_is_validated_at_the_edge():
    assert ClusterConfig().memory_margin == 0.15
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(FieldError, match="memory_margin"):
            ClusterConfig(memory_margin=bad)
    with pytest.raises(FieldError, match=r"cluster\.memory_margin"):
        load_run_config("configs/small.yaml", ["cluster.memory_margin=-1"])


def test_memory_limit_is_validated_at_the_edge():
    assert WorkerConfig(memory_limit="2GB").memory_bytes() == 2e9
    assert WorkerConfig(memory_limit="1.5GiB").memory_bytes() == 1.5 * 2 ** 30
    assert WorkerConfig().memory_bytes() is None
    for bad in ("lots", 0, -1, "inf"):
        with pytest.raises(FieldError, match="memory_limit"):
            WorkerConfig(memory_limit=bad)
    with pytest.raises(FieldError, match=r"cluster\.workers\.1\.memory_limit"):
        load_run_config("configs/small.yaml",
                        ["cluster.workers=[{name: a}, {name: b, memory_limit: 2XB}]"])
    assert fmt_bytes(float("inf")) == "unlimited"


# Two real workers of unequal memory limits ------------------------------------------------


def _limits(tmp_path, dataset, names):
    """cpu-0's limit: its predicted peak holding one unit of each layer (on this machine's
    bare processes, as a run predicts it); cpu-1: ample."""
    config = tiny_config(tmp_path, dataset)
    from pipeline.prediction import network_for
    from pipeline.probe.tables import costmodel_network
    spec = network_for(config)
    peaks = split_peaks(strategy_named("kernel"), costmodel_network(spec), config.train.batch,
                        constants=machine_memory_constants())
    small = [[4, layer.kernels - 4] for layer in spec.conv]
    margin = config.cluster.memory_margin
    return peaks, {names[0]: {"memory_limit": int(planned(peaks(small)[0], margin)) + 1},
                   names[1]: {"memory_limit": "20GB"}}


def test_split_follows_memory_and_stays_exact(tmp_path, shared_cluster, tiny_dataset_factory):
    """Alike workers (speed alone: the even split, 4/6 and 8/4 of 10 and 12 kernels) where
    cpu-0's limit holds one unit of each layer: the run moves the rest to cpu-1,
    within both limits, and trains exactly what plain PyTorch trains."""
    dataset = tiny_dataset_factory("float32")
    peaks, changes = _limits(tmp_path, dataset, ["cpu-0", "cpu-1"])
    client, cluster = shared_workers(shared_cluster, "PROBE", changes)
    config = tiny_config(tmp_path, dataset, placement="even", **{"train.steps": 2})
    config.cluster = cluster
    result = run_training(config, client=client)
    split = result.summary["kernel_split"]
    assert split == [[4, 6], [4, 8]], split
    memory = json.loads(result.record.attrs["placement_choice"])["memory"]
    assert memory["split_before"] == [[4, 6], [8, 4]] and memory["units_moved"] == 1
    assert memory["margin"] == 0.15
    assert planned(memory["predicted_peak"][0], 0.15) <= memory["capacity"][0]
    trained = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
    expected, _ = replay_in_pytorch(config, dataset)
    assert max_relative_error(trained, expected) < 1e-4


def test_a_run_that_fits_nowhere_is_refused_before_it_trains(tmp_path, shared_cluster,
                                                             tiny_dataset_factory):
    dataset = tiny_dataset_factory("float32")
    client, cluster = shared_workers(shared_cluster, "PROBE",
                                     {"cpu-0": {"memory_limit": "100MB"},
                                      "cpu-1": {"memory_limit": "100MB"}})
    config = tiny_config(tmp_path, dataset, placement="even")
    config.cluster = cluster
    with pytest.raises(MemoryRefused, match=r"worker cpu-\d needs .* has 100 MB"):
        run_training(config, client=client)
    # a recorded split is repeated exactly or refused, never moved
    peaks, changes = _limits(tmp_path, dataset, ["cpu-0", "cpu-1"])
    client, cluster = shared_workers(shared_cluster, "PROBE", changes)
    config = tiny_config(tmp_path / "recorded", dataset, placement="recorded",
                         split_from=[[8, 2], [8, 4]])
    config.cluster = cluster
    with pytest.raises(MemoryRefused, match=r"worker cpu-0 needs .* recorded split"):
        run_training(config, client=client)


def test_embedded_config_that_fits_nowhere_is_refused_before_its_cluster_starts(tmp_path,
                                                                                capsys):
    """`--check` (and a run) stop at the config: one line, exit 2, no cluster."""
    status = train_cli.main(["configs/paper.yaml", "--check", f"output={tmp_path / 'run'}",
                             "cluster.workers=[{name: a, memory_limit: 500MB}, "
                             "{name: b, memory_limit: 500MB}]"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == 2
    assert len(lines) == 1 and "worker a needs" in lines[0] and "has 500 MB" in lines[0]
    status = train_cli.main(["configs/paper.yaml", "--check", f"output={tmp_path / 'run'}",
                             "cluster.workers=[{name: a, memory_limit: 700MB}, "
                             "{name: b, memory_limit: 4GB}]"])
    assert status == 0  # b takes what a (the master: its head and little else) cannot hold


def test_scaling_points_carry_the_peak_and_whether_it_fits():
    """A predict-only point at 1024 devices: the largest peak per device under the
    split the model used, and `memory_fits` against the kind's memory (the preset's,
    or the sweep's `hardware.kinds.<kind>.memory`); counted in milliseconds."""
    import time
    from experiments.scaling import run as scaling
    from experiments.scaling.config import build_point

    def point(strategy: str, memory: float | None = None):
        hardware = {"devices": 1024, "device": "gpu", "link": {"gbps": 10, "latency_us": 5}}
        if memory is not None:
            hardware["kinds"] = {"gpu": {"memory": memory}}
        return build_point({"strategy": strategy, "network": {"preset": "marques"},
                            "train": {"batch": 2048}, "hardware": hardware,
                            "options": {"split": "proportional", "scheme": "a"}})

    for strategy in ("kernel", "data", "hybrid"):
        values = scaling.evaluate_point(point(strategy))
        assert 0 < values["peak_memory"] < 40e9 and values["memory_fits"] == 1.0
        start = time.perf_counter()
        small = scaling.evaluate_point(point(strategy, memory=values["peak_memory"] - 1))
        assert time.perf_counter() - start < 2.0
        assert small["memory_fits"] == 0.0
    single = scaling.evaluate_point(point("single"))
    assert single["peak_memory"] > values["peak_memory"]


def test_capacities_come_from_the_config_the_scheduler_or_the_gpu():
    from pipeline.placement.capacity import capacities_from
    from pipeline.cluster.workers import ClusterWorker
    workers = [ClusterWorker("tcp://a:1", "a", "CPU", 1, 1.0, "cpu"),
               ClusterWorker("tcp://b:1", "b", "CPU", 1, 1.0, "cpu"),
               ClusterWorker("tcp://c:1", "c", "GPU", 1, 1.0, "cuda:0")]
    reported = {"tcp://a:1": {"memory_limit": 2e9}, "tcp://b:1": {"memory_limit": 0},
                "tcp://c:1": {"memory_limit": 64e9}}
    gpus = {"c": 80e9}
    # external workers: what the scheduler reports (0: none); a GPU's total caps it
    assert capacities_from(workers, {}, reported, gpus) == [2e9, float("inf"), 64e9]
    # embedded: the config's limits, by name (None: none), whatever Dask reports
    limits = {"a": None, "b": 1e9, "c": None}
    assert capacities_from(workers, limits, reported, gpus) == [float("inf"), 1e9, 80e9]


def test_a_run_config_is_predicted_under_the_split_its_run_used():
    """What measured and `mode: predict` sweeps store as `predicted_peak_memory`: on
    this machine's bare processes, the same ones a run's working memory is measured
    against (pipeline/records/memory.py)."""
    from pipeline.prediction import predict_memory
    here = machine_memory_constants()
    config = load_run_config("configs/paper.yaml", ["cluster.workers=2", "train.batch=32"])
    even_split = predict_memory(config)
    by_quanta = [[256, 244], [752, 748]]  # even in the config's channel quanta (16, 47)
    assert even_split.per_device == peak_memory("kernel", PAPER, 32, by_quanta,
                                                constants=here).per_device
    assert [p["baseline"] for p in even_split.parts] == [memory_baseline(WORKER_IMPORTS)] * 2
    lopsided = {"kernel_split": [[96, 404], [282, 1218]], "split_workers": ["cpu-0", "cpu-1"],
                "master": "cpu-1"}
    footprint = predict_memory(config, lopsided)
    assert footprint.per_device == peak_memory("kernel", PAPER, 32, lopsided["kernel_split"],
                                               master=1, constants=here).per_device
    assert footprint.per_device[1] > footprint.per_device[0]
    reference = predict_memory(load_run_config("configs/paper.yaml", ["strategy=reference"]))
    assert reference.per_device == peak_memory("reference", PAPER, 32,
                                               constants=here).per_device
    assert reference.parts[0]["baseline"] == memory_baseline(CLIENT_IMPORTS)


# Tied layers and networks the memory count does not price ---------------------------------


def test_tied_rows_move_together_off_a_device_that_would_overflow():
    """Rows 0 and 2 are tied (a residual sum adds them): a unit leaves device 0 from
    both at once, and they stay equal; untied, one row alone would have moved."""
    weights = [10.0, 1.0, 10.0]  # bytes a kernel of each row holds

    def peaks(counts: list[list[int]]) -> list[float]:
        return [sum(w * row[d] for w, row in zip(weights, counts)) for d in range(2)]

    counts, capacity = [[8, 8], [8, 8], [8, 8]], [150.0, float("inf")]
    tied = move_to_fit(counts, [4, 4, 4], capacity, peaks, tied=[[0, 2], [1]])
    assert tied.counts == [[4, 12], [8, 8], [4, 12]] and tied.moved == 1
    untied = move_to_fit(counts, [4, 4, 4], capacity, peaks)
    assert untied.counts[0] != untied.counts[2]
    # which rows a strategy's split ties: a kernel split's residual groups; no sample's
    resnet20 = build_preset("resnet20", (3, 32, 32), 10, "float32", 0.25, 0.0)
    assert strategy_named("kernel").tied_rows(resnet20) == resnet20.tied_groups()
    assert strategy_named("data").tied_rows(resnet20) is None


def test_memory_checks_refuse_a_zoo_network_too_big_for_its_workers(tmp_path):
    """resnet20 (batch norm, residual sums) on workers far too small: `--check`
    refuses it in one line naming a worker, as for the paper family; the memory
    prediction gives every worker's peak."""
    limits = ("cluster.workers=[{name: a, memory_limit: 1MB}, "
              "{name: b, memory_limit: 1MB}]")
    status = train_cli.main(["configs/small.yaml", "--check", f"output={tmp_path / 'run'}",
                             "network.preset=resnet20", "network.width=0.25", limits])
    assert status == 2
    config = load_run_config("configs/small.yaml", [f"output={tmp_path / 'run'}",
                                                    "network.preset=resnet20",
                                                    "strategy=kernel", limits])
    peaks = predict_memory(config).per_device
    assert len(peaks) == 2 and all(peak > 100e6 for peak in peaks)
    # `auto`'s run is counted as the strategy it chose
    auto = load_run_config("configs/small.yaml", [f"output={tmp_path / 'run'}",
                                                  "network.preset=resnet20",
                                                  "strategy=auto", limits])
    chosen = {"strategy_choice": {"chosen": "kernel"}}
    assert predict_memory(auto) is None
    assert predict_memory(auto, chosen).per_device == peaks

def test_auto_is_refused_before_its_cluster_starts_only_where_no_strategy_fits(tmp_path):
    """`--check` of `strategy=auto` on workers too small for every strategy it may
    choose: one line naming what each needs, exit 2 (it used to pass, and the run
    started a cluster and probed it before the chosen strategy was refused); on
    workers that hold some strategy (here 1 MB more than the least of them with
    `cluster.memory_margin`), it passes, leaving the choice to the model."""
    def check(limit: str) -> tuple[int, str]:
        workers = f"cluster.workers=[{{name: a, memory_limit: {limit}}}, " \
                  f"{{name: b, memory_limit: {limit}}}]"
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            status = train_cli.main(["configs/small.yaml", "--check", "strategy=auto",
                                     f"output={tmp_path / 'run'}", workers])
        return status, err.getvalue()

    status, err = check("1MB")
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: memory: strategy 'auto' found no strategy that fits the workers' memory (")
    for name in ("kernel", "single", "data", "hybrid"):
        assert f"{name}: worker a needs " in lines[0]
    least = min(planned(predict_memory(load_run_config(
        "configs/small.yaml", [f"strategy={name}", "placement=even"])).largest, 0.15)
        for name in ("kernel", "single", "data", "hybrid"))
    assert check(f"{int(least / 1e6) + 1}MB")[0] == 0
