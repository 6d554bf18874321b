"""The model's error per strategy in the report (pure)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import xarray as xr

from experiments.report.errors import error_rows, error_section, memory_error_rows
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
    # no compute errors and no step times in this store: dashes, not made-up figures
    assert "| kernel | 3 | 4.0% | +2.0% | 10.0% | - | - |" in lines
    assert "| data | 3 | 20.0% | -20.0% | 30.0% | - | - |" in lines
    empty = _store().assign(prediction_error=lambda ds: ds.prediction_error * np.nan)
    assert error_section(empty) == []
    assert error_section(_store().drop_vars("prediction_error")) == []


def test_the_error_table_sets_the_compute_error_and_the_repeats_spread_beside_it():
    store = _store()
    store["compute_error"] = store.prediction_error * 0.5
    # kernel: workers 1 repeats 1.0 / 1.1 s (spread 1/10.5), workers 2 one done repeat
    # only (the other has no time); data: 2.0 / 2.4 (0.4 / 2.2) and 3.0 / one failed
    steps = np.array([[[1.0, 1.1], [5.0, np.nan]], [[2.0, 2.4], [3.0, 9.0]]])
    store["step_time"] = (store.prediction_error.dims, steps)
    rows = error_rows(store).set_index("strategy")
    assert rows.loc["kernel", "compute_median"] == pytest.approx(0.01)
    assert rows.loc["kernel", "repeat_spread"] == pytest.approx(0.1 / 1.05)
    assert rows.loc["data", "repeat_spread"] == pytest.approx(0.4 / 2.2)  # failed run out
    assert "| data | 3 | 20.0% | -20.0% | 30.0% | -10.0% | 18.2% |" in error_section(store)
    one_repeat = store.isel(repeat=[0])
    assert np.isnan(error_rows(one_repeat).set_index("strategy").loc["kernel",
                                                                       "repeat_spread"])


def test_the_error_table_names_the_cpu_it_was_measured_on():
    machine = {"host": "vm", "cpu": "AMD EPYC 7B13", "cores": 2}
    lines = error_section(_store().assign_attrs(machine=json.dumps(machine)))
    assert any("Measured on AMD EPYC 7B13, 2 cores (host vm): the error holds for that "
               "machine, after its own probe." in line for line in lines)
    assert any("an unrecorded CPU" in line for line in error_section(_store()))


def test_the_error_table_names_the_workers_machines_not_the_clients():
    """A sweep on a cluster (`--scheduler`, Slurm jobs) is started on a login node:
    the store's `machine` is that node's, but the runs, their errors and the probes
    behind them were measured on the workers' machines, as each done point keeps
    them (a failed point's are not counted)."""
    store = _store().assign_attrs(machine=json.dumps({"host": "login", "cpu": "Intel Xeon",
                                                      "cores": 4}))
    node = {"w0": {"machine": "node17: AMD EPYC 9654, 96 cores, AVX512", "torch_threads": 4}}
    texts = np.full(store.status.shape, json.dumps(node), dtype=object)
    other = {"w0": {"machine": "node18: AMD EPYC 9654, 96 cores, AVX512"}}
    texts[1, 1, 1] = json.dumps(other)  # data's failed run
    store["worker_machines"] = (store.status.dims, texts)
    lines = error_section(store)
    assert any("Measured on node17: AMD EPYC 9654, 96 cores, AVX512 (the workers' machine): "
               "the error holds for that machine, after its own probe." in line
               for line in lines), lines
    assert not any("login" in line or "node18" in line for line in lines)
    texts[1, 1, 0] = json.dumps(other)  # a done run on another node
    store["worker_machines"] = (store.status.dims, texts)
    assert any("Measured on node17: AMD EPYC 9654, 96 cores, AVX512; node18: AMD EPYC "
               "9654, 96 cores, AVX512 (the workers' machines): the error holds for those "
               "machines" in line for line in error_section(store))


def test_the_memory_models_error_is_tabled_beside_the_step_times():
    store = _store()
    measured = xr.full_like(store.prediction_error, 400e6)
    store = store.assign(memory_peak=measured, predicted_peak_memory=measured * 1.1)
    store["predicted_peak_memory"][0, 0, 0] = 300e6  # kernel's first run: -25 %
    rows = memory_error_rows(store).set_index("strategy")
    assert rows.loc["kernel", "runs"] == 4 and rows.loc["data", "runs"] == 3
    assert rows.loc["kernel", "max_abs"] == pytest.approx(0.25)
    assert rows.loc["data", "median"] == pytest.approx(0.10)
    lines = error_section(store)
    assert "## The memory model's error per strategy" in lines
    assert "| data | 3 | 10.0% | +10.0% | 10.0% |" in lines
    assert memory_error_rows(_store()).empty  # no memory figures: no table


def test_a_store_without_a_strategy_axis_names_its_base_strategy():
    """Its rows are named after the base config's strategy (they said "?")."""
    ds = xr.Dataset({"status": (("workers", "repeat"), np.full((2, 1), DONE)),
                     "predicted_peak_memory": (("workers", "repeat"), [[110.0], [120.0]]),
                     "memory_peak": (("workers", "repeat"), [[100.0], [100.0]])},
                    coords={"workers": [1, 2], "repeat": [0]},
                    attrs={"config": "base: {strategy: single}\n"})
    assert list(memory_error_rows(ds)["strategy"]) == ["single"]
