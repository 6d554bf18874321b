"""`mode: predict` end to end: a real sweep of the model alone (one probe of a real
embedded cluster, nothing trained) and its `auto` points."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import xarray as xr

from experiments.sweep.config import load_sweep
from experiments.sweep.run import run_sweep
from tests.test_sweep import write_sweep

STRATEGIES = ["single", "kernel", "data", "auto"]


@pytest.fixture(scope="module")
def predicted(tmp_path_factory, tiny_dataset_factory) -> tuple[str, str]:
    """A `mode: predict` sweep of every distributed strategy and `auto` on 2 workers:
    its store and its output. The model probes the cluster once (CNN_PREDICT_PROBE
    auto, a cache of the test's own), as a user's predict sweep does."""
    tmp_path = tmp_path_factory.mktemp("predict")
    config = write_sweep(tmp_path, tiny_dataset_factory("float32"),
                         {"strategy": STRATEGIES}, name="predicted", mode="predict",
                         base={"cluster": {"workers": 2}})
    path = str(tmp_path / "predicted.zarr")
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CNN_PREDICT_PROBE", "auto")
        patch.setenv("CNN_PROBE_CACHE", str(tmp_path / "probes"))
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
    assert choice["requested"] == "auto" and choice["chosen"] in STRATEGIES[:-1]
    # its prediction is the choice's: the fastest the model finds among them, on the
    # same probe the fixed strategies' points were predicted from
    assert np.isclose(float(steps.sel(strategy="auto")), choice["predicted_step_time"])
    assert float(steps.sel(strategy="auto")) <= float(steps.drop_sel(strategy="auto").min()) \
        * (1 + 1e-9)
    assert np.isfinite(float(ds.predicted_peak_memory.sel(strategy="auto", repeat=0)))
    assert f"(auto picks {choice['chosen']})" in output

