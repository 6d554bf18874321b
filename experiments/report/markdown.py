"""report.md of a measured sweep: provenance, figures, main table, device mixes, failures.

`write_markdown` writes it from the store and the figures drawn; `mixes_section`
is its table of how the work was shared among a run's devices (`device_shares`
reads one run's split back from the store's texts), present where the sweep
varies its devices or its workers differ in device or tag.

Why apart from the figures: report.md is text that must stay readable without
them (provenance, the paper comparison, failures), and the device-mix table has
no figure.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import xarray as xr

from experiments.report.auto import auto_section
from experiments.report.errors import error_section
from experiments.report.growth import growth_section
from experiments.report.links import links_section
from experiments.report.repeats import split_changes_section
from experiments.report.view import PAPER_POINT, PAPER_STRATEGY, StoreView, has_paper_network
from experiments.sweep.provenance import mixed_sessions
from experiments.sweep.store_layout import DONE, FAILED, INFEASIBLE, SKIPPED, infeasible
from experiments.sweep.summary import format_table, summary_table

#: What report.md says of a `mode: predict` store, under "Figures".
PREDICT_ONLY = ("This sweep ran the performance model alone (`mode: predict`): nothing "
                "was measured, so every figure here is the model's. What only measured "
                "steps give is left out: speedup, breakdown, batch, placement, memory, "
                "step spread and predicted-against-measured figures, the device-mix table "
                "and auto against the measured best (an `auto` point is the prediction of "
                "the strategy it would pick, named in its `strategy_choice`).")


#: What report.md says under a figure, where its picture alone could mislead.
NOTES = {"breakdown.png": "Each part of a step is its own median over the measured "
         "steps (along each step's critical worker); the medians need not add up to "
         "the median step, the hatched bar beside them."}


def _provenance(ds: xr.Dataset) -> list[str]:
    machine = json.loads(ds.attrs.get("machine", "{}"))
    versions = json.loads(ds.attrs.get("versions", "{}"))
    status = ds.status.values
    memory = machine.get("memory_bytes")
    mixed = mixed_sessions(json.loads(ds.attrs.get("sessions") or "[]"))
    too_big = int(((status == FAILED) & infeasible(ds.failure.values)).sum()) \
        if "failure" in ds else 0
    lines = [
        f"- points: {int((status == DONE).sum())} done, {int((status == FAILED).sum()) - too_big} "
        f"failed, " + (f"{too_big} not run (predicted beyond their workers' memory), "
                       if too_big else "")
        + f"{int((status == 0).sum())} pending, {int((status == SKIPPED).sum())} not "
        f"applicable (they would repeat another point), of {status.size}",
        f"- machine: {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores"
        + (f", {memory / 2**30:.0f} GiB" if memory else "")
        + (f", GPUs: {', '.join(machine['gpus'])}" if machine.get("gpus") else ", no GPU")
        + f" ({machine.get('host', '?')})",
        *trained_on(ds),
        f"- code revision {ds.attrs.get('code_revision', '?')}; "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + (" (the first session's)" if mixed else ""),
        *([f"- warning: {mixed}; their figures are mixed in this store (--fresh measures "
           "every point again under one)"] if mixed else []),
        f"- started {ds.attrs.get('started', '?')}, {_ended(ds.attrs.get('finished'), status)}",
        f"- command: `{ds.attrs.get('command', '')}`",
        *_later_commands(ds),
        *_growth_lines(ds),
        _speedup_line(ds),
    ]
    cores = machine.get("cores")
    if cores and "n_workers" in ds and np.nanmax(ds.n_workers.values, initial=0) + 1 > cores:
        lines.append(f"- note: some points ran more worker threads (+1 master) than the "
                     f"{cores} cores here; their timings include contention.")
    return lines


def _later_commands(ds: xr.Dataset) -> list[str]:
    """The sessions' commands other than the store's first (`--extend`, an override):
    the first alone no longer reproduces a store grown since."""
    try:
        sessions = json.loads(ds.attrs.get("sessions") or "[]")
    except ValueError:
        return []
    first = ds.attrs.get("command", "")
    later = list(dict.fromkeys(str(s["command"]) for s in sessions
                               if isinstance(s, dict) and s.get("command")
                               and s["command"] != first))
    return [f"- later sessions ran: {'; '.join(f'`{c}`' for c in later)}"] if later else []


def _growth_lines(ds: xr.Dataset) -> list[str]:
    """One line per time the store grew (``--extend``): when, its points before and
    after, and what was added; none for a store that never grew."""
    try:
        growths = json.loads(ds.attrs.get("growths") or "[]")
    except ValueError:
        return ["- grown with --extend (its record of when is unreadable)"]
    return [f"- grown with --extend {g.get('at', '?')}: {g.get('points_before', '?')} -> "
            f"{g.get('points_after', '?')} points ({'; '.join(g.get('changes') or [])}); "
            "the points before it kept as measured" for g in growths]


def _ended(finished: str | None, status: np.ndarray) -> str:
    """When the sweep's last session ended, and whether that finished it."""
    pending = int((status == 0).sum())
    if not finished:
        return "no session ended yet (a sweep running, or one killed)"
    if pending:
        return f"last session ended {finished} with {pending} point(s) pending"
    return f"finished {finished}"


def _speedup_line(ds: xr.Dataset) -> str:
    """What speedup is taken against, or why the store has none."""
    baseline = ds.attrs.get("speedup_baseline", "single")
    if ds.attrs.get("mode") == "predict":
        return ("- no speedup: it is taken over measured steps, and this sweep measured "
                "none (`mode: predict`)")
    if "speedup" in ds and not np.isfinite(ds.speedup.values).any():
        return (f"- no speedup: it is taken against `{baseline}` (`speedup_baseline`) on the "
                "fewest workers, and this store has no done point of it")
    return (f"- speedup is against `{baseline}` at the same other coordinates (median over "
            "its repeats); efficiency divides it by the workers' summed relative speed over "
            "the baseline's.")


def _paper_comparison(sweep: StoreView, frame: pd.DataFrame) -> str | None:
    if not has_paper_network(sweep.ds):  # another network's speedup: no comparison
        return None
    data = frame[(frame["strategy"] == PAPER_STRATEGY) & frame["equal_workers"]
                 & np.isclose(frame["n_workers"], PAPER_POINT[0])]
    if data.empty or data["speedup"].isna().all():
        return None
    best = data.loc[data["speedup"].idxmax()]
    where = ", ".join(f"{d} {best[d]}" for d in sweep.dims)
    return (f"Best kernel-parallel speedup on {PAPER_POINT[0]} equal workers: "
            f"{best['speedup']:.2f}x (efficiency {best['efficiency']:.0%}; {where}); the paper "
            f"reports {PAPER_POINT[1]}x ({PAPER_POINT[1] / PAPER_POINT[0]:.0%}).")


def trained_on(ds: xr.Dataset) -> list[str]:
    """report.md's lines on the machines the workers trained on (the `machine` line
    above is the client's), one per machine with the workers that ran on it, over
    every point's `worker_machines`; none in a store written before it was kept."""
    if "worker_machines" not in ds:
        return []
    workers: dict[str, set[str]] = {}
    for text in ds.worker_machines.values.ravel():
        for name, said in json.loads(str(text or "") or "{}").items():
            workers.setdefault(str(said["machine"]), set()).add(str(name))
    return [f"- workers' machine: {machine} ({', '.join(sorted(names))})"
            for machine, names in sorted(workers.items())]


def device_shares(kernel_split: str, batch_split: str, worker_devices: str
                  ) -> list[tuple[str, str, float]]:
    """``(worker, "device, tag", share)`` of a run's work: its kernels over all conv
    layers (kernel, single) or its samples (data, hybrid), as the store keeps them."""
    workers = json.loads(worker_devices or "[]")
    kernels = json.loads(kernel_split or "[]")
    rows = [list(r) for r in zip(*kernels)] if kernels else [[k] for k in json.loads(
        batch_split or "[]")]
    total = sum(sum(r) for r in rows)
    if not workers or len(rows) != len(workers) or not total:
        return []
    return [(name, f"{device}, {tag}", sum(row) / total)
            for (name, tag, device), row in zip(workers, rows)]


def emulated_speeds(labels: str) -> dict[str, str]:
    """", emulated 0.5x speed" by worker name, from a point's `worker_labels`
    ("cpu-0, cpu-1 (emulated 0.5x speed)"): a slower device emulated on this machine's
    CPU (its tasks sleep in proportion to their compute), which the report says."""
    found = {}
    for label in labels.split(", "):
        name, _, rest = label.partition(" (")
        if rest.startswith("emulated"):
            found[name] = ", " + rest.rstrip(")")
    return found


def mixes_section(ds: xr.Dataset, sweep: StoreView) -> list[str]:
    """report.md's table of step time and each device's share, point by point (first
    done repeat), where the sweep varies its devices (a `cluster.devices`, `resources`
    or `workers` axis) or runs whose workers differ in device or tag. Points with no
    measured step (`mode: predict`) have no row: nothing ran to share the work."""
    if "worker_devices" not in ds:
        return []
    status, texts = ds.status.values, {n: ds[n].values for n in (
        "kernel_split", "batch_split", "worker_devices")}
    emulated = ds["worker_labels"].values if "worker_labels" in ds else None
    labels = {dim: [str(v) for v in ds[dim].values] for dim in sweep.dims}
    rows, kinds = [], set()
    for position in np.ndindex(*status.shape[:-1]):
        done = np.flatnonzero(status[position] == DONE)
        steps = ds.step_time.values[position][done]
        if not np.isfinite(steps).any():  # nothing measured (`mode: predict`)
            continue
        cell = position + (int(done[0]),)
        shares = device_shares(*(str(texts[n][cell]) for n in texts))
        kinds.update(kind for _n, kind, _s in shares)
        where = ", ".join(f"{d} {labels[d][i]}" for d, i in zip(sweep.dims, position))
        step = float(np.nanmedian(steps))
        slower = emulated_speeds(str(emulated[cell])) if emulated is not None else {}
        rows.append(f"| {where or 'the point'} | {step * 1e3:.1f} | " + ", ".join(
            f"{name} ({kind}{slower.get(name, '')}) {share:.0%}"
            for name, kind, share in shares) + " |")
    mixed = sweep.dim_with("cluster.devices", "cluster.resources", "cluster.workers") \
        or len(kinds) > 1
    if not rows or not mixed:
        return []
    return ["## Device mixes", "",
            "Step time (median over done repeats) and each worker's share of the work "
            "(kernels over all conv layers, or samples), from the first done repeat. "
            "Workers of a mix that are not listed were given nothing (left out by the "
            "placement).", "", "| point | step (ms) | shares |", "|---|---:|---|", *rows, ""]


#: Said under the main table where some worker was an emulated slower device.
EMULATED_NOTE = ("Workers given a speed below 1 (labels such as `1+0.5`) are emulated "
                 "slower devices: the same CPU, their tasks sleeping in proportion to their "
                 "compute (`cluster.workers`' `speed`), not slower hardware.")


def write_markdown(ds: xr.Dataset, sweep: StoreView, frame: pd.DataFrame, figures: list[str],
                   path: str) -> None:
    table = summary_table(ds)
    lines = [f"# Sweep `{ds.attrs.get('sweep_name', '?')}`", ""]
    lines += _provenance(ds)
    comparison = _paper_comparison(sweep, frame)
    if comparison:
        lines += ["", comparison]
    accuracies = frame.dropna(subset=["accuracy"]).groupby("strategy")["accuracy"]
    if len(accuracies) > 1:
        spread = ", ".join(f"{s} {a.min():.3f}" + (f"-{a.max():.3f}" if a.max() > a.min() else "")
                           for s, a in accuracies)
        lines += ["", f"Test accuracy by strategy (distribution must not change it): {spread}."]
    lines += ["", "## Figures", ""]
    if ds.attrs.get("mode") == "predict":
        lines += [PREDICT_ONLY, ""]
    captions = {"speedup.png": "Speedup against workers", "breakdown.png": "Time breakdown",
                "batch.png": "Batch size", "placement.png": "Placement on unequal workers",
                "memory.png": "Memory per worker (working, the fullest worker)",
                "step_times.png": "Spread of measured steps",
                "prediction.png": "Predicted against measured",
                "predicted.png": "Predicted step time",
                "links.png": "Step time against link rate"}
    for name in figures:
        if not name.startswith("growth_"):  # those have a section of their own
            lines += [f"![{captions.get(name, name)}]({name})", ""]
            lines += [f"*{NOTES[name]}*", ""] if name in NOTES else []
    lines += growth_section(figures)
    lines += ["## Main figures (median over done repeats)", "", format_table(table, True), ""]
    if "worker_labels" in ds and any("emulated" in str(v) for v in ds.worker_labels.values.ravel()):
        lines += [EMULATED_NOTE, ""]
    lines += split_changes_section(ds)
    lines += mixes_section(ds, sweep)
    lines += links_section(sweep, frame)
    lines += error_section(ds)
    lines += auto_section(ds, frame, sweep.dims, sweep.worker_dim)
    failures = table[table["failure"] != ""]
    too_big = failures["failure"].str.startswith(INFEASIBLE)
    for title, rows in (("Failed points", failures[~too_big]),
                        ("Points not run: beyond their workers' memory", failures[too_big])):
        if rows.empty:
            continue
        lines += [f"## {title}", ""]
        for _, row in rows.iterrows():
            where = ", ".join(f"{d}={row[d]}" for d in sweep.dims) or "the point"
            lines.append(f"- {where}: {row['failure']}")
        lines.append("")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines))
