"""The sweep's results store: one labelled Dataset in Zarr, written point by point.

Layout (``xr.open_zarr(path)`` is all a reader needs):

- dims: one per axis (named as in the sweep, e.g. ``strategy``, ``workers``,
  ``batch``), then ``repeat``; series add ``step``;
- per point (axes + repeat): ``status`` (0 pending, 1 done, 2 failed, 3 not
  applicable: the point would repeat another, e.g. `single` at two workers),
  ``failure`` (the reason, text), ``run_id``, ``started``/``finished``/``wall_time``, the
  measured figures (``step_time`` and its spread, ``throughput``, ``speedup``,
  ``efficiency``, the compute/storage/master/wait breakdown, ``bytes_moved``,
  ``loss``, ``accuracy``, ``n_workers``, ``capacity``, the fullest worker's
  ``memory_peak`` and ``memory_working`` and the client's), the model's
  ``predicted_step_time`` and ``prediction_error``;
- per point and step: ``step_time_series`` and ``loss_series`` (all steps; the
  ``warmup`` coordinate marks those excluded from the figures).

Why a template plus per-point writes: the template (all NaN, status 0) is written
once, up front, so the store always opens cleanly and has its final shape; each
finished point then writes its own cells, data first and ``status`` last. Every
per-point variable is chunked one point to a file, so a point's write touches only
its own files (and the derived ``speedup``/``efficiency``, one file each, rewritten
over the whole grid). Zarr's local store
replaces a chunk file atomically, and only one sweep writes at a time
(`SweepLock`), so a process killed at any moment leaves every cell either as it
was or complete, and a point whose status is not 1 is simply run again.

Checksums (:mod:`experiments.sweep.results_checksums`): each point's write records a
CRC-32C of its files before its status lands; a resumed sweep verifies them and
runs a damaged point again (`verify_for_resume`), and a report refuses a damaged
store (`verify_for_reading`). Stores of format 2, written before checksums, are
refused by the sweep and reported unchecked, with a warning.

This module owns that layout (the variables, their units and meanings, the
template) and the writes; reading a store back as a table is
:mod:`experiments.sweep.summary`, and the speedup baseline :mod:`experiments.sweep.speedup`.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import xarray as xr
import zarr

from experiments.sweep.results_checksums import (Checksums, StoreDamaged, Verification,
                                                 encoded_chunk, read_metadata)
from experiments.sweep.speedup import compute_speedup, speedup_reference
from experiments.sweep.axes import Axis, value_json, value_label
from experiments.sweep.config import Sweep
from experiments.sweep.points import worker_count
from pipeline.records.step_breakdown import COMPONENTS
from storage.labelled import write_dataset
from storage.locks import LockBusy, OwnerLock

PENDING, DONE, FAILED, SKIPPED = 0, 1, 2, 3
#: The parts the model predicts (it has no dataset part of its own; its wait is the
#: client's share of the cores, pipeline/costmodel/contention.py).
PREDICTED_COMPONENTS = ("compute", "exchange", "wait", "client")
#: 3: chunks of one point, checksums.json; 2: status 3 (not applicable), batch_split.
STORE_FORMAT = "hetcnn-sweep/3"
UNCHECKED_FORMAT = "hetcnn-sweep/2"  # the last format without checksums
#: Recomputed over the whole grid after every point (`refresh_derived`).
DERIVED = ("speedup", "efficiency")
DERIVED_INPUTS = ("status", "step_time", "capacity")

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
                "by this point's step_time"),
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
                              "docs/model.md, 'Memory per device'. Stores written before "
                              "it have none"),
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
    "failure": "why the point failed (status 2) or is not run (status 3)",
    "run_id": "identifies the run that produced this point's values",
    "kernel_split": "kernels per worker per conv layer (JSON), as placed (kernel, single)",
    "batch_split": "samples of each step's batch per worker (JSON; data, hybrid)",
    "worker_labels": "the workers used, with emulated speeds",
    "worker_devices": "the workers used, in split order: JSON [[name, resource tag, device]]",
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


#: What mends damaged metadata: the file itself, or starting the sweep over.
REPAIR = ("restore it from a copy, or run the sweep with --fresh to start it over (or "
          "--out to write elsewhere)")
#: Damaged points named one per line on resume; the rest are counted.
SHOWN_DAMAGE = 10


def record_whole_store(path: str) -> None:
    """Checksums of a store written whole (``mode: scaling``): every file is `fixed`."""
    Checksums.new(path, "scaling", [], [], [], {}).save()


class StoreBusy(LockBusy):
    """Another sweep holds the store's lock."""


class StoreMismatch(ValueError):
    """The store exists but holds a different sweep (or is not a sweep store)."""


# Lock -------------------------------------------------------------------------------


class SweepLock(OwnerLock):
    """``<store>.lock``: one sweep writes a store at a time (see `storage.locks`)."""

    busy_error = StoreBusy

    def __init__(self, store_path: str) -> None:
        store = store_path.rstrip("/")
        super().__init__(store + ".lock", store, "another sweep")


# Template ---------------------------------------------------------------------------


def _companion_name(wanted: str, fallback: str, taken: set[str]) -> str:
    for name in (wanted, fallback):
        if name not in taken:
            return name
    index = 2
    while f"{fallback}_{index}" in taken:
        index += 1
    return f"{fallback}_{index}"


def _axis_coords(axis: Axis, taken: set[str]) -> dict[str, tuple]:
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
        coords.update(_axis_coords(axis, taken))
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


# The store --------------------------------------------------------------------------


@dataclass
class PointResult:
    """What one finished point writes."""

    values: dict[str, float]
    texts: dict[str, str]
    series: dict[str, np.ndarray]


def _quiet_consolidate(path: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(path)


class ResultStore:
    """Creates, checks and fills one sweep's store (the caller holds the lock)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._record: Checksums | None = None
        self._status_files: dict[int, bytes] = {}
        self._inputs: dict[str, np.ndarray] | None = None

    def exists(self) -> bool:
        return os.path.exists(self.path)

    def _group(self, mode: str = "r+") -> zarr.Group:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return zarr.open_group(self.path, mode=mode, use_consolidated=False)

    @property
    def record(self) -> Checksums:
        """The store's checksums, read once: only this sweep writes them meanwhile."""
        if self._record is None:
            self._record = Checksums.load(self.path)
        return self._record

    def create(self, template: xr.Dataset) -> None:
        """Write the template beside the store's path and rename it into place: a
        sweep killed meanwhile leaves no store (or the old one's leftovers) rather
        than one without its consolidated metadata; `complete` is set last."""
        staging = f"{self.path}.creating"
        for path in (staging, self.path):
            if os.path.exists(path):
                shutil.rmtree(path)
        template = template.copy()
        template.attrs["store_format"] = STORE_FORMAT
        template.attrs["complete"] = False
        dims = list(template["status"].dims)
        per_point = [name for name, variable in template.data_vars.items()
                     if list(variable.dims[:len(dims)]) == dims and name not in DERIVED]
        encoding = {name: {"chunks": tuple(1 if d in dims else template.sizes[d]
                                           for d in template[name].dims)}
                    for name in per_point}
        write_dataset(template, staging, mode="w", encoding=encoding)
        Checksums.new(staging, str(template.attrs.get("mode", "measure")), per_point,
                      [n for n in DERIVED if n in template], dims,
                      {d: [str(v) for v in template[d].values] for d in dims}).save()
        os.rename(staging, self.path)
        self._record = None
        self.set_attrs(complete=True)

    def attrs(self) -> dict[str, Any]:
        return dict(self._group("r").attrs)

    def check(self, fingerprint: str, text: str) -> None:
        """Refuse a store made for another sweep, naming the first difference, and one
        whose root metadata is damaged (StoreDamaged, naming the file)."""
        root = os.path.join(self.path, "zarr.json")
        if os.path.exists(root) or Checksums.is_record(self.path):
            try:
                read_metadata(root)
            except StoreDamaged as error:
                raise StoreDamaged(f"{error}; {REPAIR}") from None
        try:
            attrs = self.attrs()
        except Exception as error:  # noqa: BLE001 - anything unreadable is not ours
            raise StoreMismatch(f"{self.path} is not a readable Zarr store ({error}); "
                                "pass --fresh to replace it or --out to write elsewhere") \
                from None
        found = str(attrs.get("store_format", ""))
        if found == UNCHECKED_FORMAT:
            raise StoreMismatch(f"{self.path} was written before sweep stores recorded "
                                f"checksums (store format {found}, this one writes "
                                f"{STORE_FORMAT}), so its finished points cannot be "
                                "checked: pass --fresh to run the sweep over or --out to "
                                "write elsewhere (python -m experiments.report still "
                                "reads it, unchecked)")
        if found.startswith("hetcnn-sweep/") and found != STORE_FORMAT:
            raise StoreMismatch(f"{self.path} was written by another version of this project "
                                f"(store format {found}, this one writes {STORE_FORMAT}); "
                                "pass --fresh to start it over or --out to write elsewhere")
        if found != STORE_FORMAT:
            raise StoreMismatch(f"{self.path} is not a sweep results store; choose another "
                                "--out (or --fresh to replace it)")
        if attrs.get("fingerprint") != fingerprint:
            old = str(attrs.get("config", "")).splitlines()
            new = text.splitlines()
            first = next(((a, b) for a, b in zip(old + [""] * len(new), new + [""] * len(old))
                          if a != b), ("", ""))
            raise StoreMismatch(f"{self.path} holds a different sweep (first difference: "
                                f"{first[0].strip()!r} there, {first[1].strip()!r} here); "
                                "pass --fresh to start over or --out for a new store")

    def is_sweep_store(self) -> bool:
        """Whether the path holds a sweep store (possibly half-made, or with damaged
        root metadata beside its checksums): safe to replace."""
        try:
            if str(self.attrs().get("store_format", "")).startswith("hetcnn-sweep/"):
                return True
        except Exception:  # noqa: BLE001
            pass
        return Checksums.is_record(self.path)

    def is_complete(self) -> bool:
        try:
            return bool(self.attrs().get("complete"))
        except Exception:  # noqa: BLE001
            return False

    def status(self) -> np.ndarray:
        return self._group("r")["status"][...]

    def set_attrs(self, **attrs: Any) -> None:
        """Update root attributes. The group is opened with its consolidated metadata,
        so the one (atomic) write of the root's metadata keeps it: opened without, the
        write drops it until the consolidation after, and a sweep killed in between
        left a store that opened only with a warning."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            group = zarr.open_group(self.path, mode="r+")
        group.attrs.update(attrs)
        _quiet_consolidate(self.path)

    # Verifying -----------------------------------------------------------------------

    def _verify(self) -> Verification:
        """The record's verdict; StoreDamaged (with what mends it) for damage to the
        record, the metadata or the coordinates."""
        try:
            return self.record.verify()
        except StoreDamaged as error:
            scaling = self._record is not None and self._record.data.get("mode") == "scaling"
            raise StoreDamaged(f"{error}; " + ("run the same sweep command again to rewrite "
                                               "the store" if scaling else REPAIR)) from None

    def verify_for_resume(self) -> tuple[np.ndarray, list[str]]:
        """Before a sweep goes on: check every file against the record; a damaged point
        is made pending again (its files removed) so that it runs again, and damaged
        derived figures are recomputed. Returns the verified status and one warning
        line per damaged point (at most `SHOWN_DAMAGE`, then a count). StoreDamaged
        for damaged metadata or coordinates (nothing to run again would mend them)."""
        found = self._verify()
        lines = [f"warning: {self.path}: point ({self.record.describe(key)}) is damaged: "
                 f"{damage}; it runs again" for key, damage in found.damaged.items()]
        hidden = len(lines) - SHOWN_DAMAGE
        if hidden > 0:
            lines = lines[:SHOWN_DAMAGE] + [f"warning: {self.path}: and {hidden} more "
                                            "damaged point(s), which run again"]
        for key in found.damaged:
            self.record.forget_point(tuple(int(i) for i in key.split("/")))
        self._inputs = None
        if found.derived is not None:
            lines.append(f"warning: {self.path}: {found.derived}; speedup and efficiency "
                         "are recomputed from the points")
        if not found.intact:
            self.refresh_derived()
        return found.status, lines

    def verify_for_reading(self) -> str | None:
        """Before a report reads the store: StoreDamaged (one line naming the first
        damaged file, and how many points) if anything fails its checksum; a warning
        line for a store of the format before checksums, read unchecked; StoreMismatch
        for what is not a sweep store."""
        root = os.path.join(self.path, "zarr.json")
        if not os.path.exists(root) and not Checksums.is_record(self.path):
            raise StoreMismatch(f"{self.path}: not a sweep results store")
        read_metadata(root)
        found_format = str(self.attrs().get("store_format", ""))
        if found_format == UNCHECKED_FORMAT:
            return (f"warning: {self.path} was written before sweep stores recorded "
                    "checksums (store format 2): its figures are reported unchecked")
        if found_format != STORE_FORMAT:
            raise StoreMismatch(f"{self.path}: not a sweep results store")
        found = self._verify()
        if found.damaged:
            key, damage = next(iter(found.damaged.items()))
            more = len(found.damaged) - 1
            raise StoreDamaged(f"{self.path}: point ({self.record.describe(key)}) is damaged: "
                               f"{damage}" + (f" (and {more} more damaged point(s))"
                                              if more else "")
                               + "; the same sweep command runs damaged points again")
        if found.derived is not None:
            raise StoreDamaged(f"{self.path}: {found.derived}; run the same sweep command "
                               "again to recompute speedup and efficiency")
        return None

    # Writing -------------------------------------------------------------------------

    def _status_file(self, value: int) -> tuple[str, bytes]:
        """The bytes of a point's status file holding `value` (the same for every point)."""
        if value not in self._status_files:
            self._status_files[value] = encoded_chunk(os.path.join(self.path, "status"),
                                                      np.int8(value))
        return "status", self._status_files[value]

    def _begin(self, region: tuple[int, ...]) -> zarr.Group:
        """Before a point's cells are written: its record entry and files go (so a
        sweep stopped from here on leaves it pending), and its cached figures."""
        self.record.forget_point(region)
        if self._inputs is not None:
            for name, values in self._inputs.items():
                values[region] = PENDING if name == "status" else np.nan
        return self._group()

    def _commit(self, group: zarr.Group, region: tuple[int, ...], status: int) -> None:
        """Record the point's files and the status file it is about to get, then
        write that status: the record never lags behind a point marked done."""
        self.record.record_point(region, status, self._status_file(status))
        group["status"][region] = status
        if self._inputs is not None:
            for name, values in self._inputs.items():
                values[region] = group[name][region]

    def _derived_inputs(self, group: zarr.Group) -> dict[str, np.ndarray]:
        """What speedup and efficiency are computed from, read whole once (one file
        per point: reading them after every point would cost seconds on a large
        grid) and kept up to date by the writes of this one writer."""
        if self._inputs is None:
            self._inputs = {name: group[name][...] for name in DERIVED_INPUTS}
        return self._inputs

    def write_point(self, region: tuple[int, ...], result: PointResult) -> None:
        """Data first, then status 1: a kill in between leaves the point pending."""
        group = self._begin(region)
        for name, value in {**result.values, **result.texts}.items():
            if name not in DERIVED and (name in group or name not in ADDED_LATER):
                group[name][region] = value
        for name, values in result.series.items():
            row = np.full(group[name].shape[-1], np.nan)
            row[: min(len(values), row.size)] = values[: row.size]
            group[name][region] = row
        self._commit(group, region, DONE)

    def write_skipped(self, region: tuple[int, ...], reason: str) -> None:
        """A point not run (it would repeat another): its reason, status 3."""
        group = self._begin(region)
        group["failure"][region] = reason
        self._commit(group, region, SKIPPED)

    def write_failure(self, region: tuple[int, ...], reason: str,
                      values: dict[str, float], texts: dict[str, str]) -> None:
        """Clear any half-written figures (the point's files go first), record the
        reason and whatever figures the failure has, then status 2."""
        group = self._begin(region)
        for name, value in {**values, **texts}.items():
            if name not in DERIVED and name in group:
                group[name][region] = value
        group["failure"][region] = reason
        self._commit(group, region, FAILED)

    def refresh_derived(self) -> None:
        """Recompute speedup and efficiency over the whole grid from what is done."""
        group = self._group()
        reference = json.loads(group.attrs.get("speedup_reference", "{}"))
        dims = list(json.loads(group.attrs.get("dims", "[]")))
        inputs = self._derived_inputs(group)
        done = inputs["status"] == DONE
        step_time = np.where(done, inputs["step_time"], np.nan)
        capacity = np.where(done, inputs["capacity"], np.nan)
        axis = dims.index(reference["dim"]) if reference.get("dim") in dims else None
        workers = (dims.index(reference["workers_dim"])
                   if reference.get("workers_dim") in dims else None)
        speedup, efficiency = compute_speedup(step_time, capacity, axis,
                                              reference.get("index"),
                                              bool(reference.get("available")), workers,
                                              reference.get("workers_index"))
        group["speedup"][...] = speedup
        group["efficiency"][...] = efficiency
        self.record.record_derived()
