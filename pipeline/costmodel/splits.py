"""Sharing out the kernels of each conv layer over unequal devices.

``split_kernels_proportional`` follows Marques et al.: kernels in proportion
to each device's speed for that layer.  It ignores that every active device
pays for reading the other shards' part of the layer input and for writing
their part of its partial gradient, so a fast device behind a slow link gets
too much.

``split_kernels_minmax`` minimises the slowest device's predicted time of each
layer, traffic included.  Per layer, device ``d``'s forward + backward time
``t_d(k)`` is non-decreasing in its kernel count ``k`` (and zero at ``k = 0``:
an idle device has no task).  Handing out kernels one quantum at a time, each
to the device whose time after taking it is least, is optimal for
``min max_d t_d(k_d)`` subject to ``sum_d k_d = K`` with non-decreasing
``t_d``: if some pick exceeded the optimum ``T*``, every device would already
hold at least what it can take within ``T*``, and those counts already sum
to ``K``.  Layers a residual sum ties (`Network.tied_groups`) get one row:
a group is split as one layer whose cost is the sum of its layers' (both
splits).  Groups are visited last first because a layer's backward reads one
partial per device active in each layer reading it (in a residual network a
reader's group may come later in that order: it counts as many devices as
could hold a quantum each).  The store's shared
bandwidth couples devices; as a guard the result is compared with the
proportional split under the full model and the better one is returned, so it
is never worse.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Sequence

import numpy as np

from .devices import DeviceSpec, LinkSpec, StoreSpec, distinct
from .kernel import group_cost, predict_kernel
from .kernel_context import KernelContext
from .network import Network
from .prediction import Options, layer_quantum

__all__ = ["apportion", "split_kernels_proportional", "split_kernels_minmax"]


def apportion(total: int, weights: Sequence[float], quantum: int = 1) -> list[int]:
    """Split ``total`` in proportion to ``weights`` in multiples of ``quantum``.

    Largest-remainder rounding on whole quanta; if ``total`` is not a
    multiple of ``quantum`` the leftover goes to the heaviest device.  The
    counts always sum to ``total``.
    """
    units, rest = divmod(total, quantum)
    wsum = float(sum(weights))
    w = np.asarray(weights, dtype=float)
    raw = units * w / wsum
    base = raw.astype(np.int64)  # the whole quanta, rounded down (raw >= 0)
    # largest remainder first, then the heavier device, then the lower index
    order = np.lexsort((np.arange(len(w)), -w, -(raw - base)))
    base[order[: units - int(base.sum())]] += 1
    counts = base * quantum
    if rest:
        counts[int(np.argmax(w))] += rest
    return counts.tolist()


def split_kernels_proportional(
    network: Network, devices: Sequence[DeviceSpec], quantum: int | Sequence[int] = 1
) -> list[list[int]]:
    """Kernels of each layer in proportion to each device's rate for that layer.

    The rate is the calibrated one for the layer's name if the device has it,
    else its effective conv rate.  ``quantum``: one value or one per layer (a tied
    group takes its first layer's).  Layers a residual sum ties share one row, in
    proportion to each device's speed over the whole group (`_group_rates`).
    """
    kinds, kind_of = distinct(devices)
    rows: list[list[int]] = [[] for _ in network.conv]
    for group in network.tied_groups():
        rates = _group_rates(network, group, kinds)
        row = apportion(network.conv[group[0]].out_channels, [rates[k] for k in kind_of],
                        layer_quantum(quantum, group[0]))
        for l in group:
            rows[l] = list(row)
    return rows


def _group_rates(network: Network, group: Sequence[int],
                 devices: Sequence[DeviceSpec]) -> list[float]:
    """Each device's speed on a tied group: its rate for a layer alone; for several,
    the inverse of its seconds per sample over the group's forward work (its layers
    hold the same kernels on a device)."""
    if len(group) == 1:
        layer = network.conv[group[0]]
        return [d.rate("conv", layer.name or None) for d in devices]
    layers = [network.conv[l] for l in group]
    work = [layer.macs() for layer in layers]
    return [1.0 / sum(w / d.rate("conv", layer.name or None) for w, layer in zip(work, layers))
            for d in devices]


def _gradient_sources(network: Network, rows: Sequence[Sequence[int]], l: int,
                      devices: int, quantum: int | Sequence[int]) -> int:
    """Devices handing layer ``l``'s backward a gradient part: the holders of each layer
    reading it (where its split is not chosen yet, as many as could hold a quantum
    each), and the master for the last layer."""
    total = int(l == len(network.conv) - 1)
    for r in network.readers(l):
        if rows[r]:
            total += sum(1 for k in rows[r] if k > 0)
        else:
            q = layer_quantum(quantum, r)
            total += min(devices, -(-network.conv[r].out_channels // q))
    return total


def _greedy_group(ctx: KernelContext, group: Sequence[int], sources: Sequence[int],
                  quantum: int, min_units: int = 0) -> list[int]:
    """Min-max kernel counts of one tied group (one layer in a chain), one quantum at a
    time, on the group's summed cost (`group_cost`).

    Every device first takes ``min_units`` quanta (as far as there are
    quanta); the rest go one at a time to whoever is least loaded after
    taking it.
    """
    K, P = ctx.network.conv[group[0]].out_channels, len(ctx.devices)
    if K <= 0:
        return [0] * P
    units = [quantum] * (K // quantum) + ([K % quantum] if K % quantum else [])

    def t(d: int, k: int) -> float:
        return group_cost(ctx, group, d, k, sources)

    counts = [0] * P
    start = 0
    for _ in range(min_units):
        for d in range(P):
            if start < len(units) and units[start] == units[0]:
                counts[d] += units[start]
                start += 1
    rest = units[start:]
    if not rest:
        return counts
    # heap of (time after taking the next unit, device)
    heap = [(t(d, counts[d] + rest[0]), d) for d in range(P)]
    heapq.heapify(heap)
    for i, u in enumerate(rest):
        if u != rest[0]:  # the short remainder: re-score everyone
            heap = [(t(d, counts[d] + u), d) for d in range(P)]
            heapq.heapify(heap)
        _, d = heapq.heappop(heap)
        counts[d] += u
        if i + 1 < len(rest) and rest[i + 1] == rest[0]:
            heapq.heappush(heap, (t(d, counts[d] + rest[0]), d))
    return counts


def split_kernels_minmax(
    network: Network,
    batch: int,
    devices: Sequence[DeviceSpec],
    link: LinkSpec = LinkSpec(),
    store: StoreSpec | None = None,
    quantum: int | Sequence[int] = 1,
    options: Options | None = None,
    min_units: int = 0,
) -> list[list[int]]:
    """Counts minimising each layer's slowest-device time, traffic included.

    Parameters
    ----------
    network, batch, devices, link, store
        As for :func:`~pipeline.costmodel.strategies.predict`.
    quantum : int or sequence of int
        Counts are multiples of this (except one leftover below it); one
        value or one per layer.
    options : Options, optional
        Used for the final comparison with the proportional split, and for
        the dataset store the first layer reads from.
    min_units : int
        Quanta every device must hold (an engine that runs a task per device
        and layer needs one; the proportional guard is then skipped where it
        breaks this).

    Returns
    -------
    list of list of int
        ``k[l][d]``, each row summing to the layer's kernels.
    """
    devs = tuple(devices)
    opts = options or Options()
    ctx = KernelContext(network, batch, devs, link, store, (), opts.master, opts.dataset)
    rows: list[list[int]] = [[] for _ in network.conv]
    for group in sorted(network.tied_groups(), key=lambda g: g[0], reverse=True):
        sources = [_gradient_sources(network, rows, l, len(devs), quantum) for l in group]
        row = _greedy_group(ctx, group, sources, layer_quantum(quantum, group[0]), min_units)
        for l in group:
            rows[l] = list(row)
    prop = split_kernels_proportional(network, devs, quantum)
    if min_units and any(
        k < min_units * min(layer_quantum(quantum, l), layer.out_channels)
        for l, (layer, row) in enumerate(zip(network.conv, prop)) for k in row
    ):
        return rows
    opts = dataclasses.replace(opts, quantum=quantum)
    t_g = predict_kernel(network, batch, devs, link, store, opts, rows).step_time
    t_p = predict_kernel(network, batch, devs, link, store, opts, prop).step_time
    return rows if t_g <= t_p else prop
