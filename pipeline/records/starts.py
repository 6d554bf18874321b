"""A run's record across its starts.

A run stopped by a signal and resumed (`train.resume=true`) is one run in several
*starts*: each start trains from a checkpoint on. Its final weights went through
the earlier starts' steps before that checkpoint and through its own steps after
it, so its `record.zarr` holds exactly those: when a start begins, it reads the
record the earlier starts wrote (`read_earlier`) and keeps their steps before the
checkpoint it resumes from; the steps they ran past that checkpoint were rolled
back, and its own replace them (`continue_record`). Each step says which start ran
it (the ``start`` coordinate), and the record's ``starts`` attribute keeps one
entry per start (from where, to where, how it ended, its notes). Step times are
measured afresh by every start, and a start's first steps pay its warm-up, so the
summary's timing medians leave out each start's first ``train.warmup_steps``
(`measured`).

Why a start reads the record at its beginning and not at its end: a record that
cannot be read is refused before any training (one line), and the record is then
rewritten whole beside the old one and swapped in (storage/labelled.py), so a crash
while writing leaves the earlier steps as they were.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import xarray as xr

from pipeline.config.schema import ConfigError

#: The record's coordinates along `worker` (record.py's `to_dataset`).
WORKER_COORDS = ("worker_label", "emulated_speed", "device", "resource_tag")
#: The per-step coordinate naming the start that ran each step.
START_DESCRIPTION = ("the start of the run that ran the step (0: the first; each resume "
                     "with train.resume=true adds one); the attribute `starts` describes each")


@dataclass
class EarlierRecord:
    """What a resuming start keeps of the record its run's earlier starts wrote."""

    record: xr.Dataset  # their steps before the checkpoint resumed from, in memory
    starts: list[dict[str, Any]]  # one entry per earlier start, as written


def read_earlier(output_dir: str, from_step: int,
                 say: Callable[[str], None]) -> EarlierRecord | None:
    """The earlier starts' record in `output_dir`, cut to the steps before `from_step`
    (the checkpoint this start resumes from), or None where there is none. Says one
    line where steps the earlier starts ran are replaced, and a warning where steps
    before `from_step` are missing (a start that wrote no record: killed, or failed).
    A record that cannot be read is refused (ConfigError): it is not overwritten."""
    path = os.path.join(output_dir, "record.zarr")
    if not os.path.lexists(path):
        _say_missing(list(range(from_step)), say)
        return None
    try:
        with xr.open_zarr(path) as stored:
            record = stored.load()
        steps = np.asarray(record.step.values, dtype=int)
    except Exception as error:  # noqa: BLE001 - any unreadable store: one line
        raise ConfigError(f"train.resume: the record of the run's earlier start(s), {path}, "
                          f"cannot be read ({type(error).__name__}: {error}); move it aside "
                          "to resume without it, or start over with --fresh") from None
    starts = json.loads(record.attrs["starts"]) if "starts" in record.attrs else [
        _entry_of_old_record(record, steps)]
    if "start" not in record.coords:  # written before starts were recorded: one start
        record = record.assign_coords(start=("step", np.zeros(len(steps), dtype=int)))
    kept = steps < from_step
    replaced = record.isel(step=np.flatnonzero(~kept))
    for start in sorted(set(int(s) for s in replaced.start.values)):
        ran = replaced.step.values[replaced.start.values == start]
        say(f"record: steps {step_ranges(ran)} of start {start} ran past checkpoint "
            f"{from_step}, which this start resumes from; its own steps replace them")
    _say_missing(sorted(set(range(from_step)) - set(steps[kept].tolist())), say)
    record = record.isel(step=np.flatnonzero(kept))
    for variable in record.variables.values():  # the old store's chunks and codecs
        variable.encoding = {}
    return EarlierRecord(record, starts)


def _say_missing(steps: list[int], say: Callable[[str], None]) -> None:
    if steps:
        say(f"warning: record: steps {step_ranges(steps)} are missing from the record: "
            "the start that ran them wrote none (it was killed, or stopped by an error)")


def _entry_of_old_record(record: xr.Dataset, steps: np.ndarray) -> dict[str, Any]:
    """The `starts` entry of a record written before starts were recorded: one start,
    which wrote its record only once it was complete."""
    first = int(steps[0]) if len(steps) else 0
    return {"start": 0, "from_step": int(record.attrs.get("resumed_from_step", first)),
            "to_step": int(steps[-1]) + 1 if len(steps) else first, "ended": "complete",
            "started": record.attrs.get("started"), "finished": record.attrs.get("finished")}


def step_ranges(steps: Any) -> str:
    """Steps as ranges, ``0-29, 33``, for a person."""
    values = sorted(int(s) for s in steps)
    parts: list[str] = []
    for step in values:
        if parts and int(parts[-1].split("-")[-1]) == step - 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{step}"
        else:
            parts.append(str(step))
    return ", ".join(parts)


def continue_record(earlier: EarlierRecord | None, record: xr.Dataset,
                    entry: dict[str, Any]) -> xr.Dataset:
    """This start's `record` after the steps `earlier` keeps, each step marked with the
    start that ran it, and `entry` (how this start ran) added to the ``starts``
    attribute. The attributes are this start's. Workers that only one start had get
    NaN in the other's steps."""
    starts = earlier.starts if earlier is not None else []
    index = len(starts)
    record = record.assign_coords(start=("step", np.full(record.sizes["step"], index),
                                         {"description": START_DESCRIPTION}))
    if earlier is not None and earlier.record.sizes["step"]:
        record = _joined(earlier.record, record)
    record.attrs["starts"] = json.dumps([*starts, {"start": index, **entry}], default=str)
    return record


def _joined(old: xr.Dataset, new: xr.Dataset) -> xr.Dataset:
    """`old`'s steps then `new`'s, over the union of their workers (and layers); the
    workers' coordinates and the variables' descriptions are `new`'s where it has them,
    and a variable only one of them has is NaN in the other's steps."""
    union = {"worker": list(new.worker.values) + [w for w in old.worker.values
                                                  if w not in set(new.worker.values)]}
    layers = sorted(set(_labels(old, "layer")) | set(_labels(new, "layer")))
    if layers:
        union["layer"] = layers
    parts = [ds.drop_vars([c for c in WORKER_COORDS if c in ds.coords])
             .reindex({dim: labels for dim, labels in union.items() if dim in ds.dims})
             for ds in (old, new)]
    for one, other in ((parts[0], parts[1]), (parts[1], parts[0])):
        for name in set(other.data_vars) - set(one.data_vars):  # e.g. a GPU's figures
            dims = other[name].dims
            shape = tuple(one.sizes["step"] if d == "step" else len(union[d]) for d in dims)
            one[name] = (dims, np.full(shape, np.nan), dict(other[name].attrs))
    parts = [ds.assign_coords({dim: labels for dim, labels in union.items() if dim in ds.dims})
             for ds in parts]
    joined = xr.concat(parts, dim="step", data_vars="all", coords="minimal",
                       compat="override", join="outer", combine_attrs="override")
    for name in new.data_vars:
        joined[name].attrs = dict(new[name].attrs)
    for name in WORKER_COORDS:
        by_worker = dict(zip(old.worker.values, old[name].values)) if name in old.coords else {}
        by_worker.update(zip(new.worker.values, new[name].values) if name in new.coords else [])
        if by_worker:
            joined = joined.assign_coords(
                {name: ("worker", [by_worker.get(w) for w in union["worker"]])})
    joined.attrs = dict(new.attrs)
    return joined


def _labels(ds: xr.Dataset, dim: str) -> list:
    """The labels of `dim` in `ds` ([] where it has none)."""
    return ds[dim].values.tolist() if dim in ds.coords else []


#: What a start's step times depend on beyond the run's arithmetic (which a resume
#: keeps): starts that differ in any of these timed other set-ups.
SETUP_KEYS = ("strategy", "placement", "workers", "batch")


def other_setup_starts(record: xr.Dataset) -> list[int]:
    """The starts that ran with another strategy, placement, workers or batch than the
    record's last start (a resume may change them): their step times are another
    set-up's, which the timing figures leave out."""
    try:
        entries = json.loads(record.attrs.get("starts", "[]"))
    except (TypeError, ValueError):
        return []
    if len(entries) < 2:
        return []

    def setup(entry: dict[str, Any]) -> list[Any]:
        return [entry.get(key) for key in SETUP_KEYS]

    last = setup(entries[-1])
    return [int(entry["start"]) for entry in entries
            if "start" in entry and setup(entry) != last]


def changed_setup(record: xr.Dataset) -> np.ndarray:
    """Per step of the record: whether it ran after a recovery or a join had placed its
    start's work again on other workers (from the checkpoint the recovery restored, or
    the one the join came at, on): another set-up than the one the start was placed
    on, which the summary names (its split, master and prediction), and with the new
    placement's warm-up in its first steps."""
    steps = np.asarray(record.step.values) if "step" in record.coords else np.zeros(0, int)
    starts = (np.asarray(record.start.values) if "start" in record.coords
              else np.zeros(len(steps), dtype=int))
    changed = np.zeros(len(steps), dtype=bool)
    try:
        entries = json.loads(record.attrs.get("starts", "[]"))
    except (TypeError, ValueError):
        entries = []
    if not entries:  # a record without starts: the attributes are its one start's
        entries = [{"start": 0, **{key: _attr_list(record, key)
                                   for key in ("recoveries", "joins")}}]
    for entry in entries:
        at = [r.get("restored_step") for r in entry.get("recoveries") or []] \
            + [j.get("at_step") for j in entry.get("joins") or []]
        at = [int(step) for step in at if step is not None]
        if at and "start" in entry:
            changed |= (starts == int(entry["start"])) & (steps >= min(at))
    return changed


def _attr_list(record: xr.Dataset, key: str) -> list:
    try:
        return list(json.loads(record.attrs.get(key, "[]")))
    except (TypeError, ValueError):
        return []


def other_setup(record: xr.Dataset) -> np.ndarray:
    """Per step of the record: whether it ran on another set-up than the one the
    summary names, the last start's as it was placed: a step of a start with another
    strategy, placement, workers or batch (`other_setup_starts`), or one run after a
    recovery or join re-placed its start's work (`changed_setup`)."""
    starts = (np.asarray(record.start.values) if "start" in record.coords
              else np.zeros(record.sizes.get("step", 0), dtype=int))
    return np.isin(starts, other_setup_starts(record)) | changed_setup(record)


def measured(record: xr.Dataset, warmup_steps: int) -> xr.Dataset:
    """The record's steps the timing figures cover: each start's steps less its first
    `warmup_steps` (a start measures its first steps with its warm-up in them), and
    less the steps run on another set-up than the last start's as placed
    (`other_setup`: another start's, or after a recovery or join); where that leaves
    none, the warm-up steps are kept, and where still none, every step."""
    starts = (np.asarray(record.start.values) if "start" in record.coords
              else np.zeros(record.sizes.get("step", 0), dtype=int))
    same = ~other_setup(record)
    keep = same.copy()
    for start in np.unique(starts):
        keep[np.flatnonzero(starts == start)[:warmup_steps]] = False
    for chosen in (keep, same):
        if chosen.any():
            return record.isel(step=np.flatnonzero(chosen))
    return record


def placed_setup_unmeasured(record: xr.Dataset) -> bool:
    """Whether no step of the record ran on the set-up the summary names (the last
    start's as placed): a recovery from checkpoint 0 placed every step again, on other
    workers, and the timing figures (`measured`) fall back on those steps."""
    return bool(record.sizes.get("step", 0)) and bool(other_setup(record).all())


def left_out_steps(record: xr.Dataset, warmup_steps: int) -> tuple[list[int], list[int]]:
    """(warm-up steps, steps run on another set-up) that the timing figures
    (`measured`) leave out, as the summary lists them. Where `measured` falls back to
    steps it would leave out (a recovery from checkpoint 0 re-placed every step), those
    are in neither list: the figures include them."""
    kept = set(measured(record, warmup_steps).step.values.tolist())
    steps = record.step.values.tolist() if "step" in record.coords else []
    other = other_setup(record) if steps else np.zeros(0, dtype=bool)
    others = sorted(s for s, o in zip(steps, other) if o and s not in kept)
    return sorted(set(steps) - kept - set(others)), others
