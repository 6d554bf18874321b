"""`strategy: auto` in the report: its choice against the measured best (pure)."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import xarray as xr

from experiments.report.auto import auto_rows, auto_section


def _store() -> tuple[xr.Dataset, pd.DataFrame]:
    """At 1 worker auto chose single (the best); at 2 it chose kernel while data was
    measured faster."""
    choice = np.full((3, 2, 1), "", dtype=object)
    choice[2, 0, 0] = json.dumps({"chosen": "single"})
    choice[2, 1, 0] = json.dumps({"chosen": "kernel"})
    ds = xr.Dataset({"strategy_choice": (("strategy", "workers", "repeat"), choice)},
                    coords={"strategy": ["single", "kernel", "auto"], "workers": [1, 2],
                            "repeat": [0]})
    times = {("single", "1"): 0.10, ("kernel", "1"): 0.11, ("auto", "1"): 0.102,
             ("single", "2"): 0.10, ("kernel", "2"): 0.08, ("auto", "2"): 0.081,
             ("data", "2"): 0.06, ("reference", "1"): 0.05}  # no candidate of auto
    frame = pd.DataFrame([{"strategy": s, "workers": w, "step_time": t}
                          for (s, w), t in times.items()])
    return ds, frame


def test_auto_rows_compare_the_choice_with_the_fastest_fixed_strategy():
    ds, frame = _store()
    rows = auto_rows(ds, frame, ["workers"]).set_index("workers")
    assert rows.loc["1", "chosen"] == "single" and rows.loc["1", "best"] == "single"
    assert math.isclose(rows.loc["1", "auto_over_best"], 0.02)
    assert rows.loc["2", "chosen"] == "kernel" and rows.loc["2", "best"] == "data"
    assert math.isclose(rows.loc["2", "chosen_s"], 0.08)
    assert math.isclose(rows.loc["2", "auto_over_best"], 0.081 / 0.06 - 1)


def test_auto_section_is_absent_without_auto_points():
    ds, frame = _store()
    lines = auto_section(ds, frame, ["strategy", "workers"])
    assert lines[0] == "## Strategy auto against the measured best"
    assert any(line.startswith("| 2 | kernel | 0.0810 | data | 0.0600 | +35% |") for line in lines)
    fixed = frame[frame["strategy"] != "auto"]
    assert auto_section(ds.drop_sel(strategy="auto"), fixed, ["strategy", "workers"]) == []
