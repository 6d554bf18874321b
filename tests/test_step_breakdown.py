"""Where a step's time goes (pipeline/records/step_breakdown.py): pure, no cluster."""

from __future__ import annotations

import math

import numpy as np
import xarray as xr

from pipeline.records.step_breakdown import (COMPONENTS, compute_error, model_breakdown,
                                             phase_seconds, record_breakdown, split_step)
from tasks.receipts import OpEvent, Phase, Receipt


def _receipt(worker: str, phases: list[tuple[str, float]]) -> Receipt:
    """One task whose phases run back to back from t=100 s."""
    event, clock = OpEvent("conv-forward", 0, 100.0), 100.0
    for kind, seconds in phases:
        event.phases.append(Phase(kind, clock, clock + seconds))
        clock += seconds
    event.end = clock
    return Receipt("task", worker, 3, 100.0, clock, [event])


def test_the_critical_worker_gives_the_components_and_the_rest_is_the_client():
    """w1 accounted for 0.09 s (it waited 0.03 s for w0's slot); w0 for 0.07 s. The
    step took 0.1 s: 0.01 s of it no phase of w1 covers."""
    receipts = [_receipt("w0", [("compute", 0.05), ("write", 0.01), ("read", 0.005),
                                ("dataset", 0.005)]),
                _receipt("w1", [("compute", 0.03), ("emulated", 0.02), ("wait", 0.03),
                                ("read", 0.004), ("write", 0.002), ("dataset", 0.004)])]
    phases = phase_seconds(receipts)
    assert math.isclose(phases["w1"]["wait"], 0.03)
    got = split_step(0.1, phases)
    assert list(got) == list(COMPONENTS)
    expected = {"compute": 0.05, "exchange": 0.006, "dataset": 0.004, "wait": 0.03,
                "client": 0.01}
    assert all(math.isclose(got[p], expected[p], abs_tol=1e-12) for p in COMPONENTS), got
    assert math.isclose(sum(got.values()), 0.1)


def test_the_components_always_add_up_to_the_step():
    """Overlapping steps (in flight) can account for more than the wall time: the
    components are scaled down to it, the client's is zero; no receipts: all client."""
    got = split_step(0.05, {"w0": {"compute": 0.04, "read": 0.02}})
    assert math.isclose(sum(got.values()), 0.05) and got["client"] == 0.0
    assert math.isclose(got["compute"] / got["exchange"], 2.0)
    assert split_step(0.2, {}) == {"compute": 0.0, "exchange": 0.0, "dataset": 0.0,
                                   "wait": 0.0, "client": 0.2}


def test_the_record_breakdown_is_medians_of_each_step_after_the_warmup():
    steps, workers = 4, 2
    zeros = np.zeros((steps, workers))
    compute = np.array([[9.0, 9.0], [0.05, 0.04], [0.06, 0.03], [0.05, 0.05]])
    wait = np.array([[0.0, 0.0], [0.0, 0.03], [0.0, 0.04], [0.0, 0.02]])
    record = xr.Dataset(
        {"step_time": ("step", [10.0, 0.1, 0.1, 0.1]),
         "compute_time": (("step", "worker"), compute),
         "read_time": (("step", "worker"), zeros + 0.01),
         "write_time": (("step", "worker"), zeros),
         "dataset_time": (("step", "worker"), zeros),
         "exchange_wait_time": (("step", "worker"), wait)},
        coords={"step": range(steps), "worker": ["w0", "w1"]})
    got = record_breakdown(record, warmup_steps=1)
    # the critical worker is w1 (0.08 s accounted) in every measured step
    assert math.isclose(got["compute"], 0.04) and math.isclose(got["wait"], 0.03)
    assert math.isclose(got["client"], 0.02) and math.isclose(got["exchange"], 0.01)
    empty = record_breakdown(record.isel(step=slice(0, 0)), 0)
    assert all(math.isnan(v) for v in empty.values())


def test_the_models_breakdown_in_the_same_components():
    breakdown = {"compute": [0.1, 0.2], "compute_max": 0.2, "compute_critical": 0.15,
                 "master": 0.01, "communication": 0.0, "storage": 0.03, "overhead": 0.004}
    got = model_breakdown(breakdown)
    assert math.isclose(got["compute"], 0.16) and math.isclose(got["exchange"], 0.03)
    assert got["client"] == 0.004 and got["wait"] == 0.0 == got["dataset"]
    assert all(math.isnan(v) for v in model_breakdown(None).values())


def test_the_compute_error_is_the_models_critical_compute_against_the_busiest_workers():
    """The dense head counts as compute on both sides (the master's critical path)."""
    predicted = {"compute_critical": 0.15, "master": 0.01, "storage": 0.03, "overhead": 0.004}
    assert math.isclose(compute_error(predicted, 0.08), 1.0)
    assert math.isclose(compute_error(predicted, 0.32), -0.5)
    assert compute_error(None, 0.08) is None  # no prediction
    assert compute_error(predicted, None) is None
    assert compute_error(predicted, 0.0) is None  # an emulated or empty run
