"""Each op of a finished run, split into its compute, its workspace accesses and the
rest, a `kernel` run's conv ops beside the probe's tables, and a step as the run spent
it beside the step as the model priced it.

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
no weight decay): a backward that steps with them reads a little over.

Last, per worker, its measured steps (medians): the step's span in compute, in
batch reads and workspace reads and writes, in waits for a peer's slot and in the
rest (between ops), then the gap to its next step; its steps that open a task against
the later ones of a task (`task_positions`: what a task's start costs on the worker's
core, which one or two steps a task pay in their median step); and the model's breakdown from the
summary (`predicted_breakdown`: its overhead holds the waits and the gaps between
tasks or steps). The two are what told a step's miss apart into compute, waits and
the client's share (docs/model.md, "Building blocks"). Not a test: a diagnosis for a
prediction that missed (docs/benchmarks.md, "The model's error").
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


def _lanes(events: list[dict[str, Any]]) -> tuple[dict[int, str], dict[int, list[dict[str, Any]]]]:
    """Each trace lane's worker name, and its complete events (``"ph": "X"``)."""
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    lanes: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        if event.get("ph") == "X" and event.get("tid") in names:
            lanes[event["tid"]].append(event)
    return names, lanes


def _steps(lane_events: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """A lane's ``step N`` spans in time order, each with its step number."""
    steps = [(int(e["name"].split()[1]), e) for e in lane_events
             if e.get("cat") == "task" and re.fullmatch(r"step \d+", e["name"])]
    return sorted(steps, key=lambda numbered: numbered[1]["ts"])


def op_parts(events: list[dict[str, Any]], left_out: Collection[int] = range(WARMUP_STEPS)
             ) -> dict[OpKey, dict[str, float]]:
    """Per (worker, op) the median over the steps not `left_out` of each part of
    `PARTS` (seconds; an op that runs more than once a step is summed within it)."""
    names, lanes = _lanes(events)
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


#: A step as `step_parts` splits it.
STEP_PARTS = ("span", "compute", "io", "wait", "rest", "gap")
#: The phases inside a step that make each of its parts.
STEP_PHASES = {"compute": ("compute", "emulated"), "io": ("read", "write", "dataset"),
               "wait": ("wait",)}


def step_parts(events: list[dict[str, Any]], left_out: Collection[int] = range(WARMUP_STEPS)
               ) -> dict[str, dict[str, float]]:
    """Per worker the median over the steps not `left_out` of `STEP_PARTS` (seconds):
    its ``step N`` span, the compute, batch and workspace I/O and wait phases inside
    it, the rest of the span, and the gap to its next step's start (over the steps
    that have one)."""
    names, lanes = _lanes(events)
    out = {}
    for lane, lane_events in lanes.items():
        steps = _steps(lane_events)
        phases = [e for e in lane_events if e.get("cat") == "phase"]
        figures: dict[str, list[float]] = defaultdict(list)
        for index, (number, step) in enumerate(steps):
            if number in left_out:
                continue
            start, end = step["ts"], step["ts"] + step["dur"]
            inside = [p for p in phases if start <= p["ts"] < end]
            for part, phase_names in STEP_PHASES.items():
                figures[part].append(sum(p["dur"] for p in inside if p["name"] in phase_names))
            figures["span"].append(step["dur"])
            figures["rest"].append(step["dur"] - sum(figures[k][-1] for k in STEP_PHASES))
            if index + 1 < len(steps):
                figures["gap"].append(steps[index + 1][1]["ts"] - end)
        if figures:
            out[names[lane]] = {part: median(figures[part]) / 1e6 if figures[part] else 0.0
                                for part in STEP_PARTS}
    return out


def task_positions(events: list[dict[str, Any]], left_out: Collection[int] = range(WARMUP_STEPS)
                   ) -> dict[str, dict[str, tuple[float, int]]]:
    """Per worker, the median span (seconds) and count of its steps not `left_out` that
    open a task (``first``) and of those after them in the same task (``later``): a
    task's steps are those the client submitted together (``submit steps A-B`` in the
    trace; ``submit step A``: a task of one). The first pays the task's start on the
    worker's core; the median step meets it at one or two steps a task only."""
    opens = {}
    for event in events:
        found = re.fullmatch(r"submit steps? (\d+)(?:-(\d+))?", event.get("name", ""))
        if found and event.get("cat") == "client":
            first = int(found[1])
            opens.update({step: first for step in range(first, int(found[2] or first) + 1)})
    names, lanes = _lanes(events)
    out = {}
    for lane, lane_events in lanes.items():
        spans: dict[str, list[float]] = defaultdict(list)
        for step, event in _steps(lane_events):
            if step in opens and step not in left_out:
                spans["first" if opens[step] == step else "later"].append(event["dur"])
        if spans:
            out[names[lane]] = {where: (median(spans[where]) / 1e6 if spans[where] else 0.0,
                                        len(spans[where])) for where in ("first", "later")}
    return out


def model_line(summary: dict[str, Any]) -> str | None:
    """The model's step and its breakdown from a run's summary (None: not predicted)."""
    b = summary.get("predicted_breakdown")
    if not summary.get("predicted_step_time") or not isinstance(b, dict):
        return None
    io = b.get("storage", 0.0) + b.get("communication", 0.0)
    return (f"model    a step {1e3 * summary['predicted_step_time']:.2f} ms: compute "
            f"{1e3 * b.get('compute_critical', 0.0):.2f}, master {1e3 * b.get('master', 0.0):.2f}"
            f", io {1e3 * io:.2f}, overhead {1e3 * b.get('overhead', 0.0):.2f}, contention "
            f"{1e3 * b.get('contention', 0.0):.2f}")


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
    left_out = set(summary.get("warmup_steps_left_out", range(WARMUP_STEPS)))
    with open(os.path.join(run, "trace.json"), encoding="utf-8") as handle:
        events = json.load(handle)["traceEvents"]
    parts = op_parts(events, left_out)
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
    for worker, p in sorted(step_parts(events, left_out).items()):
        lines.append(f"{worker:8s} a step's span {1e3 * p['span']:.2f} ms: compute "
                     f"{1e3 * p['compute']:.2f}, io {1e3 * p['io']:.2f}, wait "
                     f"{1e3 * p['wait']:.2f}, rest {1e3 * p['rest']:.2f}; then "
                     f"{1e3 * p['gap']:.2f} to its next step")
    for worker, where in sorted(task_positions(events, left_out).items()):
        (first, opened), (later, inside) = where["first"], where["later"]
        lines.append(f"{worker:8s} a task's first step {1e3 * first:.2f} ms ({opened} "
                     f"steps)" + (f", its later ones {1e3 * later:.2f} ms ({inside}): "
                                  f"{1e3 * (first - later):+.2f} ms a task" if inside else ""))
    model = model_line(summary)
    if model:
        lines.append(model)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories (trace.json, summary.json)")
    args = parser.parse_args()
    for run in args.runs:
        print("\n".join(report(run)), flush=True)


if __name__ == "__main__":
    main()
