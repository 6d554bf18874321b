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
to ``K``.  Layers are visited last to first because a layer's backward reads
one partial per device active in the layer above.  The store's shared
bandwidth couples devices; as a guard the result is compared with the
proportional split under the full model and the better one is returned, so it
is never worse.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Sequence

from .devices import DeviceSpec, LinkSpec, StoreSpec
from .kernel import layer_cost, predict_kernel
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
    raw = [units * w / wsum for w in weights]
    base = [int(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - base[i]), -weights[i], i))
    for i in order[: units - sum(base)]:
        base[i] += 1
    counts = [b * quantum for b in base]
    if rest:
        counts[max(range(len(weights)), key=lambda i: weights[i])] += rest
    return counts


def split_kernels_proportional(
    network: Network, devices: Sequence[DeviceSpec], quantum: int | Sequence[int] = 1
) -> list[list[int]]:
    """Kernels of each layer in proportion to each device's rate for that layer.

    The rate is the calibrated one for the layer's name if the device has it,
    else its effective conv rate.  ``quantum``: one value or one per layer.
    """
    return [
        apportion(layer.out_channels, [d.rate("conv", layer.name or None) for d in devices],
                  layer_quantum(quantum, l))
        for l, layer in enumerate(network.conv)
    ]


def _greedy_layer(ctx: KernelContext, l: int, sources: int, quantum: int, min_units: int = 0) -> list[int]:
    """Min-max kernel counts of one layer, one quantum at a time.

    Every device first takes ``min_units`` quanta (as far as there are
    quanta); the rest go one at a time to whoever is least loaded after
    taking it.
    """
    K, P = ctx.network.conv[l].out_channels, len(ctx.devices)
    if K <= 0:
        return [0] * P
    units = [quantum] * (K // quantum) + ([K % quantum] if K % quantum else [])

    def t(d: int, k: int) -> float:
        return layer_cost(ctx, l, d, k, sources)

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
    L = len(network.conv)
    rows: list[list[int]] = [[] for _ in range(L)]
    for l in reversed(range(L)):
        sources = 1 if l == L - 1 else sum(1 for k in rows[l + 1] if k > 0)
        rows[l] = _greedy_layer(ctx, l, sources, layer_quantum(quantum, l), min_units)
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
