"""trace.json from receipts (Chrome trace format) and its picture (no cluster)."""

from __future__ import annotations

import json

from experiments.report.trace_plot import main as plot_main
from pipeline.records.trace import ClientEvent, write_trace
from tasks.receipts import OpEvent, Phase, Receipt


def _receipt(worker: str, step: int, t: float, head: bool) -> Receipt:
    events = [OpEvent("conv-forward", 0, t, t + 0.3,
                      [Phase("dataset", t, t + 0.05, 1000), Phase("compute", t + 0.05, t + 0.25),
                       Phase("write", t + 0.25, t + 0.3, 512, "act/0/0")])]
    if head:
        events.append(OpEvent("dense-head", -1, t + 0.3, t + 0.5,
                              [Phase("wait", t + 0.3, t + 0.35, 0, "act/0/1"),
                               Phase("compute", t + 0.35, t + 0.5)]))
    return Receipt(f"step-{step}-{worker}", worker, step, t, t + 0.5, events,
                   loss=1.5 if head else None)


def test_trace_is_valid_chrome_json_with_nested_lanes(tmp_path):
    origin = 1000.0
    receipts = [_receipt(w, s, origin + s, w == "w0") for s in (0, 1) for w in ("w0", "w1")]
    client = [ClientEvent("submit step 0", origin, origin + 0.001),
              ClientEvent("collect step 0", origin + 0.001, origin + 0.6)]
    path = tmp_path / "trace.json"
    write_trace(str(path), receipts, client, ["w0", "w1"], origin)
    trace = json.loads(path.read_text())
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert lanes == {0: "client", 1: "w0", 2: "w1"}
    complete = [e for e in events if e["ph"] == "X"]
    assert {e["cat"] for e in complete} == {"client", "task", "op", "phase"}
    by_cat = lambda cat: [e for e in complete if e["cat"] == cat]  # noqa: E731
    assert len(by_cat("task")) == 4 and len(by_cat("client")) == 2
    # every phase lies inside an op, every op inside a task, on the same lane
    for inner, outer in (("phase", "op"), ("op", "task")):
        for event in by_cat(inner):
            assert any(o["tid"] == event["tid"] and o["ts"] <= event["ts"]
                       and event["ts"] + event["dur"] <= o["ts"] + o["dur"] + 0.2
                       for o in by_cat(outer)), event
    heads = [e for e in by_cat("op") if e["name"] == "dense-head"]
    assert {lanes[e["tid"]] for e in heads} == {"w0"}
    write = next(e for e in by_cat("phase") if e["name"] == "write")
    assert write["args"] == {"bytes": 512, "slot": "act/0/0"}
    assert by_cat("task")[0]["ts"] == 0.0 and by_cat("task")[0]["dur"] == 500000.0


def test_trace_plot_draws_the_steps(tmp_path, capsys):
    origin = 50.0
    receipts = [_receipt(w, s, origin + s, w == "w0") for s in (0, 1, 2) for w in ("w0", "w1")]
    path = tmp_path / "trace.json"
    write_trace(str(path), receipts, [], ["w0", "w1"], origin)
    picture = tmp_path / "step.png"
    assert plot_main([str(path), "--steps", "1", "2", "-o", str(picture)]) == 0
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_main([str(path), "--steps", "9", "-o", str(picture)]) == 2  # no such step


def test_trace_plot_reads_the_array_form_and_says_what_is_wrong_in_one_line(tmp_path, capsys):
    """The array form of the Chrome trace format was a TypeError traceback, a string
    traceEvents an AttributeError one, a summary.json `error: ...: 'traceEvents'`, and an
    unwritable -o blamed the trace."""
    origin = 50.0
    receipts = [_receipt(w, s, origin + s, w == "w0") for s in (0, 1) for w in ("w0", "w1")]
    path = tmp_path / "trace.json"
    write_trace(str(path), receipts, [], ["w0", "w1"], origin)
    array = tmp_path / "array.json"
    array.write_text(json.dumps(json.loads(path.read_text())["traceEvents"]))
    picture = tmp_path / "step.png"
    assert plot_main([str(array), "--steps", "1", "-o", str(picture)]) == 0
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    bad = {"string.json": '{"traceEvents": "x"}', "summary.json": '{"steps": 4}',
           "numbers.json": "[1, 2]", "partial.json": '{"traceEvents": [{"ph": "X", "ts": 0}]}'}
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
        assert plot_main([str(tmp_path / name), "-o", str(picture)]) == 2
    assert plot_main([str(path), "-o", str(tmp_path / "missing" / "step.png")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == len(bad) + 1 and all(line.startswith("error: ") for line in lines)
    for line, name in zip(lines, bad):
        assert f"{tmp_path / name}: not a trace" in line, line
    assert "no traceEvents" in lines[1]
    assert str(tmp_path / "missing" / "step.png") in lines[-1] and str(path) not in lines[-1]
