"""Data-parallel and single-device steps (Castelló et al. §data parallelism).

Every device holds a replica and processes its share of the batch; after the
backward pass the weight gradients are summed with an allreduce whose
volume is the parameter count, independent of the batch.  With ``overlap``
each layer's gradients go as soon as every replica has them, on one
communication channel, while the backward pass goes on.
"""

from __future__ import annotations

from typing import Sequence

from . import collectives
from .compute import LayerTime, conv_time, dense_time
from .devices import IDEAL_LINK, DeviceSpec, LinkSpec, StoreSpec, distinct
from .batch_reads import shard_batch_read
from .network import Network
from .prediction import Options, Prediction, split_batch

__all__ = ["layer_times", "replica_times", "measured_trunk", "unique_rows", "per_device_totals",
           "allreduce_schedule", "predict_single", "predict_data", "comm_link"]


def layer_times(dev: DeviceSpec, network: Network, batch: float, dense: bool = True) -> list[LayerTime]:
    """Per-layer times of a whole replica, in forward order."""
    out = [conv_time(dev, c, batch, input_grad=network.source(i) >= 0)
           for i, c in enumerate(network.conv)]
    if dense:
        out += [dense_time(dev, [d], batch, input_grad=bool(network.conv) or i > 0,
                          dropout=(network.dense_dropout(i),))
                for i, d in enumerate(network.dense)]
    return out


def replica_times(devices: Sequence[DeviceSpec], network: Network, shares: Sequence[float],
                  dense: bool = True) -> list[list[LayerTime]]:
    """`layer_times` of every device at its share, timed once per distinct device and
    share: equal devices get the very same list, which `allreduce_schedule` and a
    thousand-device sweep then count once."""
    kinds, kind_of = distinct(devices)
    cache: dict[tuple[int, float], list[LayerTime]] = {}
    out = []
    for kind, share in zip(kind_of, shares):
        if (kind, share) not in cache:
            rows = layer_times(kinds[kind], network, share, dense)
            cache[kind, share] = measured_trunk(kinds[kind], rows, len(network.conv), share)
        out.append(cache[kind, share])
    return out


def measured_trunk(dev: DeviceSpec, times: list[LayerTime], convs: int, batch: float
                   ) -> list[LayerTime]:
    """A replica's per-layer ``times`` with its conv layers rescaled to the device's
    measured trunk (`TrunkTime`), where it has one: each conv layer keeps its share of
    the forward and of the backward as the layer tables give them."""
    if dev.trunk is None or batch <= 0 or not convs:
        return times
    forward, backward = dev.trunk.times(batch)
    conv = times[:convs]
    f_sum, b_sum = sum(t.forward for t in conv), sum(t.backward for t in conv)
    scaled = []
    for i, t in enumerate(conv):
        f = t.forward / f_sum if f_sum > 0 else float(i == 0)
        b = t.backward / b_sum if b_sum > 0 else float(i == 0)
        first = t.backward_input / t.backward if t.backward > 0 else 0.0
        scaled.append(LayerTime(forward * f, backward * b, t.update, backward * b * first))
    return scaled + times[convs:]


def comm_link(devices: Sequence[DeviceSpec], link: LinkSpec) -> LinkSpec:
    """The link a collective over ``devices`` runs at: the slowest one."""
    return LinkSpec.slowest([d.link or link for d in devices])


def allreduce_schedule(
    times: list[list[LayerTime]],
    grad_bytes: list[float],
    link: LinkSpec,
    algorithm: str,
    overlap: bool,
) -> tuple[float, float]:
    """End of forward+backward+allreduce, and the compute part of it.

    Parameters
    ----------
    times : list of list of LayerTime
        ``times[d][i]``: device ``d``, layer ``i`` in forward order.
    grad_bytes : list of float
        Gradient bytes of each layer.
    link : LinkSpec
        Link of the collective.
    algorithm : str
        Allreduce algorithm.
    overlap : bool
        ``False``: one allreduce of all gradients after the backward pass.
        ``True``: one per layer, started when all replicas finished that
        layer's backward, one at a time.

    Returns
    -------
    end, compute : float
        Seconds until the last gradient is summed; slowest replica's
        forward + backward.
    """
    p = len(times)
    times = unique_rows(times)
    compute = max(sum(t.forward + t.backward for t in row) for row in times)
    if not overlap:
        return compute + collectives.allreduce(sum(grad_bytes), p, link, algorithm), compute
    n = len(grad_bytes)
    ready = [0.0] * n
    for row in times:
        clock = sum(t.forward for t in row)
        for i in reversed(range(n)):
            clock += row[i].backward
            ready[i] = max(ready[i], clock)
    channel = 0.0
    for i in reversed(range(n)):
        channel = max(channel, ready[i]) + collectives.allreduce(grad_bytes[i], p, link, algorithm)
    return max(channel, compute), compute


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
    shares = split_batch(batch, weights)
    times = replica_times(devices, network, shares)
    s = devices[0].bytes_per_elem
    grads = [c.params() * s for c in network.conv] + [d.params() * s for d in network.dense]
    lk = comm_link(devices, link)
    end, compute = allreduce_schedule(times, grads, lk, options.allreduce, options.overlap)
    update = max(sum(t.update for t in row) for row in unique_rows(times))
    per_dev = per_device_totals(times)
    breakdown = {
        "compute": per_dev, "compute_max": max(per_dev), "compute_critical": compute + update,
        "communication": end - compute, "storage": 0.0, "master": 0.0, "overhead": 0.0,
    }
    return Prediction(
        "data", end + update, batch, breakdown,
        details={"batch_shares": shares, "allreduce_bytes": sum(grads)},
    )
