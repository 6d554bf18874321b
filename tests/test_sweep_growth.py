"""Growing a sweep's store (``--extend``): which changes are growth (`plan_growth`,
pure, on the configs' YAML), the grown store's derived figures over a baseline that
moved (the store alone, its points written by hand: no training), and a scaling
sweep, which is rewritten whole. A measured sweep grown end to end, refused, and
stopped at each step of its growth is in tests/test_sweep_integrity.py."""

from __future__ import annotations

import os

import numpy as np
import pytest
import xarray as xr
import yaml

from experiments.report.markdown import _provenance
from experiments.sweep import store_growth
from experiments.sweep.config import load_sweep
from experiments.sweep.growth import Growth, plan_growth
from experiments.sweep.results import PointResult, ResultStore, StoreMismatch
from experiments.sweep.store_growth import GROWING, grow_store
from experiments.sweep.store_layout import DONE, build_template
from tests.helpers import run_main
from tests.test_scaling import write_scaling
from tests.test_sweep import write_sweep

BASE = {"name": "s", "base": {"train": {"lr": 0.1}},
        "axes": {"strategy": ["single", "kernel"], "train.batch": [8, 16]},
        "zip": [{"dim": "size", "fields": {"network.conv.0.kernels": [4, 8],
                                            "network.conv.1.kernels": [8, 16]}}],
        "repeats": 1, "output": None}


def grown(**changes) -> str:
    """BASE's YAML with top-level keys replaced."""
    return yaml.safe_dump({**BASE, **changes}, sort_keys=False)


STORED = grown()


def test_more_repeats_and_added_values_are_growth():
    plan = plan_growth(STORED, grown(
        repeats=3, axes={"strategy": ["single", "kernel"], "train.batch": [32, 16, 8]},
        zip=[{"dim": "size", "fields": {"network.conv.0.kernels": [4, 8, 2],
                                        "network.conv.1.kernels": [8, 16, 4]}}]))
    assert isinstance(plan, Growth), plan
    assert plan.moves == ((0, 1), (2, 1), (0, 1), (0,))  # batch 8 -> 2, 16 -> 1
    assert plan.new_shape == (2, 3, 3, 3) and plan.new_points == 54 - 8
    assert plan.new_region((1, 0, 1, 0)) == (1, 2, 1, 0)
    assert plan.changes == ("repeats: 1 there, 3 here",
                            "axes.train.batch: [8, 16] there, [32, 16, 8] here",
                            "zip.0: {network.conv.0.kernels: [4, 8], network.conv.1.kernels: "
                            "[8, 16]} there, {network.conv.0.kernels: [4, 8, 2], "
                            "network.conv.1.kernels: [8, 16, 4]} here")


def test_what_the_fingerprint_does_not_see_does_not_block_growth():
    plan = plan_growth(STORED, grown(repeats=2, output="elsewhere.zarr",
                                     keep_checkpoints=True))
    assert isinstance(plan, Growth) and plan.new_points == 8


@pytest.mark.parametrize("changes, first", [
    ({"repeats": 2, "axes": {"strategy": ["single"], "train.batch": [8, 16, 32]}},
     "axes.strategy: [single, kernel] there, [single] here"),
    ({"repeats": 2, "base": {"train": {"lr": 0.2}}}, "base.train.lr: 0.1 there, 0.2 here"),
    ({"repeats": 0}, "repeats: 1 there, 0 here"),
    ({"axes": {"strategy": ["single", "kernel"], "train.batch": [16, 8]}},  # moved only
     "axes.train.batch: [8, 16] there, [16, 8] here"),
    ({"axes": {"strategy": ["single", "kernel"],
               "train.batch": {"dim": "b", "values": [8, 16, 32]}}},  # another dim
     "axes.train.batch.dim: (none) there, b here"),
    ({"axes": {"strategy": ["single", "kernel"], "train.batch": [8, 16], "train.lr": [0.1]}},
     "axes.train.lr: (none) there, [0.1] here"),  # a new axis is another grid
    ({"axes": {"train.batch": [8, 16, 32], "strategy": ["single", "kernel"]}},
     "the axes' order: strategy, batch, size there, batch, strategy, size here"),
])
def test_anything_else_is_refused_naming_its_first_difference(changes, first):
    assert plan_growth(STORED, grown(**changes)) == first


def test_the_grown_store_recomputes_speedup_over_a_baseline_that_moved(tmp_path):
    """`reference` on 2 threads was its own baseline (speedup 1); grown to 1 and 2,
    the baseline is the 1-thread point: the kept point's speedup waits for it (NaN),
    then is its step time over the kept one's."""
    def sweep(workers: list[int]):
        return load_sweep(write_sweep(tmp_path, "unused.zarr", {
            "strategy": ["reference"], "cluster.workers": workers},
            speedup_baseline="reference"), out=str(tmp_path / "moved.zarr"))

    def point(step_time: float, capacity: float) -> PointResult:
        return PointResult({"step_time": step_time, "capacity": capacity,
                            "throughput": 16 / step_time}, {"run_id": "r"}, {})

    old = sweep([2])
    store = ResultStore(old.store_path)
    store.create(build_template(old, {"fingerprint": old.fingerprint, "config": old.text}))
    store.write_point((0, 0, 0), point(0.2, 2.0))
    store.refresh_derived()
    assert float(xr.open_zarr(old.store_path).speedup[0, 0, 0]) == 1.0
    new = sweep([1, 2])
    plan = plan_growth(old.text, new.text)
    grow_store(old.store_path, new, plan)
    ds = xr.open_zarr(old.store_path).load()
    assert list(ds.workers.values) == [1, 2] and int(ds.status[0, 1, 0]) == DONE
    assert '"workers_index": 0' in ds.attrs["speedup_reference"]
    assert np.isnan(ds.speedup[0, 1, 0]) and ds.attrs["fingerprint"] == new.fingerprint
    # the report says the store grew, when, and by what
    grown = [line for line in _provenance(ds) if line.startswith("- grown with --extend")]
    assert len(grown) == 1 and ": 1 -> 2 points (" in grown[0], grown
    assert "[2] there, [1, 2] here" in grown[0], grown
    store = ResultStore(old.store_path)
    store.write_point((0, 0, 0), point(0.3, 1.0))
    store.refresh_derived()
    ds = xr.open_zarr(old.store_path).load()
    assert float(ds.speedup[0, 1, 0]) == pytest.approx(1.5)
    assert float(ds.efficiency[0, 1, 0]) == pytest.approx(0.75)
    assert store.record.verify().intact


def test_a_damaged_point_is_not_copied_and_is_pending_in_the_grown_store(tmp_path):
    def sweep(batches: list[int]):
        return load_sweep(write_sweep(tmp_path, "unused.zarr", {
            "strategy": ["reference"], "train.batch": batches}), out=str(tmp_path / "d.zarr"))

    old = sweep([8, 16])
    store = ResultStore(old.store_path)
    store.create(build_template(old, {"fingerprint": old.fingerprint, "config": old.text}))
    for region in ((0, 0, 0), (0, 1, 0)):
        store.write_point(region, PointResult({"step_time": 0.1}, {"run_id": "r"}, {}))
    os.remove(os.path.join(old.store_path, "step_time", "c", "0", "0", "0"))  # batch 8's
    new = sweep([8, 16, 32])
    grow_store(old.store_path, new, plan_growth(old.text, new.text))
    found = ResultStore(old.store_path).verify()
    assert found.intact and found.status[0, :, 0].tolist() == [0, DONE, 0]


def test_a_growth_that_would_lengthen_the_step_series_is_refused_and_keeps_the_store(
        tmp_path):
    """An added `train.steps` value longer than the store's per-step series cannot be
    copied into it: one message names both lengths and the way out, and the store
    stays as it was, with nothing left beside it."""
    def sweep(steps: list[int]):
        path = write_sweep(tmp_path, "unused.zarr", {"strategy": ["reference"],
                                                     "train.steps": steps})
        config = yaml.safe_load(open(path, encoding="utf-8"))
        del config["measure"]  # which would set the steps itself
        with open(path, "w", encoding="utf-8") as handle:
            yaml.safe_dump(config, handle, sort_keys=False)
        return load_sweep(path, out=str(tmp_path / "s.zarr"))

    old = sweep([3])
    store = ResultStore(old.store_path)
    store.create(build_template(old, {"fingerprint": old.fingerprint, "config": old.text}))
    store.write_point((0, 0, 0), PointResult({"step_time": 0.1}, {"run_id": "r"}, {}))
    new = sweep([3, 6])
    plan = plan_growth(old.text, new.text)
    assert isinstance(plan, Growth) and plan.new_points == 1
    with pytest.raises(StoreMismatch, match=r"per-step series \(3 steps there, 6 here\); "
                                            r"pass --fresh"):
        grow_store(old.store_path, new, plan)
    found = ResultStore(old.store_path).verify()
    assert found.intact and found.status.ravel().tolist() == [DONE]
    assert not os.path.exists(old.store_path + GROWING)


def test_a_scaling_sweep_grown_with_extend_is_rewritten(tmp_path):
    """A scaling store is predicted whole by every run: --extend rewrites it with the
    added values; without it, the refusal names --extend."""
    store = str(tmp_path / "scale.zarr")
    assert run_main("sweep", [write_scaling(tmp_path, {"hardware.devices": [1, 2]}),
                              "--out", store])[0] == 0
    config = write_scaling(tmp_path, {"hardware.devices": [1, 2, 4]})
    status, lines, out = run_main("sweep", [config, "--out", store])
    assert status == 2 and "1 new point(s)" in lines[0] and "pass --extend" in lines[0]
    assert run_main("sweep", [config, "--out", store, "--extend"])[0] == 0
    assert list(xr.open_zarr(store).devices.values) == [1, 2, 4]


@pytest.mark.parametrize("exchanges", [True, False])
def test_the_swap_puts_the_grown_store_in_place_and_removes_the_old(tmp_path, monkeypatch,
                                                                    exchanges):
    """One atomic exchange where the file system has it; else two renames (their
    window is finished by `settle_growth`: tests/test_sweep_integrity.py)."""
    if not exchanges:
        monkeypatch.setattr(store_growth, "_exchange", lambda first, second: False)
    store, grown = tmp_path / "s.zarr", tmp_path / "s.zarr.growing"
    for path, name in ((store, "old"), (grown, "new")):
        path.mkdir()
        (path / name).write_text(name)
    store_growth.swap_in(str(grown), str(store))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]
    assert [p.name for p in store.iterdir()] == ["new"]
