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
    mode: measure                    # 'predict': the model alone (pipeline.prediction);
                                     # 'scaling': hypothetical clusters, see
                                     # experiments.scaling.config

Every point is the base mapping with its axis values applied by `set_dotted` and is
validated by `build_run_config` here, at load time, so a bad axis fails before
anything runs, with one `ConfigError` line naming the field.

Why `measure:` rather than train.steps: a sweep's timing protocol (steps discarded
as warm-up, steps measured) is one decision for the whole grid, and spelling the
measured count out avoids the off-by-warm-up mistakes of `train.steps`. When
`measure` is absent, each point's train.steps/train.warmup_steps are used as they
are (and may then be swept).

This module owns the file's schema and `load_sweep`, which reads, overrides and
checks it; the axes are parsed in :mod:`experiments.sweep.axes` and the points'
rules (strategy fit, cluster, run order) are :mod:`experiments.sweep.points`.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import os
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from experiments.sweep.axes import Axis, build_axes, point_data
from experiments.sweep.points import Point, cluster_key, fit_point_to_strategy, run_order
from pipeline.cluster.workers import scheduler_address
from pipeline.config.run_config import RunConfig, build_run_config, with_overrides
from pipeline.model_probe import probe_policy
from pipeline.config.schema import (ConfigError, described, from_dict, load_yaml, parse_override,
                                    set_dotted, to_dict)
from pipeline.strategies import Strategy, strategy_of


@dataclass
class AxisValues:
    """An axis with its dim named: ``{dim: batch_size, values: [32, 64]}`` (the
    file's shape, for the schema; `experiments.sweep.axes` parses it)."""

    dim: str | None = described(None, "the dim's name in the results (null: the field's "
                                "last part)")
    values: list[Any] = described(factory=list, doc="the field's values, one a position")


@dataclass
class ZipGroup:
    """Fields that move together as one dim (the file's shape, for the schema)."""

    dim: str | None = described(None, "the dim's name (null: the first field's last part)")
    fields: dict[str, list[Any]] = described(
        factory=dict, doc="dotted field -> values; every field as many values")


#: An ``axes:`` entry's value and a ``zip:`` group, as the schema describes them.
AXES_CONTENT = dict[str, list[Any] | AxisValues]
#: The parts of a named axis an override can change (`axes.<field>.values=[...]`).
AXIS_PARTS = tuple(AxisValues.__dataclass_fields__)
ZIP_CONTENT = list[ZipGroup | dict[str, list[Any]]]


@dataclass
class MeasureConfig:
    """The timing protocol of every point: `warmup_steps` discarded, `steps` measured."""

    warmup_steps: int = described(1, "steps of each point discarded as warm-up "
                                  "(sets `train.warmup_steps`)")
    steps: int = described(8, "steps of each point measured (`train.steps` is warm-up plus "
                           "these)")

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ConfigError(f"measure.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.steps < 1:
            raise ConfigError(f"measure.steps must be at least 1, got {self.steps}")


@dataclass
class SweepConfig:
    """The sweep file as written (axes still raw; `expand` checks them)."""

    name: str = described("sweep", "the sweep's name (default: the file's name): its "
                          "store is `results/<name>.zarr`")
    base: dict[str, Any] | str = described(
        factory=dict, content=RunConfig | str,
        doc="the run config every point starts from (a mapping as for `python -m "
        "pipeline.train`), or a path to a run config file (relative to the sweep file, "
        "else to the current folder)")
    axes: dict[str, Any] = described(
        factory=dict, content=AXES_CONTENT,
        doc="a grid: dotted run-config field -> its values (a list, or `{dim: NAME, "
        "values: [...]}` to name the dim)")
    zip: list[dict[str, Any]] = described(
        factory=list, content=ZIP_CONTENT,
        doc="fields that move together, one dim a group: `{dim: NAME, fields: {field: "
        "[...], ...}}`, or `{field: [...], ...}` (the dim named after the first field)")
    repeats: int = described(1, "times each point runs (the `repeat` dim)")
    measure: MeasureConfig | None = described(
        None, "the timing protocol of every point (null: each point's `train.steps` and "
        "`train.warmup_steps` as they are, and they may be swept)")
    speedup_baseline: Literal["single", "reference"] = described(
        "single", "the strategy whose step time on the fewest workers `speedup` divides")
    mode: Literal["measure", "predict", "scaling"] = described(
        "measure", "`measure` runs every point; `predict`, the model alone "
        "(pipeline/prediction.py); `scaling`, hypothetical clusters (the scaling sweep "
        "below)")
    output: str | None = described(None, "the results store (null: `results/<name>.zarr`)")
    keep_checkpoints: bool = described(False, "keep each point's checkpoints (large: the "
                                       "paper's network ~300 MB a point)")
    probe_samples: Literal["once", "per_repeat"] = described(
        "once", "how a measured sweep probes each cluster for the model: `once`; "
        "`per_repeat`, once more before each repeat after the first, every later prediction "
        "from the median of each figure over the samples so far (pipeline/probe/samples.py; "
        "on the 2-core hosts it did not lower the error: docs/benchmarks.md)")

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ConfigError(f"repeats must be at least 1, got {self.repeats}")
        if not self.name or "/" in self.name:
            raise ConfigError(f"name: {self.name!r} cannot name a results store")


SWEEP_KEYS = {f for f in SweepConfig.__dataclass_fields__}


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


def store_sharing_runs(store_path: str) -> str:
    """The other store path whose run directories are this one's (`runs_dir_for`):
    results/x for results/x.zarr, and results/x.zarr for results/x."""
    path = store_path.rstrip("/")
    return path[: -len(".zarr")] if path.endswith(".zarr") else path + ".zarr"


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
            _set_axis(axes, key.split(".", 1)[1], value)
        elif head == "base" and "." in key:
            base_overrides.append(text.split(".", 1)[1])
        elif head in sweep_keys:  # base=FILE replaces the base, as the file's own key
            set_dotted(data, key, value)
        else:
            base_overrides.append(text)
    base = data.get("base", {})
    if not isinstance(base, (dict, str)):
        raise ConfigError(f"base: expected a run config (a mapping) or a path to one, "
                          f"got {base!r}")
    return data, base_overrides


def _set_axis(axes: dict, name: str, value: Any) -> None:
    """``axes.<field>=[...]`` replaces (or adds) the axis over a field;
    ``axes.<field>.values=[...]`` and ``axes.<field>.dim=NAME`` change a part of an axis
    the file already has (a named one keeps its dim)."""
    field, _, part = name.rpartition(".")
    if part in AXIS_PARTS and field in axes:
        if isinstance(axes[field], dict):
            axes[field][part] = value
            return
        if part == "values":
            axes[field] = value
            return
        axes[field] = {"dim": value, "values": axes[field]}
        return
    axes[name] = value


def ignored_prediction_note(sweep: Sweep) -> str | None:
    """A warning where the base sets `prediction` to other than a run's default: the
    points' runs take the sweep's probe policy ($CNN_PREDICT_PROBE), so it was ignored
    unsaid (a base written from a run's config.yaml holds the default: no warning)."""
    value = sweep.base.get("prediction")
    if value is None or value == RunConfig.prediction:
        return None
    return (f"warning: base.prediction: {value} is not used: a sweep's points take its probe "
            f"policy, $CNN_PREDICT_PROBE (now {probe_policy()}; docs/sweeps.md)")


def _resolve_base(base: dict | str, source: str) -> dict:
    if isinstance(base, str):
        if not base.strip():
            raise ConfigError("base: expected a run config (a mapping) or a path to one, "
                              "got ''")
        candidates = [os.path.join(os.path.dirname(os.path.abspath(source)), base), base]
        path = next((c for c in candidates if os.path.exists(c)), None)
        if path is None:
            raise ConfigError(f"base: no run config {base} beside the sweep file "
                              f"({candidates[0]}) or in the current folder")
        try:
            loaded = load_yaml(path)
        except ConfigError as error:  # a folder, unreadable, not YAML: said as the base's
            raise ConfigError(f"base: {error}") from None
        if isinstance(loaded, dict) and {"axes", "base"} & set(loaded):
            raise ConfigError(f"base: {base} is a sweep config (it has "
                              f"{' and '.join(sorted({'axes', 'base'} & set(loaded)))}), not "
                              "a base: name the base it uses, or write its fields here")
        return loaded
    return copy.deepcopy(base)



#: Sweep fields that do not make a sweep another (its fingerprint leaves them out).
NOT_IDENTITY = ("output", "keep_checkpoints", "probe_samples")


def sweep_identity(resolved: dict) -> dict:
    """The parts of a resolved sweep config (`Sweep.text` read back) its fingerprint
    sees: all but `NOT_IDENTITY` and the base's scheduler address."""
    identity = {k: v for k, v in resolved.items() if k not in NOT_IDENTITY}
    base = copy.deepcopy(resolved.get("base"))
    if isinstance(base, dict) and isinstance(base.get("cluster"), dict):
        base["cluster"].pop("scheduler", None)
    identity["base"] = base
    return identity


def _fingerprint(data: dict) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def checked_config(data: dict) -> tuple[RunConfig, Strategy]:
    """A point's (or the base's) run config, and its strategy, which has checked it."""
    config = build_run_config(data)
    return config, strategy_of(config)


def load_sweep(path: str, overrides: list[str] = (), scheduler: str | None = None,
               out: str | None = None) -> Sweep:
    """Load, override, expand and validate a sweep file; raises ConfigError."""
    raw = load_yaml(path)
    raw.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    raw, base_overrides = _route_overrides(raw, list(overrides))
    config: SweepConfig = from_dict(SweepConfig, raw)
    if config.mode == "scaling":
        raise ConfigError("mode: 'scaling' sweeps describe hypothetical clusters, not run "
                          "configs: load them with experiments.scaling.config."
                          "load_scaling_sweep (python -m experiments.sweep does)")
    base = with_overrides(_resolve_base(config.base, path), base_overrides)  # as a run's
    if config.measure is not None:
        set_dotted(base, "train.warmup_steps", config.measure.warmup_steps)
        set_dotted(base, "train.steps", config.measure.warmup_steps + config.measure.steps)
    if scheduler:
        set_dotted(base, "cluster.scheduler", scheduler)
    base_config, _ = checked_config(base)  # a bad base fails here, before the axes
    axes = build_axes(config)
    external = scheduler_address(base_config.cluster) is not None

    # Check each axis value on its own first, so an error names the axis it came from.
    for axis in axes:
        for index in range(len(axis)):
            try:
                checked_config(point_data(base, [axis], (index,)))
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
        data = point_data(base, axes, position)
        labels = {axis.dim: axis.labels[i] for axis, i in zip(axes, position)}
        try:
            strategy = checked_config(data)[1]
        except ConfigError as error:
            where = " ".join(f"{dim}={label}" for dim, label in labels.items())
            raise ConfigError(f"{error} (at point {where})") from None
        skip = fit_point_to_strategy(data, axes, position, strategy)
        if external:
            for axis, index in zip(axes, position):
                if "cluster.workers" in axis.fields:  # a count: use that many of the cluster
                    set_dotted(data, "cluster.use_workers",
                               axis.value_of(index, "cluster.workers"))
        point = Point(position, repeat, labels, RunConfig(), strategy, order, None, skip)
        data.update({"name": f"{config.name}-{order:04d}", "progress": False,
                     "output": os.path.join(runs_dir, point.id)})
        try:
            point.config = build_run_config(data)
        except ConfigError as error:
            raise ConfigError(f"{error} (at point {point.describe()})") from None
        point.cluster_key = cluster_key(point.config, strategy)
        points.append(point)

    resolved = to_dict(config)
    resolved["base"] = base
    text = yaml.safe_dump(resolved, sort_keys=False)
    return Sweep(config, path, base, axes, run_order(points), text,
                 _fingerprint(sweep_identity(resolved)),
                 store_path, scheduler_address(base_config.cluster))
