"""Predict-only sweeps over the zoo at ImageNet size: the config names every zoo
network, points that do not fit a device's memory are infeasible with their reason,
the report maps where each strategy wins per network, tabulates where kernel
overtakes data and where the hybrid wins, and the A100 anchor holds.

Arithmetic only (no cluster): the shipped zoo sweep cut down by overrides, in-process.
"""

from __future__ import annotations

import io
import math
import os

import matplotlib.image
import numpy as np
import pytest

from experiments.report import cli as report
from experiments.scaling.anchors import ANCHOR_BAND, a100_resnet50, krizhevsky_anchors
from experiments.scaling import hardware as hw
from experiments.scaling import memory_fit
from experiments.scaling.figure_style import speedup_text
from experiments.scaling.config import build_point, load_scaling_sweep, network_of, options_of
from experiments.scaling.regions import count_ranges, first_overtaking
from experiments.scaling.run import (assess_point, evaluate_grid, evaluate_point,
                                     run_scaling_sweep)
from experiments.sweep.store_layout import DONE, FAILED
from pipeline.config.schema import ConfigError
from pipeline.costmodel import alexnet, marques_cifar
from pipeline.costmodel.memory import Footprint
from pipeline.strategies import STRATEGIES
from tasks.zoo import PRESETS
from tests.test_costmodel_zoo import TORCHVISION, zoo_network
from tests.test_sweep import ROOT, open_clean

ZOO = os.path.join(ROOT, "experiments", "configs", "scaling_zoo.yaml")
#: The shipped zoo sweep cut to a few seconds: two networks, small clusters, one device.
SMALL = ["axes.network.preset.values=[alexnet,resnet20]", "axes.hardware.devices=[1,4,16]",
         "axes.train.batch=[8,256]", "axes.hardware.link.gbps.values=[1,100]",
         "axes.hardware.device.values=[a100]"]


def zoo_point(preset: str, **network) -> dict:
    return {"network": {"preset": preset, **network}, "hardware": {"device": "a100"}}


@pytest.mark.parametrize("preset", PRESETS)
def test_every_zoo_preset_is_the_network_the_engine_trains(preset):
    net = network_of(build_point(zoo_point(preset)).network)
    if preset == "alexnet":  # Krizhevsky's check's network: the zoo's without dropout
        assert net == alexnet() and net.params() == TORCHVISION["alexnet"][0]
    elif preset == "marques":
        assert net.params() == marques_cifar().params()
        assert [c.out_hw for c in net.conv] == [c.out_hw for c in marques_cifar().conv]
    else:
        assert net == zoo_network(preset)
    assert net.dense[-1].out_features == (10 if preset in ("resnet20", "marques") else 1000)


def test_width_scales_a_preset_as_in_training():
    net = network_of(build_point(zoo_point("vgg16", width=0.25)).network)
    assert net == zoo_network("vgg16", 0.25)
    assert network_of(build_point(zoo_point("alexnet", width=0.5)).network) == \
        zoo_network("alexnet", 0.5)


@pytest.mark.parametrize("network, names", [
    ({"preset": "vgg16", "image": 64}, ["network.image", "3x224x224"]),
    ({"preset": "resnet50", "hidden": [10]}, ["network.hidden", "resnet50"]),
    ({"preset": "resnet50", "width": 0}, ["network.width", "(0, 64]"]),
    ({"conv": [{"kernels": 8}], "width": 0.5}, ["network.width", "scales a preset"]),
])
def test_bad_zoo_networks_name_the_field(network, names):
    with pytest.raises(ConfigError) as error:
        build_point({"network": network})
    for name in names:
        assert name in str(error.value)


@pytest.fixture(scope="module")
def small_zoo_store(tmp_path_factory):
    """The shipped zoo sweep, networks chosen by the override the docs give."""
    store = str(tmp_path_factory.mktemp("zoo") / "zoo.zarr")
    sweep = load_scaling_sweep(ZOO, SMALL, out=store)
    printed = io.StringIO()
    status = run_scaling_sweep(sweep, out=printed, argv=["test"])
    return store, status, printed.getvalue()


def test_a_small_zoo_grid_runs(small_zoo_store):
    store, status, printed = small_zoo_store
    assert status == 0, printed
    ds = open_clean(store)
    assert list(ds.network.values) == ["alexnet", "resnet20"]
    assert dict(ds.sizes) == {"network": 2, "strategy": 4, "devices": 3, "batch": 2,
                              "link_gbps": 2, "device": 1, "repeat": 1}
    done = ds.status == DONE
    assert int(done.sum()) > 0.8 * ds.status.size
    # every predicted point carries its memory, and it fits
    assert (ds.memory_fits.where(done) == 1).sum() == done.sum()
    assert (ds.peak_memory.where(done) > 0).sum() == done.sum()


def test_points_that_do_not_fit_a_device_are_infeasible_with_their_reason(tmp_path):
    """A 1.6 GB device: alexnet's single step at batch 256 does not fit, data's share
    over 16 devices does; the first is recorded infeasible with the memory it needs."""
    sweep = load_scaling_sweep(ZOO, SMALL + ["hardware.kinds.a100.memory=1.6e9",
                                             "axes.strategy=[single,data]"],
                               out=str(tmp_path / "x.zarr"))
    outcome = evaluate_grid(sweep)
    at = {dim: i for i, dim in enumerate(sweep.dims)}
    single = (0, 0, 0, 1, 1, 0, 0)  # alexnet, single, 1 device, batch 256, 100 Gb/s
    assert [sweep.axes[at[d]].labels[single[at[d]]] for d in sweep.dims] == \
        ["alexnet", "single", "1", "256", "100", "a100"]
    assert outcome.status[single] == FAILED
    reason = str(outcome.failure[single])
    assert reason.startswith("Infeasible: out of memory: a device needs ")
    assert "more than the 1.6 GB of one `a100` (hardware.kinds.a100.memory)" in reason
    assert outcome.values["peak_memory"][single] > 1.6e9
    assert outcome.values["memory_fits"][single] == 0
    assert math.isnan(outcome.values["predicted_step_time"][single])
    data = (0, 1, 2, 1, 1, 0, 0)  # alexnet, data, 16 devices, batch 256
    assert outcome.status[data] == DONE and outcome.values["memory_fits"][data] == 1
    assert outcome.out_of_memory > 0 and outcome.errors == 0


def test_speedups_over_a_baseline_that_does_not_fit_are_marked(tmp_path):
    """On a 1.6 GB device alexnet's `single` at batch 256 does not fit: data's speedup
    there is against a step no device could run, so the store says so
    (`baseline_fits` 0) and the report's table marks it and says why; at batch 8 the
    baseline fits and nothing is marked."""
    store = str(tmp_path / "x.zarr")
    run_scaling_sweep(load_scaling_sweep(ZOO, SMALL + ["hardware.kinds.a100.memory=1.6e9",
                                                       "axes.strategy=[single,data]",
                                                       "axes.network.preset.values=[alexnet]"],
                                         out=store))
    ds = open_clean(store)
    data = ds.sel(strategy="data", devices=4).isel(repeat=0)
    assert list(data.baseline_fits.sel(batch=256).values.ravel()) == [0.0, 0.0]
    assert list(data.baseline_fits.sel(batch=8).values.ravel()) == [1.0, 1.0]
    out_dir = str(tmp_path / "report")
    report.make_report(store, out_dir)
    table = open(os.path.join(out_dir, "report.md"), encoding="utf-8").read().split(
        "## Fastest strategy and its speedup")[1].split("##")[0]
    header = [cell.strip() for cell in table.splitlines()[2].strip("|").split("|")]
    batch = header.index("batch")
    rows = {}
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if cells[0] == "alexnet":
            rows.setdefault(cells[batch], []).append(cells[batch + 1:])
    assert sorted(rows) == ["256", "8"], rows
    # the mark follows the speedup and its unit: "data 2.0x*"
    assert all(cell.endswith("x*") for row in rows["256"] for cell in row[1:]), rows
    assert not any("*" in cell for row in rows["8"] for cell in row), rows
    assert "`single` does not fit one device's memory" in table


def test_a_speedup_keeps_a_significant_figure():
    assert speedup_text(0.0026) == "0.003" and speedup_text(0.5) == "0.5"
    assert speedup_text(12.4) == "12" and speedup_text(1.3, 0.0) == "1.3*"
    assert speedup_text(math.nan) == ""


def test_a_memory_model_without_a_figure_leaves_the_point_predicted(monkeypatch):
    """A strategy whose memory model gives NaN: predicted, its fit unknown."""
    monkeypatch.setattr(STRATEGIES["data"], "peak_memory",
                        lambda *args, **kwargs: Footprint([math.nan] * 4, [{}] * 4))
    sweep = load_scaling_sweep(ZOO, SMALL + ["axes.strategy=[data]"], out="unused.zarr")
    outcome = evaluate_grid(sweep)
    assert (outcome.status == DONE).sum() > 0 and outcome.errors == 0
    done = outcome.status == DONE
    assert np.isnan(outcome.values["memory_fits"][done]).all()
    assert np.isfinite(outcome.values["predicted_step_time"][done]).all()


def test_the_report_maps_each_network_and_tabulates_the_regions(small_zoo_store):
    store, _, _ = small_zoo_store
    out_dir = os.path.join(os.path.dirname(store), "report")
    paths = [os.path.basename(p) for p in report.make_report(store, out_dir)]
    for name in ("winner_alexnet.png", "winner_resnet20.png"):
        assert name in paths
        image = matplotlib.image.imread(os.path.join(out_dir, name))
        assert image.shape[0] > 200 and image[..., :3].std() > 0.05, name
    text = open(os.path.join(out_dir, "report.md"), encoding="utf-8").read()
    assert "](winner_alexnet.png)" in text
    crossover = text.split("## Where kernel parallelism overtakes data parallelism")[1]
    assert "| network | batch | device | 1 Gb/s | 100 Gb/s |" in crossover
    assert "| alexnet | 256 | a100 |" in crossover.split("##")[0]
    assert "## Where the hybrid wins" in text
    anchors = text.split("## Anchors")[1]
    assert "| one A100 (`a100` preset), ResNet-50, batch 256, TF32 | 1400 images/s |" in anchors
    assert "Krizhevsky's hybrid, 8 K20 GPUs" in anchors


def test_overtaking_and_ranges_read_the_grid_in_order():
    counts = [1, 4, 16, 64]
    nan = math.nan
    kernel, data = np.array([1.0, 0.5, 0.2, 0.3]), np.array([1.0, 0.4, 0.3, nan])
    assert first_overtaking(kernel, data, counts) == "16"
    assert first_overtaking(data[:2], kernel[:2], counts[:2]) == "4"
    assert first_overtaking(kernel[:2], data[:2], counts[:2]) == "none"  # a tie is not
    # one device is no parallelism, whatever the two strategies' prices there
    assert first_overtaking(np.array([0.9, 0.5]), np.array([1.0, 0.4]), [1, 4]) == "none"
    assert first_overtaking(np.array([nan, 1.0]), np.array([1.0, nan]), [1, 4]) == "-"
    assert count_ranges(counts, np.array([False, True, True, False])) == "4-16"
    assert count_ranges(counts, np.array([True, False, True, True])) == "1, 16-64"
    assert count_ranges(counts, np.zeros(4, dtype=bool)) == "none"


def test_the_a100_preset_trains_resnet50_near_nvidias_rate():
    anchor = a100_resnet50()
    assert 1 / ANCHOR_BAND <= anchor.ratio <= ANCHOR_BAND, anchor
    assert anchor.published == 1400.0
    assert all(0.8 < a.ratio < 1.25 for a in krizhevsky_anchors())



def test_local_batch_norm_drops_the_statistics_exchanges():
    """`train.batch_norm: local`: ResNet-50's replicas exchange no batch-norm statistics
    (two small all-reduces a layer and step under `sync`); AlexNet has none to drop."""
    def step(preset: str, batch_norm: str) -> float:
        return evaluate_point(build_point({
            "strategy": "data", "network": {"preset": preset},
            "train": {"batch": 256, "batch_norm": batch_norm},
            "hardware": {"devices": 64, "device": "a100", "link": {"gbps": 10}}}))[
                "predicted_step_time"]

    assert step("resnet50", "local") < step("resnet50", "sync")
    assert step("alexnet", "local") == step("alexnet", "sync")


def test_points_differing_in_link_share_one_memory_walk_with_the_same_peaks():
    """The footprint is kept for the next points (memory_fit.py); what it gives is the
    strategy's own count for each point."""
    memory_fit._footprint.cache_clear()
    peaks = []
    for gbps in (1, 100, 400):
        point = build_point({"strategy": "kernel", "network": {"preset": "resnet20"},
                             "train": {"batch": 64},
                             "hardware": {"devices": 8, "device": "a100", "link": {"gbps": gbps}}})
        figures, _ = assess_point(point)
        strategy = STRATEGIES["kernel"]
        prediction = strategy.model(network_of(point.network), 64, *_model_inputs(point))
        direct = strategy.peak_memory(network_of(point.network), 64,
                                      strategy.split_of_prediction(prediction),
                                      gpu=[True] * 8)
        assert figures["peak_memory"] == direct.largest
        peaks.append(figures["peak_memory"])
    assert len(set(peaks)) == 1
    # one walk for kernel's split, one for the speedup's baseline (`single` on a device)
    assert memory_fit._footprint.cache_info().misses == 2


def _model_inputs(point):
    """`Strategy.model`'s devices, link, store and options for `point`."""
    devices, _ = hw.device_list(point.hardware)
    return (devices, hw.link_spec(point.hardware.link), hw.store_spec(point.hardware.store),
            options_of(point))
