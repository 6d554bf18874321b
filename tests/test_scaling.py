"""Scaling sweeps (``mode: scaling``): the model over hypothetical clusters, as a user meets
it: the CLI writes a store that ``xr.open_zarr`` reads like a measured sweep's, the
figures are consistent with the model, bad hardware is refused with one line, and the
report draws the three scaling figures.

Everything here is arithmetic (no cluster, no training): one real CLI subprocess, the
rest in-process.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys

import matplotlib.image
import pytest
import yaml

from experiments.report import cli as report
from experiments.sweep import cli as sweep_cli
from experiments.sweep.store_layout import DONE, FAILED
from experiments.scaling.baseline import UNFIT_NOTE
from experiments.scaling.run import Infeasible, evaluate_point
from experiments.scaling.config import build_point, load_scaling_sweep, network_of
from experiments.scaling.hardware import DaskConfig, device_spec, link_spec, overhead_spec
from experiments.sweep.axes import value_label
from pipeline.costmodel import predict
from pipeline.strategies import STRATEGIES
from tests.test_sweep import ROOT, close, error_lines, open_clean

SCALING_FIGURES = ["winner_workers_batch.png", "winner_workers_bandwidth.png",
                   "scaling_speedup.png"]


def write_scaling(tmp_path, axes: dict, base: dict | None = None, name: str = "tinyscale",
                  **extra) -> str:
    """A scaling sweep over a small network on the `cpu` preset."""
    config = {
        "name": name, "mode": "scaling",
        "base": {"strategy": "kernel",
                 "network": {"conv": [{"kernels": 16}, {"kernels": 32}]},
                 "train": {"batch": 16},
                 "hardware": {"devices": 1, "device": "cpu",
                              "link": {"gbps": 10, "latency_us": 5}},
                 **(base or {})},
        "axes": axes, **extra,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


TINY_AXES = {"strategy": ["single", "kernel", "data", "hybrid"],
             "hardware.devices": [1, 2, 4],
             "train.batch": [2, 16],
             "hardware.link.gbps": {"dim": "link_gbps", "values": [1, 100]}}


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory):
    """The real CLI on a 48-point grid; data/hybrid at batch 2 on 4 devices cannot run."""
    tmp_path = tmp_path_factory.mktemp("scaling")
    config = write_scaling(tmp_path, TINY_AXES)
    store = str(tmp_path / "out" / "tinyscale.zarr")
    result = subprocess.run([sys.executable, "-m", "experiments.sweep.cli", config, "--out", store],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    return store, result


def test_cli_writes_a_store_that_reads_like_a_measured_sweep(tiny_store):
    store, result = tiny_store
    assert result.returncode == 0, result.stderr  # infeasible points are not errors
    assert "48 points" in result.stdout and "44 predicted, 4 infeasible, 0 failed" in result.stdout
    assert f"report: python -m experiments.report {store})" in result.stdout  # as documented
    ds = open_clean(store)
    assert dict(ds.sizes) == {"strategy": 4, "devices": 3, "batch": 2, "link_gbps": 2,
                              "repeat": 1}
    assert list(ds.devices.values) == [1, 2, 4] and ds.devices.attrs["units"] == "devices"
    assert ds.batch.attrs["units"] == "samples" and ds.link_gbps.attrs["units"] == "Gb/s"
    for name in ("predicted_step_time", "throughput", "speedup", "efficiency", "compute_time",
                 "communication_time", "storage_time", "master_time", "overhead_time",
                 "baseline_step_time", "n_workers", "capacity", "status", "failure"):
        assert name in ds, name
        assert ds[name].attrs.get("units") and ds[name].attrs.get("description"), name
    assert "step_time" not in ds  # nothing was measured
    assert ds.attrs["mode"] == "scaling" and ds.attrs["store_format"] == "hetcnn-sweep/3"
    for key in ("config", "presets", "versions", "code_revision", "command", "axes"):
        assert ds.attrs.get(key), key
    presets = json.loads(ds.attrs["presets"])
    assert list(presets) == ["cpu"] and presets["cpu"][0]["flops"] == 2.08e11

    infeasible = ds.sel(batch=2, devices=4, strategy=["data", "hybrid"])
    assert (infeasible.status == FAILED).all()
    reason = str(infeasible.failure.sel(strategy="data", link_gbps=1, repeat=0).values)
    assert reason.startswith("Infeasible: batch 2 is smaller than the 4 devices")
    assert infeasible.predicted_step_time.isnull().all()
    done = ds.status == DONE
    assert int(done.sum()) == 44 and (ds.failure.where(done, "") == "").all()

    t = ds.predicted_step_time
    assert close(ds.throughput, ds.batch / t)
    parts = sum(ds[n] for n in ("compute_time", "communication_time", "storage_time",
                                "master_time", "overhead_time"))
    assert close(parts.where(done), t.where(done))
    # speedup: single on one device, same batch (and any link), over the step time
    single_one = t.sel(strategy="single", devices=1)
    assert close(ds.baseline_step_time.where(done), single_one.broadcast_like(t).where(done))
    assert close(ds.speedup, single_one / t)
    assert close(ds.efficiency, ds.speedup / ds.n_workers)  # equal devices
    assert (ds.n_workers.sel(strategy="single") == 1).all()
    assert list(ds.n_workers.sel(strategy="kernel", batch=16, link_gbps=1).values.ravel()) \
        == [1, 2, 4]
    # single ignores the devices it is given; more bandwidth never hurts
    assert close(t.sel(strategy="single", devices=4), single_one)
    assert (t.sel(link_gbps=100) <= t.sel(link_gbps=1) * (1 + 1e-12)).where(done.all(
        "link_gbps")).fillna(True).all()


def test_report_draws_the_three_scaling_figures(tiny_store):
    store, _ = tiny_store
    out_dir = os.path.join(os.path.dirname(store), "report")
    paths = report.make_report(store, out_dir)
    assert [os.path.basename(p) for p in paths] == SCALING_FIGURES + ["report.md"]
    for name in SCALING_FIGURES:
        image = matplotlib.image.imread(os.path.join(out_dir, name))
        assert image.shape[0] > 300 and image.shape[1] > 400, name
        assert image[..., :3].std() > 0.05, name
    text = open(os.path.join(out_dir, "report.md"), encoding="utf-8").read()
    for name in SCALING_FIGURES:
        assert f"]({name})" in text
    assert "44 predicted, 4 infeasible" in text and "`cpu`" in text
    assert "| link_gbps | batch | 1 dev. | 2 dev. | 4 dev. |" in text
    assert "Infeasible: batch N is smaller than the N devices" in text


def test_speedup_and_capacity_of_a_mix_follow_the_model():
    """A mix's devices are taken fastest kind first: the baseline is `single` on a GPU,
    and the GPUs come before the CPU written first (kernel's master is device 0)."""
    point = build_point({"strategy": "kernel", "network": {"preset": "marques"},
                         "train": {"batch": 64},
                         "hardware": {"devices": {"cpu": 1, "gpu": 2},
                                      "kinds": {"gpu": {"conv_efficiency": 0.5}},
                                      "link": {"gbps": 100, "latency_us": 2}}})
    values = evaluate_point(point)
    net = network_of(point.network)
    cpu, gpu = device_spec(point.hardware, "cpu"), device_spec(point.hardware, "gpu")
    assert gpu.conv_efficiency == 0.5 and gpu.flops == 1.95e13
    one = predict("single", net, 64, gpu).step_time
    assert one < predict("single", net, 64, cpu).step_time
    step = predict("kernel", net, 64, [gpu, gpu, cpu], link_spec(point.hardware.link)).step_time
    assert math.isclose(values["predicted_step_time"], step)
    assert math.isclose(values["baseline_step_time"], one)
    assert math.isclose(values["speedup"], one / step)
    relative = predict("single", net, 64, cpu).step_time
    assert math.isclose(values["capacity"], 2 + one / relative)
    assert math.isclose(values["efficiency"], one / step / (2 + one / relative))
    assert value_label("hardware.devices", {"cpu": 1, "gpu": 2}) == "1cpu+2gpu"


@pytest.mark.parametrize("strategy", ["single", "kernel", "data", "hybrid"])
def test_a_mix_is_one_point_whatever_the_order_it_is_written_in(strategy):
    """`{cpu: 4, gpu: 4}` and `{gpu: 4, cpu: 4}` are the same eight devices. Against
    `single` on the first kind written, one grid gave them 76x and 1.3x (data, marques,
    batch 128, 100 Gb/s), and `single` on the mix ran on a CPU or a GPU by the order;
    now every figure is the same, against the GPU."""
    def figures(devices: dict) -> dict:
        return evaluate_point(build_point({
            "strategy": strategy, "network": {"preset": "marques"}, "train": {"batch": 128},
            "hardware": {"devices": devices, "link": {"gbps": 100}}}))

    cpu_first, gpu_first = figures({"cpu": 4, "gpu": 4}), figures({"gpu": 4, "cpu": 4})
    assert cpu_first == pytest.approx(gpu_first, rel=1e-12, nan_ok=True)
    assert cpu_first["baseline_step_time"] == pytest.approx(
        figures({"gpu": 1})["predicted_step_time"] if strategy == "single"
        else figures({"gpu": 1})["baseline_step_time"], rel=1e-12)
    if strategy == "single":  # on the fastest device: the baseline itself
        assert cpu_first["speedup"] == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("strategy", ["data", "hybrid"])
def test_replicas_of_a_mix_take_samples_in_proportion_to_speed_by_default(strategy):
    """An A100 beside a CPU node 9x slower: by default each replica's share follows its
    speed, as a run's calibrated placement gives it, and the pair beats the A100 alone;
    with `options.batch_split: equal` (the default before) the CPU node's half of the
    batch made the pair 4.5x slower than the A100 alone, a map's artefact of the
    default rather than of data parallelism on unequal devices."""
    def figures(**options) -> dict:
        return evaluate_point(build_point({
            "strategy": strategy, "network": {"preset": "resnet50"}, "train": {"batch": 256},
            "hardware": {"devices": {"a100": 1, "cpu_node": 1}, "link": {"gbps": 400}},
            "options": {"overlap": True, **options}}))

    default, equal = figures(), figures(batch_split="equal")
    assert default == figures(batch_split="proportional")
    assert default["speedup"] > 1.0 > 4 * equal["speedup"]


@pytest.mark.parametrize("strategy", ["data", "hybrid"])
def test_a_device_given_no_sample_takes_no_part_in_the_exchanges(strategy):
    """Two A100s and two CPU nodes 9x slower at batch 4: the split in proportion to speed
    gives the CPU nodes no sample, and, as in a run, they leave it: the step is the two
    A100s' (it was priced with all four in every all-reduce and ring, the CPU nodes idle,
    and at 4096 devices twice the A100s' own step)."""
    def step(devices: dict) -> float:
        return evaluate_point(build_point({
            "strategy": strategy, "network": {"preset": "resnet50"}, "train": {"batch": 4},
            "hardware": {"devices": devices, "link": {"gbps": 100}},
            "options": {"overlap": True}}))["predicted_step_time"]

    assert step({"a100": 2, "cpu_node": 2}) == pytest.approx(step({"a100": 2}), rel=1e-12)
    point = build_point({"strategy": strategy, "network": {"preset": "resnet50"},
                         "train": {"batch": 4},
                         "hardware": {"devices": {"a100": 2, "cpu_node": 2}}})
    devices = [device_spec(point.hardware, k) for k in ("a100", "a100", "cpu_node", "cpu_node")]
    shares = predict(strategy, network_of(point.network), 4, devices,
                     link_spec(point.hardware.link), batch_split="proportional"
                     ).details["batch_shares"]
    assert shares == [2, 2, 0, 0]  # every device's share, for its memory


@pytest.mark.parametrize("strategy", ["kernel", "data", "hybrid"])
def test_infinite_bandwidth_speedup_approaches_the_device_count(strategy):
    """Marques' network is compute-bound: with free links every strategy nears P.

    Not P exactly: kernel-parallel keeps the dense head on the master and every
    holder joins the shards of each input it gathers into the whole (a copy that does
    not shrink with P), both Amdahl terms, so the bound is 94 % of P here (kernel at
    16 devices: 94.9 %), for every strategy alike."""
    for devices in (2, 4, 8, 16):
        point = build_point({"strategy": strategy, "train": {"batch": 256},
                             "hardware": {"devices": devices, "device": "cpu",
                                          "link": {"gbps": math.inf, "latency_us": 0}}})
        speedup = evaluate_point(point)["speedup"]
        assert 0.94 * devices < speedup <= devices * (1 + 1e-9), (devices, speedup)


def test_data_parallel_needs_a_sample_per_device():
    point = build_point({"strategy": "data", "train": {"batch": 8},
                         "hardware": {"devices": 16}})
    with pytest.raises(Infeasible, match="batch 8 is smaller than the 16 devices"):
        evaluate_point(point)
    point.strategy = "kernel"  # kernel-parallel shares kernels, not samples
    assert evaluate_point(point)["speedup"] > 0


def test_mix_axis_and_dry_run(tmp_path, capsys):
    config = write_scaling(tmp_path, {"strategy": ["single", "data"],
                                      "hardware.devices": [1, {"cpu": 2, "gpu": 2}]},
                           base={"train": {"batch": 2}})
    assert sweep_cli.main([config, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "4 points" in out and "devices=2cpu+2gpu" in out
    # the reason, as the run records it in `failure`
    assert "infeasible: batch 2 is smaller than the 4 devices" in out, out
    store = tmp_path / "mix.zarr"
    assert sweep_cli.main([config, "--out", str(store)]) == 0
    ds = open_clean(store)
    assert list(ds.devices.values) == ["1", "2cpu+2gpu"]
    assert "devices_value" in ds.coords
    assert ds.status.sel(strategy="data", devices="2cpu+2gpu").item() == FAILED
    # a store of this sweep is simply recomputed; another sweep's is refused
    assert sweep_cli.main([config, "--out", str(store)]) == 0
    other = write_scaling(tmp_path, {"hardware.devices": [1, 2]}, name="other")
    capsys.readouterr()
    assert sweep_cli.main([other, "--out", str(store)]) == 2
    assert "holds a different sweep" in capsys.readouterr().err
    assert sweep_cli.main([other, "--out", str(store), "--fresh"]) == 0
    assert list(open_clean(store).devices.values) == [1, 2]


@pytest.mark.parametrize("axes, base, expected", [
    ({"hardware.link.gbps": [10, -1]}, None,
     ["hardware.link.gbps", "positive", "-1", "axes.hardware.link.gbps, value #2 of 2"]),
    ({"hardware.devices": [4, {"cpu": 1, "tpu": 2}]}, None,
     ["hardware.devices.tpu", "unknown device kind 'tpu'", "cpu, gpu, k20"]),
    ({"hardware.lnk.gbps": [10]}, None, ["hardware.lnk", "unknown key"]),
    ({}, {"hardware": {"devices": 2, "kinds": {"gpu": {"conv_efficiency": 1.5}}}},
     ["hardware.kinds.gpu.conv_efficiency", "(0, 1]"]),
    ({}, {"hardware": {"devices": 2, "kinds": {"fast": {"flops": 1e12}}}},
     ["hardware.kinds.fast", "unknown preset 'fast'", "preset:"]),
    ({"strategy": ["kernel", "magic"]}, None, ["strategy", "'magic'"]),
    ({"strategy": ["kernel", "auto"]}, None,
     ["strategy", "'auto'", "single, kernel, data, hybrid", "axes.strategy, value #2 of 2"]),
    ({"strategy": ["reference"]}, None,
     ["strategy", "'reference'", "single, kernel, data, hybrid", "axes.strategy"]),
    ({}, {"strategy": "auto"}, ["strategy", "'auto'", "single, kernel, data, hybrid"]),
    ({}, {"hardware": {"devices": 2, "dask": {"task_ms": 3, "steps_per_task": 0}}},
     ["hardware.dask.steps_per_task", "at least 1"]),
    ({}, {"network": {"preset": "alexnet", "conv": [{"kernels": 4}]}},
     ["network.conv", "either network.preset or conv layers"]),
    ({"network.preset": ["resnet20", "vgg16"]}, {"network": {"image": 32}},
     ["network.image", "vgg16 takes its own 3x224x224 images", "value #2 of 2"]),
    # past the model's range: 10^20 devices overflowed an int64 coordinate, 10^8 computed
    # for minutes; a batch of 10^20 or a width of 1e300 overflowed in the model
    ({"hardware.devices": [99999999999999999999]}, None,
     ["hardware.devices", "1 to 65536", "axes.hardware.devices"]),
    ({"hardware.devices": [4, 100000000]}, None, ["hardware.devices", "value #2 of 2"]),
    ({"hardware.devices": [{"cpu": 40000, "gpu": 40000}]}, None,
     ["hardware.devices", "80000 devices; at most 65536"]),
    ({}, {"train": {"batch": 99999999999999999999}}, ["train.batch", "16777216"]),
    ({}, {"network": {"preset": "marques", "width": 1e300}}, ["network.width", "(0, 64]"]),
    # an axis named after a later axis's field, which has no other name to fall back on
    ({"network.preset": {"dim": "strategy", "values": ["alexnet"]}, "strategy": ["data"]},
     None, ["axes.strategy: its dim name 'strategy' is taken by another axis", "`dim:`"]),
])
def test_bad_scaling_configs_exit_2_with_one_line(tmp_path, capsys, axes, base, expected):
    config = write_scaling(tmp_path, axes, base=base)
    assert sweep_cli.main([config, "--out", str(tmp_path / "bad.zarr")]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for text in expected:
        assert text in lines[0], lines[0]
    assert not (tmp_path / "bad.zarr").exists()


def test_a_one_value_axis_is_counted_by_its_value(tmp_path, capsys):
    """"1 points (1 devices)" read as one device where the point had 65536."""
    config = write_scaling(tmp_path, {"hardware.devices": [65536]})
    assert sweep_cli.main([config, "--dry-run", "--out", str(tmp_path / "s.zarr")]) == 0
    assert ": 1 point (devices 65536) -> " in capsys.readouterr().out


def test_a_measured_sweeps_key_on_a_scaling_sweep_names_the_keys_it_takes(tmp_path, capsys):
    """`repeats=3` (docs/sweeps.md's example override, for measured sweeps) listed the
    base's keys as if it were one of them."""
    config = write_scaling(tmp_path, {"hardware.devices": [1, 2]})
    assert sweep_cli.main([config, "--dry-run", "repeats=3"]) == 2
    [line] = error_lines(capsys.readouterr().err)
    assert line.startswith("error: repeats: a measured sweep's key; a scaling sweep "), line
    assert "axes, base, description, mode, name, output, zip" in line


def test_shipped_scaling_config_loads():
    sweep = load_scaling_sweep(os.path.join(ROOT, "experiments", "configs", "scaling.yaml"))
    assert sweep.dims == ["strategy", "devices", "batch", "link_gbps", "network"]
    assert len(sweep.points) == 4 * 11 * 4 * 4 * 2


def test_an_override_changes_a_part_of_an_axis_the_file_has():
    """`axes.<field>.values=` keeps a named axis's dim (the docs' way of choosing
    networks); `.dim=` names a plain one; `axes.<field>=` still replaces an axis."""
    sweep = load_scaling_sweep(os.path.join(ROOT, "experiments", "configs", "scaling.yaml"),
                               ["axes.network.preset.values=[alexnet]",
                                "axes.strategy.dim=method", "axes.hardware.devices=[2]",
                                "axes.train.batch.values=[64]"])
    assert sweep.dims == ["method", "devices", "batch", "link_gbps", "network"]
    labels = {axis.dim: axis.labels for axis in sweep.axes}
    assert labels["network"] == ("alexnet",) and labels["batch"] == ("64",)
    assert labels["devices"] == ("2",) and len(labels["method"]) == 4


def test_a_model_error_is_recorded_and_exits_1(tmp_path, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise ValueError("no model for this")

    monkeypatch.setattr(STRATEGIES["hybrid"], "model", broken)
    config = write_scaling(tmp_path, {"strategy": ["data", "hybrid"],
                                      "hardware.devices": [1, 2]})
    store = tmp_path / "broken.zarr"
    assert sweep_cli.main([config, "--out", str(store)]) == 1
    assert "2 point(s) failed in the model: ValueError: no model for this" in \
        capsys.readouterr().out
    ds = open_clean(store)
    assert (ds.status.sel(strategy="data") == DONE).all()
    assert (ds.failure.sel(strategy="hybrid") == "ValueError: no model for this").all()


def test_the_task_gap_is_paid_once_per_task_of_steps():
    """hardware.dask.steps_per_task: the engine's tasks run several steps
    (train.steps_per_task), so the gap between a worker's tasks is shared out."""
    one = overhead_spec(DaskConfig(task_ms=3.0, sync_ms=0.5, hop_ms=20.0))
    ten = overhead_spec(DaskConfig(task_ms=3.0, sync_ms=0.5, hop_ms=20.0, steps_per_task=10))
    assert one.task == pytest.approx(3e-3) and ten.task == pytest.approx(3e-4)
    assert (ten.sync, ten.hop) == (one.sync, one.hop)  # per exchange, not per task
    assert overhead_spec(None) is None


def test_the_commands_a_sweep_prints_and_records_survive_a_shell(tmp_path, capsys):
    """A store in a folder with a space and an override with one: the closing line's
    report command and the store's `command` attr are quoted, so that they can be
    pasted into a shell as they are."""
    config = write_scaling(tmp_path, {"strategy": ["single", "kernel"]})
    store = str(tmp_path / "my results" / "tinyscale.zarr")
    argv = [config, "--out", store, "axes.hardware.devices=[1, 2]"]
    assert sweep_cli.main(argv) == 0
    assert f"report: python -m experiments.report {shlex.quote(store)})" in capsys.readouterr().out
    command = open_clean(store).attrs["command"]
    assert shlex.split(command) == ["python", "-m", "experiments.sweep", *argv]


def test_the_closing_lines_mark_a_speedup_whose_baseline_does_not_fit(tmp_path, capsys):
    """VGG-16 at batch 4096 does not fit one A100 (`baseline_fits` 0): the report marks
    such speedups with `*`, and the sweep's closing "best speedup" lines now do too,
    with the note; they read 79.9x unmarked before."""
    config = write_scaling(tmp_path, {"strategy": ["single", "data"],
                                      "hardware.devices": [1, 64]},
                           base={"network": {"preset": "vgg16"}, "train": {"batch": 4096},
                                 "hardware": {"devices": 1, "device": "a100",
                                              "link": {"gbps": 400}}})
    assert sweep_cli.main([config, "--out", str(tmp_path / "vgg.zarr")]) == 0
    out = capsys.readouterr().out
    assert open_clean(tmp_path / "vgg.zarr").baseline_fits.max() == 0
    (line,) = [line for line in out.splitlines() if "data: best speedup" in line]
    assert re.search(r"best speedup +[0-9.]+x\* \(efficiency", line), line
    assert UNFIT_NOTE in out


def test_the_closing_lines_write_a_swept_number_as_its_label(tmp_path, capsys):
    """A swept device rate is written as its coordinate's label (`flops=2e+14`), not
    as NumPy's float (`flops=200000000000000.0`)."""
    config = write_scaling(tmp_path, {"strategy": ["kernel"], "hardware.devices": [1, 2],
                                      "hardware.kinds.gpu.flops": [1e14, 2e14]},
                           base={"hardware": {"devices": 1, "device": "gpu"}})
    assert sweep_cli.main([config, "--out", str(tmp_path / "f.zarr")]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "best speedup" in line]
    assert re.search(r"flops=[12]e\+14\b", line) and "00000000" not in line, line
