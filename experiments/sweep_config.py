"""The sweep config: a base run config plus axes, expanded into validated points.

A sweep file looks like::

    name: quick                      # default: the file's name
    base:                            # a run config mapping (as for pipeline.train),
      network: {conv: [{kernels: 32}, {kernels: 64}]}   # or a path to a run config file
      train: {batch: 64, eval_samples: 1000}
    measure: {warmup_steps: 1, steps: 7}   # sets train.warmup_steps and train.steps
    axes:                            # dotted run-config field -> list of values (a grid)
      strategy: [reference, single, kernel]
      cluster.workers: [1, 2]
      train.batch: {dim: batch_size, values: [32, 64]}   # optional explicit dim name
    zip:                             # fields that move together: one dim per group
      - {dim: kernels, fields: {network.conv.0.kernels: [32, 500],
                                network.conv.1.kernels: [64, 1500]}}
      - {train.lr: [0.05, 0.1], train.momentum: [0.9, 0.8]}  # dim named after 1st field
    repeats: 2
    speedup_baseline: single         # or reference
    mode: measure                    # 'predict' only with experiments.prediction;
                                     # 'scaling': hypothetical clusters, see
                                     # experiments.scaling_config

Every point is the base mapping with its axis values applied by `set_dotted` and is
validated by `build_run_config` here, at load time, so a bad axis fails before
anything runs, with one `ConfigError` line naming the field.

Why `measure:` rather than train.steps: a sweep's timing protocol (steps discarded
as warm-up, steps measured) is one decision for the whole grid, and spelling the
measured count out avoids the off-by-warm-up mistakes of `train.steps`. When
`measure` is absent, each point's train.steps/train.warmup_steps are used as they
are (and may then be swept).
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import itertools
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import numpy as np
import yaml

from pipeline.cluster import scheduler_address
from pipeline.config import RunConfig, build_run_config
from pipeline.schema import ConfigError, from_dict, load_yaml, parse_override, set_dotted, to_dict

#: Run-config fields the sweep sets itself, per point.
NOT_SWEEPABLE = ("name", "output", "progress", "cluster.scheduler", "train.resume")
#: Names a dim may not take: the store's own dims and variables use them.
RESERVED_NAMES = {
    "repeat", "step", "warmup", "status", "failure", "run_id", "started", "finished",
    "wall_time", "step_time", "step_time_p25", "step_time_p75", "step_time_min",
    "step_time_max", "throughput", "speedup", "efficiency", "compute_time", "storage_time",
    "master_time", "wait_time", "bytes_moved", "loss", "accuracy", "n_workers", "capacity",
    "measured_steps", "predicted_step_time", "prediction_error", "kernel_split", "batch_split",
    "worker_labels", "worker_devices", "step_time_series", "loss_series",
}
_DIM_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class MeasureConfig:
    """The timing protocol of every point: `warmup_steps` discarded, `steps` measured."""

    warmup_steps: int = 1
    steps: int = 8

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ConfigError(f"measure.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.steps < 1:
            raise ConfigError(f"measure.steps must be at least 1, got {self.steps}")


@dataclass
class SweepConfig:
    """The sweep file as written (axes still raw; `expand` checks them)."""

    name: str = "sweep"
    base: dict[str, Any] | str = field(default_factory=dict)
    axes: dict[str, Any] = field(default_factory=dict)
    zip: list[dict[str, Any]] = field(default_factory=list)
    repeats: int = 1
    measure: MeasureConfig | None = None
    speedup_baseline: Literal["single", "reference"] = "single"
    mode: Literal["measure", "predict", "scaling"] = "measure"
    output: str | None = None  # the store; default results/<name>.zarr
    keep_checkpoints: bool = False  # per-point checkpoints are large (paper net: ~300 MB)

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ConfigError(f"repeats must be at least 1, got {self.repeats}")
        if not self.name or "/" in self.name:
            raise ConfigError(f"name: {self.name!r} cannot name a results store")


SWEEP_KEYS = {f for f in SweepConfig.__dataclass_fields__}


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
                return np.array(flat, dtype=np.int64)
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in flat):
                return np.array(flat, dtype=np.float64)
        return np.array(self.labels, dtype=object)

    @property
    def plain(self) -> bool:
        """Whether the coordinate itself holds the values (no companion needed)."""
        if len(self.fields) != 1:
            return False
        return all(isinstance(v[0], (int, float, str)) and not isinstance(v[0], bool)
                   for v in self.values)

    def value_of(self, position: int, name: str) -> Any:
        return self.values[position][self.fields.index(name)]


@dataclass
class Point:
    """One run of the grid: a position along every axis and a repeat number."""

    position: tuple[int, ...]
    repeat: int
    labels: dict[str, str]
    config: RunConfig
    order: int  # position in grid order (for stable directory names)
    cluster_key: str | None  # the worker set it needs; None: no cluster (reference)
    skip: str = ""  # why the point is not run (it would repeat another point), if so

    @property
    def region(self) -> tuple[int, ...]:
        """Its cell in the store: axis positions, then the repeat."""
        return (*self.position, self.repeat)

    @property
    def id(self) -> str:
        parts = [f"{dim}={label}" for dim, label in self.labels.items()]
        slug = re.sub(r"[^A-Za-z0-9._=+-]", "_", ",".join(parts + [f"repeat={self.repeat}"]))
        return f"{self.order:04d}_{slug}"[:180]

    def describe(self) -> str:
        return " ".join([f"{dim}={label}" for dim, label in self.labels.items()]
                        + [f"repeat={self.repeat}"])


@dataclass
class Sweep:
    """A loaded sweep: its config, axes, points in run order, and where results go."""

    config: SweepConfig
    source: str
    base: dict[str, Any]  # the resolved base mapping (overrides and measure applied)
    axes: list[Axis]
    points: list[Point]  # in run order
    text: str  # the resolved sweep config as YAML (stored with the results)
    fingerprint: str  # changes whenever the grid or what a point runs changes
    store_path: str
    scheduler: str | None

    @property
    def dims(self) -> list[str]:
        return [axis.dim for axis in self.axes]

    @property
    def shape(self) -> tuple[int, ...]:
        return (*(len(axis) for axis in self.axes), self.config.repeats)

    @property
    def steps(self) -> int:
        return max(p.config.train.steps for p in self.points)

    @property
    def runs_dir(self) -> str:
        return runs_dir_for(self.store_path)

    def axis_with_field(self, name: str) -> Axis | None:
        return next((axis for axis in self.axes if name in axis.fields), None)


def runs_dir_for(store_path: str) -> str:
    """Per-point run directories live next to the store: results/x.zarr -> results/x.runs."""
    stem = store_path.rstrip("/")
    if stem.endswith(".zarr"):
        stem = stem[: -len(".zarr")]
    return stem + ".runs"


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


# Loading -----------------------------------------------------------------------------


def _route_overrides(data: dict, overrides: list[str],
                     sweep_keys: set[str] = SWEEP_KEYS) -> tuple[dict, list[str]]:
    """Sweep keys go to the sweep (``axes.train.batch=[8,16]`` keeps its dots);
    anything else (``train.batch=32``, ``base.train.batch=32``) overrides the base."""
    data = copy.deepcopy(data)
    base_overrides: list[str] = []
    for text in overrides:
        key, value = parse_override(text)
        head = key.split(".", 1)[0]
        if head == "axes" and "." in key:
            axes = data.get("axes")
            if axes is None:
                axes = data["axes"] = {}
            if not isinstance(axes, dict):
                raise ConfigError("axes: expected a mapping of field -> values")
            axes[key.split(".", 1)[1]] = value
        elif head == "base" and "." in key:
            base_overrides.append(text.split(".", 1)[1])
        elif head in sweep_keys and head != "base":
            set_dotted(data, key, value)
        else:
            base_overrides.append(text)
    return data, base_overrides


def _resolve_base(base: dict | str, source: str) -> dict:
    if isinstance(base, str):
        candidates = [os.path.join(os.path.dirname(os.path.abspath(source)), base), base]
        path = next((c for c in candidates if os.path.exists(c)), candidates[0])
        return load_yaml(path)
    return copy.deepcopy(base)


def _dim_name(fields: tuple[str, ...], taken: set[str]) -> str:
    short = fields[0].split(".")[-1]
    if short not in taken and short not in RESERVED_NAMES and _DIM_NAME.match(short):
        return short
    return re.sub(r"[^A-Za-z0-9_]", "_", fields[0])


def _axis_values(where: str, raw: Any) -> list[Any]:
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: expected a list of values, got {raw!r}"[:200])
    if not raw:
        raise ConfigError(f"{where}: an axis needs at least one value")
    return raw


def _parse_axes(config: SweepConfig) -> list[tuple[str | None, tuple[str, ...], list[tuple], str]]:
    """(explicit dim or None, fields, values per position, where) for each axis."""
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


def _build_axes(config: SweepConfig) -> list[Axis]:
    axes: list[Axis] = []
    taken: set[str] = set()
    for dim, fields, values, where in _parse_axes(config):
        if dim is not None:
            if not isinstance(dim, str) or not _DIM_NAME.match(dim):
                raise ConfigError(f"{where}.dim: {dim!r} is not a usable name "
                                  "(letters, digits, _)")
            if dim in taken or dim in RESERVED_NAMES:
                raise ConfigError(f"{where}.dim: the name {dim!r} is already taken")
        else:
            dim = _dim_name(fields, taken)
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


def _point_data(base: dict, axes: list[Axis], position: tuple[int, ...]) -> dict:
    data = copy.deepcopy(base)
    for axis, index in zip(axes, position):
        for name, value in zip(axis.fields, axis.values[index]):
            set_dotted(data, name, copy.deepcopy(value))
    return data


def worker_count(value: Any) -> int:
    """Workers a `cluster.workers` value stands for (a count, or a list of workers)."""
    return value if isinstance(value, int) else len(value)


def fewest_workers(axis: Axis) -> int:
    """Position along a `cluster.workers` axis of its smallest worker count (the first
    such)."""
    counts = [worker_count(axis.value_of(i, "cluster.workers")) for i in range(len(axis))]
    return counts.index(min(counts))


def fit_point_to_strategy(data: dict, axes: list[Axis], position: tuple[int, ...]) -> str:
    """Make a point of the grid mean what its strategy can do on its workers.

    Along a workers axis, `reference` (plain PyTorch in one process) runs with as many
    threads as the point has workers, unless `reference.threads` is swept itself;
    `single` uses one worker whatever the cluster, so it is run at the axis's
    smallest worker count only. Returns why the point is skipped ("" to run it).
    """
    axis = next((a for a in axes if "cluster.workers" in a.fields), None)
    if axis is None:
        return ""
    index = position[axes.index(axis)]
    count = worker_count(axis.value_of(index, "cluster.workers"))
    strategy = data.get("strategy", "kernel")
    if strategy == "reference" and not any("reference.threads" in a.fields for a in axes):
        set_dotted(data, "reference.threads", count)
    if strategy == "single":
        first = fewest_workers(axis)
        if index != first:
            return (f"single runs on one worker: measured at {axis.dim}="
                    f"{axis.labels[first]}")
    return ""


def _cluster_key(config: RunConfig) -> str | None:
    if config.strategy == "reference":
        return None
    if scheduler_address(config.cluster):
        return "external"
    return json.dumps(to_dict(config.cluster.worker_list()), sort_keys=True)


def run_order(points: list[Point]) -> list[Point]:
    """Reference points first (no cluster, and before any nanny has touched this
    process's environment), then one block per worker set in order of first
    appearance, so one embedded cluster serves a whole block; within a block all
    points of repeat 0, then of repeat 1, ... so repeats are spread in time."""
    blocks: dict[str | None, list[Point]] = {None: []}
    for point in sorted(points, key=lambda p: p.order):
        blocks.setdefault(point.cluster_key, []).append(point)
    ordered: list[Point] = []
    for block in blocks.values():
        ordered.extend(sorted(block, key=lambda p: (p.repeat, p.order)))
    return ordered


def load_predictor() -> Callable[[RunConfig, dict | None], float | None] | None:
    """`experiments.prediction.predict_point` if that module exists, else None.

    The analytical model lands in its own module later; until then predictions stay
    NaN in the store rather than come from a stand-in model.
    """
    try:
        module = importlib.import_module("experiments.prediction")
    except ModuleNotFoundError as error:
        if error.name in ("experiments.prediction", "experiments"):
            return None
        raise
    return getattr(module, "predict_point", None)


def _fingerprint(data: dict) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_sweep(path: str, overrides: list[str] = (), scheduler: str | None = None,
               out: str | None = None) -> Sweep:
    """Load, override, expand and validate a sweep file; raises ConfigError."""
    raw = load_yaml(path)
    raw.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    raw, base_overrides = _route_overrides(raw, list(overrides))
    config: SweepConfig = from_dict(SweepConfig, raw)
    if config.mode == "scaling":
        raise ConfigError("mode: 'scaling' sweeps describe hypothetical clusters, not run "
                          "configs: load them with experiments.scaling_config."
                          "load_scaling_sweep (python -m experiments.sweep does)")
    base = _resolve_base(config.base, path)
    for text in base_overrides:
        key, value = parse_override(text)
        set_dotted(base, key, value)
    if config.measure is not None:
        set_dotted(base, "train.warmup_steps", config.measure.warmup_steps)
        set_dotted(base, "train.steps", config.measure.warmup_steps + config.measure.steps)
    if scheduler:
        set_dotted(base, "cluster.scheduler", scheduler)
    base_config = build_run_config(base)  # a bad base fails here, before the axes
    axes = _build_axes(config)
    external = scheduler_address(base_config.cluster) is not None

    # Check each axis value on its own first, so an error names the axis it came from.
    for axis in axes:
        for index in range(len(axis)):
            try:
                build_run_config(_point_data(base, [axis], (index,)))
            except ConfigError as error:
                raise ConfigError(f"{error} (in {axis.where}, value #{index + 1} of "
                                  f"{len(axis)})") from None
        if external and "cluster.workers" in axis.fields:
            if any(not isinstance(row[axis.fields.index("cluster.workers")], int)
                   for row in axis.values):
                raise ConfigError(f"{axis.where}: lists of emulated workers need the embedded "
                                  "cluster; with a scheduler, sweep worker counts "
                                  "(cluster.use_workers)")

    store_path = out or config.output or os.path.join("results", f"{config.name}.zarr")
    runs_dir = runs_dir_for(store_path)
    points: list[Point] = []
    grid = itertools.product(*(range(len(axis)) for axis in axes))
    for order, position in enumerate(itertools.product(grid, range(config.repeats))):
        position, repeat = position
        data = _point_data(base, axes, position)
        skip = fit_point_to_strategy(data, axes, position)
        if external:
            for axis, index in zip(axes, position):
                if "cluster.workers" in axis.fields:  # a count: use that many of the cluster
                    set_dotted(data, "cluster.use_workers",
                               axis.value_of(index, "cluster.workers"))
        labels = {axis.dim: axis.labels[i] for axis, i in zip(axes, position)}
        point = Point(position, repeat, labels, RunConfig(), order, None, skip)
        data.update({"name": f"{config.name}-{order:04d}", "progress": False,
                     "output": os.path.join(runs_dir, point.id)})
        try:
            point.config = build_run_config(data)
        except ConfigError as error:
            raise ConfigError(f"{error} (at point {point.describe()})") from None
        point.cluster_key = _cluster_key(point.config)
        points.append(point)

    if config.mode == "predict" and load_predictor() is None:
        raise ConfigError("mode: 'predict' needs the performance model "
                          "(experiments.prediction.predict_point), which this checkout "
                          "does not have yet")

    resolved = to_dict(config)
    resolved["base"] = base
    text = yaml.safe_dump(resolved, sort_keys=False)
    identity = {k: v for k, v in resolved.items() if k not in ("output", "keep_checkpoints")}
    identity["base"] = copy.deepcopy(base)
    identity["base"].get("cluster", {}).pop("scheduler", None)
    return Sweep(config, path, base, axes, run_order(points), text, _fingerprint(identity),
                 store_path, scheduler_address(base_config.cluster))
