"""The model's error per strategy in the report (pure)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import xarray as xr

from experiments.report.errors import error_rows, error_section
from experiments.sweep.store_layout import DONE, FAILED


def _store() -> xr.Dataset:
    errors = np.array([[[0.02, -0.04], [0.10, np.nan]],      # kernel: 3 runs with a prediction
                       [[-0.20, -0.10], [-0.30, 0.5]]])     # data: the last run failed
    status = np.full(errors.shape, DONE)
    status[1, 1, 1] = FAILED
    dims = ("strategy", "workers", "repeat")
    return xr.Dataset({"prediction_error": (dims, errors), "status": (dims, status)},
                      coords={"strategy": ["kernel", "data"], "workers": [1, 2],
                              "repeat": [0, 1]})


def test_error_rows_per_strategy_over_done_runs_with_a_prediction():
    rows = error_rows(_store()).set_index("strategy")
    assert rows.loc["kernel", "runs"] == 3
    assert rows.loc["kernel", "median_abs"] == pytest.approx(0.04)
    assert rows.loc["kernel", "median"] == pytest.approx(0.02)
    assert rows.loc["kernel", "max_abs"] == pytest.approx(0.10)
    assert rows.loc["data", "runs"] == 3  # the failed run's 0.5 left out
    assert rows.loc["data", "median"] == pytest.approx(-0.20)  # a bias keeps its sign
    assert rows.loc["data", "max_abs"] == pytest.approx(0.30)


def test_error_section_is_a_table_or_nothing():
    lines = error_section(_store())
    assert lines[0] == "## The model's error per strategy"
    assert "| kernel | 3 | 4.0% | +2.0% | 10.0% |" in lines
    assert "| data | 3 | 20.0% | -20.0% | 30.0% |" in lines
    empty = _store().assign(prediction_error=lambda ds: ds.prediction_error * np.nan)
    assert error_section(empty) == []
    assert error_section(_store().drop_vars("prediction_error")) == []


def test_the_error_table_names_the_cpu_it_was_measured_on():
    machine = {"host": "vm", "cpu": "AMD EPYC 7B13", "cores": 2}
    lines = error_section(_store().assign_attrs(machine=json.dumps(machine)))
    assert any("Measured on AMD EPYC 7B13, 2 cores (host vm)" in line for line in lines)
    assert any("an unrecorded CPU" in line for line in error_section(_store()))
