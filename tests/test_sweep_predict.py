"""`mode: predict` end to end: a real sweep of the model alone (one probe of a real
embedded cluster, nothing trained), its `auto` points, and the report of its store."""

from __future__ import annotations

import io
import json
import warnings

import numpy as np
import pytest
import xarray as xr

from experiments.report import cli as report
from experiments.report.markdown import mixes_section
from experiments.report.view import StoreView
from experiments.sweep.store_layout import DONE
from experiments.sweep.config import load_sweep
from experiments.sweep.run import run_sweep
from tests.helpers import cut_probe_to_one_round
from tests.test_sweep import write_sweep

STRATEGIES = ["single", "kernel", "data", "auto"]


@pytest.fixture(scope="module")
def predicted(tmp_path_factory, tiny_dataset_factory) -> tuple[str, str]:
    """A `mode: predict` sweep of every distributed strategy and `auto` on 2 workers:
    its store and its output. The model probes the cluster once (CNN_PREDICT_PROBE
    auto, a cache of the test's own), as a user's predict sweep does; the probe cut
    to one round (`cut_probe_to_one_round`): these tests check which strategy `auto`
    picks from its figures, not how well they predict."""
    tmp_path = tmp_path_factory.mktemp("predict")
    config = write_sweep(tmp_path, tiny_dataset_factory("float32"),
                         {"strategy": STRATEGIES}, name="predicted", mode="predict",
                         base={"cluster": {"workers": 2}})
    path = str(tmp_path / "predicted.zarr")
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CNN_PREDICT_PROBE", "auto")
        patch.setenv("CNN_PROBE_CACHE", str(tmp_path / "probes"))
        cut_probe_to_one_round(patch)
        status = run_sweep(load_sweep(config, out=path), out=out, err=io.StringIO())
    assert status == 0, out.getvalue()
    return path, out.getvalue()


def test_auto_points_are_predicted_as_the_strategy_they_would_pick(predicted):
    path, output = predicted
    ds = xr.open_zarr(path).load()
    assert ds.attrs["mode"] == "predict" and (ds.failure == "").all()
    steps = ds.predicted_step_time.isel(repeat=0)
    assert steps.notnull().all(), steps.values
    choice = json.loads(str(ds.strategy_choice.sel(strategy="auto").values[0]))
    # any strategy auto picks among, hybrid too though the sweep has no hybrid points
    assert choice["requested"] == "auto" and choice["chosen"] in (*STRATEGIES[:-1], "hybrid")
    # its prediction is the choice's: the fastest the model finds among them, on the
    # same probe the fixed strategies' points were predicted from
    assert np.isclose(float(steps.sel(strategy="auto")), choice["predicted_step_time"])
    assert float(steps.sel(strategy="auto")) <= float(steps.drop_sel(strategy="auto").min()) \
        * (1 + 1e-9)
    assert np.isfinite(float(ds.predicted_peak_memory.sel(strategy="auto", repeat=0)))
    assert f"(auto picks {choice['chosen']})" in output


def test_a_predict_store_reports_its_predictions_without_warnings(predicted, tmp_path):
    path, _ = predicted
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        written = report.make_report(path, str(tmp_path / "report"))
    names = [p.rsplit("/", 1)[-1] for p in written]
    assert "predicted.png" in names
    text = open(tmp_path / "report" / "report.md", encoding="utf-8").read()
    assert "nan" not in text.lower()
    assert "![Predicted step time](predicted.png)" in text
    assert "## Device mixes" not in text  # nothing measured to share out
    assert "`mode: predict`" in text  # says why the measured figures are not there


def test_points_with_no_measured_step_have_no_device_mix_row():
    """A predict store over workers (a sweep that varies its devices): every point done,
    none measured. The device-mix table had a `nan` row per point, and a warning."""
    shape = (2, 2, 1)  # strategy x workers x repeat
    texts = {name: (("strategy", "workers", "repeat"), np.full(shape, "", dtype=object))
             for name in ("kernel_split", "batch_split", "worker_devices")}
    ds = xr.Dataset({"status": (("strategy", "workers", "repeat"), np.full(shape, DONE)),
                     "step_time": (("strategy", "workers", "repeat"), np.full(shape, np.nan)),
                     **texts},
                    coords={"strategy": ["kernel", "auto"], "workers": [1, 2], "repeat": [0]},
                    attrs={"axes": json.dumps({"strategy": ["strategy"],
                                               "workers": ["cluster.workers"]})})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mixes_section(ds, StoreView(ds)) == []
