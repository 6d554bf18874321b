"""Kernel-parallel step (Marques et al.) with activations through a shared store.

Per conv layer ``l`` and device ``d`` holding ``k[l][d]`` kernels:

- forward: read the whole layer input (``B C(l-1) H W``), conv + ReLU + pool,
  write the pooled output slice;
- dense head on the master: read the last activations, forward, backward,
  update, write their gradient;
- backward: read the device's channel slice of every partial written by the
  layer above (one source for the last conv layer: the master), sum them,
  pool/ReLU backward, kernel grads + local update, and for ``l > 1`` write
  a full-size partial input gradient.

Each layer's forward and backward is a phase closed by a barrier (the next
phase's tasks depend on all of it).  A phase lasts as long as its slowest
active device (its I/O + compute), and no less than its total bytes over the
store's shared bandwidth.  With no store the same bytes move over each
device's link.

This is the data path of :mod:`pipeline.kernel_engine`, access by access:
every read or write is one store operation (``StoreSpec.latency``) touching
one chunk per quantum of channels (``StoreSpec.read_chunk`` /
``write_chunk``; an array shaped like layer ``l``'s output is chunked by
layer ``l``'s quantum); with ``Options.dataset`` the first layer reads the batch
from the dataset store, and so does the master (it needs the labels).

Dask: the ``2 L`` levels of a step (backward top-down, then the next
forward bottom-up) are a chain of ``2 L - 1`` dependency hops; the step
starts with the master submitting and ends with it gathering the last
forward (one client round trip), and every shard task costs ``task``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .compute import conv_time, dense_time
from .devices import DeviceSpec, LinkSpec, StoreSpec
from .network import Network
from .prediction import Options, Prediction, layer_quantum

__all__ = ["KernelContext", "io_time", "device_phase", "predict_kernel", "check_counts", "batch_bytes"]


@dataclass(frozen=True)
class KernelContext:
    """Everything a kernel-parallel phase needs."""

    network: Network
    batch: int
    devices: tuple[DeviceSpec, ...]
    link: LinkSpec
    store: StoreSpec | None
    quantum: int | Sequence[int] = 1
    dataset: StoreSpec | None = None

    def chunks(self, channels: float, layer: int) -> int:
        """Chunks touched by an access of ``channels`` channels of an array shaped like
        conv layer ``layer``'s output (chunked by that layer's quantum)."""
        if channels <= 0:
            return 0
        return int(math.ceil(channels / layer_quantum(self.quantum, layer)))

    def link_of(self, d: int) -> LinkSpec:
        """Device ``d``'s own link, else the shared one."""
        return self.devices[d].link or self.link

    @property
    def s(self) -> int:
        return self.devices[0].bytes_per_elem


def io_time(
    link: LinkSpec,
    store: StoreSpec | None,
    n_bytes: float,
    ops: int,
    direction: str,
    chunks: int = 0,
) -> float:
    """One device moving ``n_bytes`` in ``ops`` operations to or from the store.

    Link and store are in series: each operation pays both latencies, each
    chunk touched the store's per-chunk cost, and the bytes flow at the
    slower of the two bandwidths.
    """
    if ops <= 0 and n_bytes <= 0:
        return 0.0
    if store is None:
        return link.time(n_bytes, ops)
    per_byte = max(link.beta, 1.0 / store.client_bw(direction))
    return ops * (link.alpha + store.latency) + chunks * store.chunk_cost(direction) + n_bytes * per_byte


@dataclass(frozen=True)
class DevicePhase:
    """One device's part of a phase: compute and I/O seconds, bytes moved."""

    compute: float = 0.0
    io: float = 0.0
    read: float = 0.0
    written: float = 0.0

    @property
    def time(self) -> float:
        return self.compute + self.io


def device_phase(ctx: KernelContext, l: int, d: int, k: int, direction: str, sources: int = 1) -> DevicePhase:
    """Device ``d`` running ``k`` kernels of layer ``l`` forward or backward.

    Parameters
    ----------
    ctx : KernelContext
        Network, batch, devices, link, store.
    l, d, k : int
        Layer index, device index, kernels held (zero: idle, costs zero).
    direction : str
        ``"forward"`` or ``"backward"``.
    sources : int
        Backward only: partials to read and sum (devices active in layer
        ``l + 1``; one for the last layer, whose gradient the master wrote).
    """
    if k <= 0:
        return DevicePhase()
    layer, dev, link, s = ctx.network.conv[l], ctx.devices[d], ctx.link_of(d), ctx.s
    t = conv_time(dev, layer, ctx.batch, k, input_grad=l > 0)
    if direction == "forward":
        rd = layer.input_elements(ctx.batch) * s
        wr = layer.output_elements(ctx.batch, k) * s
        if l == 0 and ctx.dataset is not None:
            io = io_time(link, ctx.dataset, rd, 1, "read")
        else:
            io = io_time(link, ctx.store, rd, 1, "read", ctx.chunks(layer.in_channels, max(l - 1, 0)))
        io += io_time(link, ctx.store, wr, 1, "write", ctx.chunks(k, l))
        return DevicePhase(t.forward, io, rd, wr)
    slice_el = layer.output_elements(ctx.batch, k)
    rd = sources * slice_el * s
    wr = layer.input_elements(ctx.batch) * s if l > 0 else 0.0
    io = io_time(link, ctx.store, rd, sources, "read", sources * ctx.chunks(k, l))
    if wr:
        io += io_time(link, ctx.store, wr, 1, "write", ctx.chunks(layer.in_channels, l - 1))
    summing = dev.stream_time(sources * slice_el) if sources > 1 else 0.0
    return DevicePhase(t.backward + t.update + summing, io, rd, wr)


def _phase(ctx: KernelContext, parts: list[DevicePhase]) -> tuple[float, float, float]:
    """(time, critical compute, critical I/O) of a barrier-closed phase."""
    active = [p for p in parts if p.time > 0 or p.read > 0]
    if not active:
        return 0.0, 0.0, 0.0
    worst = max(active, key=lambda p: p.time)
    if ctx.store is not None:
        shared = sum(p.read for p in active) / ctx.store.read_bw
        shared += sum(p.written for p in active) / ctx.store.write_bw
        shared += ctx.store.latency
        floor = min(p.compute for p in active) + shared
        if floor > worst.time:
            c = min(p.compute for p in active)
            return floor, c, floor - c
    return worst.time, worst.compute, worst.io


def batch_bytes(network: Network, batch: int, s: int = 4) -> float:
    """Bytes of one batch as the dataset holds it: images and int64 labels."""
    first = network.conv[0]
    return batch * (first.in_channels * first.in_hw[0] * first.in_hw[1] * s + 8)


def check_counts(network: Network, counts: Sequence[Sequence[int]], p: int) -> list[list[int]]:
    """Validate ``k[l][d]``: one row per conv layer, ``p`` entries, exact sums."""
    rows = [list(map(int, r)) for r in counts]
    if len(rows) != len(network.conv):
        raise ValueError(f"need {len(network.conv)} rows of kernel counts, got {len(rows)}")
    for layer, row in zip(network.conv, rows):
        if len(row) != p or min(row) < 0 or sum(row) != layer.out_channels:
            raise ValueError(f"counts {row} do not split {layer.out_channels} kernels over {p} devices")
    return rows


def predict_kernel(
    network: Network,
    batch: int,
    devices: Sequence[DeviceSpec],
    link: LinkSpec,
    store: StoreSpec | None,
    options: Options,
    counts: Sequence[Sequence[int]],
) -> Prediction:
    """Step time of kernel-parallel training with a given split."""
    devs = tuple(devices)
    ctx = KernelContext(network, batch, devs, link, store, options.quantum, options.dataset)
    rows = check_counts(network, counts, len(devs))
    L, s = len(network.conv), ctx.s
    per_dev = [0.0] * len(devs)
    crit_c = crit_io = total = 0.0
    phases: list[dict] = []
    moved = 0.0

    def run(parts: list[DevicePhase], label: str) -> None:
        nonlocal crit_c, crit_io, total, moved
        t, c, io = _phase(ctx, parts)
        total += t
        crit_c += c
        crit_io += io
        moved += sum(p.read + p.written for p in parts)
        for i, p in enumerate(parts):
            per_dev[i] += p.compute
        phases.append({"phase": label, "time": t, "devices": [p.time for p in parts]})

    for l in range(L):
        run([device_phase(ctx, l, d, k, "forward") for d, k in enumerate(rows[l])], f"{network.conv[l].name}.fwd")

    # dense head on the master: one read of the last activations, one write
    # of their gradient, and (with a dataset store) the batch for its labels
    mdev = options.master_device or devs[options.master]
    mlink = mdev.link or link
    feat_bytes = batch * network.features * s
    head = dense_time(mdev, network.dense, batch)
    last = ctx.chunks(network.conv[-1].out_channels, L - 1)
    mstore = options.master_store or store
    head_io = io_time(mlink, mstore, feat_bytes, 1, "read", last)
    head_io += io_time(mlink, mstore, feat_bytes, 1, "write", last)
    if options.dataset is not None:
        head_io += io_time(mlink, options.dataset, batch_bytes(network, batch, s), 1, "read")
    master = head.total + head_io
    if options.master_device is None:
        per_dev[options.master] += head.total
    moved += 2 * feat_bytes

    for l in reversed(range(L)):
        sources = 1 if l == L - 1 else sum(1 for k in rows[l + 1] if k > 0)
        run([device_phase(ctx, l, d, k, "backward", sources) for d, k in enumerate(rows[l])], f"{network.conv[l].name}.bwd")

    overhead = 0.0
    if options.overhead is not None:
        tasks = 2 * sum(1 for r in rows for k in r if k > 0)
        overhead = options.overhead.time(tasks=tasks, hops=2 * L - 1)
    step = total + master + overhead
    io_key = "storage" if store is not None else "communication"
    breakdown = {
        "compute": per_dev,
        "compute_max": max(per_dev),
        "compute_critical": crit_c,
        "communication": 0.0,
        "storage": 0.0,
        "master": master,
        "overhead": overhead,
    }
    breakdown[io_key] = crit_io
    return Prediction(
        "kernel", step, batch, breakdown, kernel_counts=rows,
        details={"phases": phases, "bytes_moved": moved, "master_io": head_io},
    )
