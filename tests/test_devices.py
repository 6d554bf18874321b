"""Several device kinds in one run: resource tags, per-worker devices, workers left out.

CI has no GPU, so the mixes here are CPU workers under different tags, one of them
emulating a device 20x slower (speed 0.05): what a CPU beside a GPU looks like to
the placement. The runs are checked against single-process PyTorch.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from experiments.report.markdown import device_shares
from experiments.sweep.cli import main as sweep_main
from experiments.sweep.axes import value_label
from experiments.sweep.config import load_sweep
from pipeline.cluster.connect import check_devices
from pipeline.cluster.worker_setup import register_setup
from pipeline.cluster.workers import ClusterError, tagged_workers
from pipeline.config.cluster_config import ClusterConfig
from pipeline.config.run_config import build_run_config
from pipeline.records.summary import format_summary
from pipeline.config.schema import ConfigError
from pipeline.run import run_training
from storage import checkpoints
from tests.conftest import ROOT
from tests.helpers import max_relative_error, replay_in_pytorch, shared_workers, tiny_config

#: The device mix: the shared cluster's workers (tests/conftest.py) by their tags here.
FAST, MID, SLOW = "cpu-0", "cpu-1", "cpu-2"


@pytest.fixture(scope="module")
def mixed_cluster(shared_cluster):
    """`fast`, `mid` and `slow` (tagged FAST, MID, SLOW), `slow` set up at 0.05x speed
    for this module, and back at full speed after it."""
    client, cluster = shared_workers(shared_cluster, "CPU", {SLOW: {"speed": 0.05}})
    register_setup(client, cluster)
    try:
        yield client, cluster
    finally:
        register_setup(client, shared_cluster[1])


def run(tmp_path, dataset, client, cluster: ClusterConfig, tags: list[str], name: str,
        **overrides):
    config = tiny_config(tmp_path / name, dataset, **overrides)
    config.cluster = ClusterConfig(workers=cluster.workers, resources=tags)
    return config, run_training(config, client=client)


def test_workers_are_ordered_by_tag_then_name():
    table = {"tcp://a": {"name": "cpu-1", "resources": {"CPU": 1}},
             "tcp://b": {"name": "gpu-0", "resources": {"GPU": 1}},
             "tcp://c": {"name": "cpu-0", "resources": {"CPU": 1}},
             "tcp://d": {"name": "both", "resources": {"CPU": 1, "GPU": 1}},
             "tcp://e": {"name": "other", "resources": {"TPU": 1}}}
    found = tagged_workers(table, ["GPU", "CPU"])
    assert [(info["name"], tag) for _a, info, tag in found] == [
        ("both", "GPU"), ("gpu-0", "GPU"), ("cpu-0", "CPU"), ("cpu-1", "CPU")]
    assert [info["name"] for _a, info, _t in tagged_workers(table, ["CPU"])] == [
        "both", "cpu-0", "cpu-1"]


def test_devices_make_tagged_workers_and_the_run_uses_them_all():
    cluster = build_run_config({"cluster": {"devices": ["cuda:0", "cpu", "cpu"],
                                            "threads": 4}}).cluster
    workers = cluster.worker_list()
    assert [(w.name, w.device, w.resources, w.threads) for w in workers] == [
        ("gpu-0", "cuda:0", {"GPU": 1.0}, 1), ("cpu-1", "cpu", {"CPU": 1.0}, 4),
        ("cpu-2", "cpu", {"CPU": 1.0}, 4)]
    assert cluster.tags() == ["GPU", "CPU"]
    assert build_run_config({"cluster": {"devices": ["cpu"]}}).cluster.tags() == ["CPU"]
    assert build_run_config({"cluster": {"resources": ["B", "A"]}}).cluster.tags() == ["B", "A"]
    for bad, field in [({"devices": ["tpu"]}, "devices.0"),
                       ({"devices": ["cpu"], "workers": 3}, "devices"),
                       ({"resources": ["GPU"], "resource": "GPU"}, "resources"),
                       ({"workers": [{"device": "gpu"}]}, "device")]:
        with pytest.raises(ConfigError, match=field):
            build_run_config({"cluster": bad})


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_cuda_worker_is_refused_before_anything_starts():
    with pytest.raises(ClusterError, match="wants cuda:0, but this machine has 0 CUDA"):
        check_devices(ClusterConfig(devices=["cuda:0", "cpu"]).worker_list())


def test_recorded_placement_needs_its_split():
    with pytest.raises(ConfigError, match="split_from"):
        build_run_config({"placement": "recorded"})
    with pytest.raises(ConfigError, match="split_from"):
        build_run_config({"split_from": [[4, 4]]})


def test_three_tags_with_zero_kernel_shards_train_exactly(mixed_cluster, tmp_path,
                                                          tiny_dataset_factory):
    """`mid` holds nothing of layer 1 and `slow` nothing of layer 0, and layer 0 is
    split off its channel quanta (6 of 4-channel quanta: its checkpoint is chunked
    at the split's boundary): float64 weights equal single-process PyTorch's; every
    worker's tag and device are recorded. A second run reusing the first's split
    from its directory repeats it bit for bit."""
    client, cluster = mixed_cluster
    dataset = tiny_dataset_factory("float64")
    split = [[6, 4, 0], [4, 0, 8]]
    # 3 steps, not tiny_config's 5: `slow` (0.05x) holds layer 1's largest shard, so each
    # step waits out its emulated slowness; 3 steps move the weights as well
    steps = {"network.dtype": "float64", "train.steps": 3}
    config, result = run(tmp_path, dataset, client, cluster, ["FAST", "MID", "SLOW"], "first",
                         placement="recorded", split_from=json.dumps(split), **steps)
    assert result.summary["kernel_split"] == split
    assert result.summary["worker_devices"] == [
        {"name": FAST, "tag": "FAST", "device": "cpu"},
        {"name": MID, "tag": "MID", "device": "cpu"},
        {"name": SLOW, "tag": "SLOW", "device": "cpu"}]
    assert list(result.record.resource_tag.values) == ["FAST", "MID", "SLOW"]
    trained = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
    expected, _ = replay_in_pytorch(config, dataset)
    assert max_relative_error(trained, expected) <= 1e-10
    assert max_relative_error(trained, checkpoints.read_tensors(config.checkpoint_path, 0)) > 1e-3

    again, repeat = run(tmp_path, dataset, client, cluster, ["FAST", "MID", "SLOW"], "again",
                        placement="recorded", split_from=config.output_dir, **steps)
    assert repeat.summary["kernel_split"] == split and repeat.record.attrs["placement"] == "recorded"
    repeated = checkpoints.read_tensors(again.checkpoint_path, again.train.steps)
    bitwise = all((repeated[key] == trained[key]).all() for key in trained)
    assert bitwise, max_relative_error(repeated, trained)


def test_a_recorded_split_that_does_not_fit_is_one_config_error(mixed_cluster, tmp_path,
                                                                tiny_dataset_factory):
    client, cluster = mixed_cluster
    dataset = tiny_dataset_factory("float32")
    with pytest.raises(ConfigError, match=r"split_from: \[6, 4\] splits conv layer 0's "
                                          r"11 kernels: they add up to 10"):
        run(tmp_path, dataset, client, cluster, ["FAST", "SLOW"], "bad",
            placement="recorded", split_from="[[6, 4], [12, 0]]",
            **{"network.conv.0.kernels": 11})


def test_a_twenty_times_slower_worker_gets_nothing(mixed_cluster, tmp_path,
                                                   tiny_dataset_factory, capsys):
    """Calibrated placement over `fast` and a 20x slower `slow` leaves `slow` out: the
    run is `fast` alone, predicted no slower than the best single device.

    Batch 64, not tiny_config's 16: the emulated slowness is a sleep after the compute
    (`WorkerProfile.emulate`), so `slow` is busy 1/20 of its rounds and the kernel's
    scheduler runs it at once when it wakes, while `fast` computes back to back and
    shares the cores with whatever else runs. At batch 16 a round is 1.5 ms, within
    one time slice: under load `slow`'s rounds kept their 20x while `fast`'s grew up to
    10x, and 4 busy processes on this 2-core machine gave `slow` kernels in 3 runs of 8.
    At batch 64 (5 ms rounds, several slices) load lengthens both alike: 15 runs under
    6 and 8 busy processes all left `slow` out, measured 13-52x slower."""
    client, cluster = mixed_cluster
    dataset = tiny_dataset_factory("float32")
    config, result = run(tmp_path, dataset, client, cluster, ["FAST", "SLOW"], "calibrated",
                         placement="calibrated", **{"train.batch": 64,
                         "network.conv.0.kernels": 16, "network.conv.1.kernels": 24})
    choice = json.loads(result.record.attrs["placement_choice"])
    assert choice["workers"] == [FAST, SLOW]
    assert [row[1] for row in choice["split"]] == [0, 0]
    assert choice["predicted_step_time"] <= choice["predicted_best_single"]
    assert choice["best_single_device"] == FAST
    assert set(choice["alternatives"]) >= {"even", "minmax", "proportional", f"single:{FAST}",
                                           f"single:{SLOW}"}
    points = choice["calibration_points"][SLOW]
    assert all(len(layer) >= 2 for layer in points)  # two shard sizes per layer
    assert choice["alike_workers"] == []  # a slowed worker is not alike the others
    assert json.loads(result.record.attrs["left_out"]) == [SLOW]
    # one line on why: in the summary, the record, the start's lines and the closing ones
    [said] = result.summary["left_out"]
    assert json.loads(result.record.attrs["left_out_reasons"]) == [said]
    slower = float(said.split("measured ")[1].split("x slower")[0])
    assert said.startswith(f"worker {SLOW} left out: measured ") and \
        f"x slower than {FAST}" in said and slower > 5, said  # emulated 20x slower
    assert "giving it kernels would lengthen the step" in said
    closing = format_summary("r", "kernel", result.summary, [FAST])
    assert f"left out    {said}" in closing and "  critical    compute " in closing
    assert list(result.summary["critical_breakdown"]) == ["compute", "exchange", "dataset",
                                                          "wait", "client"]
    assert said in capsys.readouterr().err
    assert result.summary["workers"] == [FAST] and result.summary["kernel_split"] == [[16],
                                                                                      [24]]
    trained = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
    expected, _ = replay_in_pytorch(config, dataset)
    assert max_relative_error(trained, expected) <= 1e-4


def test_data_parallel_leaves_the_slow_worker_out_too(mixed_cluster, tmp_path,
                                                      tiny_dataset_factory):
    client, cluster = mixed_cluster
    dataset = tiny_dataset_factory("float32")
    config, result = run(tmp_path, dataset, client, cluster, ["FAST", "MID", "SLOW"], "data",
                         strategy="data", placement="calibrated")
    choice = json.loads(result.record.attrs["placement_choice"])
    assert choice["workers"] == [FAST, MID, SLOW] and choice["split"][0][2] == 0
    # FAST and MID are alike (one host, CPU, one thread, full speed): one cost, one share
    assert choice["alike_workers"] == [[FAST, MID]]
    assert abs(choice["split"][0][0] - choice["split"][0][1]) <= 1, choice["split"]
    assert json.loads(result.record.attrs["left_out"]) == [SLOW]
    [said] = result.summary["left_out"]
    assert said.startswith(f"worker {SLOW} left out: measured ") and \
        "predicted for it alone" in said, said
    # why it was left out follows the recorded predictions: a split giving it samples is
    # predicted slower, or (a tiny share off the critical path) no faster
    slot = choice["workers"].index(SLOW)
    with_it = [alt["predicted_step_time"] for alt in choice["alternatives"].values()
               if alt.get("predicted_step_time") is not None
               and any(row[slot] > 0 for row in alt["split"])]
    assert with_it and min(with_it) >= choice["predicted_step_time"], choice
    why = ("giving it samples would lengthen" if min(with_it) > choice["predicted_step_time"]
           else "no faster split gives it samples")
    assert why in said, said
    assert sum(result.summary["batch_split"]) == config.train.batch
    trained = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
    expected, _ = replay_in_pytorch(config, dataset)
    assert max_relative_error(trained, expected) <= 1e-4


def test_a_device_axis_is_labelled_by_mix_and_the_report_shows_shares():
    assert value_label("cluster.devices", ["cuda:0"]) == "gpu"
    assert value_label("cluster.devices", ["cuda:0", "cpu", "cpu"]) == "gpu+2cpu"
    assert value_label("cluster.devices", ["cpu"] * 4) == "4cpu"
    devices = json.dumps([["gpu-0", "GPU", "cuda:0"], ["cpu-1", "CPU", "cpu"]])
    shares = device_shares(json.dumps([[30, 2], [60, 8]]), "[]", devices)
    assert shares == [("gpu-0", "cuda:0, GPU", 0.9), ("cpu-1", "cpu, CPU", 0.1)]
    assert device_shares("[]", json.dumps([96, 32]), devices)[1][2] == 0.25
    assert device_shares("[]", "[]", devices) == []


def test_the_device_mix_sweep_expands_to_one_cluster_per_mix(capsys, monkeypatch):
    """experiments/configs/mixes.yaml (for a GPU machine) expands here too. Its dry run
    starts nothing; without a GPU it is refused, as its points' runs would be, and with
    the device check stubbed it lists them. They run on an embedded cluster per mix;
    the report's device-mix table is checked on a real sweep in tests/test_report.py."""
    config = os.path.join(ROOT, "experiments", "configs", "mixes.yaml")
    sweep = load_sweep(config)
    assert [str(v) for v in sweep.axes[0].labels] == ["gpu", "gpu+2cpu", "gpu+4cpu"]
    keys = {p.cluster_key for p in sweep.points}
    assert len(keys) == 3  # one embedded cluster per mix
    workers = [p.config.cluster.worker_list() for p in sweep.points]
    assert {len(w) for w in workers} == {1, 3, 5}
    assert all(w[0].device == "cuda:0" and w[-1].threads in (1, 4) for w in workers)
    monkeypatch.setenv("CNN_PREDICT_PROBE", "cached")  # what a dry run sets; undone after
    if not torch.cuda.is_available():  # every point's run would refuse here: so does the sweep
        assert sweep_main([config, "--dry-run"]) == 2
        assert ("error: cluster.devices: worker gpu-0 wants cuda:0, but this machine has 0 "
                "CUDA device(s) (at point mix=gpu") in capsys.readouterr().err
        monkeypatch.setattr("pipeline.preflight.device_problem", lambda workers: None)
    assert sweep_main([config, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("mix=gpu+4cpu") == 8 and "5 worker(s)" in out
