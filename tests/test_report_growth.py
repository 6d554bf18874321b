"""How cost grows in the report (experiments/report/growth.py), on a tiny synthetic
store: which strategies get a figure, which points each panel shows, the figure; and
the strategies figure on a store without predictions or a baseline."""

from __future__ import annotations

import json

import matplotlib.image
import numpy as np
import xarray as xr

from experiments.report.growth import (growth_figure, growth_panels, growth_rows, growth_section,
                                       growth_strategies)
from experiments.report.view import BREAKDOWN_FIGURES, POINT_FIGURES, StoreView
from experiments.sweep.store_layout import DONE, SKIPPED

STRATEGIES, BATCHES = ["single", "kernel"], [32, 128, 512]
WORKERS = ["1", "2", "0.5+0.5+0.5+0.5"]


def _store() -> xr.Dataset:
    """Compute grows with the batch and shrinks with the workers; `single` ran at one
    worker only; kernel at 512 on the emulated four has no figures (failed)."""
    shape = (len(STRATEGIES), len(BATCHES), len(WORKERS), 1)
    dims = ("strategy", "batch", "workers", "repeat")
    status = np.full(shape, DONE, dtype=np.int8)
    status[0, :, 1:, 0] = SKIPPED
    status[1, 2, 2, 0] = 2
    b = np.array(BATCHES, dtype=float)[None, :, None, None]
    w = np.array([1.0, 2.0, 4.0])[None, None, :, None]
    compute = 0.001 * b / w
    components = {"critical_compute": compute,
                  "critical_exchange": 0.01 * (w - 1) + 0 * b,
                  "critical_dataset": 0.0001 * b + 0 * w,
                  "critical_wait": 0.002 * (w - 1) + 0 * b,
                  "critical_client": 0.005 + 0 * b * w}
    step = sum(components.values())
    data = {name: (dims, np.broadcast_to(values, shape).copy()) for name, values in
            components.items()}
    data.update({"predicted_compute": (dims, np.broadcast_to(0.9 * compute, shape).copy()),
                 "predicted_exchange": (dims, np.broadcast_to(components["critical_exchange"],
                                                              shape).copy()),
                 "predicted_wait": (dims, np.full(shape, 0.002)),
                 "predicted_client": (dims, np.full(shape, 0.004))})
    for name in POINT_FIGURES:
        data.setdefault(name, (dims, np.full(shape, 1.0)))
    data["step_time"] = (dims, np.broadcast_to(step, shape).copy())
    data["predicted_step_time"] = (dims, np.broadcast_to(
        0.9 * compute + components["critical_exchange"] + 0.004, shape).copy())
    data["status"] = (dims, status)
    return xr.Dataset(data, coords={"strategy": STRATEGIES, "batch": BATCHES,
                                    "workers": WORKERS, "repeat": [0]},
                      attrs={"sweep_name": "growth", "speedup_baseline": "single",
                             "axes": json.dumps({"strategy": ["strategy"],
                                                 "batch": ["train.batch"],
                                                 "workers": ["cluster.workers"]})})


def test_each_strategy_grown_along_a_dim_gets_its_panels():
    sweep = StoreView(_store())
    frame = sweep.points()
    assert set(BREAKDOWN_FIGURES) <= set(frame.columns)
    assert growth_strategies(sweep, frame) == ["single", "kernel"]
    rows, fixed = growth_rows(sweep, frame, "kernel", "batch")
    # the last workers value with figures, the emulated four, where 512 failed: left out
    assert list(rows["batch"]) == ["32", "128"] and fixed == "workers 0.5+0.5+0.5+0.5"
    rows, fixed = growth_rows(sweep, frame, "kernel", "workers", {"batch": "512"})
    assert list(rows["workers"]) == ["1", "2"] and fixed == "batch 512"
    assert np.allclose(rows["critical_compute"], [0.512, 0.256])
    rows, fixed = growth_rows(sweep, frame, "single", "workers")
    assert list(rows["workers"]) == ["1"]  # single ran at one worker: no workers panel
    # kernel: against batch at each worker set, against workers at each batch
    grid = growth_panels(sweep, frame, "kernel")
    assert [[(dim, fixed) for dim, _rows, fixed in row] for row in grid] == [
        [("batch", "workers 1"), ("batch", "workers 2"), ("batch", "workers 0.5+0.5+0.5+0.5")],
        [("workers", "batch 32"), ("workers", "batch 128"), ("workers", "batch 512")]]
    assert [[(dim, fixed) for dim, _rows, fixed in row]
            for row in growth_panels(sweep, frame, "single")] == [[("batch", "workers 1")]]
    assert growth_strategies(StoreView(_store().drop_vars(BREAKDOWN_FIGURES)),
                             frame.drop(columns=BREAKDOWN_FIGURES)) == []


def test_the_growth_figure_and_its_section(tmp_path):
    sweep = StoreView(_store())
    frame = sweep.points()
    for strategy in ("single", "kernel"):
        path = str(tmp_path / f"growth_{strategy}.png")
        assert growth_figure(sweep, frame, strategy, path)
        image = matplotlib.image.imread(path)
        assert image.shape[1] > 400 and image[..., :3].std() > 0.05
    older = StoreView(_store().drop_vars("predicted_wait"))  # written before the model had it
    assert growth_figure(older, older.points(), "kernel", str(tmp_path / "older.png"))
    lines = growth_section(["speedup.png", "growth_single.png", "growth_kernel.png"])
    assert lines[0] == "## How cost grows"
    assert "![How kernel grows](growth_kernel.png)" in lines
    assert growth_section(["speedup.png"]) == []


def test_the_strategies_figure_draws_no_prediction_the_store_lacks(monkeypatch, tmp_path):
    """Without predictions (CNN_PREDICT_PROBE=never) the step-time panel has no
    "predicted" legend entry, and without a done baseline the speedup panel says so."""
    from experiments.report import strategies
    shape, dims = (3, 2, 1), ("strategy", "batch", "repeat")
    data = {name: (dims, np.full(shape, 1.0)) for name in POINT_FIGURES}
    data["predicted_step_time"] = (dims, np.full(shape, np.nan))
    data["speedup"] = (dims, np.full(shape, np.nan))
    data["status"] = (dims, np.full(shape, DONE, dtype=np.int8))
    ds = xr.Dataset(data, coords={"strategy": ["kernel", "data", "hybrid"], "batch": [8, 16],
                                  "repeat": [0]},
                    attrs={"sweep_name": "s", "speedup_baseline": "single",
                           "axes": json.dumps({"strategy": ["strategy"],
                                               "batch": ["train.batch"]})})
    drawn = []
    monkeypatch.setattr(strategies, "save_figure", lambda fig, path: drawn.append(fig))
    sweep = StoreView(ds)
    assert strategies.strategies_figure(sweep, sweep.points(), str(tmp_path / "s.png"))
    steps, speedup, _bytes = drawn[0].axes
    assert [t.get_text() for t in steps.get_legend().get_texts()] == ["batch 8", "batch 16"]
    assert speedup.get_title() == "speedup over 'single' (none: no done point of it)"


def test_the_strategies_figure_leaves_a_failed_largest_point_empty(monkeypatch, tmp_path):
    """Each strategy is drawn at its most workers: where that point failed, the figure
    drew the strategy's next point down (data on 1 worker beside kernel on 2) under a
    title saying 'each at its largest'. Now the slot is empty and says why, and each
    strategy's tick names the workers its bars are at."""
    from experiments.report import strategies
    shape, dims = (3, 2, 1), ("strategy", "workers", "repeat")
    data = {name: (dims, np.full(shape, 1.0)) for name in POINT_FIGURES}
    workers = np.array([1.0, 2.0])[None, :, None]
    data["step_time"] = (dims, np.broadcast_to(1.0 / workers, shape).copy())
    data["speedup"] = (dims, np.broadcast_to(workers, shape).copy())
    data["capacity"] = data["n_workers"] = (dims, np.broadcast_to(workers, shape).copy())
    status = np.full(shape, DONE, dtype=np.int8)
    status[0, 1, 0] = SKIPPED  # single: one worker only
    status[2, 1, 0] = 2  # data on 2 workers failed
    for name in POINT_FIGURES:
        data[name][1][status != DONE] = np.nan
    data["status"] = (dims, status)
    ds = xr.Dataset(data, coords={"strategy": ["single", "kernel", "data"],
                                  "workers": ("workers", [1, 2],
                                              {"fields": '["cluster.workers"]'}),
                                  "repeat": [0]},
                    attrs={"sweep_name": "s", "speedup_baseline": "single",
                           "axes": json.dumps({"strategy": ["strategy"],
                                               "workers": ["cluster.workers"]})})
    drawn = []
    monkeypatch.setattr(strategies, "save_figure", lambda fig, path: drawn.append(fig))
    sweep = StoreView(ds)
    assert strategies.strategies_figure(sweep, sweep.points(), str(tmp_path / "s.png"))
    steps = drawn[0].axes[0]
    assert [t.get_text() for t in steps.get_xticklabels()] == [
        "single\nworkers 1", "kernel\nworkers 2", "data\nworkers 2"]
    heights = [bar.get_height() for bar in steps.patches]
    assert heights[:2] == [1.0, 0.5] and np.isnan(heights[2])
    assert [t.get_text().strip() for t in steps.texts] == ["failed"]
