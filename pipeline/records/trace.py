"""A run's timeline as a Chrome trace (`trace.json`), for Perfetto or chrome://tracing.

One lane per worker, plus one for the client. On a worker lane every task is an
event (``step 5``), holding its ops (``conv-forward``, ``dense-head``,
``conv-backward``, with the layer), holding their phases (``compute``, ``read``,
``write``, ``wait``, ``dataset``, ``emulated``), so that Perfetto nests them. The
client lane shows when each step was submitted and collected, and checkpoints.
Times are microseconds since the run's start, from the workers' own clocks (the
same clock on one host; across hosts, their offsets show as shifts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from storage.space import replace_file
from tasks.receipts import Receipt

CLIENT_LANE = "client"


@dataclass
class ClientEvent:
    name: str
    start: float
    end: float
    args: dict = field(default_factory=dict)


def _complete(name: str, lane: int, start: float, end: float, origin: float,
              category: str, args: dict | None = None) -> dict:
    return {"name": name, "cat": category, "ph": "X", "pid": 1, "tid": lane,
            "ts": round((start - origin) * 1e6, 1), "dur": round(max(end - start, 0.0) * 1e6, 1),
            "args": args or {}}


def trace_events(receipts: list[Receipt], client: list[ClientEvent], workers: list[str],
                 origin: float) -> list[dict]:
    """Chrome trace events (the ``traceEvents`` list) of a run."""
    lanes = {name: index + 1 for index, name in enumerate(workers)}
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 1,
                           "args": {"name": "training run"}},
                          {"name": "thread_name", "ph": "M", "pid": 1, "tid": 0,
                           "args": {"name": CLIENT_LANE}}]
    events += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": lane,
                "args": {"name": name}} for name, lane in lanes.items()]
    events += [{"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": lane,
                "args": {"sort_index": lane}} for lane in [0, *lanes.values()]]
    for event in client:
        events.append(_complete(event.name, 0, event.start, event.end, origin, "client",
                                event.args))
    for receipt in receipts:
        lane = lanes.setdefault(receipt.worker, len(lanes) + 1)
        args = {"step": receipt.step, "task": receipt.task}
        if receipt.loss is not None:
            args["loss"] = receipt.loss
        events.append(_complete(f"step {receipt.step}", lane, receipt.start, receipt.end,
                                origin, "task", args))
        for op in receipt.events:
            name = op.name if op.layer < 0 else f"{op.name} {op.layer}"
            events.append(_complete(name, lane, op.start, op.end, origin, "op",
                                    {"step": receipt.step, "layer": op.layer}))
            for phase in op.phases:
                args = {key: value for key, value in (("bytes", phase.nbytes),
                                                      ("slot", phase.slot)) if value}
                events.append(_complete(phase.kind, lane, phase.start, phase.end, origin,
                                        "phase", args))
    return events


def write_trace(path: str, receipts: list[Receipt], client: list[ClientEvent],
                workers: list[str], origin: float) -> None:
    """Write `trace.json` (Chrome trace format, JSON object form)."""
    replace_file(path, json.dumps({"traceEvents": trace_events(receipts, client, workers, origin),
                                   "displayTimeUnit": "ms"}))
