"""The step-graph engine on a real cluster: where the dense head runs, what crosses the
workspace, the trace, and that every way of running a step gives the same weights."""

from __future__ import annotations

import json

import numpy as np

from pipeline.cluster.worker_setup import register_setup
from pipeline.cluster.workers import find_workers
from pipeline.run import run_training
from storage import checkpoints
from tasks.layout import layout_from_counts, workspace_bytes
from tests.helpers import max_relative_error, replay_in_pytorch, tiny_config


def _run(tmp_path, cluster, dataset, **overrides):
    client, cluster_config = cluster
    config = tiny_config(tmp_path, dataset, **overrides)
    config.cluster.workers = cluster_config.workers
    register_setup(client, config.cluster)
    result = run_training(config, client=client, offered=find_workers(client, config.cluster))
    return config, result


def _lanes(trace: dict) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"}


def test_single_moves_nothing_through_the_workspace(tmp_path, three_worker_cluster,
                                                    tiny_dataset_factory):
    dataset = tiny_dataset_factory("float32")
    config, result = _run(tmp_path, three_worker_cluster, dataset, strategy="single")
    record = result.record
    assert record.sizes["worker"] == 1
    assert (record.workspace_bytes == 0).all() and (record.read_bytes == 0).all()
    assert (record.dataset_bytes > 0).all()  # it did read its batches
    assert result.summary["bytes_per_step"] == 0
    trace = json.loads((tmp_path / "run" / "trace.json").read_text())
    tasks = [e for e in trace["traceEvents"] if e.get("cat") == "task"]
    assert len(tasks) == config.train.steps  # the whole step is one task


def test_dense_head_runs_on_the_chosen_master_and_the_trace_shows_it(
        tmp_path, three_worker_cluster, tiny_dataset_factory):
    dataset = tiny_dataset_factory("float64")
    config, result = _run(tmp_path, three_worker_cluster, dataset,
                          **{"cluster.use_workers": 2, "cluster.master": "cpu-1",
                             "network.dtype": "float64"})
    assert result.summary["master"] == "cpu-1"
    trace = json.loads((tmp_path / "run" / "trace.json").read_text())
    lanes = _lanes(trace)
    assert sorted(lanes.values()) == ["client", "cpu-0", "cpu-1"]
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert all(e["ts"] >= 0 and e["dur"] >= 0 and e["name"] for e in complete)
    heads = [e for e in complete if e["cat"] == "op" and e["name"] == "dense-head"]
    assert len(heads) == config.train.steps
    assert {lanes[e["tid"]] for e in heads} == {"cpu-1"}
    ops = {(lanes[e["tid"]], e["name"]) for e in complete if e["cat"] == "op"}
    for worker in ("cpu-0", "cpu-1"):
        for name in ("conv-forward 0", "conv-forward 1", "conv-backward 1", "conv-backward 0"):
            assert (worker, name) in ops
    phases = {e["name"] for e in complete if e["cat"] == "phase"}
    assert {"compute", "read", "write", "dataset"} <= phases
    trained = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
    expected, losses = replay_in_pytorch(config, dataset)
    assert max_relative_error(trained, expected) <= 1e-10
    np.testing.assert_allclose(result.record.loss.values, losses, rtol=1e-10)


def test_a_master_holding_no_kernels_trains_exactly(tmp_path, three_worker_cluster,
                                                    tiny_dataset_factory):
    """cluster.master beyond cluster.use_workers joins the run for the head alone."""
    dataset = tiny_dataset_factory("float64")
    config, result = _run(tmp_path, three_worker_cluster, dataset,
                          **{"cluster.use_workers": 2, "cluster.master": "cpu-2",
                             "network.dtype": "float64"})
    assert result.summary["master"] == "cpu-2"
    assert [row[2] for row in result.summary["kernel_split"]] == [0, 0]
    record = result.record
    assert float(record.compute_time.sel(worker="cpu-2").sum()) > 0  # the head's work
    assert float(record.shard_compute_time.sel(worker="cpu-2").sum()) == 0
    trained = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
    expected, _ = replay_in_pytorch(config, dataset)
    assert max_relative_error(trained, expected) <= 1e-10


def test_every_way_of_running_the_graph_gives_identical_weights(
        tmp_path, three_worker_cluster, tiny_dataset_factory):
    """The same ops in the same order: bit for bit, whoever orders them (ready markers
    or Dask dependencies), however many steps are in flight and however many steps a
    task runs (a task never runs past a checkpoint: saves after steps 2 and 4). The
    first run's workspace bytes, worker by worker, are the formula's."""
    dataset = tiny_dataset_factory("float32")
    common = {"cluster.use_workers": 3, "train.checkpoint_every": 2, "train.eval_samples": 0}
    base, result = _run(tmp_path / "base", three_worker_cluster, dataset, **common)
    _assert_workspace_bytes_are_the_formula(base, result)
    variants = {"scheduler": {"workspace.sync": "scheduler"}, "inflight-1": {"train.inflight": 1},
                "inflight-4": {"train.inflight": 4},
                "step-per-task": {"train.steps_per_task": 1},
                "3-steps-per-task": {"train.steps_per_task": 3, "train.inflight": 1}}
    task_steps = {"scheduler": [1] * 5, "step-per-task": [1] * 5,
                  "3-steps-per-task": [2, 2, 2, 2, 1]}
    for name, variant in variants.items():
        other, result = _run(tmp_path / name, three_worker_cluster, dataset, **common, **variant)
        if name in task_steps:
            assert result.record.task_steps.values.tolist() == task_steps[name], name
        for step in (2, 4, 5):
            for kind in ("weights", "momentum"):
                a = checkpoints.read_tensors(base.checkpoint_path, step, kind)
                b = checkpoints.read_tensors(other.checkpoint_path, step, kind)
                assert all(np.array_equal(a[k], b[k]) for k in a), (name, step, kind)
    trace = json.loads((tmp_path / "scheduler" / "run" / "trace.json").read_text())
    tasks = [e for e in trace["traceEvents"] if e.get("cat") == "task"]
    assert len(tasks) > 3 * base.train.steps  # through the scheduler: cut at every exchange


def _assert_workspace_bytes_are_the_formula(config, result) -> None:
    """Each `kernel` worker's workspace bytes a step are the formula's (3 workers)."""
    record = result.record
    split = result.summary["kernel_split"]
    assert split == [[4, 4, 2], [4, 4, 4]]  # 10 and 12 kernels in units of 4
    workers = list(record.worker.values)
    layout = layout_from_counts(workers, split, workers.index(result.summary["master"]))
    network = config.network_spec((3, 32, 32))
    expected = workspace_bytes(layout, network, config.train.batch, 4)
    for w, (read, written) in enumerate(expected):
        assert read > 0 and written > 0
        np.testing.assert_array_equal(record.read_bytes.isel(worker=w), read)
        np.testing.assert_array_equal(record.write_bytes.isel(worker=w), written)
    np.testing.assert_array_equal(record.workspace_bytes.sum("worker"),
                                  sum(r + w for r, w in expected))
