"""The cost model calibrated on a real cluster: probe, predictions, `placement: model`.

A real scheduler with two worker processes (two of the shared cluster's), a real
Zarr workspace on the engine's path and the tiny network of the other tests. Timings
on this shared machine are noisy, so the checks are on sanity (positive, finite,
consistent, within a broad factor of a measured run), not on accuracy:
benchmarks/prediction_error.py measures that.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import numpy as np
import pytest

from pipeline.costmodel import Prediction
from pipeline.costmodel.compute import DEFAULT_UPDATE_ACCESSES, GATHER_ACCESSES
from pipeline.costmodel.contention import (UNMEASURED_SHARE, contended_step,
                                          cores_filled)
from pipeline.prediction import (PointPrediction, network_for, per_step_task_costs,
                                 predict_config, predict_point, with_contention)
from pipeline.cluster.worker_setup import register_setup
from pipeline.cluster.workers import ClusterError, find_workers
from pipeline.placement.model_placement import choose_split
from pipeline.placement.split import align_to_quanta
import pipeline.probe.cache
from pipeline.probe import (ClusterProbe, DaskProbe, MasterProbe, ShardTiming, StoreProbe,
                            WorkerProbe, cached_probe, cluster_probe_from_dict,
                            find_cached_probe, probe_max_age)
from pipeline.probe.client_share import ROUNDS as SHARE_ROUNDS, median_share
from pipeline.probe.runs import REPLICA_ROUNDS, ROUNDS
from pipeline.records.summary import format_summary
from pipeline.records.step_breakdown import model_breakdown
from pipeline.run import run_training
from pipeline.strategies import strategy_named
from pipeline.strategies.auto import choose_strategy, pick, with_master
from pipeline.config.run_config import RunConfig
from pipeline.placement.memory_fit import MemoryRefused
from pipeline.preflight_memory import memory_refusal
from pipeline.records.memory import machine_memory_constants
from pipeline.engine.task_steps import median_task_steps, steps_per_task
from storage import checkpoints
from benchmarks.op_times import report as op_times_report, table_seconds
from tests.helpers import (cut_probe_to_one_round, max_relative_error, replay_in_pytorch,
                           run_main, shared_workers, tiny_config, undocumented_summary_keys)


@pytest.fixture(scope="module")
def probe_cache(tmp_path_factory):
    """A private probe cache for this module (the real one is left alone)."""
    before = os.environ.get("CNN_PROBE_CACHE")
    os.environ["CNN_PROBE_CACHE"] = str(tmp_path_factory.mktemp("probes"))
    yield os.environ["CNN_PROBE_CACHE"]
    if before is None:
        os.environ.pop("CNN_PROBE_CACHE", None)
    else:
        os.environ["CNN_PROBE_CACHE"] = before


@pytest.fixture(scope="module")
def two_workers(shared_cluster):
    """cpu-0 and cpu-1 of the shared cluster (tests/conftest.py), by their tag PROBE."""
    client, cluster = shared_workers(shared_cluster, "PROBE")
    register_setup(client, cluster)
    return client, cluster


def _config(tmp_path, dataset, cluster, **overrides):
    config = tiny_config(tmp_path, dataset, **overrides)
    config.cluster = dataclasses.replace(cluster)
    return config


@pytest.fixture(scope="module")
def probe(two_workers, probe_cache, tiny_dataset_factory, tmp_path_factory) -> ClusterProbe:
    client, cluster = two_workers
    dataset = tiny_dataset_factory("float32")
    config = _config(tmp_path_factory.mktemp("probe"), dataset, cluster)
    offered = find_workers(client, config.cluster)
    spec = network_for(config)
    return cached_probe(client, offered, spec, config.train.batch, config.channel_quanta(spec),
                        None, dataset)


def _finite_positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def test_probe_measures_positive_finite_constants(probe):
    assert [w.name for w in probe.workers] == ["cpu-0", "cpu-1"]
    for worker in probe.workers:
        layers = {t.layer for t in worker.timings}
        assert layers == {0, 1}
        for t in worker.timings:
            assert _finite_positive(t.forward_s) and _finite_positive(t.backward_s), t
    # the whole layer was timed alone on the first worker (what `single` runs)
    assert {(t.layer, t.kernels) for t in probe.workers[0].timings if t.active == 1} == \
        {(0, 10), (1, 12)}
    s = probe.store
    assert s.read_bw > 0 and s.write_bw > 0  # infinite where latency explains every access
    assert min(s.read_latency_s, s.write_latency_s) >= 0
    assert s.read_latency_s + 1 / s.read_bw > 0 and s.write_latency_s + 1 / s.write_bw > 0
    assert _finite_positive(s.dataset_read_s)
    assert probe.method == "runs"  # calibration runs of the engine's own steps
    d = probe.dask
    # the gap between queued step tasks, the marker latency, a scheduler hop
    assert 0 <= d.task_s < 0.5 and 0 <= d.sync_s < 0.5
    # a look at a written slot's marker, measured apart (two workers read each other's)
    assert d.check_s is not None and 0 <= d.check_s < 0.5
    # the gap between a worker's steps inside one task, measured apart from the one between tasks
    assert d.step_gap_s is not None and 0 <= d.step_gap_s < 0.5
    assert _finite_positive(d.hop_s) and _finite_positive(d.round_trip_s)
    # the client's CPU per step task, fitted collect by collect (probe/client_cpu.py)
    assert _finite_positive(d.client_cpu_per_task_s) and d.client_cpu_per_task_s < 0.5
    assert math.isfinite(d.client_cpu_rate) and d.client_cpu_rate >= 0
    assert _finite_positive(probe.master.dense_s)
    for worker in probe.workers:  # the backward's first part is part of it
        assert all(0 < t.input_grad_s <= t.backward_s for t in worker.timings if t.layer > 0)
    for worker in probe.workers:  # every size timed in rounds, its spread kept
        for t in worker.timings:
            assert t.rounds >= 2 and t.steps >= 2 * t.rounds, t
            assert 0 < t.low_s <= t.forward_s + t.backward_s <= t.high_s * 1.001, t
    assert probe.version == 25 and probe.phase_seconds["timed_again"] >= 0
    for worker, device in zip(probe.workers, probe.device_specs()):
        # a replica's update timed on every worker at once: a memory rate a CPU can have,
        # and the rate the model prices every element-wise pass at
        assert 1e8 < worker.memory_bw < 1e13, worker.memory_bw
        assert device.mem_bw == worker.memory_bw
    for worker in probe.workers:  # the batch read before the first layer, per size
        for t in worker.timings:
            assert (t.dataset_s is not None) == (t.layer == 0), t
            assert t.dataset_s is None or _finite_positive(t.dataset_s), t
    for worker in probe.workers:  # each replica's conv trunk, both replicas running
        t = worker.trunk
        assert t is not None and (t.rows, t.active) == (probe.batch // 2, 2), t
        assert t.forward_s > 0 and t.backward_s > 0
        assert t.rounds >= REPLICA_ROUNDS > ROUNDS  # its trunk is all of a replica's convs
        assert _finite_positive(t.dataset_s), t
        assert _finite_positive(t.dense_s), t  # the dense head on the same rows
        # a data replica's whole step on the same rows: more than its trunk's forward
        # alone, and per step: under 10x trunk and head together, where a sum over its
        # t.steps steps would not be. Not tighter: its rounds and the trunk's are
        # apart, and its millisecond steps took 5x under tests running beside it
        assert t.steps > 10 and t.forward_s < t.data_step_s < 10 * (t.forward_s + t.backward_s + t.dense_s), t
    assert all(d.trunk is not None for d in probe.device_specs(2))
    assert [d.trunk.dense for d in probe.device_specs(2)] == [w.trunk.dense_s
                                                              for w in probe.workers]
    assert [d.trunk.data_step for d in probe.device_specs(2)] == [w.trunk.data_step_s
                                                                  for w in probe.workers]
    # hybrid's dense ops, its neurons on the whole batch, read off the hybrid plan
    assert all(_finite_positive(w.trunk.hybrid_head_s) for w in probe.workers)
    assert [(d.trunk.hybrid_head, d.trunk.hybrid_head_batch) for d in probe.device_specs(2)] \
        == [(w.trunk.hybrid_head_s, probe.batch) for w in probe.workers]
    # a data replica's update, its rate the replica's update accesses over its time
    assert all(_finite_positive(w.trunk.update_s) for w in probe.workers)
    net = probe.costmodel_network()
    assert [d.update_bw for d in probe.device_specs(2)] == pytest.approx(
        [(GATHER_ACCESSES + DEFAULT_UPDATE_ACCESSES) * net.params() * 4 / w.trunk.update_s
         for w in probe.workers])
    # each worker's spread against its peer's, with both running (not alone)
    assert all(set(w.spread) == {2} and 0 < w.spread[2] < 1 for w in probe.workers)
    assert [d.spread for d in probe.device_specs(2)] == [w.spread[2] for w in probe.workers]
    assert 0 < probe.master.dense_low_s <= probe.master.dense_s <= probe.master.dense_high_s
    # the cost-model objects
    devices = probe.device_specs()
    assert all(set(d.layer_tables) == {"conv1", "conv2"} for d in devices)
    assert all(d.layer_tables["conv1"].dataset and not d.layer_tables["conv2"].dataset
               for d in devices)
    assert all(d.layer_tables["conv2"].input_grad for d in devices)
    # the accesses' spread about the store's fit, with both workers running (alone, a
    # worker's kernel plan moves no slot)
    assert set(s.spread) == {2} and 0 < s.spread[2] < 1
    store = probe.store_spec()
    assert store.chunk_cost("read") == s.read_latency_s and store.client_bw("read") == s.read_bw
    assert store.spread == s.spread[2]
    overhead = probe.overhead()
    assert (overhead.task, overhead.sync, overhead.hop, overhead.check) == (
        d.task_s, d.sync_s, d.hop_s, d.check_s)
    # the client's share of the cores, measured where two single-thread workers fill them
    if cores_filled([w.threads for w in probe.workers], d.host_cores):
        assert len(d.contention_shares) == 2 * SHARE_ROUNDS  # the even plan's and the replicas'
        assert all(s is None or 0.0 <= s <= 1.0 for s in d.contention_shares)
        assert d.contention_share == median_share(d.contention_shares)  # None: rounds disagree
    else:  # the client has a core of its own: the share is never used
        assert d.contention_share is None and d.contention_shares == []


def test_probe_is_json_and_cached(probe):
    data = json.loads(json.dumps(dataclasses.asdict(probe)))
    assert cluster_probe_from_dict(data) == probe
    assert find_cached_probe(probe.key) == probe


@pytest.mark.parametrize("text, seconds", [("", 3600), ("90", 90), ("30m", 1800),
                                           ("2d", 2 * 86400), ("inf", math.inf), ("0", 0)])
def test_the_max_age_of_a_cached_probe_is_read_from_the_environment(monkeypatch, text,
                                                                   seconds):
    monkeypatch.setenv("CNN_PROBE_MAX_AGE", text)
    assert probe_max_age() == seconds


def test_a_probe_older_than_its_max_age_is_measured_again(probe, two_workers,
                                                         tiny_dataset_factory, tmp_path,
                                                         monkeypatch):
    """A probe of 7 hours ago: a policy that may measure probes the cluster again (its
    speed may have drifted) and keeps the new one; `cached`, which measures nothing,
    takes the old one and says how old it is."""
    client, cluster = two_workers
    dataset = tiny_dataset_factory("float32")
    config = _config(tmp_path, dataset, cluster)
    monkeypatch.setenv("CNN_PROBE_CACHE", str(tmp_path / "probes"))
    monkeypatch.delenv("CNN_PROBE_MAX_AGE", raising=False)
    old = dataclasses.replace(probe, created=time.time() - 7 * 3600)
    os.makedirs(tmp_path / "probes")
    (tmp_path / "probes" / f"cluster-{probe.key}.json").write_text(
        json.dumps(dataclasses.asdict(old)))
    assert find_cached_probe(probe.key) is None
    assert find_cached_probe(probe.key, any_age=True) == old
    monkeypatch.setenv("CNN_PREDICT_PROBE", "cached")
    prediction = predict_point(config, None)
    assert prediction["probe_key"] == probe.key
    assert 7 * 3600 <= prediction["probe_age_s"] < 7 * 3600 + 600
    monkeypatch.setenv("CNN_PROBE_MAX_AGE", "8h")
    assert find_cached_probe(probe.key) == old

    monkeypatch.setenv("CNN_PROBE_MAX_AGE", "1h")
    measured: list[tuple] = []
    monkeypatch.setattr(pipeline.probe.cache, "probe_cluster",
                        lambda *args, **kwargs: measured.append(args) or probe)
    offered, spec = find_workers(client, config.cluster), network_for(config)

    def cached() -> ClusterProbe:
        return cached_probe(client, offered, spec, config.train.batch,
                            config.channel_quanta(spec), None, dataset)

    assert cached() == probe and len(measured) == 1  # measured again
    assert cached() == probe and len(measured) == 1  # and the new one kept
    assert find_cached_probe(probe.key) == probe


def test_predict_point_finds_the_cached_probe_from_the_config(probe, two_workers,
                                                              tiny_dataset_factory, tmp_path,
                                                              monkeypatch):
    _, cluster = two_workers
    config = _config(tmp_path, tiny_dataset_factory("float32"), cluster)
    monkeypatch.setenv("CNN_PREDICT_PROBE", "cached")
    prediction = predict_point(config, None)  # no probe, no client: the cache
    assert prediction is not None and prediction["probe_key"] == probe.key
    monkeypatch.setenv("CNN_PREDICT_PROBE", "never")
    assert predict_point(config, None) is None


@pytest.mark.parametrize("strategy,workers", [("reference", None), ("single", None),
                                              ("kernel", 1), ("kernel", 2)])
def test_predict_point_per_strategy_is_sane(probe, two_workers, tiny_dataset_factory,
                                            tmp_path, strategy, workers):
    _, cluster = two_workers
    config = _config(tmp_path, tiny_dataset_factory("float32"), cluster, strategy=strategy)
    config.cluster.use_workers = workers
    prediction = predict_point(config, None, None if strategy == "reference" else probe)
    assert isinstance(prediction, PointPrediction)
    seconds = prediction["predicted_step_time"]
    assert 1e-4 < seconds < 5.0 and float(prediction) == seconds
    # how sure: the step with the probe's timings at their quartiles, around the figure
    low, high = prediction["predicted_low"], prediction["predicted_high"]
    assert low <= seconds <= high and low < high, (low, seconds, high)
    b = prediction["breakdown"]
    parts = ("compute_critical", "master", "storage", "communication", "overhead")
    assert sum(b[k] for k in parts) + b.get("contention", 0.0) == pytest.approx(seconds)
    if strategy == "reference":
        assert b["overhead"] == 0 and prediction["constants"]["threads"] == 1
    else:
        assert b["overhead"] > 0 and b["storage"] > 0 and b["master"] > 0
        split = prediction["kernel_split"]
        assert [len(row) for row in split] == [1 if strategy == "single" else workers] * 2
        assert [sum(row) for row in split] == [10, 12]


def test_prediction_error_of_a_real_run(probe, two_workers, tiny_dataset_factory, tmp_path):
    client, cluster = two_workers
    config = _config(tmp_path, tiny_dataset_factory("float32"), cluster, placement="even",
                     **{"train.steps": 6})
    result = run_training(config, client=client, offered=find_workers(client, config.cluster))
    prediction = predict_point(config, result.summary, probe)
    measured = result.summary["step_time_median"]
    assert prediction["measured_step_time"] == measured
    assert prediction["prediction_error"] == pytest.approx(
        prediction["predicted_step_time"] / measured - 1)
    # a sanity bound (units, a missing or doubled part), not accuracy
    # (benchmarks/prediction_error.py): the tiny network's 12 ms step measured 43 ms
    # while two other test processes loaded this 2-core machine
    assert 1 / 10 < prediction["predicted_step_time"] / measured < 10
    # the run recorded the same prediction for itself (`prediction: cached` found the
    # module's probe of this cluster), in its summary and its record
    summary = result.summary
    assert not undocumented_summary_keys(summary)  # docs/outputs.md names every key
    assert summary["predicted_step_time"] == prediction["predicted_step_time"]
    assert summary["prediction_probe"] == probe.key
    assert 0 <= summary["prediction_probe_age_s"] < 3600  # the module's probe, just made
    assert "h old" not in format_summary("r", "kernel", summary, ["cpu-0", "cpu-1"])
    assert "; from a probe 7.0 h old)" in format_summary(
        "r", "kernel", {**summary, "prediction_probe_age_s": 7 * 3600}, ["cpu-0", "cpu-1"])
    assert summary["prediction_error"] == pytest.approx(prediction["prediction_error"])
    # and its compute's part: the model's compute on the critical path against the
    # run's busiest worker's
    model, run = (model_breakdown(summary["predicted_breakdown"])["compute"],
                  summary["compute_time_median"])
    assert summary["compute_error"] == pytest.approx(model / run - 1)
    assert f"its compute {summary['compute_error']:+.0%} against this run's" in \
        format_summary("r", "kernel", summary, ["cpu-0", "cpu-1"])
    assert result.record.attrs["predicted_step_time"] == summary["predicted_step_time"]
    on_disk = json.loads(open(os.path.join(result.output_dir, "summary.json")).read())
    assert on_disk["predicted_step_time"] == summary["predicted_step_time"]
    # benchmarks/op_times.py: each conv op beside the probe's table at the run's split
    tables = table_seconds(probe, summary)
    specs = {device.name: device for device in probe.device_specs(2)}
    assert len(tables) == 2 * 2 * 2  # workers, layers, passes
    for layer, counts in enumerate(summary["kernel_split"]):
        for worker, kernels in zip(summary["split_workers"], counts):
            table = specs[worker].layer_tables[f"conv{layer + 1}"]
            assert (tables[worker, f"conv-forward {layer}"],
                    tables[worker, f"conv-backward {layer}"]) == table.times(kernels, probe.batch)
    lines = op_times_report(result.output_dir)
    ratios = [float(line.rsplit(" ", 1)[1]) for line in lines
              if "compute/table" in line and "a step" not in line]
    # the tiny run's conv ops take about 0.5 ms: a time slice lost to another process
    # (several ms on a loaded 2-core machine; 12.9x once, in a fresh clone's first run)
    # is 10x and more, where a unit slip (ms for s) is 1000x
    assert len(ratios) == len(tables) and all(0.01 < r < 100 for r in ratios), lines
    assert sum("a step: compute" in line and "conv compute/table" in line
               for line in lines) == 2  # each worker's step in all
    spans = [line for line in lines if "a step's span" in line]  # each worker's steps
    assert [line.split()[0] for line in spans] == ["cpu-0", "cpu-1"], lines
    opened = [line for line in lines if "a task's first step" in line]  # by the submits
    assert [line.split()[0] for line in opened] == ["cpu-0", "cpu-1"], lines
    assert lines[-1].startswith(f"model    a step {1e3 * summary['predicted_step_time']:.2f} ms")


def test_a_replica_split_that_left_a_worker_out_is_priced_on_the_worker_it_used(
        probe, two_workers, tiny_dataset_factory, tmp_path):
    """A recorded split giving cpu-0 no samples: the run's `batch_split` has a column
    for cpu-1 alone (its `split_workers`), and the model prices it as the split with
    cpu-0's zero column, not as shares for cpu-0 nor as shares that do not fit."""
    client, cluster = two_workers
    config = _config(tmp_path, tiny_dataset_factory("float32"), cluster, strategy="data",
                     placement="recorded", split_from="[[0, 16]]", **{"train.steps": 4})
    result = run_training(config, client=client, offered=find_workers(client, config.cluster))
    summary = result.summary
    assert (summary["batch_split"], summary["split_workers"]) == ([16], ["cpu-1"])
    assert summary["prediction_probe"] == probe.key, summary.get("prediction_note")
    zero_column = predict_point(config, {**summary, "batch_split": [0, 16],
                                         "split_workers": ["cpu-0", "cpu-1"]}, probe)
    assert summary["predicted_step_time"] == pytest.approx(zero_column["predicted_step_time"])


def test_a_run_says_why_it_has_no_prediction(probe_cache, tiny_dataset_factory, tmp_path):
    """No cached probe of `reference` with 3 threads here, and `cached` measures none."""
    config = tiny_config(tmp_path, tiny_dataset_factory("float32"), strategy="reference",
                         **{"train.steps": 2, "reference.threads": 3})
    summary = run_training(config).summary
    assert summary["predicted_step_time"] is None and summary["prediction_error"] is None
    assert "no probe of this cluster is cached" in summary["prediction_note"]
    config.prediction, config.output = "never", str(tmp_path / "never")
    result = run_training(config)
    assert result.summary["prediction_note"] == "prediction: never"
    assert "predicted_step_time" not in result.record.attrs


def test_model_placement_runs_and_stays_exact(probe, two_workers, tiny_dataset_factory,
                                              tmp_path, monkeypatch):
    """`placement: model` on a network of its own (a probe of its own): the probe cut to
    one round, as its figures are `test_probe_measures_positive_finite_constants`'s; here
    the split it gives, the choice it records and the exact training are tested."""
    cut_probe_to_one_round(monkeypatch)
    client, cluster = two_workers
    dataset = tiny_dataset_factory("float32")
    config = _config(tmp_path, dataset, cluster, placement="model",
                     **{"network.conv.0.kernels": 16, "network.conv.1.kernels": 24})
    result = run_training(config, client=client, offered=find_workers(client, config.cluster))
    split = result.summary["kernel_split"]
    assert [sum(row) for row in split] == [16, 24]
    assert all(k % 4 == 0 for row in split for k in row)
    record = json.loads(result.record.attrs["placement_choice"])
    alternatives = record["alternatives"]
    assert record["chosen"] in alternatives and {"minmax", "calibrated", "even",
                                                 "single:cpu-0", "single:cpu-1"} <= set(alternatives)
    assert record["kernel_split"] == alternatives[record["chosen"]]["split"]
    chosen = record["predicted_step_time"]
    assert chosen == min(a["predicted_step_time"] for a in alternatives.values())
    assert chosen <= record["predicted_best_single"]
    idle = [name for d, name in enumerate(record["workers"])
            if d > 0 and not any(row[d] for row in record["kernel_split"])]
    assert json.loads(result.record.attrs["left_out"]) == idle  # cpu-0 is the master
    assert record["probe"]["workers"][0]["timings"]  # the calibration is in the record
    trained = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
    expected, _ = replay_in_pytorch(config, dataset)
    assert max_relative_error(trained, expected) <= 1e-4


def test_align_to_quanta_puts_the_short_unit_last():
    assert align_to_quanta([2, 8], 4) == [4, 6]
    assert align_to_quanta([4, 6], 4) == [4, 6]
    assert align_to_quanta([8, 4, 2], 4) == [8, 4, 2]
    assert align_to_quanta([6, 4, 4], 4) == [8, 4, 2]


def _synthetic_probe(fixed_s: float, per_kernel_s: float, slow: float) -> ClusterProbe:
    """A probe of two workers, one ``slow`` times slower; shard time = fixed + k * per kernel."""
    from tasks.specs import ConvLayerSpec, NetworkSpec

    network = NetworkSpec((ConvLayerSpec(3, 32, in_height=32, in_width=32),
                           ConvLayerSpec(32, 64, in_height=16, in_width=16)))
    workers = []
    for name, factor in (("fast", 1.0), ("slow", slow)):
        timings = [ShardTiming(layer, k, 2, factor * (fixed_s + k * per_kernel_s) / 3,
                               factor * 2 * (fixed_s + k * per_kernel_s) / 3,
                               factor * (fixed_s + k * per_kernel_s) / 3)
                   for layer, kernels in ((0, 32), (1, 64)) for k in range(4, kernels + 1, 4)]
        workers.append(WorkerProbe(name, name, 1, 1 / factor, timings))
    store = StoreProbe("shm", 3e-4, 2e9, 3e-4, 1e9, 3e-4)
    dask = DaskProbe(0.002, 0.0005, 0.01, 0.01)
    master = MasterProbe(1, 128, 0.002)
    return ClusterProbe("synthetic", 0.0, "host", dataclasses.asdict(network), 128, [4, 4],
                        workers, store, dask, master)


def test_model_split_beats_proportional_where_shards_have_fixed_costs():
    """A 3x slower worker whose every shard pays a large fixed cost (input transform,
    whole-input read, task start): proportional-to-speed gives it a third of the
    kernels, and it finishes last; the model gives it fewer (METHODS §1: minimise the
    slowest device's time including its traffic)."""
    probe = _synthetic_probe(fixed_s=0.02, per_kernel_s=0.0005, slow=3.0)
    choice = choose_split(probe)
    alternatives = choice["alternatives"]
    assert choice["chosen"] == "minmax"
    calibrated = alternatives["calibrated"]["predicted_step_time"]
    assert choice["predicted_step_time"] < 0.9 * calibrated
    for model_row, calibrated_row in zip(choice["kernel_split"],
                                         alternatives["calibrated"]["split"]):
        assert model_row[1] < calibrated_row[1]  # the slow worker gets less
    # with no fixed cost the two agree (to a quantum)
    linear = choose_split(_synthetic_probe(fixed_s=0.0, per_kernel_s=0.0005, slow=3.0))
    for a, b in zip(linear["alternatives"]["minmax"]["split"],
                    linear["alternatives"]["calibrated"]["split"]):
        assert np.abs(np.subtract(a, b)).max() <= 4


def test_reference_needs_a_master_probe(probe, tiny_dataset_factory, tmp_path):
    config = tiny_config(tmp_path, tiny_dataset_factory("float32"), strategy="reference")
    with pytest.raises(TypeError):
        predict_config(config, probe)


def test_pick_takes_the_fastest_and_a_runner_up_of_another_strategy():
    times = {("kernel", "cpu-0"): 0.30, ("kernel", "cpu-1"): 0.20, ("data", "cpu-0"): 0.25,
             ("single", "cpu-0"): 0.20}
    assert pick(times) == (("kernel", "cpu-1"), ("single", "cpu-0"))  # a tie: first listed
    assert pick({("data", "cpu-0"): 1.0}) == (("data", "cpu-0"), None)


def test_auto_candidates_let_the_model_split_where_a_strategy_allows_it(tmp_path,
                                                                       tiny_dataset_factory):
    config = tiny_config(tmp_path, tiny_dataset_factory("float32"), strategy="auto",
                         placement="even")
    candidates = strategy_named("auto").candidates(config)
    assert {"kernel", "single", "data", "hybrid"} <= set(candidates)
    assert "reference" not in candidates and "auto" not in candidates
    assert candidates["kernel"].placement == "model" and candidates["kernel"].strategy == "kernel"
    assert candidates["data"].placement == "even"  # data takes no `model` placement


def test_auto_without_a_probe_says_why_none_was_made(tmp_path, tiny_dataset_factory):
    """`auto` on a cluster the model could not probe: the line says why (the probe's
    runs failed, said above it; an s3 workspace, which the probe never times), not
    the probe policy, which a run's `auto` does not follow."""
    config = tiny_config(tmp_path, tiny_dataset_factory("float32"), strategy="auto")
    with pytest.raises(ClusterError) as refused:
        choose_strategy(config, strategy_named("auto"), None, predict_config)
    assert str(refused.value) == (
        "strategy: 'auto' needs the model's probe of this cluster, and none could be made: "
        "its calibration runs failed; the warning above says how")


def test_auto_chooses_only_among_strategies_that_fit_the_workers_memory(
        probe, two_workers, tiny_dataset_factory, tmp_path):
    """Workers of the least memory some candidate fits in: `auto` picks among those
    that fit, and records why each other is none (the memory it needs), where it used
    to pick the fastest and the run was then refused for memory (`single` on two 262 MB
    workers of configs/small.yaml, where `kernel` fits)."""
    _, cluster = two_workers
    dataset = tiny_dataset_factory("float32")
    config = _config(tmp_path, dataset, cluster, strategy="auto")
    auto = strategy_named("auto")
    workers = [(w.name, {}, "cpu") for w in probe.workers]
    here = machine_memory_constants()

    def refusal_at(capacity: float):
        return lambda candidate: memory_refusal(candidate, workers, [capacity] * 2, here)

    candidates = [c for c in auto.candidates(config).values() if isinstance(c, RunConfig)]
    capacity = next(c for c in np.arange(50e6, 2e9, 1e6)
                    if any(not refusal_at(c)(candidate) for candidate in candidates))
    fits = {c.strategy for c in candidates if not refusal_at(capacity)(c)}
    refused = {c.strategy for c in candidates} - fits
    assert fits and refused  # the least capacity that holds some holds not all
    _, _, choice = choose_strategy(config, auto, probe, predict_config, refusal_at(capacity))
    assert choice["chosen"] in fits
    assert {key.split("@")[0] for key in choice["alternatives"]} == fits
    for name in refused:
        assert choice["not_candidates"][name].startswith("memory: worker cpu-0 needs ")
    # where none fits, one line naming what each needs, as a named strategy's refusal
    with pytest.raises(MemoryRefused) as none_fit:
        choose_strategy(config, auto, probe, predict_config, refusal_at(1e6))
    line = str(none_fit.value)
    assert line.startswith("memory: strategy 'auto' found no strategy that fits the "
                           "workers' memory (") and "\n" not in line
    assert all(f"{name}: worker cpu-0 needs " in line for name in fits | refused)
    # unequal workers: kernel's master holds the dense head, so it fits with the large
    # worker as master (the small one left with no kernel), not with the small one
    lopsided = lambda candidate: memory_refusal(candidate, workers, [1e6, math.inf])  # noqa: E731
    _, _, choice = choose_strategy(config, auto, probe, predict_config, lopsided)
    assert choice["not_candidates"]["kernel@cpu-0"].startswith("memory: worker cpu-0 needs ")
    assert "kernel@cpu-1" in choice["alternatives"]
    assert "kernel@cpu-0" not in choice["alternatives"]
    chosen = with_master(auto.candidates(config)[choice["chosen"]], choice["master"])
    assert not lopsided(chosen)
    # a sweep's prediction of an `auto` point (mode: predict, --dry-run) chooses as the
    # run does, from the limits its config gives an embedded cluster's workers
    limit = f"{capacity / 1e6:.0f}MB"
    embedded = tiny_config(tmp_path, dataset, strategy="auto", **{
        "cluster.workers": f"[{{name: cpu-0, memory_limit: {limit}}}, "
                           f"{{name: cpu-1, memory_limit: {limit}}}]"})
    predicted = predict_point(embedded, probe=probe)
    assert predicted["strategy_choice"]["chosen"] in fits
    for name in refused:
        assert predicted["strategy_choice"]["not_candidates"][name].startswith("memory: ")


def test_strategy_auto_runs_the_strategy_the_model_predicts_fastest(
        probe, two_workers, tiny_dataset_factory, tmp_path, capsys):
    client, cluster = two_workers
    dataset = tiny_dataset_factory("float32")
    config = _config(tmp_path, dataset, cluster, strategy="auto", **{"train.steps": 3})
    result = run_training(config, client=client, offered=find_workers(client, config.cluster))
    choice = result.summary["strategy_choice"]
    assert not undocumented_summary_keys(result.summary)  # docs/outputs.md names every key
    alternatives = choice["alternatives"]
    assert {key.split("@")[0] for key in alternatives} >= {"kernel", "single", "data"}
    assert choice["predicted_step_time"] == min(alternatives.values())
    assert alternatives[f"{choice['chosen']}@{choice['master']}"] == choice["predicted_step_time"]
    runner = choice["runner_up"]
    assert runner["strategy"] != choice["chosen"]
    assert runner["predicted_step_time"] == min(
        t for key, t in alternatives.items() if not key.startswith(choice["chosen"] + "@"))
    # the run is the chosen strategy's, recorded as such, and predicted by the same probe
    assert result.summary["strategy"] == choice["chosen"] == result.record.attrs["strategy"]
    assert choice["probe_key"] == probe.key == result.summary.get("prediction_probe"), \
        result.summary.get("prediction_note")
    # said with the steps per task its figure prices (a short run's tasks hold fewer)
    steps = choice["task_steps"]
    assert isinstance(steps, int) and steps >= 1
    said = capsys.readouterr().err
    assert (f"strategy auto: the model picks {choice['chosen']} (master {choice['master']}), "
            f"predicted {choice['predicted_step_time']:.4f} s/step at {steps} step") in said
    assert "auto        chose" in format_summary("r", choice["chosen"], result.summary, ["w"])


def test_the_clients_share_of_the_cores_is_added_only_where_the_workers_fill_them():
    probe = _synthetic_probe(fixed_s=0.002, per_kernel_s=0.0005, slow=1.0)
    plain = Prediction("kernel", 0.050, 128, {"compute": [0.04, 0.04], "overhead": 0.01})
    assert with_contention(plain, probe) is plain  # the scheduler ran elsewhere
    here = dataclasses.replace(probe.dask, client_cpu_per_task_s=0.004, client_cpu_rate=0.02,
                               scheduler_here=True, host_cores=2)
    probe = dataclasses.replace(probe, dask=here)
    contended = with_contention(plain, probe)
    # the per-task CPU of two workers' tasks, all of it where the share is unmeasured; the
    # CPU that comes with time passing (client_cpu_rate) sits in the probe's timings
    assert contended.step_time == pytest.approx(0.050 + 2 * 0.004)
    assert contended.breakdown["contention"] == pytest.approx(contended.step_time - 0.050)
    assert model_breakdown(contended.breakdown)["wait"] == contended.breakdown["contention"]
    one = Prediction("single", 0.050, 128, {"compute": [0.04], "overhead": 0.01})
    assert with_contention(one, probe) is one  # a core left for the client
    four_cores = dataclasses.replace(probe, dask=dataclasses.replace(here, host_cores=4))
    assert with_contention(plain, four_cores) is plain


def test_the_contention_share_the_probe_measured_is_the_one_the_prediction_uses():
    """The share of the client's CPU that delays the step is the probe's
    (`DaskProbe.contention_share`); only a probe that could not measure it falls back
    to the bound (all of it), and the details say which."""
    probe = _synthetic_probe(fixed_s=0.002, per_kernel_s=0.0005, slow=1.0)
    here = dataclasses.replace(probe.dask, client_cpu_per_task_s=0.004, client_cpu_rate=0.02,
                               scheduler_here=True, host_cores=2)
    plain = Prediction("kernel", 0.050, 128, {"compute": [0.04, 0.04], "overhead": 0.01})
    for measured in (0.0, 0.55, 1.0):
        probe = dataclasses.replace(probe, dask=dataclasses.replace(
            here, contention_share=measured))
        contended = with_contention(plain, probe)
        assert contended.step_time == pytest.approx(0.050 + measured * 2 * 0.004)
        assert contended.details["contention_share"] == measured
        assert contended.details["contention_share_source"] == "probe"
    unmeasured = with_contention(plain, dataclasses.replace(probe, dask=here))
    assert unmeasured.step_time == pytest.approx(contended_step(0.050, 2, 0.004, UNMEASURED_SHARE))
    assert unmeasured.details["contention_share_source"] == "bound"


#: (strategy, workers, one path): whether every cost the cut takes off lies on the one
#: critical path (single), or every replica's path alike (data); kernel's two workers'
#: paths can trade places
STEP_PATHS = [("single", 1, True), ("kernel", 2, False), ("data", 2, True)]


@pytest.mark.parametrize("strategy, workers, one_path", STEP_PATHS)
def test_steps_per_task_share_out_the_per_task_costs(probe, two_workers, tiny_dataset_factory,
                                                     tmp_path, strategy, workers, one_path):
    """The probe prices a task per step; a run's median step carries half of a
    worker's gap between tasks at two steps a task and none at four (fewer than half
    its steps meet a task's boundary), and `auto` sizes tasks to about a second by
    the predicted step (pipeline/engine/task_steps.py). For `kernel` the step gains
    at most that: where the probe read the workers unequal and no gap between steps
    inside a task, the other worker's path became critical with the overhead cut (a
    real probe under load failed the equality once; scaled probes reproduce it)."""
    _, cluster = two_workers
    config = _config(tmp_path, tiny_dataset_factory("float32"), cluster, strategy=strategy)
    config.cluster.use_workers = workers
    one, two, four = (predict_config(config, probe, task_steps=k) for k in (1, 2, 4))
    assert [p.details["task_steps"] for p in (one, two, four)] == [1, 2, 4]
    dask = probe.dask
    assert 0 <= dask.step_gap_s < dask.task_s  # inside a task a step waits for no dispatch
    for fewer, share in ((two, 0.5), (four, 1.0)):  # the gap between steps for the rest
        saved = one.breakdown["overhead"] - fewer.breakdown["overhead"]
        cut = share * (dask.task_s - dask.step_gap_s)
        if one_path:
            assert saved == pytest.approx(cut, rel=1e-6)
        else:  # with less overhead on its path, the other worker's (slack before) may lead
            assert 0 < saved <= cut * (1 + 1e-6)
    assert four.step_time < two.step_time < one.step_time
    shared = per_step_task_costs(probe, 2).dask
    assert shared.task_s == pytest.approx((dask.task_s + dask.step_gap_s) / 2)
    assert shared.client_cpu_per_task_s == dask.client_cpu_per_task_s / 2
    assert per_step_task_costs(probe, 4).dask.client_cpu_per_task_s == 0.0
    assert per_step_task_costs(probe, 4).dask.task_s == dask.step_gap_s
    # `auto`: the tasks the run will run at the predicted step (its first tasks one
    # step each, none past a checkpoint); a long run's, as `auto` sizes them
    train = config.train
    auto = predict_config(config, probe)
    assert auto.details["task_steps"] == median_task_steps(
        "auto", one.step_time, train.steps, train.checkpoint_every, train.inflight,
        train.warmup_steps)
    train.steps, train.checkpoint_every = 400, 0
    assert (predict_config(config, probe).details["task_steps"]
            == steps_per_task("auto", one.step_time) > 1)


# Zoo networks -------------------------------------------------------------------------------

@pytest.mark.parametrize("setting", ["strategy=auto", "placement=model"])
def test_auto_and_model_placement_take_a_zoo_network(tmp_path, setting):
    """The model prices the zoo: `--check` passes resnet20 under `strategy: auto` and
    `placement: model`, as it passes the paper family."""
    argv = ["configs/small.yaml", f"output={tmp_path / 'run'}", "network.preset=resnet20",
            "network.width=0.25", setting, "--check"]
    status, lines, _ = run_main("train", argv)
    assert status == 0, lines