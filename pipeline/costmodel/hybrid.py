"""Hybrid step of "one weird trick" (Krizhevsky 2014).

Conv layers are data-parallel (each of ``K`` workers runs its share of the
batch, conv weight gradients are allreduced); dense layers are
model-parallel (each worker holds ``1/K`` of every dense layer's neurons).
Synchronised batch norm in the conv layers exchanges as `data`'s replicas do
(data.py, `replica_pass`).
Between the two, the last conv activations reach the dense layers by

- (a) an all-gather of all of them, then the dense work on the whole batch
  (or worker-sized sub-steps), then a reduce-scatter of their gradients;
- (b) ``K`` rounds: worker ``j`` broadcasts its part, all run a dense
  sub-step on it, the input gradient is reduced back to ``j``; the next
  broadcast overlaps the current sub-step;
- (c) ``K`` rounds in which every worker sends ``1/K`` of its examples to
  all (an all-gather of a round's batch), gradients reduce-scattered back.

Inside a model-parallel sub-step each dense layer after the first needs the
full input (all-gather) and the partial input gradients summed
(reduce-scatter); the logits are all-gathered for the softmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from . import collectives as col
from .compute import LayerTime, dense_time
from .data import (allreduce_schedule, batch_norm_exchanges, comm_link, per_device_totals,
                   replica_pass, replica_times, unique_rows)
from .devices import DeviceSpec, LinkSpec, distinct
from .memory import MIB
from .network import Network
from .prediction import Options, Prediction, split_batch, taking_part

__all__ = ["predict_hybrid"]


def _inner_comm(network: Network, b: float, p: int, link: LinkSpec, s: int) -> float:
    """Activation exchange inside one model-parallel dense sub-step of batch ``b``."""
    t = 0.0
    for layer in network.dense[1:]:
        n = b * layer.in_features * s
        t += col.ring_allgather(n, p, link) + col.ring_reduce_scatter(n, p, link)
    t += col.ring_allgather(b * network.dense[-1].out_features * s, p, link)
    return t


@dataclass
class _DenseHead:
    """The dense head of one prediction, model parallel over `K` devices (a fraction
    1/K of every layer's neurons each). Equal devices do equal dense work, so it is
    timed once per distinct device (`kinds`), and once per distinct sub-step size:
    scheme (b) has K rounds over K devices, and K runs to the thousands in
    predict-only scaling sweeps."""

    network: Network
    kinds: list[DeviceSpec]
    K: int
    link: LinkSpec
    s: int
    subs: dict[tuple[float, bool], tuple[float, list[LayerTime]]] = field(default_factory=dict)
    inner: dict[float, float] = field(default_factory=dict)

    def sub(self, b: float, update: bool) -> tuple[float, list[LayerTime]]:
        """One dense sub-step of `b` samples: the slowest kind's time, each kind's
        (once per distinct `b`: the K rounds of schemes b/c take one or two)."""
        if (b, update) not in self.subs:
            parts = [dense_time(dev, self.network.dense, b, 1.0 / self.K,
                                dropout=self.network.dropout,
                                accesses=self.network.update_accesses())
                     for dev in self.kinds]
            self.subs[b, update] = (max(p.forward + p.backward + (p.update if update else 0.0)
                                        for p in parts), parts)
        return self.subs[b, update]

    def inner_comm(self, b: float) -> float:
        if b not in self.inner:
            self.inner[b] = _inner_comm(self.network, b, self.K, self.link, self.s)
        return self.inner[b]


def predict_hybrid(
    network: Network, batch: int, devices: Sequence[DeviceSpec], link: LinkSpec, options: Options
) -> Prediction:
    """Hybrid data/model parallel step; ``batch`` is the total conv batch."""
    weights = ([1.0] * len(devices) if options.batch_split == "equal"
               else [d.rate("conv") for d in devices])
    every = split_batch(batch, weights)
    devices, shares = taking_part(devices, every)
    K, s = len(devices), devices[0].bytes_per_elem
    lk = comm_link(devices, link)

    # conv trunk: data parallel
    conv = replica_times(devices, network, shares, dense=False)
    grads = [c.params() * s for c in network.conv]
    replicas = replica_pass(conv, batch_norm_exchanges(network, K, lk, s, options.batch_norm))
    fwd = replicas.forward
    end = allreduce_schedule(replicas, grads, lk, options.allreduce, options.overlap,
                             options.bucket_mb * MIB)
    conv_compute = replicas.end - replicas.exchanges
    conv_bwd_and_comm = end - fwd
    conv_update = max(sum(t.update for t in row) for row in unique_rows(conv))

    # dense head: model parallel, fraction 1/K of neurons each
    frac = 1.0 / K
    per_update = options.dense_batch == "worker"
    kinds, kind_of = distinct(devices)
    head = _DenseHead(network, kinds, K, lk, s)
    dense_compute, comm, per_kind_dense = _dense_rounds(head, batch, shares, options)
    final_update = 0.0
    if not per_update:
        ups = [dense_time(dev, network.dense, 1, frac,
                          accesses=network.update_accesses()).update for dev in kinds]
        final_update = max(ups)
        per_kind_dense = [a + u for a, u in zip(per_kind_dense, ups)]
    per_dev_dense = [per_kind_dense[k] for k in kind_of]
    master = dense_compute + final_update

    step = fwd + master + comm + conv_bwd_and_comm + conv_update
    conv_comm = end - conv_compute
    per_dev = [t + dd for t, dd in zip(per_device_totals(conv), per_dev_dense)]
    breakdown = {
        "compute": per_dev, "compute_max": max(per_dev),
        "compute_critical": conv_compute + conv_update,
        "communication": comm + conv_comm, "storage": 0.0, "master": master, "overhead": 0.0,
    }
    return Prediction(
        "hybrid", step, batch, breakdown,
        details={"batch_shares": every, "dense_comm": comm, "conv_allreduce": conv_comm,
                 "batch_norm_exchanges": replicas.exchanges},
    )


def _dense_rounds(head: _DenseHead, batch: int, shares: Sequence[int], options: Options
                  ) -> tuple[float, float, list[float]]:
    """The dense head's sub-steps under the scheme (a, b or c): their compute on the
    slowest kind, the communication they leave exposed, and each kind's dense time."""
    K, lk = head.K, head.link
    per_update = options.dense_batch == "worker"
    F = head.network.features * head.s
    dense_compute = 0.0
    per_kind_dense = [0.0] * len(head.kinds)
    if options.scheme == "a":
        steps = [float(batch)] if not per_update else [float(b) for b in shares]
        comm = col.ring_allgather(batch * F, K, lk) + col.ring_reduce_scatter(batch * F, K, lk)
        for b in steps:
            t, parts = head.sub(b, per_update)
            dense_compute += t
            comm += head.inner_comm(b)
            per_kind_dense = [a + p.forward + p.backward + (p.update if per_update else 0) for a, p in zip(per_kind_dense, parts)]
    elif options.scheme in ("b", "c"):
        if options.scheme == "b":
            rounds = [float(b) for b in shares]
            send = [col.broadcast(b * F, K, lk, options.broadcast) for b in rounds]
            back = [col.reduce(b * F, K, lk, options.broadcast) for b in rounds]
        else:
            rounds = [batch / K] * K
            send = [col.ring_allgather(b * F, K, lk) for b in rounds]
            back = [col.ring_reduce_scatter(b * F, K, lk) for b in rounds]
        elapsed = send[0]
        for j, b in enumerate(rounds):
            t, parts = head.sub(b, per_update)
            dense_compute += t
            nxt = send[j + 1] if j + 1 < K else 0.0
            elapsed += (max(t, nxt) if options.overlap_dense else t + nxt)
            elapsed += head.inner_comm(b) + back[j]
            per_kind_dense = [a + p.forward + p.backward + (p.update if per_update else 0) for a, p in zip(per_kind_dense, parts)]
        comm = elapsed - dense_compute
    else:
        raise ValueError(f"unknown hybrid scheme {options.scheme!r}")
    return dense_compute, comm, per_kind_dense
