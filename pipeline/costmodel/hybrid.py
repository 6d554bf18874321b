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
from .compute import LayerTime, dense_slices_time, hybrid_head_factor
from .data import (allreduce_schedule, batch_norm_exchanges, comm_link, per_device_totals,
                   replica_pass, replica_times, unique_rows)
from .devices import DeviceSpec, LinkSpec, distinct
from .memory import MIB
from .network import Network
from .prediction import Options, Prediction, split_batch, taking_part
from .replica_exchanges import even_counts

__all__ = ["predict_hybrid", "dense_split", "holders", "dense_layer_exchange"]


def dense_split(network: Network, devices: int) -> list[list[int]]:
    """Output neurons of each dense layer per device, as even as can be, the larger
    counts first (the engine's split, tasks.replica_layout.split_counts). A layer with
    fewer neurons than devices leaves the last ones none: they hold no slice of it."""
    return [even_counts(layer.out_features, devices) for layer in network.dense]


def holders(split: Sequence[Sequence[int]]) -> list[int]:
    """Per dense layer, the devices holding neurons of it (the first ones: `dense_split`)."""
    return [sum(1 for n in row if n > 0) for row in split]


def dense_layer_exchange(network: Network, b: float, held: Sequence[int], link: LinkSpec,
                         s: int) -> float:
    """Activation exchange inside one model-parallel dense sub-step of batch ``b``: each
    dense layer after the first all-gathers its input among the holders of that input
    and of itself (``held``: per layer, `holders`; both are the first devices) and
    reduce-scatters its partial input gradient back among them; the logits are
    all-gathered among their holders for the softmax."""
    t = 0.0
    for j, layer in enumerate(network.dense[1:], start=1):
        n, taking = b * layer.in_features * s, max(held[j - 1], held[j])
        t += col.ring_allgather(n, taking, link) + col.ring_reduce_scatter(n, taking, link)
    t += col.ring_allgather(b * network.dense[-1].out_features * s, held[-1], link)
    return t


@dataclass
class _DenseHead:
    """The dense head of one prediction, model parallel over `K` devices: each holds
    `split[j][d]` neurons of dense layer `j` (`dense_split`). Devices of one kind
    holding the same neurons do the same dense work, so it is timed once per such
    `group` (few: a layer's counts differ by one at most), and once per distinct
    sub-step size: scheme (b) has K rounds over K devices, and K runs to the
    thousands in predict-only scaling sweeps."""

    network: Network
    devices: Sequence[DeviceSpec]
    link: LinkSpec
    s: int
    split: list[list[int]]
    groups: list[tuple[DeviceSpec, tuple[int, ...]]] = field(default_factory=list)
    group_of: list[int] = field(default_factory=list)
    held: list[int] = field(default_factory=list)  # per layer, its holders (`holders`)
    subs: dict[tuple[float, bool], tuple[float, list[LayerTime]]] = field(default_factory=dict)
    inner: dict[float, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.held = holders(self.split)
        kinds, kind_of = distinct(self.devices)
        index: dict[tuple[int, tuple[int, ...]], int] = {}
        for d, kind in enumerate(kind_of):
            key = (kind, tuple(row[d] for row in self.split))
            if key not in index:
                index[key] = len(self.groups)
                self.groups.append((kinds[kind], key[1]))
            self.group_of.append(index[key])

    @property
    def K(self) -> int:
        return len(self.devices)


    def slice_time(self, dev: DeviceSpec, neurons: Sequence[int], b: float) -> LayerTime:
        """`dev`'s seconds of its `neurons` of every dense layer on `b` samples (none of
        a layer it holds no neuron of: it takes no part in it), scaled to what the
        probe measured (`hybrid_head_factor`: 1 where it timed no head)."""
        return dense_slices_time(dev, self.network, neurons, b).scaled(
            hybrid_head_factor(dev, self.network, neurons))

    def sub(self, b: float, update: bool) -> tuple[float, list[LayerTime]]:
        """One dense sub-step of `b` samples: the slowest group's time, each group's
        (once per distinct `b`: the K rounds of schemes b/c take one or two)."""
        if (b, update) not in self.subs:
            parts = [self.slice_time(dev, neurons, b) for dev, neurons in self.groups]
            self.subs[b, update] = (max(p.forward + p.backward + (p.update if update else 0.0)
                                        for p in parts), parts)
        return self.subs[b, update]

    def inner_comm(self, b: float) -> float:
        if b not in self.inner:
            self.inner[b] = dense_layer_exchange(self.network, b, self.held, self.link, self.s)
        return self.inner[b]

    def rooted(self, j: int) -> int:
        """Devices in round `j`'s broadcast and reduce (scheme b): the first dense
        layer's holders, and root `j` where it holds none."""
        first = self.held[0]
        return first + (j >= first)


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

    # dense head: model parallel, each device its neurons of every layer (dense_split)
    per_update = options.dense_batch == "worker"
    head = _DenseHead(network, devices, lk, s, dense_split(network, K))
    dense_compute, comm, per_group_dense = _dense_rounds(head, batch, shares, options)
    final_update = 0.0
    if not per_update:
        ups = [head.slice_time(dev, neurons, 1).update for dev, neurons in head.groups]
        final_update = max(ups)
        per_group_dense = [a + u for a, u in zip(per_group_dense, ups)]
    per_dev_dense = [per_group_dense[g] for g in head.group_of]
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
        details={"batch_shares": every, "dense_holders": head.held, "dense_comm": comm, "conv_allreduce": conv_comm,
                 "batch_norm_exchanges": replicas.exchanges},
    )


def _dense_rounds(head: _DenseHead, batch: int, shares: Sequence[int], options: Options
                  ) -> tuple[float, float, list[float]]:
    """The dense head's sub-steps under the scheme (a, b or c): their compute on the
    slowest group, the communication they leave exposed, and each group's dense time."""
    K, lk = head.K, head.link
    per_update = options.dense_batch == "worker"
    F = head.network.features * head.s
    dense_compute = 0.0
    per_group_dense = [0.0] * len(head.groups)
    if options.scheme == "a":
        steps = [float(batch)] if not per_update else [float(b) for b in shares]
        comm = col.ring_allgather(batch * F, K, lk) + col.ring_reduce_scatter(batch * F, K, lk)
        for b in steps:
            t, parts = head.sub(b, per_update)
            dense_compute += t
            comm += head.inner_comm(b)
            per_group_dense = [a + p.forward + p.backward + (p.update if per_update else 0) for a, p in zip(per_group_dense, parts)]
    elif options.scheme in ("b", "c"):
        if options.scheme == "b":
            rounds = [float(b) for b in shares]
            send = [col.broadcast(b * F, head.rooted(j), lk, options.broadcast)
                    for j, b in enumerate(rounds)]
            back = [col.reduce(b * F, head.rooted(j), lk, options.broadcast)
                    for j, b in enumerate(rounds)]
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
            per_group_dense = [a + p.forward + p.backward + (p.update if per_update else 0) for a, p in zip(per_group_dense, parts)]
        comm = elapsed - dense_compute
    else:
        raise ValueError(f"unknown hybrid scheme {options.scheme!r}")
    return dense_compute, comm, per_group_dense
