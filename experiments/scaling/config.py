"""Scaling sweeps: predict-only grids over hypothetical clusters (``mode: scaling``).

A measured sweep's points are run configs for the cluster at hand. A scaling
sweep's points describe clusters that need not exist (1 to thousands of devices,
links of any speed, mixes of CPUs and GPUs), so they are not run configs: each is
a :class:`ScalingPoint`, validated like every config (one ``ConfigError`` line
naming the field), and the performance model (:mod:`pipeline.costmodel`) predicts
it. The file::

    name: scaling
    mode: scaling                  # what makes this a scaling sweep
    base:
      strategy: kernel             # single | kernel | data | hybrid
      network: {preset: marques}   # a zoo preset (tasks.zoo), or {conv: [...], hidden, classes}
      train: {batch: 128}          # the whole mini-batch over all devices
      hardware:                    # see experiments.scaling.hardware
        devices: 4                 # or {cpu: 2, gpu: 6}
        device: cpu
        link: {gbps: 10, latency_us: 10}
      options: {allreduce: ring, scheme: b, split: proportional}
    axes:                          # dotted fields of the point, as in measured sweeps
      strategy: [single, kernel, data, hybrid]
      hardware.devices: [1, 2, 4, 8]
      hardware.link.gbps: {dim: link_gbps, values: [1, 10, 100]}
    zip: []                        # fields moving together, as in measured sweeps

Axes and zip groups work exactly as in measured sweeps (:mod:`experiments.sweep.axes`: same
parser, same labels). There are no repeats (the model is deterministic) and no
``measure:``.
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

from experiments.scaling import hardware as hw
from experiments.sweep.axes import Axis, build_axes, point_data
from experiments.sweep.config import (AXES_CONTENT, SWEEP_KEYS, ZIP_CONTENT, _resolve_base,
                                     _route_overrides)
from experiments.scaling.networks import ConvDesc, NetworkDesc, check_network, network_of
from pipeline.costmodel import Options
from pipeline.config.schema import (ConfigError, check_range, described, from_dict, load_yaml,
                                    parse_override, set_dotted, to_dict)
from pipeline.strategies import STRATEGIES, Strategy, strategy_named

__all__ = ["ScalingPoint", "ScalingSweepConfig", "ScalingSweep", "ScalingPointRun",
           "NetworkDesc", "ConvDesc", "OptionsDesc", "is_scaling_sweep", "load_scaling_sweep",
           "build_point", "network_of", "options_of", "SCALING_VARIABLES", "field_units"]

#: Variables a scaling store adds to the measured sweeps' names (dims may not take them).
SCALING_VARIABLES = {"communication_time", "overhead_time", "baseline_step_time"}


@dataclass
class TrainDesc:
    """The step: ``batch`` samples over all devices (strong scaling), and how
    replicas take batch norm's statistics."""

    batch: int = described(128, "the whole mini-batch over all devices (strong scaling), "
                           "1 to 2^24 (past any published large-batch run's 64Ki)")
    batch_norm: Literal["sync", "local"] = described(
        "sync", "`data`/`hybrid`: batch norm's statistics over the whole batch (two small "
        "all-reduces per batch-norm layer and step) or each replica's own, as a run's "
        "`train.batch_norm`")

    #: The largest batch: 256x the 64Ki of the largest published large-batch runs;
    #: 10^20 passed and the model overflowed.
    MAX_BATCH = 2**24

    def __post_init__(self) -> None:
        check_range(self, "batch", low=1, high=self.MAX_BATCH)


@dataclass
class OptionsDesc:
    """Strategy knobs of :class:`pipeline.costmodel.Options` (see its docstring)."""

    split: Literal["proportional", "minmax"] = described(
        "proportional", "`kernel`: kernels in proportion to speed, or the min-max split")
    quantum: int = described(1, "`kernel`: shards own multiples of this many kernels")
    allreduce: Literal["ring", "rhd"] = described(
        "ring", "`data`/`hybrid`: the gradients' all-reduce, ring or recursive "
        "halving-doubling")
    overlap: bool = described(False, "`data`/`hybrid`: the all-reduce overlaps the backward "
                              "pass")
    bucket_mb: float = described(0.0, "`data`/`hybrid` with `overlap`: the least MiB of "
                                 "gradients one all-reduce carries, as PyTorch DDP's "
                                 "`bucket_cap_mb` (25 there); 0: one all-reduce per layer")
    batch_split: Literal["equal", "proportional"] = described(
        "proportional", "`data`/`hybrid`: samples per device in proportion to its speed "
        "(as a run's `placement: calibrated` shares them), or equal")
    scheme: Literal["a", "b", "c"] = described("b", "`hybrid`: how the dense layers get the "
                                               "conv features (as `hybrid.scheme`)")
    dense_batch: Literal["worker", "full"] = described(
        "worker", "`hybrid`: dense updates per part (`worker`) or one a step (`full`)")
    broadcast: Literal["binomial", "linear"] = described(
        "binomial", "`hybrid`: how a share of features is broadcast")
    overlap_dense: bool = described(True, "`hybrid`: the dense layers' exchange overlaps "
                                    "their compute")

    def __post_init__(self) -> None:
        check_range(self, "bucket_mb", low=0)


@dataclass
class ScalingPoint:
    """One point of a scaling sweep: what is trained, how, on which hypothetical cluster."""

    strategy: str = described("kernel", "`single`, `kernel`, `data` or `hybrid` (a "
                              "strategy that runs on devices)")
    network: NetworkDesc = described(factory=NetworkDesc, doc="the network")
    train: TrainDesc = described(factory=TrainDesc, doc="the step")
    hardware: hw.HardwareConfig = described(factory=hw.HardwareConfig,
                                            doc="the hypothetical cluster")
    options: OptionsDesc = described(factory=OptionsDesc, doc="the strategies' knobs "
                                     "(pipeline.costmodel.Options)")


@dataclass
class ScalingSweepConfig:
    """The sweep file as written (axes still raw)."""

    name: str = described("scaling", "the sweep's name (default: the file's name)")
    mode: Literal["scaling"] = described("scaling", "what makes this a scaling sweep")
    base: dict[str, Any] | str = described(
        factory=dict, content=ScalingPoint | str,
        doc="the point every grid position starts from (the `base.` fields below), or a "
        "path to a file holding it")
    axes: dict[str, Any] = described(
        factory=dict, content=AXES_CONTENT,
        doc="a grid over the point's dotted fields, as in measured sweeps")
    zip: list[dict[str, Any]] = described(factory=list, content=ZIP_CONTENT,
                                          doc="fields moving together, as in measured sweeps")
    output: str | None = described(None, "the results store (null: `results/<name>.zarr`)")
    description: str = described("", "what the sweep is for (kept with the results)")

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ConfigError(f"name: {self.name!r} cannot name a results store")


SCALING_KEYS = set(ScalingSweepConfig.__dataclass_fields__)


@dataclass
class ScalingPointRun:
    """One cell of the grid: its position, labels and validated point."""

    position: tuple[int, ...]
    labels: dict[str, str]
    point: ScalingPoint

    @property
    def region(self) -> tuple[int, ...]:
        """Its cell in the store: axis positions, then repeat 0."""
        return (*self.position, 0)

    def describe(self) -> str:
        return " ".join(f"{dim}={label}" for dim, label in self.labels.items()) or "base"


@dataclass
class ScalingSweep:
    """A loaded scaling sweep."""

    config: ScalingSweepConfig
    source: str
    base: dict[str, Any]
    axes: list[Axis]
    points: list[ScalingPointRun]  # in grid order
    text: str  # the resolved config as YAML (stored with the results)
    fingerprint: str
    store_path: str

    @property
    def dims(self) -> list[str]:
        return [axis.dim for axis in self.axes]

    @property
    def shape(self) -> tuple[int, ...]:
        return (*(len(axis) for axis in self.axes), 1)

    def axis_with_field(self, name: str) -> Axis | None:
        return next((axis for axis in self.axes if name in axis.fields), None)


#: Units of a scaling point's numeric fields (the store's coordinates say them).
FIELD_UNITS = {"train.batch": "samples", "hardware.devices": "devices",
               "hardware.link.gbps": "Gb/s", "hardware.link.latency_us": "us",
               "hardware.store.gbps": "Gb/s", "hardware.store.client_gbps": "Gb/s",
               "hardware.store.latency_us": "us", "hardware.dask.task_ms": "ms",
               "hardware.dask.sync_ms": "ms", "hardware.dask.hop_ms": "ms",
               "hardware.dask.steps_per_task": "steps", "options.quantum": "kernels",
               "network.width": "1", "network.image": "pixels", "network.classes": "classes"}
#: Units of a device kind's fields (`hardware.kinds.<kind>.<field>`).
KIND_UNITS = {"flops": "FLOP/s", "mem_bw": "B/s", "memory": "B", "conv_efficiency": "1",
              "dense_efficiency": "1", "mem_efficiency": "1"}


def field_units(field: str) -> str | None:
    """The units of a point's numeric field, None where it has none."""
    parts = field.split(".")
    if len(parts) == 4 and parts[:2] == ["hardware", "kinds"]:
        return KIND_UNITS.get(parts[3])
    return FIELD_UNITS.get(field)


# The point ----------------------------------------------------------------------------


def options_of(point: ScalingPoint) -> Options:
    """The cost model's options for a point."""
    o = point.options
    return Options(split=o.split, quantum=o.quantum, allreduce=o.allreduce, overlap=o.overlap,
                   bucket_mb=o.bucket_mb, batch_split=o.batch_split, scheme=o.scheme, dense_batch=o.dense_batch,
                   broadcast=o.broadcast, overlap_dense=o.overlap_dense,
                   batch_norm=point.train.batch_norm,
                   overhead=hw.overhead_spec(point.hardware.dask))


def point_strategy(point: ScalingPoint) -> Strategy:
    """The point's strategy: one that runs on a cluster, which the model can scale."""
    strategy = strategy_named(point.strategy)
    if not strategy.uses_cluster or strategy.chosen_by_model:
        why = ("trains in one process" if not strategy.uses_cluster else
               "is chosen by the model when a run starts on a real cluster")
        raise ConfigError(f"strategy: {point.strategy!r} {why}; a scaling sweep predicts "
                          f"{', '.join(scaling_strategies())}")
    return strategy


def scaling_strategies() -> list[str]:
    """The strategies a scaling sweep predicts: those that run on devices, by name
    (``single``, the one-device baseline, first)."""
    names = [name for name, s in STRATEGIES.items() if s.uses_cluster and not s.chosen_by_model]
    return sorted(names, key=lambda name: not STRATEGIES[name].one_worker)


def build_point(data: dict) -> ScalingPoint:
    """Validate one point's mapping; raises ConfigError naming the field."""
    point: ScalingPoint = from_dict(ScalingPoint, data)
    point_strategy(point)
    if point.train.batch < 1:
        raise ConfigError(f"train.batch: expected at least 1, got {point.train.batch}")
    if point.options.quantum < 1:
        raise ConfigError(f"options.quantum: expected at least 1, got {point.options.quantum}")
    check_network(point.network)
    hw.check_hardware(point.hardware)
    try:
        net = network_of(point.network)
    except ValueError as error:  # one that names its network field keeps its words
        text = str(error)
        raise ConfigError(text if text.startswith("network.") else f"network: {text}") from None
    for i, layer in enumerate(net.conv):
        if min(layer.conv_hw) < 1 or min(layer.out_hw) < 1:
            raise ConfigError(f"network.conv.{i}: the {layer.in_hw[0]}x{layer.in_hw[1]} input "
                              f"shrinks to nothing (network.image is "
                              f"{point.network.image or 32})")
    return point


# Loading ------------------------------------------------------------------------------


def is_scaling_sweep(path: str, overrides: list[str] = ()) -> bool:
    """Whether the sweep file is a scaling sweep. A ``mode=...`` override may switch
    between the modes of runs (``measure``, ``predict``), not into or out of
    ``scaling``, whose file describes hypothetical clusters, not runs: a ConfigError
    says so, rather than an unknown key of the other kind of file."""
    written = load_yaml(path).get("mode")
    mode = written
    for text in overrides:
        key, value = parse_override(text)
        if key == "mode":
            mode = value
    if (mode == "scaling") != (written == "scaling"):
        kind = ("a scaling sweep (hypothetical clusters, predicted)" if written == "scaling"
                else "a sweep of runs")
        raise ConfigError(f"mode: {path} is {kind}, which mode={mode} cannot make "
                          f"{'a sweep of runs' if written == 'scaling' else 'a scaling sweep'}"
                          ": their files differ (docs/sweeps.md); use a file of that kind")
    return mode == "scaling"


def _fingerprint(data: dict) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_scaling_sweep(path: str, overrides: list[str] = (), out: str | None = None
                       ) -> ScalingSweep:
    """Load, override, expand and validate a scaling sweep; raises ConfigError."""
    raw = load_yaml(path)
    raw.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    raw, base_overrides = _route_overrides(raw, list(overrides), SCALING_KEYS)
    config: ScalingSweepConfig = from_dict(ScalingSweepConfig, raw)
    base = _resolve_base(config.base, path)
    for text in base_overrides:
        key, value = parse_override(text)
        head = key.split(".", 1)[0]
        if head in SWEEP_KEYS - SCALING_KEYS:
            raise ConfigError(f"{head}: a measured sweep's key; a scaling sweep predicts each "
                              "point once and takes "
                              f"{', '.join(sorted(SCALING_KEYS))} (base keys as "
                              "base.<key> or <key>)")
        set_dotted(base, key, value)
    build_point(copy.deepcopy(base))  # a bad base fails here, before the axes
    axes = build_axes(config)
    for axis in axes:
        if axis.dim in SCALING_VARIABLES:
            raise ConfigError(f"{axis.where}.dim: the name {axis.dim!r} is already taken")
        for index in range(len(axis)):
            try:
                build_point(point_data(base, [axis], (index,)))
            except ConfigError as error:
                raise ConfigError(f"{error} (in {axis.where}, value #{index + 1} of "
                                  f"{len(axis)})") from None

    points: list[ScalingPointRun] = []
    for position in itertools.product(*(range(len(axis)) for axis in axes)):
        labels = {axis.dim: axis.labels[i] for axis, i in zip(axes, position)}
        run = ScalingPointRun(position, labels, ScalingPoint())
        try:
            run.point = build_point(point_data(base, axes, position))
        except ConfigError as error:
            raise ConfigError(f"{error} (at point {run.describe()})") from None
        points.append(run)

    store_path = out or config.output or os.path.join("results", f"{config.name}.zarr")
    resolved = to_dict(config)
    resolved["base"] = base
    text = yaml.safe_dump(resolved, sort_keys=False)
    identity = {k: v for k, v in resolved.items() if k != "output"}
    return ScalingSweep(config, path, base, axes, points, text, _fingerprint(identity),
                        store_path)

