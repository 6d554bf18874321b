"""Run a scaling sweep: the performance model over hypothetical clusters, into one store.

``python -m experiments.sweep experiments/configs/scaling.yaml`` lands here when the
file says ``mode: scaling`` (see :mod:`experiments.scaling.config` for the file).

Every point is one call of :func:`pipeline.costmodel.predict`; its figures go into
the same kind of store as a measured sweep's (``xr.open_zarr``; a dim per axis plus
``repeat``, here of length 1; ``status``/``failure`` per point; units and
descriptions in attrs), with the names measured sweeps use where the meaning is
the same: ``predicted_step_time``, ``throughput``, ``speedup``, ``efficiency``,
``compute_time``, ``storage_time``, ``master_time``, ``n_workers``, ``capacity``,
plus ``communication_time``, ``overhead_time`` and ``baseline_step_time``. There is
no ``step_time``: nothing was measured.

Why the whole store is written at once, not point by point: a point costs
microseconds to milliseconds of arithmetic, a Zarr region write costs more than
that, and there is nothing worth resuming, so a rerun simply recomputes the grid
(seconds) and replaces the store. It is written next to its final place and moved
there, so an interrupted run leaves the previous store intact.

A point the strategy cannot run as described (``data`` or ``hybrid`` with fewer
samples than devices, or a device whose predicted peak memory exceeds its kind's
``memory``) is recorded as failed with the reason (``Infeasible: ...``), like a
failed measured point; one out of memory keeps ``peak_memory`` and ``memory_fits``
(0), so the store says how much it would need. Such points are expected in a grid
and do not make the exit status 1 (only a point the model could not evaluate does).
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np
import xarray as xr

from experiments.scaling import hardware as hw
from pipeline.records.record import code_revision, software_versions
from experiments.scaling.anchors import anchor_records
from experiments.sweep.provenance import machine_info
from experiments.sweep.results import STORE_FORMAT, ResultStore, SweepLock
from experiments.sweep.results_checksums import record_whole_store
from experiments.sweep.axes import grid_text, value_label
from experiments.sweep.store_layout import DONE, FAILED, axis_coords
from experiments.scaling.config import (ScalingPoint, ScalingSweep, field_units, network_of,
                                        options_of, point_strategy)
from experiments.scaling.baseline import (BASELINE, UNFIT_BASELINE, UNFIT_NOTE,
                                          devices_fastest_first, single_time)
from experiments.scaling.memory_fit import baseline_fits, memory_verdict
from experiments.scaling.view import one_device_only
from storage.labelled import write_dataset
from storage.locks import now_text

__all__ = ["Infeasible", "evaluate_point", "SCALING_MEASURES", "build_dataset",
           "run_scaling_sweep", "dry_run_scaling"]

#: name -> (units, description) of a scaling store's per-point figures.
SCALING_MEASURES: dict[str, tuple[str, str]] = {
    "predicted_step_time": ("s", "the performance model's step time for this point"),
    "throughput": ("samples/s", "training samples per second: batch / predicted_step_time"),
    "speedup": ("1", "predicted step time of `single` on one device of the mix's fastest "
                "kind, same network and batch (baseline_step_time), divided by this point's"),
    "efficiency": ("1", "speedup divided by capacity (the device count for equal devices)"),
    "compute_time": ("s", "predicted compute on the step's critical path outside the dense "
                     "head (the conv trunk; the whole replica for data)"),
    "communication_time": ("s", "predicted link time on the critical path, not hidden by "
                           "compute (activations, gradients, allreduce)"),
    "storage_time": ("s", "predicted shared-store I/O on the critical path (kernel with "
                     "hardware.store; else 0)"),
    "master_time": ("s", "predicted dense-head time on the critical path (kernel: the "
                    "master's; single: its dense layers; hybrid: the dense phase; data: 0)"),
    "overhead_time": ("s", "predicted Dask orchestration per step (kernel with "
                      "hardware.dask; else 0)"),
    "baseline_step_time": ("s", "predicted step time of `single` on one device of the mix's "
                           "fastest kind, same network and batch"),
    "baseline_fits": ("1", "1 where that baseline (`single` on one device of the mix's fastest "
                      "kind) fits the device's memory, else 0: the speedup is then against a "
                      "step no such device could run (the report marks it); NaN where the "
                      "memory model gives no figure"),
    "n_workers": ("1", "devices the strategy uses: the whole mix (idle ones included), "
                  "1 for single"),
    "capacity": ("1", "summed relative speed of those devices: each device's single-device "
                 "speed over the fastest kind's, at this network and batch"),
    "peak_memory": ("B", "the model's largest peak memory of a device under the point's split "
                    "(pipeline.costmodel.memory; a CPU device's process, a GPU's device memory)"),
    "memory_fits": ("1", "1 where every device's predicted peak is within its kind's memory "
                    "(hardware presets, `hardware.kinds.<kind>.memory`), else 0 (the point is "
                    "then infeasible: status 2); NaN where the memory model gives no figure"),
}
#: What a point that does not fit its devices' memory keeps (the rest is NaN).
MEMORY_MEASURES = ("peak_memory", "memory_fits")
BREAKDOWN_KEYS = {"compute_time": "compute_critical", "communication_time": "communication",
                  "storage_time": "storage", "master_time": "master",
                  "overhead_time": "overhead"}


class Infeasible(ValueError):
    """The strategy cannot run the point as described (an expected gap in a grid)."""


#: How the failure of a point that does not fit its devices' memory begins.
OUT_OF_MEMORY = f"{Infeasible.__name__}: out of memory"


# One point ----------------------------------------------------------------------------


def evaluate_point(point: ScalingPoint) -> dict[str, float]:
    """The model's figures for one point (see :data:`SCALING_MEASURES`), whether or
    not they fit the devices' memory (`assess_point` says).

    Raises
    ------
    Infeasible
        ``data``/``hybrid`` with fewer samples than devices: a data-parallel
        replica needs at least one sample.
    """
    return assess_point(point)[0]


def assess_point(point: ScalingPoint) -> tuple[dict[str, float], str]:
    """The point's figures, and why it cannot run ("" where it can): a device whose
    predicted peak exceeds its kind's memory. Raises `Infeasible` as `evaluate_point`."""
    strategy = point_strategy(point)
    devices, kinds = devices_fastest_first(point)
    batch = point.train.batch
    why = strategy.infeasible(batch, len(devices))
    if why:
        raise Infeasible(why)
    network = network_of(point.network)
    link = hw.link_spec(point.hardware.link)
    store = hw.store_spec(point.hardware.store)
    prediction = strategy.model(network, batch, devices, link, store, options_of(point))
    baseline = single_time(point, kinds[0])
    used = kinds[:strategy.devices_used(len(kinds))]
    relative = {kind: baseline / single_time(point, kind) for kind in set(used)}
    capacity = float(sum(relative[kind] for kind in used))
    step = prediction.step_time
    speedup = baseline / step
    values = {"predicted_step_time": step, "throughput": batch / step, "speedup": speedup,
              "efficiency": speedup / capacity, "baseline_step_time": baseline,
              "baseline_fits": baseline_fits(point, kinds[0]),
              "n_workers": float(len(used)), "capacity": capacity}
    for name, key in BREAKDOWN_KEYS.items():
        values[name] = float(prediction.breakdown.get(key, 0.0))
    verdict = memory_verdict(point, prediction, kinds)
    values.update(peak_memory=verdict.largest, memory_fits=verdict.fits)
    return values, verdict.shortfall


# The store ----------------------------------------------------------------------------


@dataclass
class Outcome:
    """What the grid came to."""

    values: dict[str, np.ndarray]
    status: np.ndarray
    failure: np.ndarray
    seconds: float

    @property
    def infeasible(self) -> int:
        return int(sum(1 for f in self.failure.ravel() if str(f).startswith("Infeasible")))

    @property
    def out_of_memory(self) -> int:
        return int(sum(1 for f in self.failure.ravel() if str(f).startswith(OUT_OF_MEMORY)))

    @property
    def errors(self) -> int:
        return int((self.status == FAILED).sum()) - self.infeasible


def evaluate_grid(sweep: ScalingSweep) -> Outcome:
    """Every point of the grid, in memory."""
    shape = sweep.shape
    values = {name: np.full(shape, np.nan) for name in SCALING_MEASURES}
    status = np.zeros(shape, dtype=np.int8)
    failure = np.full(shape, "", dtype=object)
    began = time.perf_counter()
    for run in sweep.points:
        try:
            figures, shortfall = assess_point(run.point)
        except Exception as error:  # noqa: BLE001 - recorded per point, the grid goes on
            text = " ".join(str(error).split()) or repr(error)
            failure[run.region] = f"{type(error).__name__}: {text}"[:500]
            status[run.region] = FAILED
            continue
        if shortfall:  # no prediction, but the memory it would need
            figures = {name: figures[name] for name in MEMORY_MEASURES}
            failure[run.region] = f"{Infeasible.__name__}: {shortfall}"
        for name, value in figures.items():
            values[name][run.region] = value
        status[run.region] = FAILED if shortfall else DONE
    return Outcome(values, status, failure, time.perf_counter() - began)


def _presets_used(sweep: ScalingSweep) -> dict[str, list[dict[str, Any]]]:
    """Every device kind the grid uses, resolved, with its source (a kind whose
    numbers are swept has several entries)."""
    kinds: dict[str, list[dict[str, Any]]] = {}
    for run in sweep.points:
        for name, _ in hw.device_kinds(run.point.hardware):
            preset = hw.resolve_kind(run.point.hardware, name)
            entry = {"flops": preset.flops, "mem_bw": preset.mem_bw,
                     "conv_efficiency": preset.conv_efficiency,
                     "dense_efficiency": preset.dense_efficiency,
                     "mem_efficiency": preset.mem_efficiency, "memory": preset.memory,
                     "source": preset.source}
            if entry not in kinds.setdefault(name, []):
                kinds[name].append(entry)
    return kinds


def build_dataset(sweep: ScalingSweep, outcome: Outcome, attrs: dict[str, Any]) -> xr.Dataset:
    """The store's Dataset: dims per axis + repeat, figures, status, failure, attrs."""
    dims = (*sweep.dims, "repeat")
    taken = set(dims) | set(SCALING_MEASURES) | {"status", "failure"}
    coords: dict[str, Any] = {}
    for axis in sweep.axes:
        made = axis_coords(axis, taken)
        for name, (_, values, labels) in made.items():  # a number's units, per field
            whole = name == axis.dim and len(axis.fields) == 1
            field = labels.get("field") or (axis.fields[0] if whole else None)
            units = field_units(field) if field else None
            if units and np.asarray(values).dtype.kind in "iuf":
                labels["units"] = units
        coords.update(made)
    coords["repeat"] = ("repeat", np.arange(1),
                        {"description": "repetition (the model is deterministic: one)"})
    data: dict[str, Any] = {
        "status": (dims, outcome.status, {
            "units": "1", "description": "0 pending, 1 done, 2 failed (see failure)",
            "flag_values": [0, DONE, FAILED], "flag_meanings": "pending done failed"}),
        "failure": (dims, outcome.failure, {
            "units": "1", "description": "why the point has no prediction (empty unless "
            "status is 2; 'Infeasible: ...' for what the strategy cannot run, 'Infeasible: "
            "out of memory: ...' for what does not fit its devices' memory)"}),
    }
    for name, (units, description) in SCALING_MEASURES.items():
        data[name] = (dims, outcome.values[name], {"units": units, "description": description})
    ds = xr.Dataset(data, coords=coords, attrs=attrs)
    ds.attrs["dims"] = json.dumps(sweep.dims)
    return ds


def _attrs(sweep: ScalingSweep, argv: list[str], started: str) -> dict[str, Any]:
    reference = {"strategy": BASELINE, "devices": "one device of the mix's fastest kind"}
    return {
        "title": f"scaling sweep {sweep.config.name}", "sweep_name": sweep.config.name,
        "mode": "scaling", "speedup_baseline": "single",
        "speedup_reference": json.dumps(reference),
        "description": sweep.config.description,
        "config": sweep.text, "config_file": os.path.abspath(sweep.source),
        "fingerprint": sweep.fingerprint, "repeats": 1,
        "model": "pipeline.costmodel (roofline compute, Hockney links; docs/model.md)",
        "presets": json.dumps(_presets_used(sweep)), "anchors": json.dumps(anchor_records()),
        "versions": json.dumps(software_versions()), "machine": json.dumps(machine_info()),
        "code_revision": code_revision(), "command": shlex.join(argv),
        "started": started, "finished": now_text(), "sessions": "[]",
        "axes": json.dumps({axis.dim: list(axis.fields) for axis in sweep.axes}),
        "store_format": STORE_FORMAT, "complete": True,
    }


def _replace_store(ds: xr.Dataset, path: str) -> None:
    """Write next to ``path`` and move into place: a crash keeps the old store.

    The caller holds the store's lock, so leftovers of an earlier killed run can go.
    """
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    stem = path.rstrip("/")
    for leftover in glob.glob(f"{glob.escape(stem)}.scaling-writing-*") + \
            glob.glob(f"{glob.escape(stem)}.scaling-old-*"):  # from a run killed mid-write
        shutil.rmtree(leftover, ignore_errors=True)
    staging = f"{stem}.scaling-writing-{os.getpid()}"
    write_dataset(ds, staging, mode="w")
    record_whole_store(staging)
    old = f"{stem}.scaling-old-{os.getpid()}"
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(staging, path)
    shutil.rmtree(old, ignore_errors=True)


# The command --------------------------------------------------------------------------


def _summary(ds: xr.Dataset) -> list[str]:
    """Best predicted speedup per strategy, and where; marked (`UNFIT_BASELINE`, as
    the report marks it) where its baseline does not fit one device's memory."""
    if "strategy" not in ds.dims:
        return []
    lines = []
    for strategy in ds.strategy.values:
        speedup = ds.speedup.sel(strategy=strategy)
        if not np.isfinite(speedup.values).any() or one_device_only(ds.sel(strategy=strategy)):
            continue
        best = speedup.where(np.isfinite(speedup), -np.inf).argmax(...)
        at = {dim: ds[dim].values[int(index)] for dim, index in best.items()
              if dim not in ("repeat",)}
        where = ", ".join(f"{d}={value_label(d, getattr(v, 'item', lambda: v)())}"
                          for d, v in at.items() if d != "strategy")  # 1e+14, not 1e14's digits
        value = float(speedup.isel(best))
        efficiency = float(ds.efficiency.sel(strategy=strategy).isel(best))
        fits = float(ds.baseline_fits.sel(strategy=strategy).isel(best)) \
            if "baseline_fits" in ds else 1.0
        mark = UNFIT_BASELINE if fits == 0 else ""
        lines.append(f"  {strategy:>7}: best speedup {value:8.1f}x{mark} (efficiency "
                     f"{efficiency:.0%}) at {where}")
    if any(UNFIT_BASELINE in line for line in lines):
        lines.append(f"  {UNFIT_NOTE}")
    return lines


def run_scaling_sweep(sweep: ScalingSweep, fresh: bool = False, out: TextIO | None = None,
                      argv: list[str] | None = None, extend: bool = False) -> int:
    """Evaluate the grid and write the store; returns the exit status.

    0: every point predicted or infeasible; 1: the model failed on some point.
    Raises StoreMismatch (another sweep's store, without ``fresh``, or ``extend`` where
    this sweep grows it; or not a sweep store) and StoreBusy (the lock is held).
    """
    out = out or sys.stdout
    with SweepLock(sweep.store_path):
        ResultStore(sweep.store_path).check_rewrite(sweep.fingerprint, sweep.text, fresh, extend)
        started = now_text()
        print(f"scaling sweep {sweep.config.name}: {grid_text(sweep.axes, len(sweep.points))}, "
              f"predicted by the performance model -> {sweep.store_path}", file=out)
        outcome = evaluate_grid(sweep)
        ds = build_dataset(sweep, outcome, _attrs(sweep, argv or sys.argv, started))
        written = time.perf_counter()
        _replace_store(ds, sweep.store_path)
        write_seconds = time.perf_counter() - written
    done = int((outcome.status == DONE).sum())
    print(f"{done} predicted, {outcome.infeasible} infeasible, {outcome.errors} failed; "
          f"model {outcome.seconds:.1f} s, store {write_seconds:.1f} s", file=out)
    for line in _summary(ds):
        print(line, file=out)
    print(f"\nresults: {sweep.store_path}  (xr.open_zarr; report: python -m "
          f"experiments.report {shlex.quote(sweep.store_path)})", file=out)
    if outcome.infeasible:
        memory = outcome.out_of_memory
        print(f"{outcome.infeasible} point(s) infeasible, not predicted: {memory} out of a "
              f"device's memory, {outcome.infeasible - memory} with a batch smaller than "
              "its devices (data, hybrid); each point's reason is in the store's `failure` "
              "variable.", file=out)
    if outcome.errors:
        reasons = sorted({str(f) for f, s in zip(outcome.failure.ravel(),
                                                 outcome.status.ravel())
                          if s == FAILED and not str(f).startswith("Infeasible")})
        print(f"{outcome.errors} point(s) failed in the model: {reasons[0]}"
              + (f" (and {len(reasons) - 1} other reasons)" if len(reasons) > 1 else ""),
              file=out)
        return 1
    return 0


def dry_run_scaling(sweep: ScalingSweep, out: TextIO, fresh: bool = False,
                    extend: bool = False) -> None:
    """List the points with their predicted step times; write nothing. A store the
    run would refuse is refused first, in its words (`ResultStore.check_rewrite`)."""
    ResultStore(sweep.store_path).check_rewrite(sweep.fingerprint, sweep.text, fresh, extend)
    print(f"scaling sweep {sweep.config.name}: {grid_text(sweep.axes, len(sweep.points))} -> "
          f"{sweep.store_path}", file=out)
    rows = []
    for number, run in enumerate(sweep.points, start=1):
        try:
            figures, shortfall = assess_point(run.point)
            predicted = ("infeasible: " + shortfall if shortfall
                         else f"{figures['predicted_step_time']:.4g} s")
        except Infeasible as why:  # the reason the run records, as for memory
            predicted = f"infeasible: {why}"
        except Exception as error:  # noqa: BLE001
            predicted = f"failed: {type(error).__name__}"
        rows.append([str(number), run.describe(), predicted])
    header = ["#", "point", "predicted"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    for row in [header] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip(), file=out)
