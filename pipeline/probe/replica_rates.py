"""What a replica runs beyond its trunk, timed on every worker at once: its update,
the figure of each worker's memory rate, and its dense head on its rows.

The conv layers' and the dense head's times come from the engine's own ops; what no
plan times alone is the element-wise work around them that grows with the parameter
count, not the batch: a replica's update (the gathered flat gradient and SGD with
momentum), the copy of its gradients into the ranges it hands on, the sums of the
reduction. On a CPU these are bound by memory, and the workers share the memory bus:
two replicas updating at once each stream slower than one alone. So the probe times
a replica's update (tasks/update_rate.py) on every worker at once, at the network's
parameter count (capped at `MAX_ELEMENTS`: past every cache, a figure that no longer
changes with size), and the model's `DeviceSpec.mem_bw` is its bytes over its time.

The dense head is timed on the master at the whole batch; a ``data`` replica runs it
on its own rows, where its products stream the same weights for fewer rows, and with
every other replica at once. So each worker also times the head on its share of the
replica plan (`tasks.dense_head.time_dense_head`): its trunk's `TrunkTiming.dense_s`.
"""

from __future__ import annotations

import time
import uuid
from typing import Callable, Sequence

from pipeline.cluster.workers import ClusterWorker
from pipeline.costmodel.compute import REPLICA_UPDATE_ACCESSES
from pipeline.costmodel.memory import element_bytes
from pipeline.engine.runner import TaskRunner
from pipeline.probe.tables import costmodel_network
from tasks.specs import NetworkSpec
from tasks.dense_head import time_dense_head
from tasks.update_rate import time_update

#: The most parameters timed: 64 MB a tensor in float32, far past a CPU's caches.
MAX_ELEMENTS = 1 << 24
#: How long before the workers start, so that every one of them has its task.
START_DELAY_S = 0.1


def replica_parameters(network: NetworkSpec) -> int:
    """Parameters a replica updates: every conv layer's (batch norm's included) and the
    dense head's."""
    return int(costmodel_network(network).params())


def memory_bandwidth(seconds_per_element: float, dtype: str) -> float:
    """Bytes per second of a worker whose replica update took `seconds_per_element` a
    parameter: the model's accesses of that update (`REPLICA_UPDATE_ACCESSES`) in
    bytes, over the time."""
    if seconds_per_element <= 0:
        raise ValueError("a replica's update cannot take no time")
    return REPLICA_UPDATE_ACCESSES * element_bytes(dtype) / seconds_per_element


def probe_memory_rates(client, offered: Sequence[ClusterWorker], network: NetworkSpec
                       ) -> dict[str, float]:
    """Each worker's memory bandwidth (B/s, `memory_bandwidth`) with every worker
    updating a replica at once."""
    elements = min(replica_parameters(network), MAX_ELEMENTS)
    timed = _at_once(client, offered, "update", time_update,
                     {w.name: (elements, len(offered), network.dtype) for w in offered})
    return {name: memory_bandwidth(result["seconds_per_element"], network.dtype)
            for name, result in timed.items()}


def probe_replica_heads(client, offered: Sequence[ClusterWorker], network: NetworkSpec,
                        shares: Sequence[int]) -> dict[str, float]:
    """Each worker's seconds of the dense head's forward and backward on its rows of
    `shares` (the replica plan's), every worker at once; none for a worker without rows."""
    timed = _at_once(client, offered, "head", time_dense_head,
                     {w.name: (network, rows) for w, rows in zip(offered, shares) if rows > 0})
    return {name: result["seconds"] for name, result in timed.items()}


def _at_once(client, offered: Sequence[ClusterWorker], what: str, timing: Callable[..., dict],
             args: dict[str, tuple]) -> dict[str, dict]:
    """`timing(*args[name], start_at)` on each named worker, every one given the same
    wall-clock start `START_DELAY_S` from now; its results by worker name."""
    runner = TaskRunner(client, offered, f"{what}-{uuid.uuid4().hex[:8]}")
    start_at = time.time() + START_DELAY_S
    futures = {w.name: runner.submit(timing, index, *args[w.name], start_at,
                                     name=f"{what}-{w.name}")
               for index, w in enumerate(offered) if w.name in args}
    timed = runner.gather(list(futures.values()), f"probe {what} timings")
    return dict(zip(futures, timed))
