"""The sweep store's layout: every variable with its units and meaning, the status
flags, and the template (all NaN, status pending) written before any point runs.

Apart from the store's writes (:mod:`experiments.sweep.results`) because what a store
holds is read by every reader (the report, the summary, the scaling sweep, the
measures of a point) that never writes one; the writes and the lock need it, not
the other way round.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import yaml
import xarray as xr

from experiments.sweep.speedup import speedup_reference
from experiments.sweep.axes import Axis, value_json, value_label
from experiments.sweep.config import Sweep
from experiments.sweep.points import worker_count
from pipeline.records.step_breakdown import COMPONENTS

PENDING, DONE, FAILED, SKIPPED = 0, 1, 2, 3
#: How a failed point's `failure` starts where it was not run at all: its predicted
#: peak memory exceeds a worker's limit (a measured sweep), or the model finds it
#: infeasible (a scaling sweep).
INFEASIBLE = "Infeasible: "


def infeasible(failure: np.ndarray) -> np.ndarray:
    """Where a store's `failure` texts say the point was not run (`INFEASIBLE`)."""
    return np.vectorize(lambda text: str(text).startswith(INFEASIBLE), otypes=[bool])(
        failure) if np.size(failure) else np.zeros(np.shape(failure), dtype=bool)
#: The parts the model predicts (it has no dataset part of its own; its wait is the
#: client's share of the cores, pipeline/costmodel/contention.py).
PREDICTED_COMPONENTS = ("compute", "exchange", "wait", "client")
#: Recomputed over the whole grid after every point (`ResultStore.refresh_derived`).
DERIVED = ("speedup", "efficiency")

#: name -> (units, description) of the per-point float variables, in table order.
MEASURES: dict[str, tuple[str, str]] = {
    "step_time": ("s", "median wall time of the measured steps (warm-up excluded)"),
    "step_time_p25": ("s", "25th percentile of the measured steps' wall time"),
    "step_time_p75": ("s", "75th percentile of the measured steps' wall time"),
    "step_time_min": ("s", "fastest measured step"),
    "step_time_max": ("s", "slowest measured step"),
    "throughput": ("samples/s", "training samples per second: batch / step_time"),
    "speedup": ("1", "the baseline's step_time (the sweep's speedup_baseline strategy on "
                "the fewest workers, median over repeats, same other coordinates) divided "
                "by this point's step_time, times this point's batch over the baseline's "
                "(1 but where the batch is zipped with the workers: weak scaling)"),
    "efficiency": ("1", "speedup divided by the capacity relative to the baseline's "
                   "(workers, or reference threads, for equal devices; summed relative "
                   "speeds else)"),
    "compute_time": ("s", "median per step of the busiest worker's compute (conv shards, "
                     "and the dense head on the master; emulated slow-down included)"),
    "storage_time": ("s", "median per step of the busiest worker's workspace read+write time"),
    "master_time": ("s", "median per step of the dense head's compute on the master worker"),
    "wait_time": ("s", "median per step of the time the busiest worker spent neither "
                  "computing nor reading/writing (waiting for peers, task dispatch)"),
    "bytes_moved": ("B", "median per step of the workspace bytes all workers read+wrote "
                    "(dataset reads apart; 0 for single and reference)"),
    "loss": ("1", "training cross-entropy of the last step's batch"),
    "accuracy": ("1", "test-set accuracy of the final weights"),
    "n_workers": ("1", "workers the point's strategy used (1 for single and reference)"),
    "offered_workers": ("1", "workers the point was given (its placement may leave some "
                        "idle; 1 for single and reference). Stores written before it have "
                        "none"),
    "capacity": ("1", "summed relative speed of the workers (reference: threads) the "
                 "point was given, those its placement left idle included (1.0 = one "
                 "unslowed device; emulated slower devices count their fraction)"),
    "measured_steps": ("1", "steps the timing figures are taken over"),
    "predicted_step_time": ("s", "the performance model's step time for this point "
                            "(NaN where the model has no probe of its cluster)"),
    "prediction_error": ("1", "(predicted_step_time - step_time) / step_time"),
    "compute_error": ("1", "the model's compute on the critical path against the run's "
                      "(predicted_compute / critical_compute - 1): where it is about "
                      "prediction_error, the miss is how fast the machine ran the "
                      "arithmetic against when it was probed, not the model's exchange, "
                      "waits or overheads (docs/model.md). Stores written before it have "
                      "none"),
    "predicted_low": ("s", "the model's step time with every probed shard and the dense "
                      "head at the lower quartile of the probe's steps (how sure the "
                      "prediction is: docs/model.md). Stores written before it have none"),
    "predicted_high": ("s", "the same at the upper quartile"),
    **{f"critical_{part}": ("s", f"median per measured step of its {part!r} component "
                            "along the step's critical worker (pipeline/records/step_breakdown.py: "
                            "compute, exchange, dataset, wait and client add up to each "
                            "step's wall time). Stores written before it have none")
       for part in COMPONENTS},
    **{f"predicted_{part}": ("s", f"the model's {part!r} component of predicted_step_time "
                             "(pipeline/step_breakdown.model_breakdown; NaN without a "
                             "prediction). Stores written before it have none")
       for part in PREDICTED_COMPONENTS},
    "predicted_peak_memory": ("B", "the model's largest peak memory of a worker (the "
                              "training process for reference) under the point's split: "
                              "docs/model.md, 'Memory per device'; of a point not run as "
                              "beyond its workers' memory, the peak of the worker that "
                              "cannot hold it. Stores written before it have none"),
    "recoveries": ("1", "worker losses the point's run survived (each: back to its last "
                   "checkpoint, re-placed on the surviving workers, replayed; see "
                   "recovery_log). Stores written before it have no such variable"),
    "memory_peak": ("B", "the most host resident memory any worker's process held during "
                    "a step (reference: the process training in-process), over the run"),
    "memory_working": ("B", "memory_peak less the resident memory of a bare process that "
                       "has imported what a worker imports (distributed and the task "
                       "modules; for reference, what the client imports): the memory the "
                       "point's work needed on its fullest worker"),
    "client_memory_peak": ("B", "the most host resident memory the client process held "
                           "during a step"),
    "client_cpu_per_step": ("s", "CPU time of the client's process per step (median): its "
                            "submits and collects and an embedded cluster's scheduler (for "
                            "reference, the training itself). Stores written before it have "
                            "none"),
    "task_steps": ("1", "steps per Dask task the point's run ran (median over its measured "
                   "steps; train.steps_per_task). Stores written before it have none"),
    "started": ("s", "when the point's run started, seconds since 1970-01-01 UTC"),
    "finished": ("s", "when the point's run ended, seconds since 1970-01-01 UTC"),
    "wall_time": ("s", "the point's whole run: setup, calibration, steps, evaluation"),
}
TEXTS: dict[str, str] = {
    "failure": "why the point failed (status 2; 'Infeasible: ...' where it was not run: "
               "its predicted peak memory exceeds a worker's limit) or is not run (status 3)",
    "run_id": "identifies the run that produced this point's values",
    "kernel_split": "kernels per worker per conv layer (JSON), as placed (kernel, single)",
    "batch_split": "samples of each step's batch per worker (JSON; data, hybrid)",
    "worker_labels": "the workers used, with emulated speeds",
    "worker_devices": "the workers used, in split order: JSON [[name, resource tag, device]]",
    "worker_machines": "the machine each worker trained on, as it said it (JSON {name: "
                       "{machine, torch_threads}}; the store's `machine` is the client's)",
    "recovery_log": "the run's recoveries (JSON list: lost_at_step, restored_step, "
                    "lost_workers, workers, split, replayed_steps, seconds, cause, "
                    "ended_attempt, late_writes)",
    "memory_per_worker": "each worker's peak and working memory (JSON {name: [peak, "
                         "working]}, bytes)",
    "strategy_choice": "strategy auto: what the model chose (JSON: chosen, master, placement, "
                       "predicted_step_time, runner_up, alternatives); empty otherwise",
}
#: Variables added to format 2 after it was first written: older stores lack them,
#: and a resumed sweep writes them only where they exist.
ADDED_LATER = ("recoveries", "offered_workers", "recovery_log", "worker_devices",
               "worker_machines",
               "strategy_choice", "predicted_low", "predicted_high", "memory_peak",
               "memory_working", "client_memory_peak", "memory_per_worker",
               "client_cpu_per_step", "compute_error", "task_steps",
               *(f"critical_{p}" for p in COMPONENTS),
               *(f"predicted_{p}" for p in PREDICTED_COMPONENTS))
SERIES: dict[str, tuple[str, str]] = {
    "step_time_series": ("s", "wall time of every step (see the warmup coordinate)"),
    "loss_series": ("1", "training loss of every step's batch"),
}
#: Known units of swept fields (coordinates).
FIELD_UNITS = {"train.batch": "samples", "train.steps": "steps", "cluster.workers": "workers",
               "cluster.use_workers": "workers", "train.lr": "1"}



def _companion_name(wanted: str, fallback: str, taken: set[str]) -> str:
    for name in (wanted, fallback):
        if name not in taken:
            return name
    index = 2
    while f"{fallback}_{index}" in taken:
        index += 1
    return f"{fallback}_{index}"


def axis_coords(axis: Axis, taken: set[str]) -> dict[str, tuple]:
    """The dim coordinate and its companions: full values, per-field values, counts."""
    fields = ", ".join(axis.fields)
    attrs = {"description": f"swept: {fields}", "fields": json.dumps(list(axis.fields))}
    if len(axis.fields) == 1 and axis.fields[0] in FIELD_UNITS and axis.plain:
        attrs["units"] = FIELD_UNITS[axis.fields[0]]
    coords: dict[str, tuple] = {axis.dim: (axis.dim, axis.coordinate(), attrs)}
    if not axis.plain:
        name = _companion_name(f"{axis.dim}_value", f"{axis.dim}_value", taken)
        taken.add(name)
        coords[name] = (axis.dim, np.array([value_json(list(v) if len(v) > 1 else v[0])
                                            for v in axis.values], dtype=object),
                        {"description": f"full value of {fields} (JSON)"})
    if len(axis.fields) > 1:
        for position, name in enumerate(axis.fields):
            column = Axis(axis.dim, (name,), tuple((v[position],) for v in axis.values),
                          tuple(value_label(name, v[position]) for v in axis.values),
                          axis.where)
            short = name.split(".")[-1]
            key = _companion_name(short, name.replace(".", "_"), taken)
            taken.add(key)
            values = column.coordinate() if column.plain else np.array(
                [value_json(v[0]) for v in column.values], dtype=object)
            coords[key] = (axis.dim, values, {"description": f"value of {name}",
                                              "field": name})
    if "cluster.workers" in axis.fields and not axis.plain:
        key = _companion_name(f"{axis.dim}_count", f"{axis.dim}_count", taken)
        taken.add(key)
        counts = [worker_count(axis.value_of(i, "cluster.workers")) for i in range(len(axis))]
        coords[key] = (axis.dim, np.array(counts, dtype=np.int64),
                       {"description": "workers in the embedded cluster", "units": "workers"})
    return coords


def build_template(sweep: Sweep, attrs: dict[str, Any]) -> xr.Dataset:
    """The whole store before any point has run: NaN everywhere, status 0."""
    dims = (*sweep.dims, "repeat")
    shape = sweep.shape
    taken = set(dims) | set(MEASURES) | set(TEXTS) | set(SERIES) | {"status", "step", "warmup"}
    coords: dict[str, Any] = {}
    for axis in sweep.axes:
        coords.update(axis_coords(axis, taken))
    steps = sweep.steps
    warmup = int(sweep.base.get("train", {}).get("warmup_steps", 1))
    coords["repeat"] = ("repeat", np.arange(sweep.config.repeats),
                        {"description": "repetition of the same point"})
    coords["step"] = ("step", np.arange(steps), {"description": "training step", "units": "1"})
    coords["warmup"] = ("step", np.arange(steps) < warmup,
                        {"description": "step excluded from the timing figures as warm-up"})
    data: dict[str, Any] = {
        "status": (dims, np.zeros(shape, dtype=np.int8), {
            "units": "1", "description": "0 pending, 1 done, 2 failed, 3 not applicable "
            "(see failure)", "flag_values": [PENDING, DONE, FAILED, SKIPPED],
            "flag_meanings": "pending done failed not_applicable"}),
    }
    for name, (units, description) in MEASURES.items():
        data[name] = (dims, np.full(shape, np.nan), {"units": units, "description": description})
    for name, description in TEXTS.items():
        data[name] = (dims, np.full(shape, "", dtype=object),
                      {"units": "1", "description": description})
    for name, (units, description) in SERIES.items():
        data[name] = ((*dims, "step"), np.full((*shape, steps), np.nan),
                      {"units": units, "description": description})
    ds = xr.Dataset(data, coords=coords, attrs=attrs)
    reference = speedup_reference(sweep)
    ds.attrs["speedup_reference"] = json.dumps(reference)
    ds.attrs["dims"] = json.dumps(sweep.dims)
    return ds


def axes_moved(attrs: dict[str, Any], axes: list[Axis], path: str) -> str | None:
    """Why a store of this sweep (the same fingerprint, which does not see the order
    of the axes) cannot take its points: its dims, or the fields of a zip group, are
    in another order than the sweep's, so each point's cell would be another point's.
    None where they agree (or the store does not say: written before it kept them)."""
    if not attrs.get("axes"):
        return None
    there = [(str(dim), list(fields)) for dim, fields in json.loads(attrs["axes"]).items()]
    here = [(axis.dim, list(axis.fields)) for axis in axes]
    if there == here:
        return None
    dims = [d for d, _ in there] != [d for d, _ in here]
    show = (lambda order: ", ".join(d for d, _ in order)) if dims else (
        lambda order: "; ".join(f"{d}: {', '.join(f)}" for d, f in order))
    return (f"{path} holds this sweep with its axes in another order ({show(there)} there, "
            f"{show(here)} here): each point would land in another's cell; write them in "
            "the store's order, or pass --fresh to start over or --out for a new store")


#: What a comparison of the store's config with this sweep's says when the store's
#: cannot be read as a mapping.
UNREADABLE_CONFIG = "the store's config cannot be read"


def read_both(stored: str, current: str) -> tuple[dict, dict] | None:
    """The store's config (the YAML it keeps) and this sweep's, as mappings; None
    where either is not one (`UNREADABLE_CONFIG`)."""
    try:
        there, here = yaml.safe_load(stored), yaml.safe_load(current)
    except yaml.YAMLError:
        return None
    return (there, here) if isinstance(there, dict) and isinstance(here, dict) else None


def first_difference(stored: str, current: str) -> str:
    """The first field in which two sweeps' configs (the YAML a store keeps, and this
    sweep's) differ, as ``FIELD: VALUE there, VALUE here``, by dotted name and in the
    user's terms: the sweep's own fields (``measure.steps``, ``axes.strategy``) before
    its base's, so that what the sweep derives from them (``base.train.steps``, the
    warm-up added in) is not taken for the change; a list is one value."""
    both = read_both(stored, current)
    if both is None:
        return UNREADABLE_CONFIG
    there, here = both
    old, new = _fields(there), _fields(here)
    names = list(dict.fromkeys([*new, *old]))
    names.sort(key=lambda name: name.startswith("base."))
    missing = "(none)"
    for name in names:
        if old.get(name, missing) != new.get(name, missing):
            return (f"{name}: {flow_yaml(old.get(name, missing))} there, "
                    f"{flow_yaml(new.get(name, missing))} here")
    return "the same fields in another order"


def _fields(data: dict, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``{dotted name: value}``, lists and scalars as values."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_fields(value, f"{name}."))
        else:
            out[name] = value
    return out


def flow_yaml(value: Any) -> str:
    """A value as one line of YAML (``[single, kernel]``, ``40``, ``null``)."""
    if isinstance(value, str) and value == "(none)":
        return value
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix(
        "\n...").strip()
