"""A sweep file's axes and zip groups, parsed into the dims of its grid.

Measured sweeps (:mod:`experiments.sweep.config`) and scaling sweeps
(:mod:`experiments.scaling.config`) write their grids the same way, so both parse
them here: each ``axes:`` entry and each ``zip:`` group becomes one `Axis` (a dim of
the results store), checked field by field with one `ConfigError` line naming
where it was written; its values get the short coordinate labels the store, the
report and the log show (`value_label`); and `point_data` applies one position
of the grid to the base mapping. What a point then means for its strategy lives
in :mod:`experiments.sweep.points`.

Why one module for both kinds of sweep: a dim name, a label or a duplicate-value
check that differed between them would make their stores disagree on the same axis.
"""

from __future__ import annotations

import copy
import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.config.schema import ConfigError, set_dotted
from pipeline.records.step_breakdown import COMPONENTS

#: Run-config fields the sweep sets itself, per point.
NOT_SWEEPABLE = ("name", "output", "progress", "cluster.scheduler", "train.resume",
                 "train.fresh",  # every point runs fresh, in its own directory
                 "prediction")  # the sweep's probe policy, $CNN_PREDICT_PROBE
#: Names a dim may not take: the store's own dims and variables use them.
RESERVED_NAMES = {
    "repeat", "step", "warmup", "status", "failure", "run_id", "started", "finished",
    "wall_time", "step_time", "step_time_p25", "step_time_p75", "step_time_min",
    "step_time_max", "throughput", "speedup", "efficiency", "compute_time", "storage_time",
    "master_time", "wait_time", "bytes_moved", "loss", "accuracy", "n_workers", "capacity",
    "measured_steps", "predicted_step_time", "prediction_error", "predicted_low",
    "predicted_high", "kernel_split", "batch_split", "client_cpu_per_step", "compute_error",
    "task_steps",
    "worker_labels", "worker_devices", "step_time_series", "loss_series",
    *(f"critical_{part}" for part in COMPONENTS), *(f"predicted_{part}" for part in COMPONENTS),
}
#: A sweep file's own keys that no point has (SweepConfig's and ScalingSweepConfig's
#: fields less those a run's config shares): written under ``axes:`` by mistake (a
#: ``zip:`` group indented one level too deep), they get their own message.
SWEEP_FILE_KEYS = ("axes", "base", "description", "keep_checkpoints", "measure", "mode",
                   "probe_samples", "repeats", "speedup_baseline", "zip")
#: The integers a coordinate holds as numbers (an axis of larger ones is labelled).
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
_DIM_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Axis:
    """One dimension of the grid: one field, or a zip group of fields moving together."""

    dim: str
    fields: tuple[str, ...]
    values: tuple[tuple[Any, ...], ...]  # per position: one value per field
    labels: tuple[str, ...]
    where: str  # where it was written, for messages ("axes.train.batch", "zip.0")

    def __len__(self) -> int:
        return len(self.values)

    def coordinate(self) -> np.ndarray:
        """Numbers or text when the values are plain scalars of one kind, else labels."""
        if len(self.fields) == 1:
            flat = [v[0] for v in self.values]
            if all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
                if all(INT64_MIN <= v <= INT64_MAX for v in flat):
                    return np.array(flat, dtype=np.int64)
                return np.array(self.labels, dtype=object)  # not rounded to a float
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in flat):
                return np.array(flat, dtype=np.float64)
        return np.array(self.labels, dtype=object)

    @property
    def plain(self) -> bool:
        """Whether the coordinate itself holds the values (no companion needed): not
        integers past int64's range, which it labels (`coordinate`)."""
        if len(self.fields) != 1:
            return False
        return all(isinstance(v[0], (int, float, str)) and not isinstance(v[0], bool)
                   and not (isinstance(v[0], int) and not INT64_MIN <= v[0] <= INT64_MAX)
                   for v in self.values)

    def value_of(self, position: int, name: str) -> Any:
        return self.values[position][self.fields.index(name)]


# Labels ------------------------------------------------------------------------------


def _number(value: float) -> str:
    return f"{value:g}"


def _worker_token(worker: Any) -> str:
    if not isinstance(worker, dict):
        return json.dumps(worker, sort_keys=True, separators=(",", ":"))
    token = _number(float(worker.get("speed", 1.0)))
    resources = worker.get("resources") or {"CPU": 1.0}
    if set(resources) != {"CPU"}:
        token = "/".join(sorted(resources)) + ":" + token
    if int(worker.get("threads", 1)) != 1:
        token += f"({worker['threads']}t)"
    return token


def value_label(field_name: str, value: Any) -> str:
    """A short readable coordinate label: '2', '1+0.5' (worker speeds), '32/64'."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        return str(value)  # a seed past 2^63 as written, not rounded ("1.84467e+19")
    if isinstance(value, (int, float)):
        return _number(value)
    if isinstance(value, str):
        return value
    if field_name.endswith("workers") and isinstance(value, list):
        return "+".join(_worker_token(w) for w in value)
    if field_name.endswith("devices") and isinstance(value, list) and value and all(
            isinstance(v, str) for v in value):
        return device_mix_label(value)
    if field_name.endswith("devices") and isinstance(value, dict) and value and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value.values()):
        return "+".join(f"{count}{kind}" for kind, count in value.items())  # 2cpu+6gpu
    if isinstance(value, list) and value and all(isinstance(v, dict) and "kernels" in v
                                                 for v in value):
        return "/".join(str(v["kernels"]) for v in value)
    if isinstance(value, list) and all(isinstance(v, (int, float, str)) for v in value):
        return "/".join(value_label(field_name, v) for v in value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def device_mix_label(devices: list[str]) -> str:
    """'gpu+2cpu' for [cuda:0, cpu, cpu]: how many of each kind, in first-seen order."""
    kinds = ["gpu" if d.startswith("cuda") else d for d in devices]
    order = list(dict.fromkeys(kinds))
    return "+".join(f"{kinds.count(k)}{k}" if kinds.count(k) > 1 else k for k in order)


def value_json(value: Any) -> str:
    """The full value of an axis position, as stored in the `<dim>_value` coordinate."""
    return json.dumps(value, sort_keys=True, default=str)


# Parsing -----------------------------------------------------------------------------


def _short_name(fields: tuple[str, ...]) -> str:
    return fields[0].split(".")[-1]


def _dim_name(fields: tuple[str, ...], taken: set[str], shared: set[str], where: str) -> str:
    """An axis's own dim name: its field's last part ('batch' for train.batch), else
    the whole field ('cluster_workers') where another axis has the short one: named
    with `dim:`, or unnamed with the same last part (`shared`: then each takes its
    whole field, so that no name depends on the order the axes are written in)."""
    short = _short_name(fields)
    if (short not in taken and short not in shared and short not in RESERVED_NAMES
            and _DIM_NAME.match(short)):
        return short
    full = re.sub(r"[^A-Za-z0-9_]", "_", fields[0])
    if full in taken or full in RESERVED_NAMES:
        raise ConfigError(f"{where}: its dim name {full!r} is taken by another axis; "
                          "give one of them another with `dim:`")
    return full


def _axis_values(where: str, raw: Any) -> list[Any]:
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: expected a list of values, got {raw!r}"[:200])
    if not raw:
        raise ConfigError(f"{where}: an axis needs at least one value")
    return raw


def _parse_axes(config: Any) -> list[tuple[str | None, tuple[str, ...], list[tuple], str]]:
    """(explicit dim or None, fields, values per position, where) for each axis.

    `config` is a measured or a scaling sweep config: its `axes`, `zip` and, if it
    has one, `measure`."""
    parsed = []
    seen: dict[str, str] = {}

    def claim(name: str, where: str) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}: a field must be a dotted name, got {name!r}")
        if name in seen:
            raise ConfigError(f"{where}: {name} is already swept by {seen[name]}")
        for fixed in NOT_SWEEPABLE:
            if name == fixed or name.startswith(fixed + "."):
                raise ConfigError(f"{where}: {name} cannot be swept (the sweep sets it "
                                  "for every point)")
        if getattr(config, "measure", None) is not None and name in ("train.steps",
                                                                      "train.warmup_steps"):
            raise ConfigError(f"{where}: {name} cannot be swept when `measure:` sets the "
                              "step counts")
        seen[name] = where

    for name, raw in config.axes.items():
        where = f"axes.{name}"
        if name in SWEEP_FILE_KEYS:
            raise ConfigError(f"{where}: `{name}:` is a key of the sweep file itself, "
                              "beside `axes:`, not a field to sweep")
        dim = None
        if isinstance(raw, dict):
            unknown = set(raw) - {"dim", "values"}
            if unknown or "values" not in raw:
                raise ConfigError(f"{where}: expected a list of values or "
                                  "{dim: NAME, values: [...]}")
            dim, raw = raw.get("dim"), raw["values"]
        claim(name, where)
        values = _axis_values(where, raw)
        parsed.append((dim, (name,), [(v,) for v in values], where))
    for index, group in enumerate(config.zip):
        where = f"zip.{index}"
        dim = None
        if set(group) == {"dim", "fields"} or set(group) == {"fields"}:
            dim, group = group.get("dim"), group["fields"]
            if not isinstance(group, dict):
                raise ConfigError(f"{where}.fields: expected a mapping of field -> values")
        if not group:
            raise ConfigError(f"{where}: a zip group needs at least one field")
        columns = []
        for name, raw in group.items():
            claim(name, f"{where}.{name}")
            columns.append(_axis_values(f"{where}.{name}", raw))
        lengths = {len(c) for c in columns}
        if len(lengths) > 1:
            counts = ", ".join(f"{n} has {len(c)}" for n, c in zip(group, columns))
            raise ConfigError(f"{where}: the fields of a zip group need as many values "
                              f"each ({counts})")
        parsed.append((dim, tuple(group), list(zip(*columns)), where))
    return parsed


def grid_text(axes: list[Axis], points: int) -> str:
    """How a sweep's first line counts its grid: "4 points (2 strategy x 2 devices)";
    an axis of one value by that value ("1 point (devices 4096)", not "1 devices")."""
    shape = " x ".join(f"{a.dim} {a.labels[0]}" if len(a) == 1 else f"{len(a)} {a.dim}"
                       for a in axes)
    return f"{points} point{'' if points == 1 else 's'}" + (f" ({shape})" if shape else "")


def build_axes(config: Any) -> list[Axis]:
    """The grid's dims, in order: the `axes:` entries, then the `zip:` groups.

    Names given with `dim:` are claimed first, so that an axis named after its field
    makes way for them, wherever they stand in the file."""
    parsed = _parse_axes(config)
    taken: set[str] = set()
    for dim, _, _, where in parsed:
        if dim is None:
            continue
        if not isinstance(dim, str) or not _DIM_NAME.match(dim):
            raise ConfigError(f"{where}.dim: {dim!r} is not a usable name "
                              "(letters, digits, _)")
        if dim in taken or dim in RESERVED_NAMES:
            raise ConfigError(f"{where}.dim: the name {dim!r} is already taken")
        taken.add(dim)
    unnamed = Counter(_short_name(fields) for dim, fields, _, _ in parsed if dim is None)
    shared = {short for short, count in unnamed.items() if count > 1}
    axes: list[Axis] = []
    for dim, fields, values, where in parsed:
        if dim is None:
            dim = _dim_name(fields, taken, shared, where)
            taken.add(dim)
        labels = ["/".join(value_label(f, v) for f, v in zip(fields, row)) for row in values]
        for i, label in enumerate(labels):
            if labels.index(label) != i:
                first = labels.index(label)
                if values[first] == values[i]:
                    raise ConfigError(f"{where}: the value {label} appears twice")
                labels[i] = f"{label}#{i}"
        axes.append(Axis(dim, fields, tuple(values), tuple(labels), where))
    return axes


def point_data(base: dict, axes: list[Axis], position: tuple[int, ...]) -> dict:
    """A copy of the base mapping with the values of one grid position set."""
    data = copy.deepcopy(base)
    for axis, index in zip(axes, position):
        for name, value in zip(axis.fields, axis.values[index]):
            set_dotted(data, name, copy.deepcopy(value))
    return data
