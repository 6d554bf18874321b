"""kernel.py's step on the fast timeline: each phase of the step for all devices at once.

The ops and their order are kernel.py's (`_simulate_step`); this module only groups
them by phase (a layer's forward, the dense head, a layer's backward) so that
timeline_fast.py can run a phase's reads and writes as arrays. It is used where every
device has the same link (the read and write seconds are then sums of a part per
reader and a part per source, which the fast timeline needs); otherwise kernel.py
runs its op-by-op simulation. Compute times are taken once per distinct device and
kernel count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .compute import LayerTime, conv_time, dense_time
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


def _layer_times(ctx: KernelContext, l: int, kind_of: list[int],
                 kinds: list[DeviceSpec]) -> list[LayerTime]:
    """`conv_time` of every device's shard of layer `l`, once per (device kind, count)."""
    cache: dict[tuple[int, int], LayerTime] = {}
    out = []
    for d, k in enumerate(ctx.counts[l]):
        key = (kind_of[d], k)
        if key not in cache:
            cache[key] = conv_time(kinds[kind_of[d]], ctx.network.conv[l], ctx.batch, k,
                                   input_grad=l > 0)
        out.append(cache[key])
    return out


def _summing(ctx: KernelContext, l: int, parts: int, kind_of: list[int],
             kinds: list[DeviceSpec]) -> np.ndarray:
    """Seconds each device spends summing the partial gradients it read for layer `l`."""
    if parts <= 1:
        return np.zeros(len(ctx.devices))
    layer = ctx.network.conv[l]
    return np.array([kinds[kind_of[d]].stream_time(parts * layer.output_elements(ctx.batch, k))
                     for d, k in enumerate(ctx.counts[l])])


def compute_tables(ctx: KernelContext) -> ComputeTables:
    """Every device's compute per layer, as kernel.py's ops use it."""
    kinds, kind_of = distinct(ctx.devices)
    L = len(ctx.network.conv)
    forward, first, rest = [], [], []
    per_device = np.zeros(len(ctx.devices))
    for l in range(L):
        times = _layer_times(ctx, l, kind_of, kinds)
        parts = 1 if l == L - 1 else sum(1 for k in ctx.counts[l + 1] if k > 0)
        forward.append(np.array([t.forward for t in times]))
        first.append(_summing(ctx, l, parts, kind_of, kinds)
                     + np.array([t.backward_input for t in times]))
        rest.append(np.array([t.backward - t.backward_input + t.update for t in times]))
        per_device = per_device + np.array([t.total for t in times])
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
    dataset_seconds: np.ndarray  # per device: its read of the batch (layer 1's holders)
    holders: list[np.ndarray]
    slice_bytes: list[np.ndarray]  # per layer, per device: bytes of its pooled output
    active: np.ndarray
    head: float
    act_ready: list[np.ndarray]  # per layer, per device: when its output slot is written
    partials: dict[int, InTurn]  # per layer: the partial gradients its holders handed down
    grad_ready: np.ndarray  # per device: when the master wrote its gradient slice


def _plan(ctx: KernelContext, dataset_seconds: np.ndarray) -> _Plan:
    counts = np.array(ctx.counts, dtype=np.int64).reshape(len(ctx.network.conv), -1)
    P = len(ctx.devices)
    slice_bytes = [(counts[l] * (ctx.batch * layer.out_hw[0] * layer.out_hw[1] * ctx.s))
                   .astype(float) for l, layer in enumerate(ctx.network.conv)]
    active = np.flatnonzero((counts > 0).any(axis=0) | (np.arange(P) == ctx.master))
    head = dense_time(ctx.devices[ctx.master], ctx.network.dense, ctx.batch,
                      dropout=ctx.network.dropout).total
    return _Plan(ctx, compute_tables(ctx), dataset_seconds,
                 [np.flatnonzero(row > 0) for row in counts], slice_bytes, active, head,
                 [np.zeros(P) for _ in counts], {}, np.zeros(P))


def _forward(plan: _Plan, tl: FastTimeline, l: int) -> None:
    """Layer `l`'s forward on its holders: gather the input, compute, write the output."""
    ctx, H = plan.ctx, plan.holders[l]
    L = len(plan.holders)
    if l == 0:
        if ctx.dataset is not None:
            tl.run(H, "io", plan.dataset_seconds[H])
    else:
        below = plan.holders[l - 1]
        tl.read(H, Sources(below, plan.act_ready[l - 1][below], plan.slice_bytes[l - 1][below]),
                len(H), np.zeros(len(H)), np.zeros(len(H)))
    tl.run(H, "compute", plan.tables.forward[l][H])
    if l < L - 1:
        above = plan.holders[l + 1]
        read = len(above) - np.isin(H, above) > 0
    else:
        read = H != ctx.master
    writers = H[read]
    plan.act_ready[l][writers] = tl.write_each(writers, plan.slice_bytes[l][writers], len(H))


def _head(plan: _Plan, tl: FastTimeline) -> None:
    """The master gathers the last layer, runs the dense head, hands out gradient slices."""
    m = plan.ctx.master
    last = plan.holders[-1]
    master = np.array([m])
    tl.read(master, Sources(last, plan.act_ready[-1][last], plan.slice_bytes[-1][last]), 1,
            np.zeros(1), np.zeros(1))
    tl.run(master, "master", plan.head)
    targets = last[last != m]
    if len(targets):
        n_bytes = plan.slice_bytes[-1][targets]
        seconds = tl.io("write", n_bytes, 1)
        plan.grad_ready[targets] = tl.clock[m] + np.cumsum(seconds)
        tl.run(master, "io", seconds.sum())
        tl.moved += float(n_bytes.sum())


def _backward_reads(plan: _Plan, tl: FastTimeline, l: int) -> None:
    """Layer `l`'s holders read their gradient: the master's slice, or every other
    upper holder's partial (written in turn, in device order)."""
    H, m = plan.holders[l], plan.ctx.master
    if l == len(plan.holders) - 1:
        readers = H[H != m]
        tl.read_own(readers, m, plan.grad_ready[readers], plan.slice_bytes[l][readers], len(H))
        return
    tl.read_in_turn(H, plan.partials[l + 1], plan.slice_bytes[l][H], len(H))


def _backward(plan: _Plan, tl: FastTimeline, l: int) -> None:
    """Layer `l`'s backward on its holders: read, input gradient, hand partials down,
    weight gradient and update."""
    H = plan.holders[l]
    _backward_reads(plan, tl, l)
    tl.run(H, "compute", plan.tables.backward_first[l][H])
    if l > 0:
        below = plan.holders[l - 1]
        plan.partials[l] = tl.write_in_turn(H, below, plan.slice_bytes[l - 1][below], len(H))
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


def steady_fast(ctx: KernelContext, dataset_seconds: np.ndarray
                ) -> tuple[Steady, ComputeTables]:
    """The steady step of kernel.py on the fast timeline, and the compute it used.

    `dataset_seconds`: each device's read of the batch from the dataset (layer 1's
    holders read it).
    """
    plan = _plan(ctx, dataset_seconds)
    tl = FastTimeline(ctx.link_of(0), len(ctx.devices), ctx.store, ctx.overhead, ctx.sync)
    return steady(tl, lambda t: _step(plan, t)), plan.tables
