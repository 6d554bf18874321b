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


def _single_store() -> tuple[xr.Dataset, pd.DataFrame]:
    """quick.yaml's shape over two networks: `single` measured at 1 worker only (its
    2-worker points not applicable, no step), auto at 2 workers choosing single on
    resnet20 and kernel on vgg11_bn, whose single was never measured."""
    choice = np.full((3, 2, 2, 1), "", dtype=object)
    for w, workers in enumerate([1, 2]):
        choice[2, w, 0, 0] = json.dumps({"chosen": "single"})
        choice[2, w, 1, 0] = json.dumps({"chosen": "kernel" if workers == 2 else "single"})
    ds = xr.Dataset({"strategy_choice": (("strategy", "workers", "network", "repeat"), choice)},
                    coords={"strategy": ["single", "kernel", "auto"], "workers": [1, 2],
                            "network": ["resnet20", "vgg11_bn"], "repeat": [0]})
    nan = float("nan")
    times = {("single", "1", "resnet20"): 0.0219, ("single", "2", "resnet20"): nan,
             ("kernel", "1", "resnet20"): 0.0229, ("kernel", "2", "resnet20"): 0.0358,
             ("auto", "1", "resnet20"): 0.0221, ("auto", "2", "resnet20"): 0.0234,
             ("single", "1", "vgg11_bn"): nan, ("single", "2", "vgg11_bn"): nan,
             ("kernel", "1", "vgg11_bn"): 0.05, ("kernel", "2", "vgg11_bn"): 0.04,
             ("auto", "1", "vgg11_bn"): 0.03, ("auto", "2", "vgg11_bn"): 0.041}
    frame = pd.DataFrame([{"strategy": s, "workers": w, "network": n, "step_time": t}
                          for (s, w, n), t in times.items()])
    return ds, frame


def test_auto_choosing_single_is_compared_with_single_where_the_sweep_measured_it():
    """At 2 workers `single` has no point of its own (it runs on one worker: the sweep
    measures it at 1): auto/2 choosing it is compared with that point, not with kernel
    alone, which it would appear to beat by 35 %."""
    ds, frame = _single_store()
    rows = auto_rows(ds, frame, ["workers", "network"], "workers")
    row = rows.set_index(["workers", "network"]).loc[("2", "resnet20")]
    assert row["chosen"] == "single" and row["best"] == "single"
    assert row["best_at"] == "workers 1" and math.isclose(row["best_s"], 0.0219)
    assert math.isclose(row["chosen_s"], 0.0219) and row["chosen_at"] == "workers 1"
    assert math.isclose(row["auto_over_best"], 0.0234 / 0.0219 - 1)
    assert (rows["auto_over_best"].dropna() >= 0).all()  # no point beats its best here
    lines = auto_section(ds, frame, ["strategy", "workers", "network"], "workers")
    assert "| 2 | resnet20 | single | 0.0234 | single (at workers 1) | 0.0219 | +7% |" in lines
    # without the workers dim nothing stands in for single at 2 workers: the row for
    # its choice there gives no comparison rather than -35 %
    blind = auto_rows(ds, frame, ["workers", "network"])
    assert math.isnan(blind.set_index(["workers", "network"]).loc[("2", "resnet20"),
                                                                  "auto_over_best"])


def test_a_choice_measured_nowhere_as_a_fixed_strategy_gets_no_comparison():
    """vgg11_bn's single failed everywhere: auto/1 chose it and measured faster than
    kernel, but that is auto against strategies it did not pick, so no figure."""
    ds, frame = _single_store()
    rows = auto_rows(ds, frame, ["workers", "network"], "workers")
    row = rows.set_index(["workers", "network"]).loc[("1", "vgg11_bn")]
    assert row["chosen"] == "single" and row["best"] == "kernel"
    assert math.isnan(row["chosen_s"]) and math.isnan(row["auto_over_best"])
    lines = auto_section(ds, frame, ["strategy", "workers", "network"], "workers")
    assert "| 1 | vgg11_bn | single | 0.0300 | kernel | 0.0500 | - (single not measured) |" \
        in lines


def test_a_store_without_a_strategy_axis_has_its_auto_choices_read():
    """`strategy: auto` in the base and no strategy axis (every point is auto): the
    choices are the whole store's, not a strategy dim's (it raised AttributeError
    and the report stopped with a traceback); a fixed base strategy gives no rows."""
    choice = np.array([[json.dumps({"chosen": "data"})], [json.dumps({"chosen": "kernel"})]],
                      dtype=object)
    ds = xr.Dataset({"strategy_choice": (("workers", "repeat"), choice)},
                    coords={"workers": [1, 2], "repeat": [0]})
    frame = pd.DataFrame([{"strategy": "auto", "workers": "1", "step_time": 0.1},
                          {"strategy": "auto", "workers": "2", "step_time": 0.2}])
    rows = auto_rows(ds, frame, ["workers"]).set_index("workers")
    assert list(rows["chosen"]) == ["data", "kernel"]
    assert auto_section(ds, frame.assign(strategy="single"), ["workers"]) == []


def test_auto_whose_placement_left_a_worker_out_is_said_so():
    """Auto's kernel ran on cpu-0 alone at 2 workers: its row read as auto beating the
    best by 14 %, though its step was one worker's; the row says "on 1 of 2 workers"."""
    ds, frame = _store()
    frame["n_workers"] = [1.0, 1.0, 1.0, 1.0, 2.0, 1.0, 2.0, 1.0]  # auto@2: one worker
    frame["offered_workers"] = [1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 1.0]
    rows = auto_rows(ds, frame, ["workers"]).set_index("workers")
    assert rows.loc["2", "auto_workers"] == "1 of 2" and rows.loc["1", "auto_workers"] == ""
    table = [line for line in auto_section(ds, frame, ["strategy", "workers"])
             if line.startswith("| 2 |")]
    assert table and "| kernel (on 1 of 2 workers) |" in table[0], table
