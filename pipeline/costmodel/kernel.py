"""Kernel-parallel step (Marques et al.) as the engine runs it: a timeline per device.

Device ``d`` holds ``k[l][d]`` kernels of conv layer ``l`` (possibly none);
device ``master`` also runs the dense head. Per step each device runs its ops
in order (tasks/layout.py, tasks/step_task.py):

- forward of each layer it holds, in layer order: the layer input is the batch
  (a layer reading the images: one read from the dataset) or every shard's output
  of its source layer (`Network.source`; the layer below in a chain), gathered at
  the first layer the device holds that reads it and reused by the others: its own
  shard from memory, each other shard one read of that shard's slot, the shards then
  joined into the whole input (`KernelContext.gather_time`, counted as overhead: no
  phase of the engine's holds it). Then conv, batch norm, the residual sum (its own
  channels of the added layer, from memory: tied splits), ReLU and poolings, then
  one write of its output if another device reads it (a holder of a layer reading
  it, or the master for the last layer);
- the dense head (master): a read per other shard of the last layer, the join,
  forward, backward, update, then one write per other shard of its gradient slice;
- backward of each layer it holds, top down: a read per other source (every
  other holder's partial slice of each layer reading it, in layer then device
  order, and the master's gradient slice for the last layer), the sum (with the
  residual gradients of the layers adding it, local), the tail's backward and the
  input gradient, one write per other holder of its source layer (that holder's
  channels of the partial), then the weight gradient + update.

A device starts an op when it is free and, for each read, once the slot is
written and its reader has noticed (``DaskOverhead.sync`` with ready markers,
``hop`` through the scheduler). With no store, the same bytes cross the links, a
device's accesses one after another as the engine makes them (one task's thread,
blocking reads and writes: docs/model.md, "Store"), not overlapped as a collective's
sends and receives.
Every access is one operation on a single-chunk slot. Simulating a few steps
gives the steady step time (devices pipeline across steps: a device starts its
next step when it is free and its task is queued, ``DaskOverhead.task`` later),
and walking back along the critical path splits it into compute, dense head,
storage (or communication) and overhead, which add up to the step time.

Simulated op by op this costs ``P^2`` Python steps per layer; where every device has
the same link, kernel_fast.py computes the same timeline a phase of all devices at a
time (``Options(timeline="reference")`` keeps the op-by-op one).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .batch_reads import shard_batch_read
from .compute import LayerTime, conv_time, dense_time
from .devices import DaskOverhead, DeviceSpec, LinkSpec, StoreSpec, distinct, spreads
from .kernel_context import KernelContext
from .kernel_fast import fast_applies, steady_fast
from .network import Network
from .prediction import Options, Prediction
from .timeline import Timeline, io_time, steady

__all__ = ["io_time", "predict_kernel", "check_counts", "group_cost", "layer_cost",
           "workspace_bytes"]


def check_counts(network: Network, counts: Sequence[Sequence[int]], p: int) -> list[list[int]]:
    """Validate ``k[l][d]``: one row per conv layer, ``p`` entries, exact sums, one
    row for every layer of a tied group (`Network.tied_groups`)."""
    rows = [list(map(int, r)) for r in counts]
    if len(rows) != len(network.conv):
        raise ValueError(f"need {len(network.conv)} rows of kernel counts, got {len(rows)}")
    for layer, row in zip(network.conv, rows):
        if len(row) != p or min(row) < 0 or sum(row) != layer.out_channels:
            raise ValueError(f"counts {row} do not split {layer.out_channels} kernels "
                             f"over {p} devices")
    for group in network.tied_groups():
        for l in group[1:]:
            if rows[l] != rows[group[0]]:
                first, other = network.conv[group[0]], network.conv[l]
                raise ValueError(
                    f"conv layers {first.name or group[0]} and {other.name or l} are added "
                    "channel by channel (a residual sum) and must share one kernel split, "
                    f"got {rows[group[0]]} and {rows[l]}")
    return rows


# -- the step -------------------------------------------------------------------------


def _conv(ctx: KernelContext, l: int, d: int) -> LayerTime:
    return conv_time(ctx.devices[d], ctx.network.conv[l], ctx.batch, ctx.counts[l][d],
                     input_grad=ctx.network.source(l) >= 0,
                     accesses=ctx.network.update_accesses())


def _dataset_seconds(ctx: KernelContext, d: int, l: int) -> float:
    """Device `d` reading the batch from the dataset for its kernels of layer `l`, a
    layer reading the images (batch_reads.py)."""
    return shard_batch_read(ctx.devices[d], ctx.link_of(d), ctx.dataset, ctx.network,
                            ctx.batch, ctx.counts[l][d])


def _dataset_reads(ctx: KernelContext) -> dict[int, np.ndarray]:
    """`_dataset_seconds` of every device for each layer reading the images, once per
    distinct device and count (the fast timeline's devices share one link)."""
    kinds, kind_of = distinct(ctx.devices)
    out = {}
    for l in ctx.network.readers(-1):
        seconds: dict[tuple[int, int], float] = {}
        for d, k in enumerate(ctx.counts[l]):
            if (kind_of[d], k) not in seconds:
                seconds[kind_of[d], k] = _dataset_seconds(ctx, d, l)
        out[l] = np.array([seconds[kind_of[d], k] for d, k in enumerate(ctx.counts[l])])
    return out


def _timeline(ctx: KernelContext) -> Timeline:
    return Timeline([ctx.link_of(d) for d in range(len(ctx.devices))], ctx.store, ctx.overhead,
                    ctx.sync, spreads(ctx.devices))


def _simulate_step(ctx: KernelContext, tl: Timeline) -> None:
    """One step of every device, op by op in the engine's order (the module doc)."""
    net, L, m = ctx.network, len(ctx.network.conv), ctx.master
    for d in range(len(ctx.devices)):
        if any(ctx.counts[l][d] for l in range(L)) or d == m:
            tl.run(d, "overhead", ctx.overhead.task)
    for l in range(L):
        holders, src = ctx.holders(l), net.source(l)
        gathering, reading = set(ctx.gatherers[l].tolist()), set(ctx.output_readers[l].tolist())
        for d in holders:
            if d in gathering:
                if src < 0:
                    if ctx.dataset is not None:
                        tl.run(d, "io", _dataset_seconds(ctx, d, l))
                else:
                    tl.read(d, [(f"act/{src}/{e}", ctx.slice_bytes(src, e))
                                for e in ctx.holders(src) if e != d], len(holders))
                    tl.run(d, "overhead", ctx.gather_time(ctx.devices[d], src))
            tl.run(d, "compute", _conv(ctx, l, d).forward)
            if len(reading) - (d in reading) > 0:
                tl.write(d, f"act/{l}/{d}", ctx.slice_bytes(l, d), len(holders))
    last = ctx.holders(L - 1)
    tl.read(m, [(f"act/{L - 1}/{e}", ctx.slice_bytes(L - 1, e)) for e in last if e != m], 1)
    tl.run(m, "overhead", ctx.gather_time(ctx.devices[m], L - 1))
    tl.run(m, "master", dense_time(ctx.devices[m], net.dense, ctx.batch, dropout=net.dropout,
                                 accesses=net.update_accesses()).total)
    for e in last:
        if e != m:
            tl.write(m, f"grad/{e}", ctx.slice_bytes(L - 1, e), 1)
    for l in reversed(range(L)):
        holders, src = ctx.holders(l), net.source(l)
        for d in holders:
            sources = [f"partial/{r}/{e}/{d}" for r in ctx.readers[l]
                       for e in ctx.holders(r) if e != d]
            if l == L - 1 and d != m:
                sources.append(f"grad/{d}")
            tl.read(d, [(slot, ctx.slice_bytes(l, d)) for slot in sources], len(holders))
            t = _conv(ctx, l, d)
            summing = ctx.summing_time(ctx.devices[d], l, ctx.counts[l][d])
            tl.run(d, "compute", summing + t.backward_input)
            if src >= 0:
                for e in ctx.holders(src):
                    if e != d:
                        tl.write(d, f"partial/{l}/{d}/{e}", ctx.slice_bytes(src, e),
                                 len(holders))
            tl.run(d, "compute", t.backward - t.backward_input + t.update)


def predict_kernel(
    network: Network,
    batch: int,
    devices: Sequence[DeviceSpec],
    link: LinkSpec,
    store: StoreSpec | None,
    options: Options,
    counts: Sequence[Sequence[int]],
) -> Prediction:
    """Step time of kernel-parallel training with a given split (see the module doc)."""
    devs = tuple(devices)
    rows = check_counts(network, counts, len(devs))
    ctx = KernelContext(network, batch, devs, link, store, tuple(map(tuple, rows)),
                        options.master, options.dataset, options.overhead or DaskOverhead(),
                        options.sync)
    if options.timeline == "reference" or not fast_applies(ctx):
        result = steady(_timeline(ctx), lambda tl: _simulate_step(ctx, tl))
        per_dev = [sum(t.total for t in (_conv(ctx, l, d) for l in range(len(network.conv))))
                   for d in range(len(devs))]
    else:
        result, tables = steady_fast(ctx, _dataset_reads(ctx))
        per_dev = tables.per_device.tolist()
    step, path = result.step, result.path
    head = dense_time(devs[ctx.master], network.dense, batch, dropout=network.dropout,
                      accesses=network.update_accesses()).total
    per_dev[ctx.master] += head
    io_key = "storage" if store is not None or len(devs) == 1 else "communication"
    breakdown = {"compute": per_dev, "compute_max": max(per_dev),
                 "compute_critical": path["compute"], "master": path["master"],
                 "communication": 0.0, "storage": 0.0, "overhead": path["overhead"]}
    breakdown[io_key] = path["io"]
    last = result.timeline.lanes_since(result.last_start)
    return Prediction(
        "kernel", step, batch, breakdown, kernel_counts=rows,
        details={"timeline": last, "bytes_moved": result.moved, "master": ctx.master})


def workspace_bytes(network: Network, batch: int, counts: Sequence[Sequence[int]],
                    master: int = 0, s: int = 4) -> float:
    """Bytes every device reads + writes through the workspace per step."""
    ctx = KernelContext(network, batch, tuple(DeviceSpec(flops=math.inf, bytes_per_elem=s)
                                             for _ in counts[0]), LinkSpec(), None,
                        tuple(map(tuple, counts)), master)
    tl = _timeline(ctx)
    _simulate_step(ctx, tl)
    return tl.moved


def layer_cost(ctx: KernelContext, l: int, d: int, k: int, sources: int) -> float:
    """A device's seconds for ``k`` kernels of layer ``l`` (compute and its traffic),
    with the layer's other shards held elsewhere and ``sources`` devices handing it a
    gradient part (the holders of the layers reading it; the master for the last):
    what min-max placement balances (``splits.py``)."""
    if k <= 0:
        return 0.0
    layer, dev, link, s = ctx.network.conv[l], ctx.devices[d], ctx.link_of(d), ctx.s
    reads = ctx.network.source(l) >= 0
    t = conv_time(dev, layer, ctx.batch, k, input_grad=reads,
                  accesses=ctx.network.update_accesses())
    P = len(ctx.devices)
    others_in = layer.input_elements(ctx.batch) * s * (1 - 1 / P) if reads else 0.0
    out = layer.output_elements(ctx.batch, k) * s
    io = io_time(link, ctx.store, others_in, P - 1 if reads else 0, "read", P - 1, P)
    io += io_time(link, ctx.store, out, 1, "write", 1, P) if P > 1 else 0.0
    io += io_time(link, ctx.store, out * max(sources - 1, 0), max(sources - 1, 0), "read",
                  max(sources - 1, 0), P)
    if reads and P > 1:
        io += io_time(link, ctx.store, others_in, P - 1, "write", P - 1, P)
    return t.total + io


def group_cost(ctx: KernelContext, group: Sequence[int], d: int, k: int,
               sources: Sequence[int]) -> float:
    """`layer_cost` summed over a tied group (`Network.tied_groups`): at ``k`` kernels a
    device runs every layer of the group at ``k`` kernels; ``sources`` per layer."""
    return sum(layer_cost(ctx, l, d, k, n) for l, n in zip(group, sources))
