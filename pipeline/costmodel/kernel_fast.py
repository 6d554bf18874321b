"""kernel.py's step on the fast timeline: each phase of the step for all devices at once.

The ops and their order are kernel.py's (`_simulate_step`), on the layer graph
(kernel_context.py: who gathers a layer's input, who reads its output, how many
gradient parts a holder sums); this module only groups them by phase (a layer's
forward, the dense head, a layer's backward) so that timeline_fast.py can run a
phase's reads and writes as arrays. It is used where every
device has the same link (the read and write seconds are then sums of a part per
reader and a part per source, which the fast timeline needs); otherwise kernel.py
runs its op-by-op simulation. Compute times are taken once per distinct device and
kernel count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .compute import conv_time, dense_time
from .devices import DeviceSpec, distinct, uneven
from .kernel_context import KernelContext
from .timeline import Steady, steady
from .timeline_fast import FastTimeline, InTurn, Sources

__all__ = ["ComputeTables", "compute_tables", "fast_applies", "steady_fast"]


@dataclass(frozen=True)
class ComputeTables:
    """Per layer, per device seconds of the kernel step's compute ops."""

    forward: list[np.ndarray]
    backward_first: list[np.ndarray]  # summing the partials + the input gradient
    backward_rest: list[np.ndarray]  # weight gradient + update
    per_device: np.ndarray  # all conv work of each device (the dense head apart)


def _distinct_shards(counts: np.ndarray, kind_of: np.ndarray
                     ) -> tuple[list[tuple[int, int]], np.ndarray]:
    """The distinct (device kind, kernel count) pairs of one layer's shards, and for each
    device the index of its pair: equal shards are timed once."""
    keys = kind_of * (int(counts.max(initial=0)) + 1) + counts
    unique, index = np.unique(keys, return_inverse=True)
    first = np.zeros(len(unique), dtype=np.int64)
    first[index[::-1]] = np.arange(len(keys))[::-1]  # a device of each pair
    return [(int(kind_of[d]), int(counts[d])) for d in first], index.reshape(-1)


def _layer_tables(ctx: KernelContext, l: int, kind_of: np.ndarray,
                  kinds: list[DeviceSpec]) -> tuple[np.ndarray, ...]:
    """Per device: layer `l`'s forward, the first part of its backward (summing the
    gradient parts and the input gradient), the rest (weight gradient and update), and
    all of it; each timed once per distinct device and kernel count."""
    layer = ctx.network.conv[l]
    pairs, index = _distinct_shards(np.array(ctx.counts[l], dtype=np.int64), kind_of)
    rows = []
    for kind, k in pairs:
        t = conv_time(kinds[kind], layer, ctx.batch, k, input_grad=ctx.network.source(l) >= 0,
                      accesses=ctx.network.update_accesses())
        summing = ctx.summing_time(kinds[kind], l, k)
        rows.append((t.forward, summing + t.backward_input,
                     t.backward - t.backward_input + t.update, t.total))
    table = np.array(rows, dtype=float).reshape(len(pairs), 4)
    return tuple(table[index, column] for column in range(4))


def compute_tables(ctx: KernelContext) -> ComputeTables:
    """Every device's compute per layer, as kernel.py's ops use it."""
    kinds, kind_list = distinct(ctx.devices)
    kind_of = np.array(kind_list, dtype=np.int64)
    forward, first, rest = [], [], []
    per_device = np.zeros(len(ctx.devices))
    for l in range(len(ctx.network.conv)):
        fwd, back_first, back_rest, total = _layer_tables(ctx, l, kind_of, kinds)
        forward.append(fwd)
        first.append(back_first)
        rest.append(back_rest)
        per_device = per_device + total
    return ComputeTables(forward, first, rest, per_device)


def fast_applies(ctx: KernelContext) -> bool:
    """Whether the fast timeline gives kernel.py's step: one link for every device,
    and no spread of a device's compute or the store's accesses (it keeps no variances)."""
    return len({ctx.link_of(d) for d in range(len(ctx.devices))}) == 1 and \
        not uneven(ctx.devices, ctx.store)


@dataclass
class _Plan:
    """What every simulated step reuses: who holds what, slice bytes, compute, ready times."""

    ctx: KernelContext
    tables: ComputeTables
    dataset_seconds: dict[int, np.ndarray]  # per layer reading the images, per device
    holders: list[np.ndarray]
    gatherers: list[np.ndarray]  # per layer: its holders gathering its source's output
    writers: list[np.ndarray]  # per layer: its holders whose output another device reads
    slice_bytes: list[np.ndarray]  # per layer, per device: bytes of its pooled output
    active: np.ndarray
    head: float
    gathers: list[np.ndarray]  # per layer, per device: joining its source's shards
    head_gather: float  # the master joining the last layer's shards
    act_ready: list[np.ndarray]  # per layer, per device: when its output slot is written
    partials: dict[int, InTurn]  # per layer: the partial gradients its holders handed down
    grad_ready: np.ndarray  # per device: when the master wrote its gradient slice


def _writers(ctx: KernelContext, holders: np.ndarray, l: int) -> np.ndarray:
    """Holders of layer `l` whose output slice another device reads."""
    readers = ctx.output_readers[l]
    return holders[len(readers) - np.isin(holders, readers) > 0]


def _gather_seconds(ctx: KernelContext) -> list[np.ndarray]:
    """Per layer, per device: `KernelContext.gather_time` of the layer's source, timed
    once per distinct device."""
    kinds, kind_of = distinct(ctx.devices)
    index = np.array(kind_of, dtype=np.int64)
    return [np.array([ctx.gather_time(kind, ctx.network.source(l)) for kind in kinds])[index]
            for l in range(len(ctx.network.conv))]


def _plan(ctx: KernelContext, dataset_seconds: dict[int, np.ndarray]) -> _Plan:
    counts = np.array(ctx.counts, dtype=np.int64).reshape(len(ctx.network.conv), -1)
    P = len(ctx.devices)
    slice_bytes = [(counts[l] * (ctx.batch * layer.out_hw[0] * layer.out_hw[1] * ctx.s))
                   .astype(float) for l, layer in enumerate(ctx.network.conv)]
    active = np.flatnonzero((counts > 0).any(axis=0) | (np.arange(P) == ctx.master))
    head = dense_time(ctx.devices[ctx.master], ctx.network.dense, ctx.batch,
                      dropout=ctx.network.dropout,
                      accesses=ctx.network.update_accesses()).total
    holders = [np.flatnonzero(row > 0) for row in counts]
    writers = [_writers(ctx, h, l) for l, h in enumerate(holders)]
    gathers = _gather_seconds(ctx)
    head_gather = ctx.gather_time(ctx.devices[ctx.master], len(counts) - 1)
    return _Plan(ctx, compute_tables(ctx), dataset_seconds, holders, list(ctx.gatherers), writers,
                 slice_bytes, active, head, gathers, head_gather,
                 [np.zeros(P) for _ in counts], {}, np.zeros(P))


def _forward(plan: _Plan, tl: FastTimeline, l: int) -> None:
    """Layer `l`'s forward on its holders: gather the input (those reading it first:
    read the other shards, join them), compute, write the output where another device
    reads it."""
    ctx, H, G = plan.ctx, plan.holders[l], plan.gatherers[l]
    src = ctx.network.source(l)
    if src < 0:
        if ctx.dataset is not None:
            tl.run(G, "io", plan.dataset_seconds[l][G])
    else:
        below = plan.holders[src]
        tl.read(G, Sources(below, plan.act_ready[src][below], plan.slice_bytes[src][below]),
                len(H), np.zeros(len(G)), np.zeros(len(G)))
        if plan.gathers[l][G].any():
            tl.run(G, "overhead", plan.gathers[l][G])
    tl.run(H, "compute", plan.tables.forward[l][H])
    writers = plan.writers[l]
    plan.act_ready[l][writers] = tl.write_each(writers, plan.slice_bytes[l][writers], len(H))


def _head(plan: _Plan, tl: FastTimeline) -> None:
    """The master gathers the last layer (reads, join), runs the dense head, hands out
    gradient slices."""
    m = plan.ctx.master
    last = plan.holders[-1]
    master = np.array([m])
    tl.read(master, Sources(last, plan.act_ready[-1][last], plan.slice_bytes[-1][last]), 1,
            np.zeros(1), np.zeros(1))
    if plan.head_gather > 0:
        tl.run(master, "overhead", plan.head_gather)
    tl.run(master, "master", plan.head)
    targets = last[last != m]
    if len(targets):
        n_bytes = plan.slice_bytes[-1][targets]
        seconds = tl.io("write", n_bytes, 1)
        plan.grad_ready[targets] = tl.clock[m] + np.cumsum(seconds)
        tl.run(master, "io", seconds.sum())
        tl.moved += float(n_bytes.sum())


def _backward_reads(plan: _Plan, tl: FastTimeline, l: int) -> None:
    """Layer `l`'s holders read their gradient: every other holder's partial of each
    layer reading it (each written in turn, in device order), and the master's slice
    for the last layer."""
    H, m = plan.holders[l], plan.ctx.master
    written = [plan.partials[r] for r in plan.ctx.readers[l]]
    if written:
        tl.read_each_in_turn(H, written, plan.slice_bytes[l][H], len(H))
    if l == len(plan.holders) - 1:
        readers = H[H != m]
        tl.read_own(readers, m, plan.grad_ready[readers], plan.slice_bytes[l][readers], len(H))


def _backward(plan: _Plan, tl: FastTimeline, l: int) -> None:
    """Layer `l`'s backward on its holders: read, input gradient, hand partials to the
    holders of its source layer, weight gradient and update."""
    H = plan.holders[l]
    _backward_reads(plan, tl, l)
    tl.run(H, "compute", plan.tables.backward_first[l][H])
    src = plan.ctx.network.source(l)
    if src >= 0:
        below = plan.holders[src]
        plan.partials[l] = tl.write_in_turn(H, below, plan.slice_bytes[src][below], len(H))
    tl.run(H, "compute", plan.tables.backward_rest[l][H])


def _step(plan: _Plan, tl: FastTimeline) -> None:
    """One step of every device, phase by phase (kernel.py's `_simulate_step`)."""
    tl.run(plan.active, "overhead", plan.ctx.overhead.task)
    L = len(plan.holders)
    for l in range(L):
        _forward(plan, tl, l)
    _head(plan, tl)
    for l in reversed(range(L)):
        _backward(plan, tl, l)


def steady_fast(ctx: KernelContext, dataset_seconds: dict[int, np.ndarray]
                ) -> tuple[Steady, ComputeTables]:
    """The steady step of kernel.py on the fast timeline, and the compute it used.

    `dataset_seconds`: per layer reading the images, each device's read of the batch
    from the dataset.
    """
    plan = _plan(ctx, dataset_seconds)
    tl = FastTimeline(ctx.link_of(0), len(ctx.devices), ctx.store, ctx.overhead, ctx.sync)
    return steady(tl, lambda t: _step(plan, t)), plan.tables
