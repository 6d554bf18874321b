"""Hypothetical hardware for predict-only scaling sweeps: device kinds, links, a store.

A scaling sweep describes clusters that need not exist: how many devices of which
kinds, how fast they talk, and (for kernel-parallel training) the shared store.
This module holds that description's schema (validated with
:func:`pipeline.config.schema.from_dict` like every config), the device presets, and the
conversion into the cost model's :class:`~pipeline.costmodel.DeviceSpec`,
:class:`~pipeline.costmodel.LinkSpec`, :class:`~pipeline.costmodel.StoreSpec` and
:class:`~pipeline.costmodel.DaskOverhead`.

In a sweep file::

    hardware:
      devices: 8                  # 8 devices of kind `device` ...
      # devices: {cpu: 2, gpu: 6} # ... or counts per kind, in this order
      device: cpu                 # the kind of an integer count
      kinds:                      # optional: adjust a preset, or define a new kind
        gpu: {conv_efficiency: 0.5}
        h100: {preset: gpu, flops: 6.7e13, mem_bw: 3.35e12}
      link: {gbps: 10, latency_us: 10}          # every device's link (Hockney)
      store: null                 # kernel: null = direct transfers over the links,
                                  # or {gbps: 40, latency_us: 100} for a shared store
      dask: null                  # kernel: {task_ms, sync_ms, hop_ms, steps_per_task} (DaskOverhead)

Why presets carry their sources: a predicted speedup is only as good as the rates
behind it, and a reader of a results store must be able to tell what "gpu" meant
(the store's ``presets`` attribute repeats this table).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from pipeline.costmodel import DaskOverhead, DeviceSpec, LinkSpec, StoreSpec, krizhevsky_k20_setup
from pipeline.config.schema import ConfigError, described

__all__ = ["DevicePreset", "PRESETS", "DeviceKindConfig", "LinkConfig", "StoreConfig",
           "DaskConfig", "HardwareConfig", "check_hardware", "resolve_kind", "device_kinds",
           "device_spec", "device_list", "link_spec", "store_spec", "overhead_spec", "GBIT"]

#: Bytes per second in one Gb/s.
GBIT = 1e9 / 8


@dataclass(frozen=True)
class DevicePreset:
    """A device kind's rates and where they come from.

    Attributes
    ----------
    flops : float
        The rate convolutions and dense layers run at, FLOP/s: peak FP32, or where
        noted an effective FP32 rate or the TF32 tensor-core peak (the model prices
        both kinds of layer at this rate, everything else by memory bandwidth).
    mem_bw : float
        Memory bandwidth, B/s.
    conv_efficiency, dense_efficiency, mem_efficiency : float
        Fractions of ``flops`` / ``mem_bw`` reached (Paleo's efficiency factors).
    source : str
        Where the numbers come from.
    memory : float
        Memory one device may use, bytes (``inf``: unlimited): what the predicted
        peak per device (`pipeline.costmodel.memory`) is checked against.
    accelerator : bool
        A GPU: its memory holds the tensors and a CUDA context, no host process.
    """

    flops: float
    mem_bw: float
    conv_efficiency: float
    dense_efficiency: float
    mem_efficiency: float
    source: str
    memory: float = math.inf
    accelerator: bool = False


def _k20() -> DevicePreset:
    gpu = krizhevsky_k20_setup().gpu
    return DevicePreset(gpu.flops, gpu.mem_bw, gpu.conv_efficiency, gpu.dense_efficiency,
                        gpu.mem_efficiency,
                        "Tesla K20 (NVIDIA datasheet: 3.52 TFLOP/s FP32, 208 GB/s, 5 GB); "
                        "conv efficiency 0.38 fitted to Krizhevsky 2014's single-GPU time, "
                        "dense 0.70, memory 0.75 (pipeline.costmodel.krizhevsky)",
                        memory=5e9, accelerator=True)


#: The device kinds a sweep can name without defining them.
PRESETS: dict[str, DevicePreset] = {
    "cpu": DevicePreset(
        2.08e11, 1.0e10, 1.0, 1.0, 1.0,
        "one core of this project's 2-core AMD EPYC machine (torch 2.13, one thread): a "
        "training step of the paper's 500/1500 network at batch 32 (927 GFLOP) took a "
        "median 4.45 s with `strategy: reference` (docs/benchmarks.md), i.e. 2.08e11 "
        "FLOP/s effective, used as the rate with efficiency 1; 10 GB/s streaming per "
        "core is our assumption; memory: the machine's 23 GiB over its 2 cores",
        memory=23 * 2 ** 30 / 2),
    "gpu": DevicePreset(
        1.95e13, 1.555e12, 0.6, 0.8, 0.8,
        "NVIDIA A100 40GB (datasheet: 19.5 TFLOP/s FP32 without TF32, 1555 GB/s, 40 GB); "
        "efficiencies are our assumption: cuDNN FP32 convolutions about 60 % of peak, "
        "large SGEMMs about 80 %, streaming kernels 80 % of bandwidth",
        memory=40e9, accelerator=True),
    "k20": _k20(),
    "cpu_node": DevicePreset(
        1.004e13, 4.096e11, 0.5, 0.7, 0.8,
        "a 2-socket AMD EPYC 7763 server node (AMD datasheet: 2 x 64 cores at 2.45 GHz "
        "base, two 256-bit FMA units a core, i.e. 32 FP32 FLOP a cycle: 10.0 TFLOP/s; 2 x 8 "
        "channels of DDR4-3200: 409.6 GB/s); the node is one device (one process, its "
        "cores as threads); 512 GB of memory (one 32 GB DIMM a channel); efficiencies are "
        "our assumption: oneDNN convolutions about half of peak, large SGEMMs 70 %, STREAM "
        "about 80 % of bandwidth",
        memory=512e9),
    "a100": DevicePreset(
        1.56e14, 2.039e12, 0.5, 0.6, 0.8,
        "NVIDIA A100 SXM4 80GB (datasheet: 156 TFLOP/s TF32 tensor-core dense, 2039 GB/s "
        "HBM2e, 80 GB), training in TF32; efficiencies are our assumption, not fitted: "
        "cuDNN tensor-core convolutions about half of peak at large batches, GEMMs 60 %, "
        "streaming kernels (batch norm, ReLU, pooling) 80 % of bandwidth; checked against "
        "NVIDIA's published ResNet-50 training rate (about 1,400 images/s at batch 256 in "
        "TF32) by the scaling report's anchor",
        memory=80e9, accelerator=True),
    "h100": DevicePreset(
        4.95e14, 3.35e12, 0.5, 0.6, 0.8,
        "NVIDIA H100 SXM5 80GB (datasheet: 495 TFLOP/s TF32 tensor-core dense, 3.35 TB/s "
        "HBM3, 80 GB), training in TF32; efficiencies as the a100 preset's (our "
        "assumption)",
        memory=80e9, accelerator=True),
}


@dataclass
class DeviceKindConfig:
    """A device kind: a preset (by default the kind's own name) with fields replaced."""

    preset: str | None = described(None, "the preset it starts from: `cpu`, `gpu`, `k20`, "
                                   "`cpu_node`, `a100`, `h100` (null: the kind's own name)")
    flops: float | None = described(None, "the rate of convolutions and dense layers, FLOP/s "
                                    "(a preset's: FP32, or TF32 tensor cores)")
    mem_bw: float | None = described(None, "memory bandwidth, B/s")
    conv_efficiency: float | None = described(None, "the fraction of `flops` convolutions "
                                              "reach")
    dense_efficiency: float | None = described(None, "the fraction of `flops` dense layers "
                                               "reach")
    mem_efficiency: float | None = described(None, "the fraction of `mem_bw` reached")
    memory: float | None = described(None, "bytes one device may use (`.inf`: unlimited)")


@dataclass
class LinkConfig:
    """Every device's link: ``gbps`` Gb/s (``.inf``: free), ``latency_us`` per message."""

    gbps: float = described(10.0, "each device's link, Gb/s (`.inf`: free)")
    latency_us: float = described(10.0, "latency per message, microseconds")


@dataclass
class StoreConfig:
    """A shared store (kernel-parallel activations go through it instead of links).

    ``gbps`` is the aggregate bandwidth that concurrent readers (writers) share;
    ``client_gbps`` what one device reaches alone (default: the aggregate).
    """

    gbps: float = described(40.0, "the aggregate bandwidth concurrent readers (writers) "
                            "share, Gb/s")
    latency_us: float = described(100.0, "latency per access, microseconds")
    client_gbps: float | None = described(None, "what one device reaches alone (null: the "
                                          "aggregate)")


@dataclass
class DaskConfig:
    """Orchestration costs of a kernel-parallel step (see ``pipeline.costmodel.DaskOverhead``)."""

    task_ms: float = described(0.0, "the gap between a worker's queued tasks, ms")
    sync_ms: float = described(0.0, "a ready marker to its reader (`sync: markers`), ms")
    hop_ms: float = described(0.0, "a Dask dependency (`sync: scheduler`), ms")
    steps_per_task: int = described(
        1, "consecutive steps one task runs (`train.steps_per_task`): the gap is paid once "
        "per this many steps (pipeline/engine/task_steps.py)")


@dataclass
class HardwareConfig:
    """The hypothetical cluster of one point (see the module docstring)."""

    devices: int | dict[str, int] = described(
        1, "how many devices of `device`, or a mix in order: `{cpu: 2, gpu: 6}`; 1 to "
        "65536 in all (the model's target is 1 to 4096, docs/model.md; its cost grows "
        "with the count)")
    device: str = described("cpu", "the device kind: a preset (`cpu`: a core here, `gpu`: "
                            "A100 in FP32, `k20`, `cpu_node`: a 2-socket server, `a100`, "
                            "`h100`: in TF32) or a kind of `kinds`")
    kinds: dict[str, DeviceKindConfig] = described(
        factory=dict, doc="device kinds by name: a preset's fields replaced "
        "(`{gpu: {conv_efficiency: 0.5}}`), or a new kind (`{preset: gpu, flops: ...}`)")
    link: LinkConfig = described(factory=LinkConfig, doc="every device's link")
    store: StoreConfig | None = described(
        None, "a shared store that `kernel`'s activations go through instead of links "
        "(null: direct links)")
    dask: DaskConfig | None = described(None, "Dask's orchestration costs of a `kernel` step "
                                        "(null: none)")


# Validation ---------------------------------------------------------------------------


def _positive(where: str, value: float | None, allow_inf: bool = False) -> None:
    if value is None:
        return
    if math.isnan(value) or value <= 0 or (math.isinf(value) and not allow_inf):
        bound = "a positive number" + (" (or .inf)" if allow_inf else "")
        raise ConfigError(f"{where}: expected {bound}, got {value!r}")


def _not_negative(where: str, value: float) -> None:
    if math.isnan(value) or value < 0 or math.isinf(value):
        raise ConfigError(f"{where}: expected a number >= 0, got {value!r}")


def _fraction(where: str, value: float | None) -> None:
    if value is not None and not 0 < value <= 1:
        raise ConfigError(f"{where}: expected an efficiency in (0, 1], got {value!r}")


#: The most devices a point has: 16x the model's target of 4096 (docs/model.md). A
#: point's cost grows with its devices (one share each): 10^8 computed for minutes.
MAX_DEVICES = 65536


def _known_kinds(hw: HardwareConfig) -> list[str]:
    return list(PRESETS) + [k for k in hw.kinds if k not in PRESETS]


def check_hardware(hw: HardwareConfig, where: str = "hardware") -> None:
    """Raise a ConfigError naming the field for anything the model cannot use."""
    for name, kind in hw.kinds.items():
        at = f"{where}.kinds.{name}"
        preset = kind.preset or name
        if preset not in PRESETS:
            field_name = f"{at}.preset" if kind.preset else at
            raise ConfigError(f"{field_name}: unknown preset {preset!r} (expected one of "
                              f"{', '.join(PRESETS)}; a new kind needs `preset:`)")
        _positive(f"{at}.flops", kind.flops)
        _positive(f"{at}.mem_bw", kind.mem_bw, allow_inf=True)
        _positive(f"{at}.memory", kind.memory, allow_inf=True)
        for attr in ("conv_efficiency", "dense_efficiency", "mem_efficiency"):
            _fraction(f"{at}.{attr}", getattr(kind, attr))
    known = _known_kinds(hw)
    if hw.device not in known:
        raise ConfigError(f"{where}.device: unknown device kind {hw.device!r} (expected one "
                          f"of {', '.join(known)}, or define it under {where}.kinds)")
    if isinstance(hw.devices, int):
        if not 1 <= hw.devices <= MAX_DEVICES:
            raise ConfigError(f"{where}.devices: expected 1 to {MAX_DEVICES} devices, got "
                              f"{hw.devices}")
    else:
        for name, count in hw.devices.items():
            if name not in known:
                raise ConfigError(f"{where}.devices.{name}: unknown device kind {name!r} "
                                  f"(expected one of {', '.join(known)}, or define it under "
                                  f"{where}.kinds)")
            if count < 0:
                raise ConfigError(f"{where}.devices.{name}: expected a count >= 0, got {count}")
        total = sum(hw.devices.values())
        if total < 1:
            raise ConfigError(f"{where}.devices: the mix has no device")
        if total > MAX_DEVICES:
            raise ConfigError(f"{where}.devices: the mix has {total} devices; at most "
                              f"{MAX_DEVICES}")
    _positive(f"{where}.link.gbps", hw.link.gbps, allow_inf=True)
    _not_negative(f"{where}.link.latency_us", hw.link.latency_us)
    if hw.store is not None:
        _positive(f"{where}.store.gbps", hw.store.gbps, allow_inf=True)
        _positive(f"{where}.store.client_gbps", hw.store.client_gbps, allow_inf=True)
        _not_negative(f"{where}.store.latency_us", hw.store.latency_us)
    if hw.dask is not None:
        for attr in ("task_ms", "sync_ms", "hop_ms"):
            _not_negative(f"{where}.dask.{attr}", getattr(hw.dask, attr))
        if hw.dask.steps_per_task < 1:
            raise ConfigError(f"{where}.dask.steps_per_task: expected at least 1 step, got "
                              f"{hw.dask.steps_per_task}")


# Conversion to the cost model ---------------------------------------------------------


def resolve_kind(hw: HardwareConfig, name: str) -> DevicePreset:
    """A kind's preset with the sweep's replacements applied."""
    kind = hw.kinds.get(name, DeviceKindConfig())
    base = PRESETS[kind.preset or name]
    values = {attr: getattr(kind, attr) if getattr(kind, attr) is not None else getattr(base, attr)
              for attr in ("flops", "mem_bw", "conv_efficiency", "dense_efficiency",
                           "mem_efficiency", "memory")}
    changed = [attr for attr in values if getattr(kind, attr) is not None]
    source = base.source if not changed else \
        f"preset {kind.preset or name} with {', '.join(changed)} set by the sweep"
    return DevicePreset(**values, source=source, accelerator=base.accelerator)


def device_kinds(hw: HardwareConfig) -> list[tuple[str, int]]:
    """``(kind, count)`` in order; kinds with count 0 are dropped."""
    if isinstance(hw.devices, int):
        return [(hw.device, hw.devices)]
    return [(name, count) for name, count in hw.devices.items() if count > 0]


def device_spec(hw: HardwareConfig, name: str) -> DeviceSpec:
    """One device of kind ``name`` (FP32: 4 bytes per element)."""
    p = resolve_kind(hw, name)
    return DeviceSpec(flops=p.flops, mem_bw=p.mem_bw, bytes_per_elem=4,
                      conv_efficiency=p.conv_efficiency, dense_efficiency=p.dense_efficiency,
                      mem_efficiency=p.mem_efficiency, name=name)


def device_list(hw: HardwareConfig, rank: Callable[[str], float] | None = None
                ) -> tuple[list[DeviceSpec], list[str]]:
    """Every device in order, and its kind's name: the kinds in the order written, or
    by ``rank`` (lowest first; a tie keeps the written order).

    Devices of one kind are the same object, which lets the model time equal
    devices' shares once.
    """
    kinds = device_kinds(hw)
    if rank is not None:
        kinds = sorted(kinds, key=lambda kind: rank(kind[0]))
    devices: list[DeviceSpec] = []
    names: list[str] = []
    for name, count in kinds:
        spec = device_spec(hw, name)
        devices += [spec] * count
        names += [name] * count
    return devices, names


def link_spec(link: LinkConfig) -> LinkSpec:
    """Hockney link: ``alpha = latency``, ``beta = 1 / bandwidth``, no reduction cost."""
    return LinkSpec.from_bandwidth(link.gbps * GBIT, latency=link.latency_us * 1e-6)


def store_spec(store: StoreConfig | None) -> StoreSpec | None:
    """The shared store, or None for direct transfers."""
    if store is None:
        return None
    aggregate = store.gbps * GBIT
    client = None if store.client_gbps is None else store.client_gbps * GBIT
    return StoreSpec(write_bw=aggregate, read_bw=aggregate, latency=store.latency_us * 1e-6,
                     client_write_bw=client, client_read_bw=client)


def overhead_spec(dask: DaskConfig | None) -> DaskOverhead | None:
    """Per-step Dask costs, or None for none (the task gap shared over a task's steps)."""
    if dask is None:
        return None
    return DaskOverhead(task=dask.task_ms * 1e-3 / dask.steps_per_task,
                        sync=dask.sync_ms * 1e-3, hop=dask.hop_ms * 1e-3)
