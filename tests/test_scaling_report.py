"""A scaling sweep's report over grids other than the shipped ones, as a researcher
writes them for a paper: weak scaling (the batch zipped with the device count, so each
device keeps its share), and the report's figures and tables agreeing with the
store's per-point predictions.

Arithmetic only (no cluster): the real sweep and report commands, in-process, on small
networks.
"""

from __future__ import annotations

import io
import os

import matplotlib.image

from experiments.report import cli as report
from experiments.scaling.config import load_scaling_sweep
from experiments.scaling.run import run_scaling_sweep
from experiments.sweep.store_layout import DONE
from tests.test_scaling import write_scaling
from tests.test_sweep import open_clean

#: 8 samples a device: the batch moves with the device count.
WEAK = [{"hardware.devices": [1, 2, 4, 8], "train.batch": [8, 16, 32, 64]}]


def run_sweep(tmp_path, axes: dict, **extra) -> str:
    store = str(tmp_path / "out.zarr")
    sweep = load_scaling_sweep(write_scaling(tmp_path, axes, **extra), out=store)
    printed = io.StringIO()
    assert run_scaling_sweep(sweep, out=printed, argv=["test"]) == 0, printed.getvalue()
    return store


def section(text: str, title: str) -> list[list[str]]:
    """A report.md table's rows (header first), its cells stripped."""
    body = text.split(f"## {title}")[1].split("\n## ")[0]
    return [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in body.splitlines()
            if line.startswith("|") and not set(line) <= set("|-: ")]


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
