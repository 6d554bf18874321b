"""A store resumed under other code: the sweep warns, and the report names each
session's code revision rather than the first session's alone
(experiments/sweep/provenance.py)."""

from __future__ import annotations

import io
import json

import pytest
import xarray as xr

from experiments.report import cli as report
from experiments.sweep import provenance
from experiments.sweep.config import load_sweep
from experiments.sweep.results import ResultStore
from experiments.sweep.run import run_sweep
from pipeline.records.record import code_revision, software_versions
from tests.test_report_gaps import unrendered
from tests.test_sweep import write_sweep


def test_a_store_resumed_under_another_code_revision_says_so(tmp_path, tiny_dataset_factory,
                                                             monkeypatch):
    monkeypatch.setenv("CNN_PREDICT_PROBE", "never")  # as in test_sweep: no cluster probes
    monkeypatch.setenv("CNN_PROBE_CACHE", str(tmp_path / "probes"))
    config = write_sweep(tmp_path, tiny_dataset_factory("float32"),
                         {"strategy": ["single", "kernel"]}, name="sessions")
    path = str(tmp_path / "sessions.zarr")
    err = io.StringIO()
    assert run_sweep(load_sweep(config, out=path), out=io.StringIO(), err=err) == 0
    assert "warning" not in err.getvalue()  # a new store: nothing to differ from
    ResultStore(path).write_failure((1, 0), "FloatingPointError: training diverged", {}, {})

    first = code_revision()
    monkeypatch.setattr(provenance, "code_revision", lambda: "0000000-dirty")  # `git pull`
    err = io.StringIO()
    assert run_sweep(load_sweep(config, out=path), out=io.StringIO(), err=err) == 0
    warnings = [line for line in err.getvalue().splitlines() if line.startswith("warning")]
    assert warnings == [
        f"warning: {path} holds points measured under another setup than this session's "
        f"(code revision {first} there, 0000000-dirty here): the store will mix them, and "
        "its report names each session's; --fresh measures every point again"]
    sessions = json.loads(xr.open_zarr(path).attrs["sessions"])
    assert [s["code_revision"] for s in sessions] == [first, "0000000-dirty"]
    assert sessions[1]["versions"] == software_versions()
    assert [s["cluster"] for s in sessions] == ["embedded", "embedded"]

    unrendered(monkeypatch)  # what report.md says is tested here, not the figures
    report.make_report(path, str(tmp_path / "report"))
    text = open(tmp_path / "report" / "report.md", encoding="utf-8").read()
    assert f"- code revision {first}; python " in text
    assert "(the first session's)\n" in text
    line = next(line for line in text.splitlines() if line.startswith("- warning:"))
    assert line.startswith("- warning: the store's points were measured under different code "
                           f"revision: session 1 ({sessions[0]['started']}, 2 point(s) run): "
                           f"code revision {first}; session 2 ({sessions[1]['started']}, 1 "
                           "point(s) run): code revision 0000000-dirty; "), line

    err = io.StringIO()  # nothing left to run: nothing mixed any more, no warning
    assert run_sweep(load_sweep(config, out=path), out=io.StringIO(), err=err) == 0
    assert "warning" not in err.getvalue()


@pytest.mark.parametrize("sessions, expected", [
    ([{"points_run": 2, "code_revision": "a", "host": "h"},
      {"points_run": 0, "code_revision": "b", "host": "h"}], None),  # b ran nothing
    ([{"points_run": 1, "code_revision": "a", "host": "h", "started": "T0"},
      {"points_run": 1, "code_revision": "a", "host": "g", "started": "T1",
       "versions": {"torch": "2"}}],
     "the store's points were measured under different host: session 1 (T0, 1 point(s) "
     "run): host h; session 2 (T1, 1 point(s) run): host g"),
    ([{"points_run": 1, "code_revision": "a", "started": "T0",
       "versions": {"torch": "1", "numpy": "2"}},
      {"points_run": 1, "code_revision": "a", "started": "T1",
       "versions": {"torch": "3", "numpy": "2"}}],
     "the store's points were measured under different versions: session 1 (T0, 1 "
     "point(s) run): versions torch 1; session 2 (T1, 1 point(s) run): versions torch 3"),
    ([{"points_run": 3, "code_revision": "a", "started": "T0", "cluster": "embedded"},
      {"points_run": 1, "code_revision": "a", "started": "T1",
       "cluster": "tcp://10.0.0.1:8786"}],
     "the store's points were measured under different cluster: session 1 (T0, 3 point(s) "
     "run): cluster embedded; session 2 (T1, 1 point(s) run): cluster tcp://10.0.0.1:8786"),
])
def test_mixed_sessions_names_what_differs(sessions, expected):
    assert provenance.mixed_sessions(sessions) == expected
