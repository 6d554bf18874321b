"""benchmarks/critical_path.py: the measured critical path across workers (pure)."""

from __future__ import annotations

import pytest

from benchmarks.critical_path import WARMUP_STEPS, walk


def _phase(tid: int, name: str, ts: float, dur: float, slot: str = "") -> dict:
    return {"cat": "phase", "name": name, "tid": tid, "ts": ts, "dur": dur,
            "args": {"slot": slot} if slot else {}}


def _step(step: int, t0: float) -> list[dict]:
    """Worker 1 computes 10 ms, writes slot s (5 ms) and computes 25 ms more; worker 2
    reads a slot written before it asked (3 ms check, 2 ms read), waits for s (from 6 ms
    on; s is written at 15 ms, seen 1 ms later), reads it (4 ms) and computes 21 ms:
    steps of 41 ms, worker 1 idle for the last."""
    return [
        {"cat": "op", "name": "op", "tid": 1, "ts": t0, "dur": 40e3, "args": {"step": step}},
        {"cat": "op", "name": "op", "tid": 2, "ts": t0, "dur": 41e3, "args": {"step": step}},
        _phase(1, "write", t0 - 30e3, 1e3, f"early{step}"),
        _phase(1, "compute", t0, 10e3),
        _phase(1, "write", t0 + 10e3, 5e3, f"s{step}"),
        _phase(1, "compute", t0 + 15e3, 25e3),
        _phase(2, "wait", t0, 3e3, f"early{step}"),
        _phase(2, "read", t0 + 3e3, 2e3, f"early{step}"),
        _phase(2, "wait", t0 + 6e3, 10e3, f"s{step}"),
        _phase(2, "read", t0 + 16e3, 4e3, f"s{step}"),
        _phase(2, "compute", t0 + 20e3, 21e3),
    ]


def test_a_wait_for_a_slot_written_meanwhile_crosses_to_its_writer():
    """From the last op (worker 2's) back over its compute, its read and the 1 ms lag
    to worker 1's write, then along worker 1, whose steps follow each other with 1 ms
    between them: over 3 steps, 21 + 3 x 10 + 2 x 25 ms of compute, 3 writes, 1 read."""
    steps = WARMUP_STEPS + 3
    events = [e for s in range(steps) for e in _step(s, s * 41e3)]
    seconds, count, walked = walk(events)
    assert walked == 3
    assert seconds["compute"] == pytest.approx((0.021 + 0.030 + 0.050) / 3)
    assert seconds["write"] == pytest.approx(0.005)
    assert seconds["read"] == pytest.approx(0.004 / 3)
    assert seconds["lag"] == pytest.approx(0.001 / 3)
    assert seconds["gap"] == pytest.approx(0.002 / 3)
    assert "written-wait" not in seconds and sum(seconds.values()) == pytest.approx(0.041)
    assert count == {"write": 1, "read": pytest.approx(1 / 3)}


def test_a_wait_for_a_slot_already_written_is_a_marker_check_on_the_same_worker():
    """Worker 1 alone on the path where worker 2 has no later slot to wait for."""
    events = [e for s in range(WARMUP_STEPS + 2) for e in _step(s, s * 41e3)
              if not (e["tid"] == 2 and e.get("args", {}).get("slot", "").startswith("s"))]
    seconds, _, _ = walk(events)
    # worker 2 is last: compute 21, then the gap where its wait and read were, the
    # 2 ms read and 3 ms check of the early slot (written long before), and so on
    assert seconds["written-wait"] == pytest.approx(0.003)
    assert seconds["read"] == pytest.approx(0.002)
    assert "lag" not in seconds
