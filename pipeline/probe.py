"""Measure this cluster's constants for the cost model, with real Dask tasks.

The analytical model (:mod:`pipeline.costmodel`) predicts a step from shard
times, a store and Dask's latencies.  This module measures those on the
cluster that will run the step, the way the engine uses it:

- **conv shards, workspace store, master** (with a dataset to train on):
  calibration runs of the engine's own tasks (:mod:`pipeline.probe_runs`):
  a few steps per plan (the even split over 1..n workers, plus small and
  lopsided shards where a step is cheap).  Per worker and layer, forward and
  backward (+ SGD update) seconds at each kernel count run, as a table, not
  one FLOP rate: on CPUs a shard's time is far from linear in its kernel
  count (oneDNN blocks of 8-16 channels; 4 kernels cost as much as 16), and a
  synthetic loop reads 15-30 % fast (fresh pages fault expensively in this
  VM).  The store's per-access latency, per-chunk cost and bandwidth, per
  direction, are fitted to every workspace access of those tasks (on the
  engine's own workspace path, :func:`storage.workspace.default_workspace_path`);
  the master's dense head, its own accesses and its batch read come from
  the same steps.
- **without a dataset**: synthetic timing loops of the real shapes on every
  worker at once, Zarr accesses of the engine's array shapes, and the dense
  head in this process (:mod:`pipeline.probe_timing`).
- **Dask**: a client round trip of a trivial pinned task; chains of dependent
  levels of ``P`` tasks (as the engine's layers depend on each other); and
  engine steps of sleeping tasks for ``P = 1..n``, to which the model's
  per-hop and per-task costs are fitted (:func:`pipeline.probe_timing.fit_overhead`).
- **the master for ``strategy: reference``** (:func:`probe_master`, this
  process, ``threads`` torch threads): every conv layer's forward and backward
  timed inside whole steps of the plain network, and the rest of the step.

A probe costs seconds for the small network and a minute or two for the
paper's, so :func:`cached_probe` keeps them as JSON files keyed by everything
that changes the figures: host, torch version, network shapes, batch,
per-layer channel quanta (the workspace's chunking), dtype, the worker set
(names, threads, emulated speeds, resource tag), workspace location and
dataset.  The cache directory is ``$CNN_PROBE_CACHE`` or
``~/.cache/dask-cnn/probes``; delete a file (or pass ``refresh=True``) to
measure again, e.g. after the machine's load changed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from pipeline.costmodel import (DaskOverhead, DeviceSpec, LayerTable, Network, Options,
                                StoreSpec, sequential)
from pipeline.placement import split_even
from pipeline.probe_timing import (Submitter, clock_task, estimate_s, fit_overhead, fit_store,
                                   noop, nonneg_fit, repeats_for, skeleton_step, sleep_task,
                                   time_dataset, time_dense, time_network, time_shard,
                                   time_store)
from tasks.specs import ConvLayerSpec, NetworkSpec

PROBE_VERSION = 3


# -- results -------------------------------------------------------------------------


@dataclass
class ShardTiming:
    """One measured shard: ``kernels`` of ``layer`` while ``active`` workers ran at once."""

    layer: int
    kernels: int
    active: int
    forward_s: float
    backward_s: float


@dataclass
class WorkerProbe:
    """One worker's measured shard times."""

    name: str
    address: str
    threads: int
    emulated_speed: float
    timings: list[ShardTiming] = field(default_factory=list)


@dataclass
class StoreProbe:
    """The workspace store: ``t = latency + chunks * chunk_s + bytes / bw`` per access.

    ``*_bw`` are one client's; ``concurrent_*_bw`` the aggregate with every
    worker at once.  ``dataset_read_s``: one batch through ``read_batch`` on a
    worker (``None``: no dataset given).
    """

    path: str
    read_latency_s: float
    read_chunk_s: float
    read_bw: float
    write_latency_s: float
    write_chunk_s: float
    write_bw: float
    concurrent_read_bw: float
    concurrent_write_bw: float
    dataset_read_s: float | None = None
    master: dict[str, float] = field(default_factory=dict)


@dataclass
class DaskProbe:
    """Dask's costs: round trip, per-level hop and per-task cost, empty engine steps.

    ``hop_s`` and ``task_s`` are fitted to the steps (see ``fit_overhead``).
    ``level_s[i] = [P, seconds]``: a level of ``P`` tasks in a dependent
    chain; ``skeleton_step_s[i] = [P, seconds]``: the orchestration time of an
    engine step (``layers`` conv layers, sleeping tasks) driven as the engine
    drives it.
    """

    client_round_trip_s: float
    hop_s: float
    task_s: float
    level_s: list[list[float]] = field(default_factory=list)
    skeleton_step_s: list[list[float]] = field(default_factory=list)
    layers: int = 0


@dataclass
class MasterProbe:
    """This process with ``threads`` torch threads: dense head, whole conv layers."""

    threads: int
    batch: int
    dense_s: float
    timings: list[ShardTiming] = field(default_factory=list)
    dataset_read_s: float | None = None
    key: str = ""
    created: float = 0.0


@dataclass
class ClusterProbe:
    """Everything measured on one cluster for one network and batch (JSON via ``asdict``)."""

    key: str
    created: float
    host: str
    network: dict[str, Any]
    batch: int
    quanta: list[int]
    workers: list[WorkerProbe]
    store: StoreProbe
    dask: DaskProbe
    master: MasterProbe
    seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    method: str = "runs"
    version: int = PROBE_VERSION

    # conversion to the cost model --------------------------------------------------

    def network_spec(self) -> NetworkSpec:
        """The probed network's shapes."""
        return network_spec_from_dict(self.network)

    def costmodel_network(self) -> Network:
        """The probed network as the cost model describes it."""
        return costmodel_network(self.network_spec())

    def device_specs(self, active: int | None = None) -> list[DeviceSpec]:
        """Cost-model devices of the first ``active`` workers (default all).

        Each conv layer gets a :class:`LayerTable` from the points measured
        with ``active`` workers running at once, completed by the points
        measured with other counts (so interpolation has a full range), and a
        rate (for proportional splits) from its largest point.
        """
        active = len(self.workers) if active is None else active
        return [_device_spec(w.name, w.timings, self.costmodel_network(), self.batch, active)
                for w in self.workers[:active]]

    def store_spec(self) -> StoreSpec:
        """The workspace store as the workers reach it, per access and per chunk."""
        s = self.store
        return _store_spec(asdict(s), s.concurrent_read_bw, s.concurrent_write_bw)

    def master_store_spec(self) -> StoreSpec | None:
        """The workspace store as the master reaches it (``None``: not measured)."""
        s = self.store
        if not s.master:
            return None
        return _store_spec(s.master, s.concurrent_read_bw, s.concurrent_write_bw)

    def dataset_spec(self) -> StoreSpec | None:
        """The dataset store as one batch read costs it (latency only), if measured."""
        return dataset_store(self.store.dataset_read_s)

    def overhead(self) -> DaskOverhead:
        """Dask's per-task, per-hop and round-trip costs."""
        d = self.dask
        return DaskOverhead(task=d.task_s, hop=d.hop_s, client_round_trip=d.client_round_trip_s)

    def kernel_options(self, **extra: Any) -> Options:
        """Cost-model options of the engine on this cluster (``extra``: more fields)."""
        return Options(quantum=list(self.quanta), dataset=self.dataset_spec(),
                       overhead=self.overhead(), master_device=self.master_spec(),
                       master_store=self.master_store_spec(), **extra)

    def master_spec(self) -> DeviceSpec:
        """The master (dense head) as a cost-model device."""
        return self.master_device(self.master)

    def master_device(self, master: MasterProbe) -> DeviceSpec:
        """A master probe as a device: dense rate and whole-layer conv tables."""
        return master_device(master, self.costmodel_network())

    def calibration(self, active: int | None = None) -> dict[str, list[float]]:
        """Seconds per kernel per layer and worker at the even share, like the engine's."""
        active = len(self.workers) if active is None else active
        spec = self.network_spec()
        out: dict[str, list[float]] = {}
        devices = self.device_specs(active)
        net = self.costmodel_network()
        for index, (worker, device) in enumerate(zip(self.workers, devices)):
            row = []
            for layer, conv, quantum in zip(spec.conv, net.conv, self.quanta):
                k = split_even(layer.kernels, active, quantum)[index]
                f, b = device.layer_tables[conv.name].times(k, self.batch)
                row.append((f + b) / k)
            out[worker.name] = row
        return out


# -- conversions ---------------------------------------------------------------------


def network_spec_from_dict(data: dict[str, Any]) -> NetworkSpec:
    """Rebuild a :class:`NetworkSpec` from ``asdict`` output (JSON lists included)."""
    conv = tuple(ConvLayerSpec(**layer) for layer in data["conv"])
    return NetworkSpec(conv, tuple(data.get("hidden", ())), int(data["classes"]),
                       str(data["dtype"]))


def costmodel_network(spec: NetworkSpec) -> Network:
    """The engine's network (conv + ReLU + pool per layer, dense head) for the cost model.

    Layers are named ``conv1``, ``conv2``, ... as the probe's tables are.
    """
    first = spec.conv[0]
    convs = [dict(out_channels=c.kernels, kernel=c.kernel_size, padding=c.padding, pool=c.pool)
             for c in spec.conv]
    net = sequential(first.in_channels, (first.in_height, first.in_width), convs,
                     [*spec.hidden, spec.classes], name="engine")
    for ours, theirs in zip(net.conv, spec.conv):
        if (ours.out_hw, ours.in_channels) != ((theirs.out_height, theirs.out_width),
                                               theirs.in_channels):
            raise ValueError(f"cost model shapes differ from the engine's at {ours.name}")
    return net


def _device_spec(name: str, timings: Sequence[ShardTiming], net: Network, batch: int,
                 active: int, dense_rate: float | None = None) -> DeviceSpec:
    tables, rates = {}, {}
    for index, conv in enumerate(net.conv):
        mine = [t for t in timings if t.layer == index]
        if not mine:
            continue
        exact = {t.kernels for t in mine if t.active == active}
        # prefer the measurements made with the same number of workers running
        points = [(t.kernels, t.forward_s, t.backward_s) for t in mine
                  if t.active == active or t.kernels not in exact]
        table = LayerTable.from_points(batch, points)
        tables[conv.name] = table
        k = table.kernels[-1]
        seconds = table.forward[-1] + table.backward[-1]
        flops = conv.forward(batch, k).flops + conv.backward_weight(batch, k).flops
        if index > 0:
            flops += conv.backward_input(batch, k).flops
        rates[conv.name] = flops / seconds
    mean = float(np.mean(list(rates.values()))) if rates else 1e9
    dense_eff = 1.0 if dense_rate is None else dense_rate / mean
    return DeviceSpec(flops=mean, dense_efficiency=dense_eff, layer_rates=rates,
                      layer_tables=tables, name=name)


def dense_flops(net: Network, batch: int) -> float:
    """FLOPs of the dense head's forward, both backward products (as the model counts)."""
    total = 0.0
    for i, layer in enumerate(net.dense):
        total += layer.forward(batch).flops + layer.backward_weight(batch).flops
        if i > 0 or net.conv:
            total += layer.backward_input(batch).flops
    return total


def master_device(master: MasterProbe, net: Network) -> DeviceSpec:
    """The master as a device: conv tables (if measured) and its measured dense rate."""
    rate = dense_flops(net, master.batch) / master.dense_s
    return _device_spec("master", master.timings, net, master.batch, 1, dense_rate=rate)


def _store_spec(fit: dict[str, Any], concurrent_read: float, concurrent_write: float
                ) -> StoreSpec:
    return StoreSpec(
        write_bw=max(concurrent_write, fit["write_bw"]), read_bw=max(concurrent_read, fit["read_bw"]),
        latency=0.5 * (fit["read_latency_s"] + fit["write_latency_s"]),
        client_write_bw=fit["write_bw"], client_read_bw=fit["read_bw"],
        read_chunk=fit["read_chunk_s"], write_chunk=fit["write_chunk_s"],
    )


def dataset_store(seconds: float | None) -> StoreSpec | None:
    """The dataset store as a latency per batch read (``None``: not measured)."""
    if seconds is None:
        return None
    return StoreSpec(write_bw=math.inf, read_bw=math.inf, latency=seconds)


# -- probing the master ----------------------------------------------------------------


def probe_master(network: NetworkSpec, batch: int, threads: int = 1, conv: bool = True,
                 dataset: str | None = None) -> MasterProbe:
    """Time the master's own work in this process with ``threads`` torch threads.

    ``conv``: time the whole network's training steps (what ``strategy:
    reference`` runs) and split each step by layer (:func:`time_network`);
    otherwise time the dense head alone.  The process's torch thread count is
    restored afterwards.
    """
    from pipeline.network import dense_head
    from tasks.worker_state import configure_process

    before = torch.get_num_threads()
    configure_process(threads)
    try:
        timings = []
        if conv:
            forward, backward, dense_s = time_network(network, batch, dataset, threads)
            timings = [ShardTiming(i, layer.kernels, 1, f, b)
                       for i, (layer, f, b) in enumerate(zip(network.conv, forward, backward))]
        else:
            dense_s = time_dense(dense_head(network)[0], network, batch)
        read_s = time_dataset(dataset, batch, 5) if dataset else None
    finally:
        torch.set_num_threads(before)
    return MasterProbe(threads, batch, dense_s, timings, read_s, created=time.time())


# -- probing the cluster ---------------------------------------------------------------


def _kernel_points(layer: ConvLayerSpec, n: int, quantum: int, batch: int
                   ) -> list[tuple[int, list[int]]]:
    """Measurement rounds of one layer: ``(active, counts per worker)``.

    The even shares the engine uses with 1..n workers, then (all workers at
    once) small counts from one quantum up, for interpolation where another
    split lands, as far as they are cheap.
    """
    rounds: list[tuple[int, list[int]]] = []
    for active in range(1, n + 1):
        if math.ceil(layer.kernels / quantum) >= active:
            rounds.append((active, split_even(layer.kernels, active, quantum)))
    shares = {k for _, counts in rounds for k in counts}
    smallest = min(shares)
    k = quantum
    while k < smallest:
        if estimate_s(layer, batch, k) < 0.5 or k == quantum:
            rounds.append((n, [k] * n))
        k *= 2
    # a point between the share of n workers and the whole layer, for uneven splits
    if n > 1:
        middle = quantum * int(round((layer.kernels / n + layer.kernels) / 2 / quantum))
        if middle not in shares and 0 < middle < layer.kernels and \
                estimate_s(layer, batch, middle) < 1.0:
            rounds.append((n, [middle] * n))
    return rounds


def probe_compute(client: Any, slots: Sequence[Any], network: NetworkSpec, batch: int,
                  quanta: Sequence[int]) -> list[WorkerProbe]:
    """Shard times per worker: rounds in lockstep, each after the previous one."""
    submit = Submitter(client, slots)
    n = len(slots)
    previous: list[Any] = []
    jobs = []
    for index, layer in enumerate(network.conv):
        for active, counts in _kernel_points(layer, n, quanta[index], batch):
            current = []
            for worker, k in enumerate(counts[:active]):
                repeats, warmup = repeats_for(estimate_s(layer, batch, k))
                future = submit(time_shard, worker, layer, batch, k, network.dtype, index > 0,
                                repeats, warmup, deps=previous)
                current.append(future)
                jobs.append((worker, index, k, active, future))
            previous = current
    results = client.gather([job[-1] for job in jobs])
    workers = [WorkerProbe(s.name, s.address, s.threads, s.emulated_speed) for s in slots]
    for (worker, index, k, active, _), r in zip(jobs, results):
        workers[worker].timings.append(ShardTiming(index, k, active, r["forward_s"],
                                                   r["backward_s"]))
    return workers


def probe_store(client: Any, slots: Sequence[Any], network: NetworkSpec, batch: int,
                quanta: Sequence[int], workspace_dir: str | None = None,
                dataset: str | None = None, repeats: int = 3) -> StoreProbe:
    """Store constants on the engine's workspace path, alone and with all workers at once."""
    import zarr

    from pipeline.cluster import all_local
    from storage.arrays import create_array
    from storage.workspace import default_workspace_path, remove_workspace

    run_id = f"probe-{uuid.uuid4().hex[:8]}"
    path = (os.path.join(workspace_dir, f"{run_id}.zarr") if workspace_dir else
            default_workspace_path(os.path.join(os.getcwd(), "runs", run_id), run_id,
                                   all_local(list(slots))))
    root = zarr.open_group(path, mode="w")
    names: dict[int, list[str]] = {}
    # the layers' outputs (act, grad_top, partials are shaped so), chunked per layer
    shapes = [(layer.kernels, layer.out_height, layer.out_width, q)
              for layer, q in zip(network.conv, quanta)]
    for worker in range(len(slots)):
        names[worker] = []
        for i, (channels, h, w, q) in enumerate(shapes):
            for kind, chunk in (("q", min(q, channels)), ("whole", channels)):
                name = f"w{worker}/{kind}{i}"
                create_array(root, name, (batch, channels, h, w), (batch, chunk, h, w),
                             network.dtype)
                names[worker].append(name)
    submit = Submitter(client, slots)
    try:
        solo = client.gather(submit(time_store, 0, path, names[0], repeats))
        read = fit_store(solo, 0)
        write = fit_store(solo, 1)
        mine = time_store(path, names[0], repeats)  # the master's own accesses
        master = dict(zip(("read_latency_s", "read_chunk_s", "read_bw"), fit_store(mine, 0)))
        master.update(zip(("write_latency_s", "write_chunk_s", "write_bw"), fit_store(mine, 1)))
        big = [n for n in names[0] if "/q" in n]
        futures = [submit(time_store, w, path, [n.replace("w0/", f"w{w}/") for n in big], 1,
                          "full") for w in range(len(slots))]
        together = client.gather(futures)
        concurrent = {}
        for direction in (0, 1):
            per_worker = [sum(r[2] for r in rows if r[0] == direction) /
                          sum(r[3] for r in rows if r[0] == direction) for rows in together]
            concurrent[direction] = float(sum(per_worker))
        dataset_s = (client.gather(submit(time_dataset, 0, dataset, batch, 5))
                     if dataset else None)
    finally:
        remove_workspace(path)
        if not workspace_dir and os.path.basename(path) == "workspace.zarr":
            try:
                os.rmdir(os.path.dirname(path))
            except OSError:
                pass
    return StoreProbe(
        path=os.path.dirname(path), read_latency_s=read[0], read_chunk_s=read[1],
        read_bw=read[2], write_latency_s=write[0], write_chunk_s=write[1], write_bw=write[2],
        concurrent_read_bw=max(concurrent[0], read[2]),
        concurrent_write_bw=max(concurrent[1], write[2]), dataset_read_s=dataset_s,
        master=master)


def probe_dask(client: Any, slots: Sequence[Any], layers: int = 2, round_trips: int = 30,
               levels: int = 12, repeats: int = 3) -> DaskProbe:
    """Round trip, dependent chains of levels of 1..n tasks, and engine steps.

    A chain is submitted whole behind a gate (a short sleep task), so that
    the scheduler has every task before the first runs; the tasks' own
    clocks then time each level from the end of the one below (the workers
    must share a clock: true on one host).  The chains are recorded as the
    per-hop cost; the model's ``hop`` and ``task`` are fitted to engine
    steps of sleeping tasks (:func:`skeleton_step`), where submissions
    overlap running tasks as they do in training.
    """
    submit = Submitter(client, slots)
    n = len(slots)
    trips = []
    for i in range(round_trips + 3):
        t0 = time.perf_counter()
        submit(noop, i % n).result()
        trips.append(time.perf_counter() - t0)
    round_trip = float(np.median(trips[3:]))
    level_s = []
    for active in range(1, n + 1):
        runs = []
        for _ in range(repeats):
            gate = submit(sleep_task, 0, 0.05 + 0.002 * levels * active)
            chain: list[list[Any]] = []
            previous: list[Any] = [gate]
            for _level in range(levels):
                previous = [submit(clock_task, w, deps=previous) for w in range(active)]
                chain.append(previous)
            ends = [max(end for _, end in client.gather(level)) for level in chain]
            runs.append(float(np.median(np.diff(ends))))
        level_s.append([active, float(np.median(runs))])
    skeleton = [[active, skeleton_step(client, slots[:active], layers)]
                for active in range(1, n + 1)]
    hop, task = fit_overhead(skeleton, round_trip, layers)
    return DaskProbe(round_trip, hop, task, level_s, skeleton, layers)


# -- the whole probe and its cache --------------------------------------------------------


def probe_key(network: NetworkSpec, batch: int, quanta: Sequence[int], workers: Sequence[Any],
              workspace: str, dataset: str | None, extra: str = "") -> str:
    """Cache key: everything that changes the probe's figures (see the module doc)."""
    identity = {"version": PROBE_VERSION, "host": socket.gethostname(),
                "network": asdict(network), "batch": batch, "quanta": list(quanta),
                "workers": [list(w) for w in workers], "workspace": workspace,
                "dataset": os.path.abspath(dataset) if dataset else None, "extra": extra,
                "torch": torch.__version__}
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def cache_dir() -> str:
    """Where probes are kept: ``$CNN_PROBE_CACHE`` or ``~/.cache/dask-cnn/probes``."""
    return os.environ.get("CNN_PROBE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "dask-cnn", "probes")


def workspace_location(all_local: bool, workspace_dir: str | None = None) -> str:
    """The kind of place the engine's workspace goes (a cache-key part)."""
    if workspace_dir:
        return os.path.abspath(workspace_dir)
    shm = all_local and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
    return "shm" if shm else "output"


def slot_identity(slots: Sequence[Any]) -> list[tuple]:
    """What identifies a worker set for the cache."""
    return [(s.name, s.threads, s.emulated_speed, s.resource) for s in slots]


def probe_cluster(client: Any, slots: Sequence[Any], network: NetworkSpec, batch: int,
                  quanta: Sequence[int], workspace_dir: str | None = None,
                  dataset: str | None = None) -> ClusterProbe:
    """Measure everything the model needs on ``slots`` (see the module doc)."""
    from pipeline.cluster import all_local

    clock = [time.perf_counter()]
    seconds: dict[str, float] = {}

    def lap(name: str) -> None:
        now = time.perf_counter()
        seconds[name] = now - clock[0]
        clock[0] = now

    if dataset:  # calibration runs of the engine's own tasks (pipeline.probe_runs)
        workers, store, master = probe_by_runs(client, slots, network, batch, quanta,
                                               workspace_dir, dataset)
        lap("runs")
        method = "runs"
    else:  # no dataset to run on: synthetic timing loops
        workers = probe_compute(client, slots, network, batch, quanta)
        lap("compute")
        store = probe_store(client, slots, network, batch, quanta, workspace_dir, dataset)
        lap("store")
        master = probe_master(network, batch, threads=1, conv=False, dataset=dataset)
        method = "synthetic"
    dask_probe = probe_dask(client, slots, layers=len(network.conv))
    lap("dask")
    where = workspace_location(all_local(list(slots)), workspace_dir)
    key = probe_key(network, batch, quanta, slot_identity(slots), where, dataset)
    plain = json.loads(json.dumps(asdict(network)))  # as it comes back from the cache
    return ClusterProbe(key, time.time(), socket.gethostname(), plain, batch, list(quanta),
                        workers, store, dask_probe, master, sum(seconds.values()), seconds,
                        method)


def probe_by_runs(client: Any, slots: Sequence[Any], network: NetworkSpec, batch: int,
                  quanta: Sequence[int], workspace_dir: str | None, dataset: str
                  ) -> tuple[list[WorkerProbe], StoreProbe, MasterProbe]:
    """Shard times, store and master figures from calibration runs of the engine.

    Store: ``t = ops * latency + chunks * chunk_s + bytes / bw`` fitted (non-negative
    least squares) per direction to every workspace access of the runs' tasks;
    the master's accesses, of one shape only, give its per-access latency on top
    of the workers' chunk cost and bandwidth.  The runs already include workers
    contending for the store, so the aggregate bandwidth is not a separate floor.
    """
    from pipeline import probe_runs

    records = probe_runs.run_plans(client, slots, network, batch, quanta, dataset,
                                   probe_runs.plans_for(network, batch, quanta, len(slots)),
                                   workspace_dir)
    timings = probe_runs.shard_timings(records)
    workers = [WorkerProbe(s.name, s.address, s.threads, s.emulated_speed,
                           [ShardTiming(*t) for t in timings.get(s.name, [])]) for s in slots]
    rows, dataset_reads = probe_runs.access_rows(records, network, quanta)
    fits = {}
    for direction, name in ((0, "read"), (1, "write")):
        data = np.array([r[1:] for r in rows if r[0] == direction], float)
        latency, chunk, per_byte = nonneg_fit(data[:, :3], data[:, 3])
        bw = 1.0 / per_byte if per_byte > 0 else math.inf
        fits[name] = (float(latency), float(chunk), float(bw))
    mrows, dense, rest = probe_runs.master_rows(records, network, quanta)
    master_fit: dict[str, float] = {}
    for direction, name in ((0, "read"), (1, "write")):
        latency, chunk, bw = fits[name]
        residual = [t - ch * chunk - b / bw for d, _, ch, b, t in mrows if d == direction]
        master_fit.update({f"{name}_latency_s": max(float(np.median(residual)), 0.0),
                           f"{name}_chunk_s": chunk, f"{name}_bw": bw})
    n = len(slots)
    store = StoreProbe(
        path=workspace_dir or "engine default", read_latency_s=fits["read"][0],
        read_chunk_s=fits["read"][1], read_bw=fits["read"][2], write_latency_s=fits["write"][0],
        write_chunk_s=fits["write"][1], write_bw=fits["write"][2],
        concurrent_read_bw=n * fits["read"][2], concurrent_write_bw=n * fits["write"][2],
        dataset_read_s=float(np.median(dataset_reads)), master=master_fit)
    master = MasterProbe(1, batch, float(np.median(dense)), [],
                         float(np.median(rest)), created=time.time())
    return workers, store, master


def cluster_probe_from_dict(data: dict[str, Any]) -> ClusterProbe:
    """Inverse of ``asdict`` (for the JSON cache)."""
    workers = [WorkerProbe(**{**w, "timings": [ShardTiming(**t) for t in w["timings"]]})
               for w in data["workers"]]
    master = data["master"]
    master = MasterProbe(**{**master, "timings": [ShardTiming(**t) for t in master["timings"]]})
    return ClusterProbe(**{**data, "workers": workers, "store": StoreProbe(**data["store"]),
                           "dask": DaskProbe(**data["dask"]), "master": master})


def _load(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def _save(path: str, data: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.{uuid.uuid4().hex[:6]}.tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1)
    os.replace(temporary, path)


def cached_probe(client: Any, slots: Sequence[Any], network: NetworkSpec, batch: int,
                 quanta: Sequence[int], workspace_dir: str | None = None,
                 dataset: str | None = None, refresh: bool = False,
                 cache: bool = True) -> ClusterProbe:
    """:func:`probe_cluster`, reusing a JSON file of an earlier identical probe."""
    from pipeline.cluster import all_local

    where = workspace_location(all_local(list(slots)), workspace_dir)
    key = probe_key(network, batch, quanta, slot_identity(slots), where, dataset)
    path = os.path.join(cache_dir(), f"cluster-{key}.json")
    if cache and not refresh:
        data = _load(path)
        if data is not None and data.get("version") == PROBE_VERSION:
            return cluster_probe_from_dict(data)
    result = probe_cluster(client, slots, network, batch, quanta, workspace_dir, dataset)
    if cache:
        _save(path, asdict(result))
    return result


def find_cached_probe(key: str) -> ClusterProbe | None:
    """A cached cluster probe by key, or None."""
    data = _load(os.path.join(cache_dir(), f"cluster-{key}.json"))
    if data is None or data.get("version") != PROBE_VERSION:
        return None
    return cluster_probe_from_dict(data)


def cached_master_probe(network: NetworkSpec, batch: int, threads: int,
                        dataset: str | None = None, refresh: bool = False,
                        cache: bool = True, measure: bool = True) -> MasterProbe | None:
    """:func:`probe_master` (conv layers included), reusing an earlier identical probe.

    ``measure=False``: only the cache (``None`` if it has no such probe).
    """
    key = probe_key(network, batch, [], [("master", threads)], "none", dataset)
    path = os.path.join(cache_dir(), f"master-{key}.json")
    if cache and not refresh:
        data = _load(path)
        if data is not None and data.get("key") == key:
            return MasterProbe(**{**data, "timings": [ShardTiming(**t) for t in data["timings"]]})
    if not measure:
        return None
    result = probe_master(network, batch, threads, conv=True, dataset=dataset)
    result.key = key
    if cache:
        _save(path, asdict(result))
    return result
