"""The measured critical path of a run, across workers, beside the model's.

    python -m benchmarks.critical_path RUN_DIR [RUN_DIR ...]

The record's critical breakdown (pipeline/records/step_breakdown.py) splits a step along one
worker's phases, so a wait there holds whatever its writer was doing. This walks
back from the run's last op through its trace (trace.json): along a worker's phases,
and at a wait for a slot written while it waited, over to the writer at the end of
that write. What it crosses, per measured step (after `WARMUP_STEPS`): compute,
reads, writes, batch reads (dataset), the lag from a write to its waiting reader,
waits for slots already written (one marker check), and untraced gaps; and the
number of workspace accesses (reads, writes, batch reads) on it. Beside it, the
model's critical path for the same run from the run's own probe (its prediction's
breakdown: compute, storage, overhead). Not a test: figures for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
from bisect import bisect_right
from collections import defaultdict
from typing import Any

#: Steps left out at the start (the sweep's warm-up and the pipeline filling).
WARMUP_STEPS = 4
#: Phase kinds that are workspace or dataset accesses.
ACCESSES = ("read", "write", "dataset")


def _end(event: dict[str, Any]) -> float:
    return event["ts"] + event["dur"]


def walk(events: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, int], int]:
    """Seconds per kind and accesses per kind on the critical path, and the steps walked."""
    ops = [e for e in events if e.get("cat") == "op"]
    steps = sorted({e["args"]["step"] for e in ops})
    measured = steps[WARMUP_STEPS:]
    start = min(e["ts"] for e in ops if e["args"]["step"] == measured[0])
    phases: dict[int, list[dict[str, Any]]] = defaultdict(list)
    writes: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "phase":
            phases[e["tid"]].append(e)
            if e["name"] == "write":
                writes[e["args"]["slot"]].append(e)
    for group in (*phases.values(), *writes.values()):
        group.sort(key=_end)
    lane_ends = {tid: [_end(e) for e in lane] for tid, lane in phases.items()}
    write_ends = {slot: [_end(w) for w in group] for slot, group in writes.items()}
    last = max(ops, key=_end)
    lane, t = last["tid"], last["ts"] + last["dur"]
    seconds: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    while t > start:
        at = bisect_right(lane_ends.get(lane, []), t + 1) - 1  # the last to end by t
        while at >= 0 and phases[lane][at]["ts"] >= t:
            at -= 1
        if at < 0:
            seconds["gap"] += t - start
            break
        phase = phases[lane][at]
        end = min(_end(phase), t)
        seconds["gap"] += t - end
        t = end
        if phase["name"] == "wait":
            slot = phase["args"]["slot"]
            latest = bisect_right(write_ends.get(slot, []), end + 1) - 1  # its last write
            writer = writes[slot][latest] if latest >= 0 else None
            if writer and _end(writer) > phase["ts"] and writer["tid"] != lane:
                seconds["lag"] += end - _end(writer)
                lane, t = writer["tid"], _end(writer)
                continue
            seconds["written-wait"] += end - phase["ts"]
        else:
            seconds[phase["name"]] += end - phase["ts"]
            if phase["name"] in ACCESSES:
                count[phase["name"]] += 1
        t = phase["ts"]
    n = len(measured)
    return ({k: v / n / 1e6 for k, v in seconds.items()},
            {k: v / n for k, v in count.items()}, n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories (trace.json, summary.json)")
    args = parser.parse_args()
    kinds = ("compute", "read", "write", "dataset", "lag", "written-wait", "gap")
    print("run | step s | " + " | ".join(kinds) + " | accesses | model: compute, storage, "
          "overhead, step")
    for run in args.runs:
        with open(os.path.join(run, "trace.json"), encoding="utf-8") as handle:
            events = json.load(handle)["traceEvents"]
        with open(os.path.join(run, "summary.json"), encoding="utf-8") as handle:
            summary = json.load(handle)
        seconds, count, _ = walk(events)
        model = summary.get("predicted_breakdown") or {}
        compute = model.get("compute_critical", 0.0) + model.get("master", 0.0)
        storage = model.get("storage", 0.0) + model.get("communication", 0.0)
        overhead = model.get("overhead", 0.0) + model.get("contention", 0.0)
        print(f"{os.path.basename(os.path.normpath(run))} | {summary['step_time_median']:.4f} | "
              + " | ".join(f"{seconds.get(k, 0.0):.4f}" for k in kinds)
              + f" | {sum(count.values()):.1f} | {compute:.4f}, {storage:.4f}, {overhead:.4f}, "
              f"{summary.get('predicted_step_time') or 0.0:.4f}")


if __name__ == "__main__":
    main()
