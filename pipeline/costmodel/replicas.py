"""Data-parallel and hybrid steps as the engine runs them, through a shared store.

The link-based models (data.py, hybrid.py) price MPI-style collectives over links;
this one follows the engine's own ops and slots (tasks/replica_layout.py) on a
timeline per device (timeline.py), when a store is given:

- ``data``: each device trains its replica on its share of the batch (dataset read,
  forward, backward), writes every other device's range of its flat gradient, reads
  and sums its own range from every other device, writes that sum, reads every other
  sum, and updates the whole replica (on one link for all, computed for all devices
  at once: timeline_fast.py);
- ``hybrid``: each device runs the conv layers on its share and writes its rows of
  the last conv features for every part they belong to; per part (scheme a, b, c)
  and dense layer, its neurons' forward from the gathered input, then the backward
  from the gathered logits or the reduced gradient of its outputs, handing its
  partial input gradient on to the rows' or neurons' owners; then the conv layers'
  backward and the conv gradients' reduce-scatter and all-gather as ``data``
  (a phase of all devices at a time where timeline_fast.py applies; through the
  scheduler, scheme c keeps the op-by-op simulation: a device's final reads from
  several parts wait for one hop in all).

The breakdown: ``compute_critical`` (conv and replica compute), ``master`` (the dense
layers' compute, hybrid), ``storage`` (workspace and dataset I/O), ``overhead``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .compute import (FLATTEN_ACCESSES, GATHER_ACCESSES, LayerTime, dense_slice_time,
                      hybrid_head_factor)
from .data import per_device_totals, replica_times
from .devices import DaskOverhead, DeviceSpec, LinkSpec, StoreSpec, spreads, uneven
from .batch_reads import replica_batch_read
from .network import Network
from .replica_exchanges import (Stretches, even_counts, exchange_ops, exchange_phases, hand_on,
                                norm_slots, reduce_ops, reduce_phases, stretches)
from .prediction import Options, Prediction, split_batch, taking_part
from .timeline import Timeline, steady
from .timeline_fast import FastTimeline, InTurn, Sources

__all__ = ["predict_data_store", "predict_hybrid_store", "hybrid_parts", "even_counts"]


def hybrid_parts(shares: Sequence[int], scheme: str) -> list[list[tuple[int, int]]]:
    """The parts the dense layers run on: ``(device, rows)`` pieces, in device order
    (as tasks.replica_layout.HybridLayout.parts, without the row offsets)."""
    owners = [d for d, b in enumerate(shares) if b > 0]
    if scheme == "a":
        return [[(d, shares[d]) for d in owners]]
    if scheme == "b":
        return [[(d, shares[d])] for d in owners]
    p = len(shares)
    parts = []
    for k in range(p):
        piece = [(d, math.floor((k + 1) * shares[d] / p) - math.floor(k * shares[d] / p))
                 for d in owners]
        piece = [(d, n) for d, n in piece if n > 0]
        if piece:
            parts.append(piece)
    return parts


def flatten_time(dev: DeviceSpec, conv_params: float, dense_params: float = 0.0) -> float:
    """Seconds of copying a replica's gradients out into the flat ranges it hands on:
    the conv trunk's only where no measured trunk holds them already (the probe times
    a trunk's backward with its flattening, tasks/hybrid_ops.py)."""
    conv = conv_params if dev.trunk is None else 0.0
    return dev.stream_time(FLATTEN_ACCESSES * (conv + dense_params))


def _shares(batch: int, devices: Sequence[DeviceSpec], options: Options) -> list[int]:
    if options.batch_shares is not None:
        shares = [int(b) for b in options.batch_shares]
        if len(shares) != len(devices) or sum(shares) != batch or min(shares) < 0:
            raise ValueError(f"batch shares {shares} do not split {batch} over {len(devices)}")
        return shares
    weights = ([1.0] * len(devices) if options.batch_split == "equal"
               else [d.rate("conv") for d in devices])
    return split_batch(batch, weights)


def _finish(strategy: str, batch: int, result, per_device: list[float], store: StoreSpec | None,
            details: dict) -> Prediction:
    path = result.path
    breakdown = {"compute": per_device, "compute_max": max(per_device),
                 "compute_critical": path["compute"], "master": path["master"],
                 "communication": 0.0 if store is not None else path["io"],
                 "storage": path["io"] if store is not None else 0.0,
                 "overhead": path["overhead"]}
    return Prediction(strategy, result.step, batch, breakdown,
                      details={**details, "bytes_moved": result.moved})


def predict_data_store(network: Network, batch: int, devices: Sequence[DeviceSpec],
                       link: LinkSpec, store: StoreSpec, options: Options) -> Prediction:
    """``data`` through the store, as the engine runs it (see the module doc); a
    device given no sample leaves the run (`taking_part`)."""
    every = _shares(batch, devices, options)
    devices, shares = taking_part(devices, every)
    p = len(devices)
    params = network.params()
    times = replica_times(devices, network, shares, data_step=True)
    cut = stretches(times, *norm_slots(network, p, devices[0].bytes_per_elem,
                                       options.batch_norm))
    update = {d: dev.update_time((GATHER_ACCESSES + network.update_accesses()) * params)
              for d, dev in enumerate(devices)}
    stream = {d: dev.stream_time(1.0) for d, dev in enumerate(devices)}
    overhead = options.overhead or DaskOverhead()
    links = [dev.link or link for dev in devices]
    step = (_data_step_fast if options.timeline != "reference" and len(set(links)) == 1
            and not uneven(devices, store) else _data_step)  # the fast one keeps no variances
    timeline = (FastTimeline(links[0], p, store, overhead, options.sync) if step is _data_step_fast
                else Timeline(links, store, overhead, options.sync, spreads(devices)))
    result = steady(timeline, lambda tl: step(tl, network, devices, shares, cut, params,
                                              update, stream, options.dataset))
    per_device = per_device_totals(times)
    return _finish("data", batch, result, per_device, store, {"batch_shares": every})


def _data_step(tl: Timeline, network: Network, devices: Sequence[DeviceSpec],
               shares: list[int], cut: Stretches, params: int,
               update: dict[int, float], stream: dict[int, float],
               dataset: StoreSpec | None) -> None:
    """`predict_data_store`'s step op by op: each device's replica (batch norm's
    exchanges in it) and hand-on of its ranges, then the reduce-scatter and all-gather
    (the reference of `_data_step_fast`)."""
    p, s = len(devices), devices[0].bytes_per_elem
    conv = network.conv_params()
    for d, (dev, b) in enumerate(zip(devices, shares)):
        tl.run(d, "overhead", tl.overhead.task)
        if dataset is not None and b:
            tl.run(d, "io", replica_batch_read(dev, tl.links[d], dataset, network, b))
    exchange_ops(tl, cut)
    for d, dev in enumerate(devices):
        tl.run(d, "compute", float(cut.last[d]) + flatten_time(dev, conv, params - conv))
        hand_on(tl, d, p, params, s, "grads")
    reduce_ops(tl, p, params, s, update, stream, "grads")


def _data_step_fast(tl: FastTimeline, network: Network, devices: Sequence[DeviceSpec],
                    shares: list[int], cut: Stretches, params: int,
                    update: dict[int, float], stream: dict[int, float],
                    dataset: StoreSpec | None) -> None:
    """`predict_data_store`'s step for all devices at once (timeline_fast.py): the
    replicas, the hand-on of every range in turn, the reduce-scatter and all-gather."""
    p, s = len(devices), devices[0].bytes_per_elem
    everyone = np.arange(p)
    tl.run(everyone, "overhead", tl.overhead.task)
    if dataset is not None:
        reading = np.array([d for d, b in enumerate(shares) if b])
        tl.run(reading, "io", np.array([replica_batch_read(devices[d], tl.link, dataset, network,
                                                           shares[d]) for d in reading]))
    exchange_phases(tl, cut)
    conv = network.conv_params()
    tl.run(everyone, "compute", cut.last + np.array([flatten_time(dev, conv, params - conv)
                                                     for dev in devices]))
    reduce_phases(tl, params, s, update, stream)


def predict_hybrid_store(network: Network, batch: int, devices: Sequence[DeviceSpec],
                         link: LinkSpec, store: StoreSpec, options: Options) -> Prediction:
    """``hybrid`` through the store, as the engine runs it (see the module doc); a
    device given no sample leaves the run (`taking_part`): no trunk, no dense slice."""
    every = _shares(batch, devices, options)
    devices, shares = taking_part(devices, every)
    h = _hybrid_setup(network, devices, shares, _kept_split(options.dense_split, len(devices)),
                      options)
    p = len(devices)
    overhead = options.overhead or DaskOverhead()
    links = [dev.link or link for dev in devices]
    if _hybrid_fast_applies(links, h.parts, options) and not uneven(devices, store):
        result = steady(FastTimeline(links[0], p, store, overhead, options.sync),
                        lambda tl: _hybrid_step_fast(tl, h))
    else:
        result = steady(Timeline(links, store, overhead, options.sync, spreads(devices)),
                        lambda tl: _hybrid_step(tl, h))
    per_device = [h.trunk[d].total + sum(h.dense_seconds(d, j, batch, kind)
                                         for j in range(len(network.dense))
                                         for kind in ("forward", "backward"))
                  for d in range(p)]
    return _finish("hybrid", batch, result, per_device, store,
                   {"batch_shares": every, "dense_split": [list(r) for r in h.split],
                    "parts": len(h.parts)})


def _hybrid_fast_applies(links: list[LinkSpec], parts: list[list[tuple[int, int]]],
                         options: Options) -> bool:
    """Whether `_hybrid_step_fast` gives `predict_hybrid_store`'s step: one link for all,
    and through the scheduler (one hop before a device's final reads, whatever parts
    they come from) each device in one part at most."""
    if options.timeline == "reference" or len(set(links)) != 1:
        return False
    members = [e for part in parts for e, _ in part]
    return options.sync != "scheduler" or len(members) == len(set(members))


@dataclass
class _HybridSetup:
    """`predict_hybrid_store`'s setup, as `_hybrid_step` and `_hybrid_step_fast` use it."""

    network: Network
    devices: Sequence[DeviceSpec]
    shares: list[int]
    parts: list[list[tuple[int, int]]]
    s: int
    conv_params: int
    trunk: list[LayerTime]
    forward: Stretches  # the trunk's forward, cut at batch norm's exchanges
    backward: Stretches  # and its backward
    update: dict[int, float]
    stream: dict[int, float]
    dataset: StoreSpec | None
    dense_batch: str
    split: Sequence[Sequence[int]]
    head_factor: dict[int, float]  # `hybrid_head_factor` per device
    _dense: dict[tuple[int, int, str], np.ndarray] = field(default_factory=dict)

    def dense_seconds(self, d: int, j: int, rows: int, kind: str) -> float:
        """Device `d`'s seconds of its slice of dense layer `j` on `rows` samples."""
        layer = self.network.dense[j]
        times = dense_slice_time(self.devices[d], self.network, j, rows,  # the part's rows
                                 self.split[j][d] / layer.out_features).scaled(self.head_factor[d])
        if kind == "forward":
            return times.forward
        return times.backward + (times.update if self.dense_batch == "worker" else 0.0)

    def dense(self, j: int, rows: int, kind: str) -> np.ndarray:
        """Every device's seconds of dense layer `j` on `rows` samples (once per part size)."""
        if (j, rows, kind) not in self._dense:
            self._dense[j, rows, kind] = np.array([self.dense_seconds(d, j, rows, kind)
                                                   for d in range(len(self.devices))])
        return self._dense[j, rows, kind]

    def out_bytes(self, j: int, rows: int) -> np.ndarray:
        """Bytes of each device's outputs of dense layer `j` on `rows` samples."""
        return rows * np.array(self.split[j], dtype=float) * self.s


def _kept_split(split: Sequence[Sequence[int]] | None, taking: int
                ) -> Sequence[Sequence[int]] | None:
    """`Options.dense_split` where it splits over the devices taking part (a run's
    record: its layout was built after the idle workers left); else None, the even
    split over those, as such a layout splits the neurons."""
    if split is None or any(len(row) != taking for row in split):
        return None
    return split


def _hybrid_setup(network: Network, devices: Sequence[DeviceSpec], shares: list[int],
                  dense_split: Sequence[Sequence[int]] | None, options: Options) -> _HybridSetup:
    """The batch's parts, the dense split, each device's trunk and update."""
    p, s = len(devices), devices[0].bytes_per_elem
    split = dense_split or [even_counts(layer.out_features, p) for layer in network.dense]
    conv_params = network.conv_params()
    rows = replica_times(devices, network, shares, dense=False)
    trunk = [sum(row, LayerTime()) for row in rows]
    after_forward, before_backward = norm_slots(network, p, s, options.batch_norm)
    accesses = network.update_accesses()
    update = {d: dev.update_time((GATHER_ACCESSES + accesses) * conv_params)
              for d, dev in enumerate(devices)}
    if options.dense_batch == "full":  # the dense slices step once, at the end
        for d, dev in enumerate(devices):
            update[d] += sum(dev.update_time(accesses * layer.params(
                split[j][d] / layer.out_features)) for j, layer in enumerate(network.dense))
    stream = {d: dev.stream_time(1.0) for d, dev in enumerate(devices)}
    return _HybridSetup(network, devices, shares, hybrid_parts(shares, options.scheme), s,
                        conv_params, trunk, stretches(rows, after_forward, None),
                        stretches(rows, None, before_backward), update, stream,
                        options.dataset, options.dense_batch, split,
                        {d: hybrid_head_factor(dev, network, [row[d] for row in split])
                         for d, dev in enumerate(devices)})


def _hybrid_step(tl: Timeline, h: _HybridSetup) -> None:
    """`predict_hybrid_store`'s step op by op: trunks forward, features written, every
    part through the dense layers, trunks backward, the conv gradients reduced."""
    p, s, features = len(h.devices), h.s, h.network.features
    for d, b in enumerate(h.shares):
        tl.run(d, "overhead", tl.overhead.task)
        if b and h.dataset is not None:
            tl.run(d, "io", replica_batch_read(h.devices[d], tl.links[d], h.dataset,
                                               h.network, b))
    exchange_ops(tl, h.forward)
    for d in range(p):
        tl.run(d, "compute", float(h.forward.last[d]))
        for k, part in enumerate(h.parts):
            for e, rows in part:
                if e == d and p > 1:
                    tl.write(d, f"feat/{k}/{d}", rows * features * s)
    for k, part in enumerate(h.parts):
        _hybrid_dense_part(tl, h, k, part)
    for d in range(p):
        sources = [(f"din/{k}/0/{e}/{d}", rows * features * s)
                   for k, part in enumerate(h.parts) for owner, rows in part if owner == d
                   for e in range(p) if e != d]
        tl.read(d, sources)
    exchange_ops(tl, h.backward)
    for d, dev in enumerate(h.devices):
        tl.run(d, "compute", float(h.backward.last[d]) + flatten_time(dev, h.conv_params))
        hand_on(tl, d, p, h.conv_params, s, "grads")
    reduce_ops(tl, p, h.conv_params, s, h.update, h.stream, "grads")


def _hybrid_dense_part(tl: Timeline, h: _HybridSetup, k: int, part: list[tuple[int, int]]
                       ) -> None:
    """Part `k` through every device's slice of the dense layers, forward then backward,
    the input gradients handed on to the rows' or neurons' owners."""
    p, s, features, split = len(h.devices), h.s, h.network.features, h.split
    last = len(h.network.dense) - 1
    n = sum(rows for _, rows in part)
    for j in range(last + 1):
        for d in range(p):
            if j == 0:
                tl.read(d, [(f"feat/{k}/{e}", rows * features * s)
                            for e, rows in part if e != d])
            else:
                tl.read(d, [(f"out/{k}/{j - 1}/{e}", n * split[j - 1][e] * s)
                            for e in range(p) if e != d])
            tl.run(d, "master", h.dense_seconds(d, j, n, "forward"))
            if p > 1:
                tl.write(d, f"out/{k}/{j}/{d}", n * split[j][d] * s)
    for j in reversed(range(last + 1)):
        for d in range(p):
            if j == last:
                tl.read(d, [(f"out/{k}/{last}/{e}", n * split[last][e] * s)
                            for e in range(p) if e != d])
            else:
                tl.read(d, [(f"din/{k}/{j + 1}/{e}/{d}", n * split[j][d] * s)
                            for e in range(p) if e != d])
            tl.run(d, "master", h.dense_seconds(d, j, n, "backward"))
            if j == 0:
                for e, rows in part:
                    if e != d:
                        tl.write(d, f"din/{k}/0/{d}/{e}", rows * features * s)
            else:
                for e in range(p):
                    if e != d:
                        tl.write(d, f"din/{k}/{j}/{d}/{e}", n * split[j - 1][e] * s)


def _hybrid_step_fast(tl: FastTimeline, h: _HybridSetup) -> None:
    """`predict_hybrid_store`'s step a phase of all devices at a time (timeline_fast.py)."""
    p = tl.devices
    everyone = np.arange(p)
    tl.run(everyone, "overhead", tl.overhead.task)
    if h.dataset is not None:
        busy = np.array([d for d, b in enumerate(h.shares) if b])
        tl.run(busy, "io", np.array([replica_batch_read(h.devices[d], tl.link, h.dataset,
                                                        h.network, h.shares[d]) for d in busy]))
    exchange_phases(tl, h.forward)
    tl.run(everyone, "compute", h.forward.last)
    row_bytes = h.network.features * h.s
    pieces = [(np.array([e for e, _ in part]), np.array([r for _, r in part], dtype=float))
              for part in h.parts]
    feats = [tl.write_each(members, rows * row_bytes, 1) if p > 1 else np.zeros(len(members))
             for members, rows in pieces]
    firsts = [_dense_part(tl, h, members, rows, ready) for (members, rows), ready
              in zip(pieces, feats)]
    for (members, rows), first in zip(pieces, firsts):
        tl.read_in_turn(members, first, rows * row_bytes, 1)
    exchange_phases(tl, h.backward)
    tl.run(everyone, "compute", h.backward.last + np.array([flatten_time(dev, h.conv_params)
                                                            for dev in h.devices]))
    reduce_phases(tl, h.conv_params, h.s, h.update, h.stream)


def _dense_part(tl: FastTimeline, h: _HybridSetup, members: np.ndarray, rows: np.ndarray,
                feat_ready: np.ndarray) -> InTurn:
    """One part (`rows` samples of each of its `members`) through the dense layers on
    every device, forward then backward; returns the input gradients handed back to
    the members."""
    p, last = tl.devices, len(h.network.dense) - 1
    everyone, none = np.arange(p), np.zeros(p)
    n = int(rows.sum())
    feat_bytes = rows * (h.network.features * h.s)
    out: list[np.ndarray] = []
    handed: InTurn | None = None
    for j in range(last + 1):
        src = (Sources(members, feat_ready, feat_bytes) if j == 0
               else Sources(everyone, out[j - 1], h.out_bytes(j - 1, n)))
        tl.read(everyone, src, 1, none, none)
        tl.run(everyone, "master", h.dense(j, n, "forward"))
        out.append(tl.write_each(everyone, h.out_bytes(j, n), 1) if p > 1 else none)
    for j in reversed(range(last + 1)):
        if j == last:
            tl.read(everyone, Sources(everyone, out[last], h.out_bytes(last, n)), 1, none, none)
        elif handed is not None:
            tl.read_in_turn(everyone, handed, h.out_bytes(j, n), 1)
        tl.run(everyone, "master", h.dense(j, n, "backward"))
        handed = (tl.write_in_turn(everyone, members, feat_bytes, 1) if j == 0
                  else tl.write_in_turn(everyone, everyone, h.out_bytes(j - 1, n), 1))
    assert handed is not None  # a network has a dense layer
    return handed
