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


def load(path: str) -> tuple[dict[int, str], list[dict]]:
    """Lane names by thread id, and the complete ("X") events."""
    with open(path, encoding="utf-8") as handle:
        events = json.load(handle)["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return lanes, [e for e in events if e.get("ph") == "X"]


def draw(path: str, steps: list[int], output: str, title: str = "") -> None:
    """Draw the given steps' tasks (and the client's work during them) to `output`."""
    lanes, events = load(path)
    tasks = [e for e in events if e["cat"] == "task" and e["args"].get("step") in steps]
    if not tasks:
        raise ValueError(f"no task of steps {steps} in the trace")
    start = min(e["ts"] for e in tasks)
    end = max(e["ts"] + e["dur"] for e in tasks)
    inside = [e for e in events if e["ts"] < end and e["ts"] + e["dur"] > start]
    order = sorted(lanes)
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
    figure.savefig(output, dpi=110)
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
    except (OSError, ValueError, KeyError) as error:
        print(f"error: {args.trace}: {error}", file=sys.stderr)
        return 2
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
