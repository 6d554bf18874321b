"""Draw steps of a run's timeline (`trace.json`) as a picture, one lane per worker.

    python -m experiments.report.trace_plot runs/small/trace.json --steps 5 6 -o step.png

Each op is a bar on its worker's lane, split into its phases (compute, workspace
read/write, waiting for a peer, dataset reads); the client lane shows submissions,
collections and checkpoints. For a zoomable view, open trace.json in Perfetto
(https://ui.perfetto.dev) or chrome://tracing.
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from pipeline.cli import OneLineParser, UsageError  # noqa: E402

COLOURS = {"compute": "#4c72b0", "emulated": "#8da0cb", "read": "#dd8452", "write": "#c44e52",
           "wait": "#dddddd", "dataset": "#55a868"}


class NotATrace(ValueError):
    """The input is JSON but not a timeline this tool can draw (said as one line)."""


class OutputProblem(Exception):
    """The picture could not be written to `-o` (said naming the output, not the trace)."""


def complete_event(event: object) -> bool:
    """Whether `event` is a complete ("X") event with the fields `draw` reads."""
    if not isinstance(event, dict) or event.get("ph") != "X":
        return False
    numbers = all(isinstance(event.get(key), (int, float)) and not isinstance(event.get(key), bool)
                  for key in ("ts", "dur"))
    return (numbers and isinstance(event.get("cat"), str) and isinstance(event.get("name"), str)
            and lane_id(event.get("tid")) and isinstance(event.get("args", {}), dict))


def lane_id(tid: object) -> bool:
    """Whether `tid` names a lane (a number or a string; other tools write either)."""
    return isinstance(tid, (int, str)) and not isinstance(tid, bool)


def load(path: str) -> tuple[dict[int, str], list[dict]]:
    """Lane names by thread id, and the complete ("X") events.

    Both forms of the Chrome trace format are read: an object with `traceEvents`
    (what a run writes) and a bare array of events; anything else (a run's
    summary.json, say) is NotATrace, not a KeyError or TypeError traceback."""
    with open(path, encoding="utf-8") as handle:
        trace = json.load(handle)
    if isinstance(trace, dict):
        if "traceEvents" not in trace:
            raise NotATrace("not a trace: no traceEvents")
        trace = trace["traceEvents"]
    if not isinstance(trace, list):
        raise NotATrace("not a trace: traceEvents is not a list of events")
    if not all(isinstance(event, dict) for event in trace):
        raise NotATrace("not a trace: an event is not an object")
    lanes = {e["tid"]: str(e["args"]["name"]) for e in trace
             if e.get("ph") == "M" and e.get("name") == "thread_name" and lane_id(e.get("tid"))
             and isinstance(e.get("args"), dict) and "name" in e["args"]}
    events = [e for e in trace if e.get("ph") == "X"]
    if not all(complete_event(e) for e in events):
        raise NotATrace("not a trace: a complete (\"X\") event lacks ts, dur, tid, cat or name")
    for event in events:  # a lane without a thread_name (other tools' traces) is named by its id
        lanes.setdefault(event["tid"], f"thread {event['tid']}")
    return lanes, events


def draw(path: str, steps: list[int], output: str, title: str = "") -> None:
    """Draw the given steps' tasks (and the client's work during them) to `output`."""
    lanes, events = load(path)
    tasks = [e for e in events if e["cat"] == "task" and e.get("args", {}).get("step") in steps]
    if not tasks:
        raise ValueError(f"no task of steps {steps} in the trace")
    start = min(e["ts"] for e in tasks)
    end = max(e["ts"] + e["dur"] for e in tasks)
    inside = [e for e in events if e["ts"] < end and e["ts"] + e["dur"] > start]
    order = sorted(lanes, key=lambda tid: (isinstance(tid, str), tid))
    row = {tid: len(order) - 1 - i for i, tid in enumerate(order)}
    figure, axes = plt.subplots(figsize=(11, 0.8 + 0.75 * len(order)))
    for event in inside:
        y = row.get(event["tid"])
        if y is None:
            continue
        left = (max(event["ts"], start) - start) / 1e3
        width = (min(event["ts"] + event["dur"], end) - max(event["ts"], start)) / 1e3
        if event["cat"] == "phase":
            axes.barh(y, width, left=left, height=0.5, color=COLOURS.get(event["name"], "#999"),
                      edgecolor="none")
        elif event["cat"] == "op":
            axes.barh(y + 0.33, width, left=left, height=0.12, color="black", edgecolor="white",
                      linewidth=0.5)
            if width > (end - start) / 1e3 / 40:
                axes.text(left + width / 2, y + 0.47, event["name"].replace("conv-", ""),
                          ha="center", va="bottom", fontsize=7)
        elif event["cat"] == "client":
            axes.barh(y, max(width, (end - start) / 1e3 / 300), left=left, height=0.4,
                      color="#bbbbbb" if event["name"].startswith("collect") else "#333333")
    axes.set_yticks([row[t] for t in order], [lanes[t] for t in order])
    axes.set_ylim(-0.6, len(order) - 0.2)
    axes.set_xlim(0, (end - start) / 1e3)
    axes.set_xlabel("ms")
    axes.set_title(title or f"{path}: step{'s' if len(steps) > 1 else ''} "
                   f"{', '.join(map(str, steps))}", fontsize=10)
    figure.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()],
                  loc="lower center", ncol=len(COLOURS), fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0.35 / figure.get_figheight(), 1, 1))
    try:
        figure.savefig(output, dpi=110)
    except (OSError, ValueError) as error:  # no such folder, no permission, an unknown suffix
        raise OutputProblem(str(error)) from error
    finally:
        plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m experiments.report.trace_plot",
                           description=__doc__.split("\n")[0])
    parser.add_argument("trace", help="a run's trace.json")
    parser.add_argument("--steps", type=int, nargs="+", default=[1], help="steps to draw")
    parser.add_argument("-o", "--output", default="trace.png")
    parser.add_argument("--title", default="")
    try:
        args = parser.parse_args(argv)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        draw(args.trace, args.steps, args.output, args.title)
    except OutputProblem as error:
        print(f"error: -o {args.output}: {error}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as error:
        print(f"error: {args.trace}: {error}", file=sys.stderr)
        return 2
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
