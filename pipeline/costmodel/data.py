"""Data-parallel and single-device steps (Castelló et al. §data parallelism).

Every device holds a replica and processes its share of the batch; after the
backward pass the weight gradients are summed with an allreduce whose
volume is the parameter count, independent of the batch.  With ``overlap``
each layer's gradients go as soon as every replica has them, on one
communication channel, while the backward pass goes on. Synchronised batch norm
(``Options.batch_norm``) adds a small allreduce per batch-norm layer, forward and
backward, at which the replicas wait for each other (`replica_pass`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from . import collectives
from .compute import FLATTEN_ACCESSES, LayerTime, conv_time, dense_time
from .devices import IDEAL_LINK, DeviceSpec, LinkSpec, StoreSpec, distinct
from .memory import MIB
from .batch_reads import shard_batch_read
from .network import Network
from .prediction import Options, Prediction, split_batch, taking_part

__all__ = ["GRADIENT_SUM", "gradient_sums", "layer_times", "replica_times", "measured_trunk", "whole_step", "unique_rows", "per_device_totals",
           "ReplicaPass", "replica_pass", "batch_norm_exchanges", "allreduce_schedule",
           "predict_single", "predict_data", "comm_link"]


#: Element accesses of summing one more consumer's gradient into a layer's output
#: gradient, as autograd accumulates it (read both, write).
GRADIENT_SUM = 3


def gradient_sums(network: Network) -> list[int]:
    """How many times each conv layer's output gradient is summed in the backward: once
    per consumer beyond the first (a layer reading the output, or adding it), as where a
    residual block's input feeds the block and its shortcut; 0 in a chain."""
    consumers = [0] * len(network.conv)
    for l, layer in enumerate(network.conv):
        if network.source(l) >= 0:
            consumers[network.source(l)] += 1
        if layer.residual is not None:
            consumers[layer.residual] += 1
    return [max(count - 1, 0) for count in consumers]


def layer_times(dev: DeviceSpec, network: Network, batch: float, dense: bool = True) -> list[LayerTime]:
    """Per-layer times of a whole replica, in forward order: each layer's backward
    starts with the sums of its output's gradients (`gradient_sums`)."""
    out = []
    for i, (c, sums) in enumerate(zip(network.conv, gradient_sums(network))):
        t = conv_time(dev, c, batch, input_grad=network.source(i) >= 0,
                      accesses=network.update_accesses())
        if sums:
            extra = dev.stream_time(GRADIENT_SUM * sums * c.output_elements(batch))
            t = LayerTime(t.forward, t.backward + extra, t.update, t.backward_input + extra)
        out.append(t)
    if dense:
        out += [dense_time(dev, [d], batch, input_grad=bool(network.conv) or i > 0,
                          dropout=(network.dense_dropout(i),),
                          accesses=network.update_accesses())
                for i, d in enumerate(network.dense)]
    return out


def replica_times(devices: Sequence[DeviceSpec], network: Network, shares: Sequence[float],
                  dense: bool = True, data_step: bool = False) -> list[list[LayerTime]]:
    """`layer_times` of every device at its share, timed once per distinct device and
    share: equal devices get the very same list, which `allreduce_schedule` and a
    thousand-device sweep then count once. ``data_step``: a ``data`` replica's, brought
    to its measured whole step where the device has one (`whole_step`)."""
    kinds, kind_of = distinct(devices)
    cache: dict[tuple[int, float], list[LayerTime]] = {}
    out = []
    for kind, share in zip(kind_of, shares):
        if (kind, share) not in cache:
            rows = layer_times(kinds[kind], network, share, dense)
            times = measured_trunk(kinds[kind], rows, len(network.conv), share)
            if data_step:
                times = whole_step(kinds[kind], times, network, share)
            cache[kind, share] = times
        out.append(cache[kind, share])
    return out


def measured_trunk(dev: DeviceSpec, times: list[LayerTime], convs: int, batch: float
                   ) -> list[LayerTime]:
    """A replica's per-layer ``times`` with its conv layers rescaled to the device's
    measured trunk (`TrunkTime`), where it has one: each conv layer keeps its share of
    the forward and of the backward as the layer tables give them; likewise its dense
    layers to the trunk's timing of the head on the replica's rows, where it has one."""
    if dev.trunk is None or batch <= 0 or not convs:
        return times
    conv = _rescaled(times[:convs], *dev.trunk.times(batch))
    dense, head = times[convs:], dev.trunk.dense_time(batch)
    if head is not None and dense:
        total = sum(t.forward + t.backward for t in dense)
        share = sum(t.forward for t in dense) / total if total > 0 else 0.5
        dense = _rescaled(dense, head * share, head * (1.0 - share))
    return conv + dense


def whole_step(dev: DeviceSpec, times: list[LayerTime], network: Network, batch: float
               ) -> list[LayerTime]:
    """A ``data`` replica's per-layer ``times`` (conv and dense) scaled alike so that
    they and the flattening of the dense gradients the store model adds
    (`replicas.flatten_time`: the trunk's is in its backward) come to the device's
    measured whole replica step (`TrunkTime.data_step`), where it has one: each layer
    keeps its share of the forward and of the backward, as `measured_trunk` gives them.
    Where the figure leaves nothing for the layers, ``times`` stand."""
    step = dev.trunk.data_step_time(batch) if dev.trunk is not None else None
    modelled = sum(t.forward + t.backward for t in times)
    if step is None or modelled <= 0:
        return times
    flatten = dev.stream_time(FLATTEN_ACCESSES * (network.params() - network.conv_params()))
    if step <= flatten:
        return times
    factor = (step - flatten) / modelled
    return [t.scaled(factor) for t in times]


def _rescaled(times: list[LayerTime], forward: float, backward: float) -> list[LayerTime]:
    """``times`` scaled to ``forward`` and ``backward`` seconds in all, each layer
    keeping its share of each (the first layer all of it where none has any)."""
    f_sum, b_sum = sum(t.forward for t in times), sum(t.backward for t in times)
    scaled = []
    for i, t in enumerate(times):
        f = t.forward / f_sum if f_sum > 0 else float(i == 0)
        b = t.backward / b_sum if b_sum > 0 else float(i == 0)
        first = t.backward_input / t.backward if t.backward > 0 else 0.0
        scaled.append(LayerTime(forward * f, backward * b, t.update, backward * b * first))
    return scaled


def comm_link(devices: Sequence[DeviceSpec], link: LinkSpec) -> LinkSpec:
    """The link a collective over ``devices`` runs at: the slowest one."""
    return LinkSpec.slowest([d.link or link for d in devices])


def batch_norm_exchanges(network: Network, p: int, link: LinkSpec, s: int,
                         batch_norm: str) -> list[float]:
    """Seconds of synchronised batch norm's exchange at each conv layer (0: none), the
    same forward and backward: an allreduce of two values per channel (forward: the
    sum and the sum of squares; backward: the sums of dy and of dy * x-hat), by the
    fastest algorithm for so short a vector. None under ``local`` or with one replica."""
    if batch_norm == "local" or p <= 1:
        return []
    return [collectives.fastest_allreduce(2 * c.out_channels * s, p, link) if c.batch_norm
            else 0.0 for c in network.conv]


@dataclass(frozen=True)
class ReplicaPass:
    """The replicas' forward and backward on their shares of the batch.

    Sync batch norm makes every replica wait for all at each batch-norm layer, forward
    and backward (its exchange), so the replicas then go in lockstep: each stretch
    between two exchanges ends with the slowest replica's.

    Attributes
    ----------
    devices : int
        Replicas.
    forward : float
        When the last replica ends its forward pass.
    ready : list of float
        When every replica has ended layer ``i``'s backward (its gradient complete).
    end : float
        When the last replica ends its backward pass.
    exchanges : float
        Seconds of batch norm's exchanges in ``end``.
    """

    devices: int
    forward: float
    ready: list[float]
    end: float
    exchanges: float = 0.0


def replica_pass(times: list[list[LayerTime]], norms: Sequence[float] = ()) -> ReplicaPass:
    """The pass of replicas timed ``times[d][i]`` (device ``d``, layer ``i`` in forward
    order), with batch norm's exchange of ``norms[i]`` seconds after layer ``i``'s
    forward and before its backward (`batch_norm_exchanges`; empty: no exchange)."""
    p, rows = len(times), unique_rows(times)
    n = len(rows[0]) if rows else 0
    if not any(norms):
        ready = [0.0] * n
        for row in rows:
            clock = sum(t.forward for t in row)
            for i in reversed(range(n)):
                clock += row[i].backward
                ready[i] = max(ready[i], clock)
        return ReplicaPass(p, max(sum(t.forward for t in row) for row in rows), ready,
                           max(sum(t.forward + t.backward for t in row) for row in rows))
    exchange = list(norms) + [0.0] * (n - len(norms))
    clocks = [0.0] * len(rows)
    for i in range(n):
        clocks = [c + row[i].forward for c, row in zip(clocks, rows)]
        if exchange[i]:
            clocks = [max(clocks) + exchange[i]] * len(rows)
    forward, ready = max(clocks), [0.0] * n
    for i in reversed(range(n)):
        if exchange[i]:
            clocks = [max(clocks) + exchange[i]] * len(rows)
        clocks = [c + row[i].backward for c, row in zip(clocks, rows)]
        ready[i] = max(clocks)
    return ReplicaPass(p, forward, ready, max(clocks), 2 * sum(exchange))


def allreduce_schedule(
    replicas: ReplicaPass,
    grad_bytes: list[float],
    link: LinkSpec,
    algorithm: str,
    overlap: bool,
    bucket_bytes: float = 0.0,
) -> float:
    """End of forward+backward+allreduce.

    Parameters
    ----------
    replicas : ReplicaPass
        The replicas' forward and backward (`replica_pass`).
    grad_bytes : list of float
        Gradient bytes of each layer.
    link : LinkSpec
        Link of the collective.
    algorithm : str
        Allreduce algorithm.
    overlap : bool
        ``False``: one allreduce of all gradients after the backward pass.
        ``True``: one per bucket, started when all replicas finished the backward
        of the bucket's layers, one at a time.
    bucket_bytes : float
        With ``overlap``: the layers' gradients, last layer first, fill buckets of
        at least this many bytes, as PyTorch DDP's ``bucket_cap_mb`` does, so that
        the collective's latency is paid per bucket rather than per layer (at
        thousands of devices a ring's ``2 (p - 1)`` latencies a layer dominate);
        0: one bucket per layer.

    Returns
    -------
    float
        Seconds until the last gradient is summed.
    """
    p = replicas.devices
    if not overlap:
        return replicas.end + collectives.allreduce(sum(grad_bytes), p, link, algorithm)
    channel, bucket = 0.0, 0.0
    for i in reversed(range(len(grad_bytes))):
        bucket += grad_bytes[i]
        if bucket >= bucket_bytes or i == 0:  # full, or the last layer's backward is done
            channel = (max(channel, replicas.ready[i])
                       + collectives.allreduce(bucket, p, link, algorithm))
            bucket = 0.0
    return max(channel, replicas.end)


def unique_rows(times: list[list[LayerTime]]) -> list[list[LayerTime]]:
    """The distinct replicas' rows (`replica_times` gives equal replicas one list):
    maxima over replicas need each once."""
    return list({id(row): row for row in times}.values())


def per_device_totals(times: list[list[LayerTime]]) -> list[float]:
    """Each replica's forward + backward + update, summed once per distinct row."""
    totals: dict[int, float] = {}
    for row in times:
        if id(row) not in totals:
            totals[id(row)] = sum(t.total for t in row)
    return [totals[id(row)] for row in times]


def predict_single(
    network: Network, batch: int, device: DeviceSpec, dataset: StoreSpec | None = None
) -> Prediction:
    """Whole network on one device: compute, plus reading the batch from ``dataset``."""
    t = sum(layer_times(device, network, batch), LayerTime())
    compute = t.total
    conv = sum(layer_times(device, network, batch, dense=False), LayerTime()).total
    storage = 0.0
    if network.conv:  # as a holder of every kernel of the first layer reads it
        storage = shard_batch_read(device, device.link or IDEAL_LINK, dataset, network, batch,
                                   network.conv[0].out_channels)
    breakdown = {
        "compute": [compute], "compute_max": compute, "compute_critical": conv,
        "communication": 0.0, "storage": storage, "master": compute - conv, "overhead": 0.0,
    }
    return Prediction("single", compute + storage, batch, breakdown)


def predict_data(
    network: Network, batch: int, devices: Sequence[DeviceSpec], link: LinkSpec, options: Options
) -> Prediction:
    """Data parallel: per-device batch, allreduce of every weight gradient."""
    weights = [1.0] * len(devices) if options.batch_split == "equal" else [d.rate("conv") for d in devices]
    every = split_batch(batch, weights)
    devices, shares = taking_part(devices, every)
    times = replica_times(devices, network, shares)
    s = devices[0].bytes_per_elem
    grads = [c.params() * s for c in network.conv] + [d.params() * s for d in network.dense]
    lk = comm_link(devices, link)
    replicas = replica_pass(times, batch_norm_exchanges(network, len(devices), lk, s,
                                                        options.batch_norm))
    end = allreduce_schedule(replicas, grads, lk, options.allreduce, options.overlap,
                             options.bucket_mb * MIB)
    compute = replicas.end - replicas.exchanges
    update = max(sum(t.update for t in row) for row in unique_rows(times))
    per_dev = per_device_totals(times)
    breakdown = {
        "compute": per_dev, "compute_max": max(per_dev), "compute_critical": compute + update,
        "communication": end - compute, "storage": 0.0, "master": 0.0, "overhead": 0.0,
    }
    return Prediction(
        "data", end + update, batch, breakdown,
        details={"batch_shares": every, "allreduce_bytes": sum(grads),
                 "batch_norm_exchanges": replicas.exchanges},
    )
