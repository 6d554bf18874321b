"""What a probe measured, and how it becomes the cost model's devices, store and overheads.

Plain dataclasses (JSON through `dataclasses.asdict` and `cluster_probe_from_dict`),
so that a probe can be cached and recorded next to the predictions made from it.
Single timings are pipeline/probe/timings.py; their translation into the model's
tables and devices pipeline/probe/tables.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from pipeline.costmodel import DaskOverhead, DeviceSpec, Network, Options, StoreSpec, TrunkTime
from pipeline.costmodel.compute import DEFAULT_UPDATE_ACCESSES, GATHER_ACCESSES, conv_time
from pipeline.costmodel.memory import element_bytes
from pipeline.placement.split import split_even
from pipeline.probe.tables import (costmodel_network, dataset_store, device_spec, head_rate,
                                   network_spec_from_dict)
from pipeline.probe.timings import ShardTiming, TrunkTiming
from tasks.specs import NetworkSpec

PROBE_VERSION = 25  # 5: rounds, robust figures, spread, outliers; 6: replica trunks;
#                    7: the client's CPU per step; 8: batch reads per shard and trunk;
#                    9: each worker's compute spread against its peers; 10: none new,
#                    but the workers' max-pool got faster (tasks/pooling.py), so every
#                    earlier probe's compute figures are stale; 11: the workspace
#                    accesses' spread (`StoreProbe.spread`), and the measured steps
#                    in one task per worker (runs.py: `PlanEngines.run`); 12: the
#                    client's share of the cores (`DaskProbe.contention_share`), and
#                    zoo networks' records whole (tables.network_spec_from_dict);
#                    13: each worker's memory rate (`WorkerProbe.memory_bw`); 14: the
#                    share by the client's own CPU clock (client_share.py), not a burner;
#                    15: the spread read stretch by stretch (readings.relative_spreads);
#                    16: the workspace's latency and bandwidth fitted to each access
#                    size's median (readings.store_fit); 17: a data replica's whole
#                    step (`TrunkTiming.data_step_s`, runs.ReplicaPlan); 18: the
#                    client's CPU per task fitted collect by collect (client_cpu.py),
#                    not round by round; 19: a look at a written slot's marker apart
#                    from noticing one (`DaskProbe.check_s`); 20: a data replica's
#                    update (`TrunkTiming.update_s`); 21: the gap between steps
#                    inside a task (`DaskProbe.step_gap_s`); 22: the reference
#                    probe's short steps timed in rounds (reference.py); 23: its
#                    steps and the cluster probe's rounds with the heap frozen, as a
#                    run's steps (pipeline/engine/heap.py); 24: hybrid's dense ops
#                    (`TrunkTiming.hybrid_head_s`); 25: compute read without a
#                    measured task's first step (readings.steady_receipts)


@dataclass
class WorkerProbe:
    """One worker's measured shard times, and its replica's conv trunk (``None``: not
    measured, e.g. a probe of version 5 or a network hybrid cannot split)."""

    name: str
    address: str
    threads: int
    emulated_speed: float
    timings: list[ShardTiming] = field(default_factory=list)
    trunk: TrunkTiming | None = None
    #: its ops' compute spread against its peers', per number of workers running
    #: (`readings.relative_spreads`): the cost model's `DeviceSpec.spread`
    spread: dict[int, float] = field(default_factory=dict)
    #: its memory rate, B/s, with every worker streaming at once (replica_rates.py):
    #: the cost model's `DeviceSpec.mem_bw` (None: not measured, streams cost nothing)
    memory_bw: float | None = None
    #: the machine it ran on, as it said it (tasks/machine.py; "": not asked, as in
    #: probes cached before workers were asked)
    machine: str = ""


@dataclass
class StoreProbe:
    """The workspace as tasks reach it: ``t = latency + bytes / bw`` per access.

    Every access is one single-chunk slot. ``dataset_read_s``: one batch through
    ``read_batch`` on a worker. ``spread``: per number of workers running, an
    access's spread about that (`readings.access_spreads`): the cost model's
    `StoreSpec.spread`.
    """

    path: str
    read_latency_s: float
    read_bw: float
    write_latency_s: float
    write_bw: float
    dataset_read_s: float | None = None
    spread: dict[int, float] = field(default_factory=dict)


@dataclass
class DaskProbe:
    """The engine's orchestration costs (see `pipeline.costmodel.DaskOverhead`).

    ``task_s``: gap between a worker's consecutive (queued) step tasks;
    ``step_gap_s``: between a worker's consecutive steps inside one task (None: not
    measured, a probe before version 21); ``sync_s``:
    a ready marker to its waiting reader; ``check_s``: a reader's look at the marker
    of a slot written before it came (None: not measured, as ``sync_s``); all from the
    calibration runs.
    ``hop_s``: a dependency between trivial tasks through the scheduler, and
    ``round_trip_s``: a client round trip of a trivial task.
    ``client_cpu_per_task_s`` and ``client_cpu_rate``: the probing process's CPU per
    step as ``per_task * tasks + rate * seconds`` (client_cpu.client_cpu_fit);
    ``scheduler_here``: whether the scheduler ran in that process (an embedded
    cluster), so that its work is in those figures; ``host_cores``: the cores that
    process could run on. ``contention_share``: how much of its CPU per task delays the step
    where the workers fill the cores, measured (pipeline/probe/client_share.py;
    ``contention_shares`` each pair's figure); None where it was not (one worker, a
    core left over, an external scheduler).
    """

    task_s: float
    sync_s: float
    hop_s: float
    round_trip_s: float
    client_cpu_per_task_s: float = 0.0
    client_cpu_rate: float = 0.0
    scheduler_here: bool = False
    host_cores: int = 0
    contention_share: float | None = None
    contention_shares: list[float | None] = field(default_factory=list)
    check_s: float | None = None
    step_gap_s: float | None = None


@dataclass
class MasterProbe:
    """One process with ``threads`` torch threads: the dense head, whole conv layers.

    For a cluster probe, the dense head as the master worker runs it; for
    ``strategy: reference``, this process training the whole network.
    ``dense_low_s``, ``dense_high_s``: quartiles of the dense head's steps (0: not kept).
    """

    threads: int
    batch: int
    dense_s: float
    timings: list[ShardTiming] = field(default_factory=list)
    dataset_read_s: float | None = None
    key: str = ""
    created: float = 0.0
    dense_low_s: float = 0.0
    dense_high_s: float = 0.0
    #: when each sample merged into this probe was taken (as `ClusterProbe`'s)
    samples_created: list[float] = field(default_factory=list)

    def created_times(self) -> list[float]:
        """When the samples this probe stands for were taken (itself alone: `created`)."""
        return list(self.samples_created) or [self.created]

    def at(self, bound: str) -> "MasterProbe":
        """This probe with every timing at its lower or upper quartile (`bound`
        ``"low"``, ``"high"``; ``"mid"``: itself): what the prediction's band uses."""
        if bound == "mid":
            return self
        edge = self.dense_low_s if bound == "low" else self.dense_high_s
        return replace(self, dense_s=edge if edge > 0 else self.dense_s,
                       timings=[t.scaled(bound) for t in self.timings])


@dataclass
class ClusterProbe:
    """Everything measured on one cluster for one network and batch."""

    key: str
    created: float
    host: str  # the client's machine (tasks/machine.py: name, CPU, cores, ...); the
    #            workers' are each `WorkerProbe.machine`
    network: dict[str, Any]
    batch: int
    quanta: list[int]
    workers: list[WorkerProbe]
    store: StoreProbe
    dask: DaskProbe
    master: MasterProbe  # the dense head on the first worker
    seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    method: str = "runs"
    version: int = PROBE_VERSION
    #: when each probe sample merged into this one was taken (samples.py: every figure
    #: the median over them); empty for a single probe, taken at `created`
    samples_created: list[float] = field(default_factory=list)

    def created_times(self) -> list[float]:
        """When the samples this probe stands for were taken (itself alone: `created`)."""
        return list(self.samples_created) or [self.created]

    def network_spec(self) -> NetworkSpec:
        return network_spec_from_dict(self.network)

    def at(self, bound: str) -> "ClusterProbe":
        """This probe with every shard and the dense head at the lower or upper
        quartile of their steps (`bound` ``"low"``, ``"high"``; ``"mid"``: itself).
        The store's and Dask's constants stay: they are fits and medians over every
        access of every run, not single sizes."""
        if bound == "mid":
            return self
        workers = [replace(w, timings=[t.scaled(bound) for t in w.timings],
                           trunk=w.trunk.scaled(bound) if w.trunk else None)
                   for w in self.workers]
        return replace(self, workers=workers, master=self.master.at(bound))

    def costmodel_network(self) -> Network:
        return costmodel_network(self.network_spec())

    def device_specs(self, active: int | None = None) -> list[DeviceSpec]:
        """Cost-model devices of the first ``active`` workers (default all).

        Each conv layer gets a :class:`LayerTable` from the points measured with
        ``active`` workers running at once, completed by points measured with
        other counts. The dense head was timed on the first worker; another
        worker's is scaled by its emulated speed. A worker whose replica trunk was
        timed with ``active`` workers running gets it as its `TrunkTime`, and its
        spread against its peers with ``active`` running as its `DeviceSpec.spread`
        (0 where none was measured, as alone), and its update's rate
        (`update_rate`) as its `DeviceSpec.update_bw`; its memory rate (`memory_bw`)
        is the rate of every other element-wise pass.
        """
        active = len(self.workers) if active is None else active
        net = self.costmodel_network()
        s = element_bytes(self.network_spec().dtype)  # what `memory_bw` was figured in
        first = self.workers[0].emulated_speed
        specs = []
        for w in self.workers[:active]:
            mem_bw = w.memory_bw or math.inf
            head_s = self.master.dense_s * first / w.emulated_speed
            spec = device_spec(w.name, w.timings, net, self.batch, active,
                               head_rate(net, self.batch, head_s, mem_bw, s), mem_bw, s)
            if w.trunk is not None and w.trunk.active == active:
                spec = replace(spec, trunk=TrunkTime(w.trunk.rows, w.trunk.forward_s,
                                                     w.trunk.backward_s, w.trunk.dataset_s,
                                                     w.trunk.dense_s, w.trunk.data_step_s,
                                                     w.trunk.hybrid_head_s, self.batch),
                               update_bw=update_rate(w.trunk.update_s, net, s))
            specs.append(replace(spec, spread=w.spread.get(active, 0.0)))
        return specs

    def store_spec(self, active: int | None = None) -> StoreSpec:
        """The workspace: per-access costs as one chunk each, bandwidth per client, and
        the accesses' spread with the first ``active`` workers running (default all; 0
        where that count was not measured)."""
        s = self.store
        n = len(self.workers)
        active = n if active is None else active
        return StoreSpec(write_bw=n * s.write_bw, read_bw=n * s.read_bw, latency=0.0,
                         client_write_bw=s.write_bw, client_read_bw=s.read_bw,
                         read_chunk=s.read_latency_s, write_chunk=s.write_latency_s,
                         spread=s.spread.get(active, 0.0))

    def dataset_spec(self) -> StoreSpec | None:
        return dataset_store(self.store.dataset_read_s)

    def overhead(self) -> DaskOverhead:
        d = self.dask
        return DaskOverhead(task=d.task_s, sync=d.sync_s, hop=d.hop_s, check=d.check_s)

    def kernel_options(self, **extra: Any) -> Options:
        """Cost-model options of the engine on this cluster (``extra``: more fields)."""
        return Options(quantum=list(self.quanta), dataset=self.dataset_spec(),
                       overhead=self.overhead(), **extra)

    def calibration(self, active: int | None = None) -> dict[str, list[float]]:
        """Seconds per kernel per layer and worker at the even share, like calibration
        (a worker the even share leaves without a layer: at one quantum of it)."""
        active = len(self.workers) if active is None else active
        spec = self.network_spec()
        net = self.costmodel_network()
        out: dict[str, list[float]] = {}
        for index, (worker, device) in enumerate(zip(self.workers, self.device_specs(active))):
            row = []
            for l, (layer, conv, quantum) in enumerate(zip(spec.conv, net.conv, self.quanta)):
                k = split_even(layer.kernels, active, quantum)[index] or quantum
                seconds = conv_time(device, conv, self.batch, k, input_grad=net.source(l) >= 0)
                row.append(seconds.total / k)
            out[worker.name] = row
        return out


def update_rate(update_s: float | None, net: Network, s: int) -> float | None:
    """Bytes per second of a replica's update that took `update_s` over every parameter of
    `net` in `s`-byte elements: its accesses at the probe's SGD (the config's
    defaults: `DEFAULT_UPDATE_ACCESSES`, after the gather's) over the time (None where
    it was not timed)."""
    if not update_s or update_s <= 0:
        return None
    return (GATHER_ACCESSES + DEFAULT_UPDATE_ACCESSES) * net.params() * s / update_s


def master_device(master: MasterProbe, net: Network, mem_bw: float = math.inf) -> DeviceSpec:
    """A master probe as a device: conv tables (if measured), its measured dense rate,
    and the memory rate `mem_bw` (B/s; inf: not measured)."""
    rate = head_rate(net, master.batch, master.dense_s, mem_bw)
    return device_spec("master", master.timings, net, master.batch, 1, rate, mem_bw)


def cluster_probe_from_dict(data: dict[str, Any]) -> ClusterProbe:
    """Inverse of ``asdict`` (for the JSON cache)."""
    workers = [WorkerProbe(**{**w, "timings": [ShardTiming(**t) for t in w["timings"]],
                              "trunk": TrunkTiming(**w["trunk"]) if w.get("trunk") else None,
                              "spread": {int(k): v for k, v in w.get("spread", {}).items()}})
               for w in data["workers"]]
    master = data["master"]
    master = MasterProbe(**{**master, "timings": [ShardTiming(**t) for t in master["timings"]]})
    spread = {int(k): v for k, v in data["store"].get("spread", {}).items()}  # JSON keys
    store = {**data["store"], "spread": spread}
    return ClusterProbe(**{**data, "workers": workers, "store": StoreProbe(**store),
                           "dask": DaskProbe(**data["dask"]), "master": master})
