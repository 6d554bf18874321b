"""benchmarks/op_times.py's split of a run's ops (pure, on made-up trace events); its
tables beside a real run's ops are tests/test_prediction.py's."""

from __future__ import annotations

import pytest

from benchmarks.op_times import model_line, op_parts, step_parts, task_positions


def _event(name: str, category: str, start_ms: float, ms: float, **args) -> dict:
    return {"name": name, "cat": category, "ph": "X", "pid": 1, "tid": 1,
            "ts": start_ms * 1e3, "dur": ms * 1e3, "args": args}


def _step(step: int, origin: float, compute: float, twice: bool = False) -> list[dict]:
    """One step of a worker: a forward of 10 ms with 1 ms read, 0.5 ms waiting,
    `compute` ms computing (the rest is its own work between phases); with `twice`
    a second op of the same name in the step, 2 ms all compute."""
    events = [_event(f"step {step}", "task", origin, 20.0, step=step),
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


def test_a_step_splits_into_compute_io_waits_the_rest_and_the_gap_to_the_next():
    events = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": 1,
               "args": {"name": "cpu-0"}}]
    for step, origin, compute in ((0, 0.0, 1.0), (1, 100.0, 8.0), (2, 121.0, 6.0),
                                  (3, 142.0, 7.0)):
        events += _step(step, origin, compute)
    got = step_parts(events, left_out={0})["cpu-0"]
    # steps 1-3: spans of 20 ms, compute 8, 6, 7; a read of 1 and a wait of 0.5 each;
    # the rest 10.5, 12.5, 11.5; then 1 ms to the next step (steps 1 and 2 have one)
    assert got["span"] == pytest.approx(0.020)
    assert got["compute"] == pytest.approx(0.007)
    assert (got["io"], got["wait"]) == (pytest.approx(0.001), pytest.approx(0.0005))
    assert got["rest"] == pytest.approx(0.0115)
    assert got["gap"] == pytest.approx(0.001)


def test_a_tasks_first_step_is_told_from_its_later_ones_by_what_the_client_submitted():
    """Tasks of steps 0-2, 3-5 and 6 (as `submit steps 0-2`, `submit step 6`), step 0
    a warm-up: the steps that open a task (3, 6) against the later ones (1, 2, 4, 5);
    a step no submit names (7) counts as neither."""
    events = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": 1,
               "args": {"name": "cpu-0"}}]
    events += [_event(name, "client", 0.0, 1.0) for name in
               ("submit steps 0-2", "submit steps 3-5", "submit step 6")]
    for step, ms in enumerate((50.0, 20.0, 22.0, 31.0, 21.0, 19.0, 35.0, 99.0)):
        events.append(_event(f"step {step}", "task", 100.0 * step, ms, step=step))
    got = task_positions(events, left_out={0})["cpu-0"]
    assert got["first"] == (pytest.approx(0.033), 2)  # steps 3 and 6: 31 and 35 ms
    assert got["later"] == (pytest.approx(0.0205), 4)  # 20, 22, 21, 19 ms
    # the warm-up counts where it is not left out: it opens the first task
    assert task_positions(events, left_out=set())["cpu-0"]["first"] == \
        (pytest.approx(0.035), 3)


def test_the_models_line_is_the_summarys_breakdown():
    summary = {"predicted_step_time": 0.0202,
               "predicted_breakdown": {"compute_critical": 0.018, "master": 0.0,
                                       "storage": 0.0008, "communication": 0.0001,
                                       "overhead": 0.0007, "contention": 0.0004}}
    assert model_line(summary) == ("model    a step 20.20 ms: compute 18.00, master 0.00, "
                                   "io 0.90, overhead 0.70, contention 0.40")
    assert model_line({"predicted_step_time": None}) is None
