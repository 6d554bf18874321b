"""Each op of a finished run, split into its compute, its workspace accesses and the
rest, and a `kernel` run's conv ops beside the probe's tables.

    python -m benchmarks.op_times RUN_DIR [RUN_DIR ...]

From a run's trace.json (a `python -m pipeline.train` output or a sweep point's),
per worker and op, the median over its measured steps (those its summary did not
leave out as warm-up; the first `WARMUP_STEPS` where it names none) of the
seconds in compute phases, in reads, writes, waits and batch reads, and in neither:
the op's own work between its phases (a `kernel` layer's join of the shards it
gathered, ``torch.cat``). The probe times compute phases alone, and the model prices
that join apart, at the memory rate (docs/model.md); an op's whole time less its
accesses reads 1.1-1.2x a table where its compute reads 1.0x (ResNet-20's first
stage, 2026-11-30).

Of a `kernel` or `single` run, each conv op also gets the probe's table at the run's
split (the cached probe its prediction names, the worker's `LayerTable` with as many
workers running) and the run's compute over it: how much slower the run computed
than its probe, layer by layer. The tables are of the probe's optimizer (no momentum,
no weight decay): a backward that steps with them reads a little over. Not a test: a
diagnosis for a prediction that missed (docs/benchmarks.md, "The model's error").
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import defaultdict
from statistics import median
from typing import Any, Collection

from pipeline.probe import ClusterProbe, find_cached_probe

#: Steps left out where a summary names none: `train.warmup_steps`' default.
WARMUP_STEPS = 2
#: Phases that are an access, not compute: their time is the workspace's or a peer's.
ACCESS_PHASES = ("read", "write", "wait", "dataset")
#: What an op's time splits into.
PARTS = ("compute", "access", "other")

OpKey = tuple[str, str]  # (worker, op name as the trace writes it: "conv-forward 3")


def op_parts(events: list[dict[str, Any]], left_out: Collection[int] = range(WARMUP_STEPS)
             ) -> dict[OpKey, dict[str, float]]:
    """Per (worker, op) the median over the steps not `left_out` of each part of
    `PARTS` (seconds; an op that runs more than once a step is summed within it)."""
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    lanes: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        if event.get("ph") == "X" and event.get("tid") in names:
            lanes[event["tid"]].append(event)
    steps: dict[OpKey, dict[int, dict[str, float]]] = defaultdict(
        lambda: defaultdict(lambda: dict.fromkeys(PARTS, 0.0)))
    for lane, lane_events in lanes.items():
        phases = [e for e in lane_events if e.get("cat") == "phase"]
        for op in (e for e in lane_events if e.get("cat") == "op"):
            step = int(op["args"].get("step", -1))
            if step < 0 or step in left_out:
                continue
            start, end = op["ts"], op["ts"] + op["dur"]
            inside = [p for p in phases if start <= p["ts"] < end]
            compute = sum(p["dur"] for p in inside if p["name"] in ("compute", "emulated"))
            access = sum(p["dur"] for p in inside if p["name"] in ACCESS_PHASES)
            parts = steps[names[lane], op["name"]][step]
            parts["compute"] += compute / 1e6
            parts["access"] += access / 1e6
            parts["other"] += max(op["dur"] - compute - access, 0.0) / 1e6
    return {key: {part: median(s[part] for s in by_step.values()) for part in PARTS}
            for key, by_step in steps.items()}


def table_seconds(probe: ClusterProbe, summary: dict[str, Any]) -> dict[OpKey, float]:
    """Per (worker, conv op) of a `kernel` or `single` run, the probe's table at the
    run's split: its worker's `LayerTable` with as many workers running, at the
    kernels the run gave it ({} for a run without a kernel split)."""
    split = summary.get("kernel_split")
    names = summary.get("split_workers") or [w.name for w in probe.workers]
    if not split:
        return {}
    tables = {spec.name: spec.layer_tables for spec in probe.device_specs(len(split[0]))}
    convs = probe.costmodel_network().conv
    out: dict[OpKey, float] = {}
    for layer, counts in enumerate(split):
        for worker, kernels in zip(names, counts):
            table = tables.get(worker, {}).get(convs[layer].name)
            if table is None or kernels <= 0:
                continue
            forward, backward = table.times(kernels, probe.batch)
            out[worker, f"conv-forward {layer}"] = forward
            out[worker, f"conv-backward {layer}"] = backward
    return out


def _order(key: OpKey) -> tuple:
    """Workers in turn, their ops by name and then layer as a number."""
    worker, op = key
    match = re.fullmatch(r"(.*?) (\d+)", op)
    return (worker, match.group(1), int(match.group(2))) if match else (worker, op, -1)


def report(run: str) -> list[str]:
    """The lines printed for one run directory."""
    with open(os.path.join(run, "summary.json"), encoding="utf-8") as handle:
        summary = json.load(handle)
    with open(os.path.join(run, "trace.json"), encoding="utf-8") as handle:
        parts = op_parts(json.load(handle)["traceEvents"],
                         set(summary.get("warmup_steps_left_out", range(WARMUP_STEPS))))
    probe = find_cached_probe(summary.get("prediction_probe") or "", any_age=True)
    tables = table_seconds(probe, summary) if isinstance(probe, ClusterProbe) else {}
    lines = [f"## {run}: {summary.get('strategy')}, step {summary['step_time_median']:.4f} s"
             + ("" if tables else "; no probe table to set beside its ops")]
    totals: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(
        ("compute", "access", "other", "table", "tabled"), 0.0))
    for key in sorted(parts, key=_order):
        worker, op = key
        p, table = parts[key], tables.get(key)
        line = (f"{worker:8s} {op:20s} compute {1e3 * p['compute']:8.2f} ms  access "
                f"{1e3 * p['access']:7.2f}  other {1e3 * p['other']:6.2f}")
        if table:
            line += f"  table {1e3 * table:8.2f}  compute/table {p['compute'] / table:5.2f}"
            totals[worker]["table"] += table
            totals[worker]["tabled"] += p["compute"]
        for part in ("compute", "access", "other"):
            totals[worker][part] += p[part]
        lines.append(line)
    for worker, t in totals.items():
        ratio = f", conv compute/table {t['tabled'] / t['table']:.3f}" if t["table"] else ""
        lines.append(f"{worker:8s} a step: compute {1e3 * t['compute']:.1f} ms, access "
                     f"{1e3 * t['access']:.1f}, other {1e3 * t['other']:.1f}{ratio}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories (trace.json, summary.json)")
    args = parser.parse_args()
    for run in args.runs:
        print("\n".join(report(run)), flush=True)


if __name__ == "__main__":
    main()
