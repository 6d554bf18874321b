"""benchmarks/op_times.py's split of a run's ops (pure, on made-up trace events); its
tables beside a real run's ops are tests/test_prediction.py's."""

from __future__ import annotations

import pytest

from benchmarks.op_times import op_parts


def _event(name: str, category: str, start_ms: float, ms: float, **args) -> dict:
    return {"name": name, "cat": category, "ph": "X", "pid": 1, "tid": 1,
            "ts": start_ms * 1e3, "dur": ms * 1e3, "args": args}


def _step(step: int, origin: float, compute: float, twice: bool = False) -> list[dict]:
    """One step of a worker: a forward of 10 ms with 1 ms read, 0.5 ms waiting,
    `compute` ms computing (the rest is its own work between phases); with `twice`
    a second op of the same name in the step, 2 ms all compute."""
    events = [_event("step", "task", origin, 20.0, step=step),
              _event("conv-forward 1", "op", origin, 10.0, step=step, layer=1),
              _event("wait", "phase", origin, 0.5),
              _event("read", "phase", origin + 0.5, 1.0),
              _event("compute", "phase", origin + 2.0, compute)]
    if twice:
        events += [_event("conv-forward 1", "op", origin + 12.0, 2.0, step=step, layer=1),
                   _event("compute", "phase", origin + 12.0, 2.0)]
    return events


def test_an_ops_time_splits_into_compute_accesses_and_the_rest_over_measured_steps():
    events = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": 1,
               "args": {"name": "cpu-0"}}]
    events += _step(0, 0.0, 1.0)  # warm-up: left out, whatever it took
    events += _step(1, 100.0, 8.0)
    events += _step(2, 200.0, 6.0)
    events += _step(3, 300.0, 7.0, twice=True)  # the op twice: summed in its step
    parts = op_parts(events, left_out={0})
    got = parts["cpu-0", "conv-forward 1"]
    # steps 1, 2, 3: compute 8, 6, 9 ms; accesses 1.5 each; the rest 0.5, 2.5, 1.5
    assert got["compute"] == pytest.approx(0.008)
    assert got["access"] == pytest.approx(0.0015)
    assert got["other"] == pytest.approx(0.0015)
    assert set(parts) == {("cpu-0", "conv-forward 1")}  # steps and phases are no ops
    # the warm-up counts where it is not left out: the median of 1, 8, 6 and 9 ms
    assert op_parts(events, left_out=set())["cpu-0", "conv-forward 1"]["compute"] == \
        pytest.approx(0.007)
