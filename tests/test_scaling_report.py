"""A scaling sweep's report over grids other than the shipped ones, as a researcher
writes them for a paper: weak scaling (the batch zipped with the device count, so each
device keeps its share), and the report's figures and tables agreeing with the
store's per-point predictions.

Arithmetic only (no cluster): the real sweep and report commands, in-process, on small
networks.
"""

from __future__ import annotations

import io
import json
import os
import re

import matplotlib.image
import pytest

from experiments.report import cli as report
from experiments.scaling.config import build_point, load_scaling_sweep, network_of
from experiments.scaling import figure_style, speedup_figure
from experiments.scaling.anchors import anchor_records
from experiments.scaling.run import _attrs as scaling_attrs
from experiments.scaling.run import _replace_store as replace_store
from experiments.scaling.run import build_dataset, evaluate_grid, run_scaling_sweep
from experiments.scaling.speedup_figure import draw_speedup
from experiments.scaling.view import ScalingView
from experiments.sweep.store_layout import DONE
from pipeline.config.run_config import load_run_config
from pipeline.config.schema import ConfigError, to_dict
from pipeline.probe.tables import costmodel_network
from tests.test_report_gaps import close_unsaved
from tests.test_scaling import write_scaling
from tests.test_sweep import ROOT, open_clean

#: 8 samples a device: the batch moves with the device count.
WEAK = [{"hardware.devices": [1, 2, 4, 8], "train.batch": [8, 16, 32, 64]}]


def run_sweep(tmp_path, axes: dict, **extra) -> str:
    store = str(tmp_path / "out.zarr")
    sweep = load_scaling_sweep(write_scaling(tmp_path, axes, **extra), out=store)
    printed = io.StringIO()
    assert run_scaling_sweep(sweep, out=printed, argv=["test"]) == 0, printed.getvalue()
    return store


@pytest.fixture
def unrendered(monkeypatch) -> None:
    """The report's figures drawn but neither laid out nor written, for a test that
    reads report.md only (laying out and writing the PNGs is most of a report's CPU;
    the tests below that look at the figures render them)."""
    for module in (figure_style, speedup_figure):
        monkeypatch.setattr(module, "save_figure", close_unsaved)


def section(text: str, title: str) -> list[list[str]]:
    """A report.md table's rows (header first), its cells stripped."""
    body = text.split(f"## {title}")[1].split("\n## ")[0]
    return [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in body.splitlines()
            if line.startswith("|") and not re.fullmatch(r"\|(:?-+:?\|)+", line)]


def test_a_weak_scaling_grid_gets_its_report(tmp_path):
    """Devices zipped with the batch: one dim holds both. The report draws what that
    dim allows (no devices x batch map: the batch is no dim of its own), labels the
    axis with both fields, and its tables read each position's device count."""
    store = run_sweep(tmp_path, {"strategy": ["single", "kernel", "data", "hybrid"],
                                 "hardware.link.gbps": {"dim": "link_gbps",
                                                        "values": [1, 100]}}, zip=WEAK)
    ds = open_clean(store)
    assert list(ds.hardware_devices.values) == [1, 2, 4, 8]
    out_dir = str(tmp_path / "report")
    paths = [os.path.basename(p) for p in report.make_report(store, out_dir)]
    assert paths == ["winner_workers_bandwidth.png", "scaling_speedup.png", "report.md"]
    for name in paths[:-1]:
        image = matplotlib.image.imread(os.path.join(out_dir, name))
        assert image.shape[0] > 200 and image[..., :3].std() > 0.05, name
    text = open(os.path.join(out_dir, "report.md"), encoding="utf-8").read()
    crossover = section(text, "Where kernel parallelism overtakes data parallelism")
    assert crossover[0] == ["1 Gb/s", "100 Gb/s"]
    t = ds.predicted_step_time.where(ds.status == DONE).isel(repeat=0)
    for column, link in enumerate([1, 100]):
        kernel = t.sel(strategy="kernel", link_gbps=link).values
        data = t.sel(strategy="data", link_gbps=link).values
        faster = [n for n, k, d in zip([1, 2, 4, 8], kernel, data) if n > 1 and k < d]
        assert crossover[1][-2 + column] == (str(faster[0]) if faster else "none")


def test_the_report_says_what_every_point_stands_on(tmp_path, unrendered):
    """Fields not swept (the link's latency, the all-reduce, the device kind and its
    capacity) are in report.md, swept ones are not repeated there; without a link
    axis the region tables name the base's link; the anchors say they stand on the
    stock presets, and that this sweep's `a100` (its rate set by the sweep) is not one."""
    store = run_sweep(tmp_path, {"strategy": ["single", "kernel", "data"],
                                 "hardware.devices": [1, 2, 4]},
                      base={"hardware": {"devices": 1, "device": "a100",
                                         "kinds": {"a100": {"flops": 5.0e13,
                                                            "memory": 1.6e9}},
                                         "link": {"gbps": 25, "latency_us": 7}},
                            "options": {"allreduce": "rhd"}})
    out_dir = str(tmp_path / "report")
    report.make_report(store, out_dir)
    text = open(os.path.join(out_dir, "report.md"), encoding="utf-8").read()
    shared = next(line for line in text.splitlines() if line.startswith("- every point"))
    for item in ("`hardware.link.latency_us=7.0`", "`hardware.link.gbps=25.0`",
                 "`options.allreduce=\"rhd\"`", "`hardware.device=\"a100\"`",
                 "`train.batch=16`", "`hardware.store=null`"):
        assert item in shared, (item, shared)
    assert "strategy=" not in shared and "hardware.devices" not in shared
    assert "hardware.kinds" not in shared  # the device kinds have their own lines
    kinds = text.split("Device kinds:")[1].split("##")[0]
    assert "`a100`: 50 TFLOP/s" in kinds and "holds 1.6 GB" in kinds
    assert section(text, "Where kernel parallelism overtakes data parallelism")[0] == \
        ["25 Gb/s"]
    anchors = text.split("## Anchors")[1]
    assert "on the stock `a100` and `k20` presets" in anchors
    assert "This sweep's `a100` is not the stock preset" in anchors


def test_out_of_memory_points_are_grouped_by_kind_not_by_size(tmp_path):
    """Alike reasons are one line in report.md, whatever sizes they name (12.2 TB, 80.6
    GB); sizes from 1000 GB are written in TB."""
    store = run_sweep(tmp_path, {"strategy": ["single"],
                                 "train.batch": [2048, 3000, 4096, 65536]},
                      base={"network": {"preset": "vgg16"},
                            "hardware": {"devices": 1, "device": "a100"}})
    ds = open_clean(store)
    reasons = {str(f) for f in ds.failure.values.ravel() if str(f)}
    assert len(reasons) >= 3, reasons
    assert any(" TB, more than the 80 GB of one `a100`" in r for r in reasons), reasons
    assert not any("e+" in r for r in reasons), reasons
    out_dir = str(tmp_path / "report")
    report.make_report(store, out_dir)
    text = open(os.path.join(out_dir, "report.md"), encoding="utf-8").read()
    listed = [line for line in text.split("## Points without a prediction")[1].splitlines()
              if line.startswith("- ")]
    assert len(listed) <= 2, listed  # GB and TB
    assert sum(int(line.split()[1]) for line in listed) == len(
        [f for f in ds.failure.values.ravel() if str(f)])


def test_a_swept_preset_field_carries_its_units_and_reads_in_the_tables(tmp_path):
    """An axis over a device kind's memory bandwidth (the zoo sweep's own example):
    the coordinate says B/s, and report.md's tables read "1e+12 B/s"-like values, not
    a thirteen-digit integer; a zipped field's coordinate has its units too."""
    store = run_sweep(tmp_path, {"strategy": ["single", "kernel", "data"],
                                 "hardware.kinds.cpu.mem_bw": {
                                     "dim": "mem_bw", "values": [1.0e12, 2.039e12]}},
                      zip=[{"hardware.devices": [1, 2, 4], "train.batch": [16, 32, 64]}])
    ds = open_clean(store)
    assert ds.mem_bw.attrs["units"] == "B/s"
    assert ds.hardware_devices.attrs["units"] == "devices"
    assert ds.batch.attrs["units"] == "samples"
    out_dir = str(tmp_path / "report")
    report.make_report(store, out_dir)
    text = open(os.path.join(out_dir, "report.md"), encoding="utf-8").read()
    rows = section(text, "Fastest strategy and its speedup")
    assert rows[0][0] == "mem_bw (B/s)"
    assert [row[0] for row in rows[1:]] == ["1e+12", "2.039e+12"]
    assert "1000000000000" not in text


def test_a_network_of_your_own_layers_is_predicted_as_a_run_builds_it(tmp_path):
    """`network.layers` as in a run config (configs/custom_resnet.yaml): the scaling
    point's network is the one the engine trains at that image size (it was refused
    as an unknown key), a bad layer is named by its path, and the sweep runs."""
    run = load_run_config(os.path.join(ROOT, "configs", "custom_resnet.yaml"))
    layers = [to_dict(layer) for layer in run.network.layers]
    point = build_point({"network": {"layers": layers, "classes": 10}})
    assert network_of(point.network) == costmodel_network(run.network_spec((3, 32, 32)))
    wide = build_point({"network": {"layers": layers, "width": 0.5, "image": 64}})
    run.network.width = 0.5
    assert network_of(wide.network) == costmodel_network(run.network_spec((3, 64, 64)))
    for network, words in (({"layers": layers, "conv": [{"kernels": 8}]}, "network.conv"),
                           ({"layers": layers, "preset": "resnet20"}, "network.layers"),
                           ({"layers": [{"pool": "max"}]}, "network.layers.0.pool"),
                           ({"layers": [{"conv": 0}]}, "network.layers.0.conv"),
                           ({"layers": [{"conv": 8}, {"pool": "max", "size": 4}], "image": 2},
                            "network.layers: the network does not fit images of 2x2")):
        with pytest.raises(ConfigError, match="^" + words.replace(".", r"\.")):
            build_point({"network": network})
    store = run_sweep(tmp_path, {"strategy": ["single", "kernel", "data"],
                                 "hardware.devices": [1, 2, 4]},
                      base={"network": {"layers": layers}})
    ds = open_clean(store)
    assert int((ds.status == DONE).sum()) == 9


def test_a_figure_says_which_device_and_links_it_stands_on(tmp_path):
    """The figures' subtitle (`ScalingView.layout`'s text): the device kind and the
    link where they are not swept, and a dim swept over one value (the device here),
    which the figures left unsaid, as if any device would do."""
    store = run_sweep(tmp_path, {"strategy": ["single", "kernel"],
                                 "hardware.devices": [1, 2],
                                 "hardware.link.latency_us": {"dim": "latency",
                                                              "values": [5]}},
                      base={"hardware": {"devices": 1, "device": "a100",
                                         "link": {"gbps": 25, "latency_us": 5}}})
    view = ScalingView(open_clean(store))
    _, _, text = view.layout([view.strategy_dim, view.workers_dim])
    assert text == "device a100, link 25 Gb/s, latency 5 us", text
    (tmp_path / "kind").mkdir()
    store = run_sweep(tmp_path / "kind", {"strategy": ["single", "kernel"],
                                          "hardware.devices": [1, 2],
                                          "hardware.device": {"dim": "device",
                                                              "values": ["h100"]}})
    view = ScalingView(open_clean(store))
    _, _, text = view.layout([view.strategy_dim, view.workers_dim])
    assert text == "link 10 Gb/s, latency 5 us, device h100", text


def test_a_network_zipped_with_its_width_gets_its_maps(tmp_path):
    """`network.preset` zipped with `network.width`: labels such as "vgg16/0.25" named
    the per-network map's file, a folder that is not there (a bare traceback)."""
    store = run_sweep(tmp_path, {"strategy": ["single", "kernel", "data"],
                                 "hardware.devices": [1, 2],
                                 "hardware.link.gbps": {"dim": "link_gbps",
                                                        "values": [10, 100]}},
                      base={"network": {"preset": "vgg16"},
                            "hardware": {"devices": 1, "device": "a100"}},
                      zip=[{"network.preset": ["vgg16", "resnet18"],
                            "network.width": [0.25, 0.5]}])
    out_dir = str(tmp_path / "report")
    paths = [os.path.basename(p) for p in report.make_report(store, out_dir)]
    assert "winner_vgg16_0.25.png" in paths and "winner_resnet18_0.5.png" in paths, paths
    text = open(os.path.join(out_dir, "report.md"), encoding="utf-8").read()
    assert "](winner_vgg16_0.25.png)" in text
    assert sorted(os.listdir(out_dir)) == sorted(paths)


def test_the_speedup_figure_marks_what_its_note_says(tmp_path):
    """Weak scaling of VGG-16 on 80 GB devices: `single` does not fit one device at the
    larger batches. The line plot's note said "*: ..." of a mark it never drew; such
    points are now open markers, and the note says so. One batch (no batch dim) is
    drawn at full strength, not as the faintest of several."""
    store = run_sweep(tmp_path, {"strategy": ["single", "data"]},
                      base={"network": {"preset": "vgg16"},
                            "hardware": {"devices": 1, "device": "a100"}},
                      zip=[{"hardware.devices": [1, 4, 16],
                            "train.batch": [256, 1024, 4096]}])
    ds = open_clean(store)
    assert list(ds.baseline_fits.sel(strategy="data").isel(repeat=0).values) == [1, 1, 0]
    fig = draw_speedup(ScalingView(ds))
    title = fig._suptitle.get_text()
    assert "open markers: `single` does not fit" in title and "*" not in title, title
    lines = [line for line in fig.axes[0].lines if len(line.get_xdata())]
    open_marks = [line for line in lines if line.get_markerfacecolor() == "white"]
    assert [list(line.get_ydata()) for line in open_marks] == [
        [float(ds.speedup.sel(strategy="data", devices="16/4096").item())]]
    assert all((line.get_alpha() or 1.0) == 1.0 for line in lines if line.get_color() != "0.6")


def test_a_small_grid_or_one_point_reports_every_prediction(tmp_path, unrendered):
    """A sweep of one point (no axes) printed no prediction and wrote a report.md with
    an empty Figures heading and no number; a small grid now lists every point's
    prediction, or why it has none, as the store holds them. A hybrid that can never
    run is '-' in its region table, as in the crossover table, not 'none'."""
    store = run_sweep(tmp_path, {}, base={"strategy": "kernel",
                                          "hardware": {"devices": 4, "device": "a100"}})
    out_dir = str(tmp_path / "report")
    assert [os.path.basename(p) for p in report.make_report(store, out_dir)] == ["report.md"]
    text = open(os.path.join(out_dir, "report.md"), encoding="utf-8").read()
    assert "## Figures" not in text
    [row] = section(text, "Every point")[1:]
    ds = open_clean(store)
    assert float(row[0]) == float(f"{ds.predicted_step_time.item():.4g}")
    assert row[-1] == ""
    (tmp_path / "none").mkdir()
    store = run_sweep(tmp_path / "none", {"strategy": ["data", "hybrid"],
                                          "hardware.devices": [2, 4]},
                      base={"train": {"batch": 1}})
    report.make_report(store, out_dir)
    text = open(os.path.join(out_dir, "report.md"), encoding="utf-8").read()
    rows = section(text, "Every point")
    assert rows[0][:3] == ["strategy", "devices", "step (s)"] and len(rows) == 5
    assert all(row[2] == "-" and row[-1].startswith("Infeasible: batch 1 is smaller")
               for row in rows[1:])
    assert section(text, "Where the hybrid wins")[1] == ["-"]


def test_the_anchors_are_the_sweeps_not_the_reports(tmp_path, unrendered):
    """The anchors table was computed when the report was written, by whatever code
    then ran, beside predictions made by the sweep's code (whose revision report.md
    names). The sweep keeps them in its store and the report prints those; a store
    without them gets today's, said so with the revision that computed them."""
    config = write_scaling(tmp_path, {"strategy": ["single", "kernel"],
                                      "hardware.devices": [1, 2]})
    sweep = load_scaling_sweep(config, out=str(tmp_path / "s.zarr"))
    outcome = evaluate_grid(sweep)
    attrs = scaling_attrs(sweep, ["test"], "2026-01-01T00:00:00+0000")
    assert json.loads(attrs["anchors"]) == anchor_records()
    older = [{**record, "predicted": 2 * record["published"]}  # that code's figures
             for record in anchor_records()]
    for name, anchors in (("kept", json.dumps(older)), ("none", None)):
        store = str(tmp_path / f"{name}.zarr")
        kept = {key: value for key, value in attrs.items() if key != "anchors"}
        replace_store(build_dataset(sweep, outcome, {**kept, **(
            {"anchors": anchors} if anchors else {})}), store)
        out_dir = str(tmp_path / f"{name}-report")
        report.make_report(store, out_dir)
        text = open(os.path.join(out_dir, "report.md"), encoding="utf-8").read()
        rows = section(text, "Anchors")[1:]
        ratios = [row[-1] for row in rows]
        if anchors:
            assert ratios == ["2.00"] * len(older), rows
            assert "predicted by the sweep's code" in text
        else:
            assert ratios != ["2.00"] * len(older), rows
            assert "predicted now by code revision" in text
