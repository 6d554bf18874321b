"""A run's summary: its figures over the measured steps (`summarize`) and the lines a
run prints (`format_summary`, the placement line, one line per worker a placement
left out).

Apart from the record (record.py) because it reads a finished record and writes
text for a person; the record is what the loop fills step by step.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import xarray as xr

from pipeline.records.memory import memory_lines, memory_summary
from pipeline.records.starts import (left_out_steps, measured, placed_setup_unmeasured,
                                     step_ranges)
from pipeline.records.step_breakdown import record_breakdown


def client_cpu_summary(tail: xr.Dataset) -> dict:
    """The client process's CPU per measured step, and as a share of one core: on a
    machine whose cores the workers fill, this is time taken from them."""
    if "client_cpu_time" not in tail or not np.isfinite(tail.client_cpu_time.values).any():
        return {}
    cpu = tail.client_cpu_time
    return {"client_cpu_per_step": float(cpu.median()),
            "client_core_share": float((cpu / tail.step_time).median())}


def summarize(ds: xr.Dataset, warmup_steps: int, batch: int, in_client: bool = False) -> dict:
    """Median step time and spread over the measured steps: the record's steps less
    each start's first `warmup_steps` (`starts.measured`; ``warmup_steps_left_out``
    lists them), as a start times its first steps with its warm-up in them
    (`in_client`: the run trained in the client's process, for its memory figures).
    ``starts`` is the record's list of the run's starts (resumes add one each)."""
    tail = measured(ds, warmup_steps)
    left_out, others = left_out_steps(ds, warmup_steps)
    re_placed = placed_setup_unmeasured(ds)
    times = np.asarray(tail.step_time.values, dtype=float)
    median = float(np.median(times)) if times.size else float("nan")

    def percentile(q: float) -> float:
        return float(np.percentile(times, q)) if times.size else float("nan")

    return {
        "recorded_steps": int(ds.sizes["step"]),
        "measured_steps": int(times.size),
        "warmup_steps_left_out": left_out,
        # steps of starts with another strategy, placement, workers or batch than the
        # last, or run after a recovery or join placed the work again
        "other_setup_steps_left_out": others,
        # every step a warm-up one: the medians fall back to them all, and say so
        "warmup_included": bool(warmup_steps > 0 and ds.sizes["step"] and not left_out
                                and not re_placed),
        # no step ran on the set-up placed (a recovery from checkpoint 0 placed them all
        # again, on other workers): the medians are of those steps, and say so
        "placed_setup_unmeasured": re_placed,
        **({"starts": json.loads(ds.attrs["starts"])} if "starts" in ds.attrs else {}),
        "step_time_median": median,
        "step_time_p25": percentile(25), "step_time_p75": percentile(75),
        "step_time_min": percentile(0), "step_time_max": percentile(100),
        "throughput": batch / median if times.size and median > 0 else float("nan"),
        "final_loss": float(ds.loss.values[-1]) if ds.sizes["step"] else float("nan"),
        "compute_time_median": float(tail.compute_time.max("worker").median()),
        "storage_time_median": float((tail.read_time + tail.write_time).max("worker").median()),
        "wait_time_median": float(tail.wait_time.median()),
        "master_time_median": float(tail.master_time.median()),
        **client_cpu_summary(tail),
        # steps per Dask task (train.steps_per_task); older records lack it
        **({"task_steps_median": float(tail.task_steps.median())} if "task_steps" in tail
           else {}),
        "bytes_per_step": float(tail.workspace_bytes.sum("worker").median()),
        # where a step's time goes along its critical worker (pipeline/records/step_breakdown.py)
        "critical_breakdown": record_breakdown(ds, warmup_steps),  # the same steps
        **memory_summary(ds, in_client),
    }


def _task_steps(summary: dict) -> str:
    """", N steps per task" where a run's tasks held several steps."""
    steps = summary.get("task_steps_median")
    return f", {steps:g} steps per task (median)" if steps and steps > 1 else ""


def _starts_line(summary: dict) -> list[str]:
    """The line of a run resumed at least once, or whose work was placed again (a
    recovery, a join): where its starts began and which steps the medians leave out,
    as warm-up or as run on another set-up."""
    starts = summary.get("starts") or []
    others = summary.get("other_setup_steps_left_out") or []
    if len(starts) < 2 and not others:
        return []
    left_out = summary.get("warmup_steps_left_out") or []
    parts = ([f"steps {step_ranges(left_out)} (each start's warm-up)"] if left_out else []) \
        + ([f"steps {step_ranges(others)} (run with another strategy, placement or "
            "workers than the last start's as placed, or after a recovery or join)"]
           if others else [])
    head = (f"  starts      {len(starts)} (resumed at step(s) "
            f"{', '.join(str(s['from_step']) for s in starts[1:])}); " if len(starts) > 1
            else "  re-placed   ")
    return [f"{head}the medians leave out " + (" and ".join(parts) or "no step")]


def _prediction_basis(summary: dict) -> str:
    """What the closing prediction prices beyond the split: the run's steps per task
    (the per-task costs shared out over them) and the client's share of the cores.
    The placement line's figure (placement: model) prices neither, which is why
    the two differ."""
    steps = summary.get("task_steps_median") or 1
    basis = f" at {steps:g} step{'s' if steps != 1 else ''} per task"
    if (summary.get("predicted_breakdown") or {}).get("contention"):
        basis += ", the client's share of the cores included"
    return basis


def _probe_age(seconds: float | None) -> str:
    """The probe's age where it is an hour or more (a machine's speed drifts)."""
    if seconds is None or seconds < 3600:
        return ""
    return f"; from a probe {seconds / 3600:.1f} h old"


def format_summary(name: str, strategy: str, summary: dict, workers: list[str],
                   embedded_scheduler: bool = True) -> str:
    """The closing lines a run prints; `embedded_scheduler`: whether the scheduler ran
    in the client's process (an embedded cluster), which the client line counts."""
    spread = (f"IQR {summary['step_time_p25']:.3f}-{summary['step_time_p75']:.3f} s, "
              f"range {summary['step_time_min']:.3f}-{summary['step_time_max']:.3f} s")
    ended_on = workers_at_the_end(summary, workers)
    lines = [
        f"run {name}: strategy {strategy} on {', '.join(workers)}"
        + (f"; ended on {', '.join(ended_on)} (below)" if ended_on != list(workers) else ""),
        *machine_lines(summary.get("worker_machines") or {}),
        f"  step time   median {summary['step_time_median']:.3f} s over "
        f"{summary['measured_steps']} measured steps ({spread})"
        + ("; warm-up included: train.warmup_steps leaves none to measure"
           if summary.get("warmup_included") else "")
        + ("; every one ran after a recovery placed the work again on other workers than "
           "placed (below)" if summary.get("placed_setup_unmeasured") else ""),
        *_starts_line(summary),
        f"  throughput  {summary['throughput']:.1f} samples/s",
        f"  breakdown   compute {summary['compute_time_median']:.3f} s, exchange "
        f"{summary['storage_time_median']:.3f} s, dense head {summary['master_time_median']:.3f}"
        f" s, wait {summary['wait_time_median']:.3f} s (medians per step)",
        *([f"  client      {summary['client_cpu_per_step'] * 1e3:.1f} ms CPU per step "
           f"({summary['client_core_share']:.0%} of a core: the client"
           + (" and an embedded scheduler" if embedded_scheduler else "")
           + f"){_task_steps(summary)}"]
          if summary.get("client_cpu_per_step") is not None else []),
        *(["  critical    " + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in
                                          summary["critical_breakdown"].items())
           + " (medians along each step's critical worker)"]
          if summary.get("critical_breakdown") else []),
        f"  exchange    {summary['bytes_per_step'] / 1e6:.2f} MB per step (workspace "
        "reads and writes)",
        *memory_lines(summary),
        f"  loss        {summary['final_loss']:.4f} (last step)",
    ]
    if summary.get("test_accuracy") is not None:
        lines.append(f"  accuracy    {summary['test_accuracy']:.3f} on "
                     f"{summary['test_samples']} test images")
    choice = summary.get("strategy_choice")
    if choice:
        runner = choice.get("runner_up")
        lines.append(f"  auto        chose {choice['chosen']} (master {choice['master']}, "
                     f"placement {choice['placement']}): predicted "
                     f"{choice['predicted_step_time']:.4f} s/step"
                     + (f"; runner-up {runner['strategy']} {runner['predicted_step_time']:.4f}"
                        " s/step" if runner else ""))
    if summary.get("predicted_step_time") is not None and summary.get("prediction_error") \
            is not None:
        compute = summary.get("compute_error")
        lines.append(f"  predicted   {summary['predicted_step_time']:.4f} s/step by the model"
                     f"{_prediction_basis(summary)} "
                     f"({summary['prediction_error']:+.0%} against the median"
                     + (f"; its compute {compute:+.0%} against this run's" if compute is not None
                        else "") + _probe_age(summary.get("prediction_probe_age_s")) + ")")
    elif summary.get("predicted_step_time") is None and summary.get("prediction_note"):
        lines.append(f"  predicted   none: {summary['prediction_note']}")
    elif summary.get("predicted_step_time") is not None and summary.get("prediction_note"):
        lines.append(f"  predicted   {summary['predicted_step_time']:.4f} s/step by the model"
                     f"{_prediction_basis(summary)}, not compared: "
                     f"{summary['prediction_note']}")
    if summary.get("link_bytes_sent"):
        lines.append(
            f"  links       {sum(summary['link_bytes_received'].values()) / 1e6:.2f} MB to "
            f"the workers, {sum(summary['link_bytes_sent'].values()) / 1e6:.2f} MB from them "
            f"({summary['workspace_transport']} workspace)")
    for line in summary.get("left_out") or []:
        lines.append(f"  left out    {line}")
    for r in summary.get("recoveries", []):
        lines.append(f"  recovered   {', '.join(r['lost_workers'])} {r.get('cause', 'lost')} "
                     f"at step {r['lost_at_step']}: back to checkpoint {r['restored_step']}, "
                     f"{r['replayed_steps']} step(s) replayed on {', '.join(r['workers'])} "
                     f"({r['seconds']:.1f} s)"
                     + (f"; {r['late_writes']} late write(s) of the ended attempt discarded"
                        if r.get("late_writes") else ""))
    for j in summary.get("joins", []):
        lines.append(f"  joined      {', '.join(j['joined_workers'])} at step {j['at_step']}: "
                     f"from then on {', '.join(j['workers'])}")
    return "\n".join(lines)


def workers_at_the_end(summary: dict, placed: list[str]) -> list[str]:
    """The workers a run ended on: those its last recovery or join left it (each
    names the run's workers from its step on: a recovery from the checkpoint it
    restored, a join from the checkpoint it came at), else the `placed` ones. At one
    step, a recovery counts after a join: a loss there restores the checkpoint the
    join came at, while a join is only noticed at a checkpoint the run reached."""
    events = [(int(r["restored_step"]), 1, list(r["workers"]))
              for r in summary.get("recoveries") or []]
    events += [(int(j["at_step"]), 0, list(j["workers"])) for j in summary.get("joins") or []]
    if not events:
        return list(placed)
    return sorted(events, key=lambda event: event[:2])[-1][2]  # stable: list order at ties


def machine_lines(worker_machines: dict[str, dict[str, Any]]) -> list[str]:
    """The closing summary's lines on which machines trained: one per machine and torch
    threads, naming its workers in their order (`worker_machines` as the record keeps
    it: {worker: {"machine", "torch_threads"}})."""
    groups: dict[tuple[str, int], list[str]] = {}
    for name, said in worker_machines.items():
        groups.setdefault((str(said["machine"]), int(said["torch_threads"])), []).append(name)
    return [f"  machine     {', '.join(names)}: {machine}; {threads} torch thread"
            + ("s" if threads != 1 else "") + (" each" if len(names) > 1 else "")
            for (machine, threads), names in groups.items()]


#: Why a split is what it is, by placement method (the placement line's end).
PLACEMENT_WHY = {"even": "an even split", "single": "one worker",
                 "calibrated": "measured speeds (placement: calibrated)",
                 "model": "the performance model (placement: model)",
                 "recorded": "a recorded split (placement: recorded)"}


#: What a placement's predicted step prices, by placement method: less than the
#: closing summary's prediction, which adds the run's steps per task and the client's
#: share of the cores (`_prediction_basis`).
PREDICTED_WHAT = {"model": "at one step per task, without the client's share of the cores",
                  "calibrated": "of the calibrated shards' compute alone"}


def placement_line(method: str, split: dict[str, Any], workers: list[str], master: str,
                   choice: dict[str, Any]) -> str:
    """The one line a run prints once its work is placed: each worker's share
    (kernels per conv layer, or samples of the batch), the master, the predicted step
    where the placement predicted one, and why (`PLACEMENT_WHY`, the candidate it
    chose, units moved to fit memory). `split` is the strategy's record of its split
    (``kernel_split`` ``[layer][worker]`` or ``batch_split`` ``[worker]``), `choice`
    the placement's (`SplitChoice.record`, with ``memory``)."""
    if "kernel_split" in split:
        rows = split["kernel_split"]
        shares = [f"{name} {'+'.join(str(row[w]) for row in rows)}"
                  for w, name in enumerate(workers)]
        what = "kernels per conv layer"
    else:
        shares = [f"{name} {count}" for name, count in zip(workers, split["batch_split"])]
        what = "samples of each batch"
    why = PLACEMENT_WHY.get(method, method)
    if choice.get("chosen"):
        why += f", the {choice['chosen']} split"
    moved = (choice.get("memory") or {}).get("units_moved") or 0
    if moved:
        why += f", then {moved} unit(s) moved to fit memory"
    predicted = choice.get("predicted_step_time")
    step = (f"; predicted {predicted:.4f} s/step {PREDICTED_WHAT.get(method, '')}".rstrip()
            if predicted else "")
    if step and moved:  # the prediction is of the split chosen, not of the one moved to
        step += " for the split before the move"
    return f"placed: {what}: {', '.join(shares)} (master {master}){step}; by {why}"


def left_out_lines(placement: str, left_out: list[str], choice: dict[str, Any],
                   seconds_per_unit: dict[str, list[float]], unit: str = "kernel",
                   workers: list[str] | None = None,
                   counts: list[list[int]] | None = None) -> list[str]:
    """One line per worker a placement gave nothing: which worker, its measured speed
    against the fastest worker's, and why (the best split that gives it work is
    predicted slower than the split chosen without it).

    `choice` is the placement's record (`SplitChoice.record`: ``workers``, ``chosen``,
    ``predicted_step_time``, ``alternatives``, among them every worker alone as
    ``single:<name>``); `seconds_per_unit` its calibration (seconds per kernel per
    conv layer, or per sample, by worker); `unit` what they count. Speed is the
    predicted step of the worker alone, its fixed costs included; without those
    predictions, the calibration's seconds per unit. A placement that measured
    nothing (even, recorded) only says it gave the worker none, unless its split
    (`counts` over `workers`, the placement's) shows the reason: too few samples or
    kernel units for every worker. A worker whose few samples were handed to another
    replica (``batch_norm_merged``) is said so.
    """
    alternatives = choice.get("alternatives", {})
    alone = {key.partition(":")[2]: alt["predicted_step_time"]
             for key, alt in alternatives.items() if key.startswith("single:")}
    per_unit = {name: sum(row) for name, row in seconds_per_unit.items() if row}
    speed, what = ((alone, f"s/step predicted for it alone by the {placement} placement")
                   if alone else (per_unit, f"s per {unit}" + (
                       ", summed over conv layers" if unit == "kernel" else "")))
    kept = {n: t for n, t in speed.items() if n not in left_out and t > 0}
    fastest = min(kept, key=kept.__getitem__) if kept else None
    names = list(choice.get("workers") or workers or [])
    # an even split made without a record of one (placement: even) is the placement's own
    own_even = counts if placement == "even" and not choice.get("split") else None
    chosen, chosen_time = choice.get("chosen"), choice.get("predicted_step_time")
    lines = []
    merged = choice.get("batch_norm_merged", {})  # `split_choice.with_rows_merged`
    before = dict(zip(merged.get("workers", []), merged.get("split_before", [[]])[0]))
    row = (choice.get("split") or own_even or [[]])[0]  # a batch split's one row
    samples = sum(row) if row and max(row) == 1 else 0  # one sample to each worker used
    memory = choice.get("memory") or {}
    moved_from = memory.get("split_before") or []  # `split_choice.fit_memory`'s record
    for name in left_out:
        index = names.index(name) if name in names else None
        if index is not None and memory.get("units_moved") and any(
                len(row) > index and row[index] > 0 for row in moved_from):
            capacity = (memory.get("capacity") or [None] * len(names))[index]
            limit = f" ({capacity / 1e6:.0f} MB)" if capacity else ""
            margin = (f", {memory['margin']:.0%} of each peak kept free: "
                      "cluster.memory_margin" if memory.get("margin") else "")
            lines.append(f"worker {name} left out: its memory{limit} holds none of the "
                         f"{unit}s the {placement} placement gave it: they were moved to "
                         f"the other workers to fit memory (its capacity{margin})")
            continue
        if before.get(name):
            lines.append(f"worker {name} left out: its {before[name]} {unit}(s) of the "
                         f"{placement} split went to another replica (train.batch_norm: "
                         "local, and a batch norm's input is 1x1: a replica needs at least "
                         f"{merged['least_rows']})")
            continue
        line = f"worker {name} left out"
        if unit == "sample" and 0 < samples < len(names):
            lines.append(f"{line}: the batch has {samples} sample(s) for {len(names)} "
                         "workers, and a worker gets whole samples")
            continue
        even = alternatives.get("even", {}).get("split") or own_even or []
        holders = max((sum(1 for k in row if k > 0) for row in even), default=len(names))
        if unit == "kernel" and holders < len(names):  # too few units, not too slow
            line += (f": no conv layer has kernels for more than {holders} of the "
                     f"{len(names)} workers in whole units (workspace.channel_quantum)")
        elif fastest is not None and speed.get(name, 0) > 0:
            line += (f": measured {speed[name] / kept[fastest]:.1f}x slower than {fastest} "
                     f"({speed[name]:.3g} against {kept[fastest]:.3g} {what})")
        else:
            line += f": {placement} placement gave it no work"
        with_it = {key: alt["predicted_step_time"] for key, alt in alternatives.items()
                   if name in names and alt.get("predicted_step_time") is not None
                   and any(row[names.index(name)] > 0 for row in alt["split"])}
        if with_it and chosen_time is not None:
            best = min(with_it, key=with_it.__getitem__)
            why = ("giving it {u}s would lengthen the step" if with_it[best] > chosen_time
                   else "the split without it was kept (no faster split gives it {u}s)")
            line += (f"; {why.format(u=unit)} ('{chosen}' without it is predicted "
                     f"{chosen_time:.3g} s/step, the fastest split with it, '{best}', "
                     f"{with_it[best]:.3g} s/step)")
        lines.append(line)
    return lines
