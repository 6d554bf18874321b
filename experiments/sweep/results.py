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

This module owns the writes and the lock; the layout (the variables, their units and
meanings, the template) is :mod:`experiments.sweep.store_layout`, reading a store back
as a table :mod:`experiments.sweep.summary`, and the speedup baseline
:mod:`experiments.sweep.speedup`.
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

from experiments.sweep.growth import Growth, plan_growth, refusal
from experiments.sweep.results_checksums import (Checksums, StoreDamaged, Verification,
                                                 encoded_chunk, read_metadata)
from experiments.sweep.speedup import compute_speedup
from experiments.sweep.store_layout import ADDED_LATER, DERIVED, DONE, FAILED, PENDING, SKIPPED
from storage.labelled import write_dataset
from storage.locks import LockBusy, OwnerLock

#: 3: chunks of one point, checksums.json; 2: status 3 (not applicable), batch_split.
STORE_FORMAT = "hetcnn-sweep/3"
UNCHECKED_FORMAT = "hetcnn-sweep/2"  # the last format without checksums
#: What the derived figures (`DERIVED`) are computed from.
DERIVED_INPUTS = ("status", "step_time", "capacity", "throughput")
#: What mends damaged metadata: the file itself, or starting the sweep over.
REPAIR = ("restore it from a copy, or run the sweep with --fresh to start it over (or "
          "--out to write elsewhere)")
#: Damaged points named one per line on resume; the rest are counted.
SHOWN_DAMAGE = 10


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

    def check(self, fingerprint: str, text: str, extend: bool = False) -> Growth | None:
        """Refuse a store made for another sweep, naming the first difference, and one
        whose root metadata is damaged (StoreDamaged, naming the file). A store of
        this sweep with fewer points (`plan_growth`) is refused naming ``--extend``;
        with `extend`, its `Growth` is returned (None: the store is this sweep's)."""
        root = os.path.join(self.path, "zarr.json")
        if os.path.exists(root) or Checksums.is_record(self.path):
            try:
                read_metadata(root)
            except StoreDamaged as error:
                raise StoreDamaged(f"{error}; {REPAIR}") from None
        try:
            attrs = self.attrs()
        except Exception as error:  # noqa: BLE001 - anything unreadable is not ours
            if not self.is_sweep_store():  # --fresh would refuse it too (check_store)
                raise StoreMismatch(f"{self.path} is not a sweep results store (not a "
                                    f"readable Zarr store: {error}); choose another "
                                    "--out") from None
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
            fresh = " (or --fresh to replace it)" if self.is_sweep_store() else ""
            raise StoreMismatch(f"{self.path} is not a sweep results store; choose another "
                                f"--out{fresh}")
        if attrs.get("fingerprint") != fingerprint:
            growth = plan_growth(str(attrs.get("config", "")), text)
            if extend and isinstance(growth, Growth):
                return growth
            raise StoreMismatch(refusal(self.path, growth, extend))
        return None

    def check_rewrite(self, fingerprint: str, text: str, fresh: bool,
                      extend: bool = False) -> None:
        """Before a sweep that rewrites the whole store (`mode: scaling`) does, and in
        its dry run: StoreMismatch for a path that holds no sweep store, or, without
        `fresh`, another sweep's store (`check`; with `extend`, one this sweep grows
        is rewritten: every point is predicted again anyway)."""
        if self.exists():
            if not self.is_sweep_store():
                raise StoreMismatch(f"{self.path} is not a sweep results store; choose "
                                    "another --out")
            if not fresh:
                self.check(fingerprint, text, extend)

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

    def verify(self) -> Verification:
        """The record's verdict, changing nothing (what the dry run shows); StoreDamaged
        (with what mends it) for damage to the record, the metadata or the coordinates."""
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
        found = self.verify()
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
        found = self.verify()
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
        batch = np.round(np.where(done, inputs["throughput"], np.nan) * step_time)  # samples
        axis = dims.index(reference["dim"]) if reference.get("dim") in dims else None
        workers = (dims.index(reference["workers_dim"])
                   if reference.get("workers_dim") in dims else None)
        speedup, efficiency = compute_speedup(step_time, capacity, axis,
                                              reference.get("index"),
                                              bool(reference.get("available")), workers,
                                              reference.get("workers_index"), batch)
        group["speedup"][...] = speedup
        group["efficiency"][...] = efficiency
        self.record.record_derived()
