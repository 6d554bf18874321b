"""Measure this cluster's constants for the cost model, with real Dask tasks.

The analytical model (:mod:`pipeline.costmodel`) predicts a step from device
rates, a store and Dask's latencies.  This module measures those on the
cluster that will run the step, the way the engine will use it:

- **conv shards** (per worker, per layer): forward and backward (+ SGD update)
  of a shard at the real shapes and batch, for the kernel counts the engine
  will run (the even shares for 1..n workers, plus small counts), with as
  many workers measuring at once as will run at once.  A table of times, not
  one FLOP rate, because on CPUs a shard's time is far from linear in its
  kernel count (oneDNN blocks of 8-16 channels; 4 kernels cost as much as 16);
- **the workspace store** (Zarr on the path the engine uses,
  :func:`storage.workspace.default_workspace_path`): per-access latency,
  per-chunk cost and bandwidth of reads and writes, fitted over accesses of
  the engine's array shapes; aggregate bandwidth with every worker at once;
  one batch read from the dataset store (``read_batch``);
- **Dask**: a client round trip of a trivial pinned task; the cost per level
  of a chain of dependent levels of ``P`` tasks (one per worker, each
  depending on the whole level below, as the engine's layers do), fitted as
  ``hop + P * task``; and, as a check, an empty step with the engine's graph;
- **the master** (this process, ``threads`` torch threads): the dense head
  and, for ``strategy: reference``, every conv layer whole.

A probe costs seconds for the small network and about a minute for the
paper's, so :func:`cached_probe` keeps them as JSON files keyed by everything
that changes the figures: host, network shapes, batch, quantum, dtype, the
worker set (names, threads, emulated speeds, resource tag; or the scheduler
address), workspace location and dataset.  The cache directory is
``$CNN_PROBE_CACHE`` or ``~/.cache/dask-cnn/probes``; delete a file (or pass
``refresh=True``) to measure again, e.g. after the machine's load changed.

Worker-side timing functions live here rather than in ``tasks`` because only
the probe runs them; they import nothing from ``pipeline`` beyond this module.
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
from tasks.conv_shard import conv_relu_pool
from tasks.specs import ConvLayerSpec, NetworkSpec

PROBE_VERSION = 1
#: Rough single-thread conv rate used only to budget how long a measurement takes.
_BUDGET_FLOPS = 40e9


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


@dataclass
class DaskProbe:
    """Dask's costs: round trip, per-level hop and per-task cost, empty engine steps.

    ``hop_s`` and ``task_s`` are fitted to the empty steps (see ``fit_overhead``).
    ``level_s[i] = [P, seconds]``: a level of ``P`` tasks in a dependent
    chain; ``skeleton_step_s[i] = [P, seconds]``: an engine step of no-op tasks
    (``layers`` conv layers) driven as the engine drives it.
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
    quantum: int
    workers: list[WorkerProbe]
    store: StoreProbe
    dask: DaskProbe
    master: MasterProbe
    seconds: float = 0.0
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
        """The workspace store, per access and per chunk."""
        s = self.store
        return StoreSpec(
            write_bw=s.concurrent_write_bw, read_bw=s.concurrent_read_bw,
            latency=0.5 * (s.read_latency_s + s.write_latency_s),
            client_write_bw=s.write_bw, client_read_bw=s.read_bw,
            read_chunk=s.read_chunk_s, write_chunk=s.write_chunk_s,
        )

    def dataset_spec(self) -> StoreSpec | None:
        """The dataset store as one batch read costs it (latency only), if measured."""
        return _dataset_store(self.store.dataset_read_s)

    def overhead(self) -> DaskOverhead:
        """Dask's per-task, per-hop and round-trip costs."""
        d = self.dask
        return DaskOverhead(task=d.task_s, hop=d.hop_s, client_round_trip=d.client_round_trip_s)

    def kernel_options(self, **extra: Any) -> Options:
        """Cost-model options of the engine on this cluster (``extra``: more fields)."""
        return Options(quantum=self.quantum, dataset=self.dataset_spec(),
                       overhead=self.overhead(), master_device=self.master_spec(), **extra)

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
            for layer, conv in zip(spec.conv, net.conv):
                k = split_even(layer.kernels, active, self.quantum)[index]
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


def _bytes_per_elem(dtype: str) -> int:
    return int(np.dtype(dtype).itemsize)


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


def _dataset_store(seconds: float | None) -> StoreSpec | None:
    if seconds is None:
        return None
    return StoreSpec(write_bw=math.inf, read_bw=math.inf, latency=seconds)


# -- worker-side timing functions ----------------------------------------------------


def time_shard(spec: ConvLayerSpec, batch: int, kernels: int, dtype: str, input_grad: bool,
               repeats: int, warmup: bool = True, deps: Sequence[Any] = ()) -> dict:
    """Median forward and backward seconds of a shard, as `conv_shard` computes them.

    Forward: conv + ReLU + pool on an input that requires grad (layers > 0).
    Backward: ``autograd.grad`` from a gradient array, then an SGD-with-momentum
    step, like ``conv_backward``.  The worker's emulated slowness is added,
    as the real tasks add it.
    """
    from tasks.worker_state import current_profile

    profile = current_profile()
    torch_dtype = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, spec.in_channels, spec.in_height, spec.in_width,
                    generator=generator, dtype=torch_dtype).to(profile.device)
    weight = (0.05 * torch.randn(kernels, spec.in_channels, spec.kernel_size,
                                 spec.kernel_size, generator=generator, dtype=torch_dtype)
              ).to(profile.device).requires_grad_(True)
    bias = torch.zeros(kernels, dtype=torch_dtype, device=profile.device, requires_grad=True)
    optimizer = torch.optim.SGD([weight, bias], lr=1e-3, momentum=0.9, weight_decay=5e-4)
    grad = np.ones((batch, kernels, spec.out_height, spec.out_width), dtype=dtype)
    forward, backward = [], []
    for attempt in range(repeats + (1 if warmup else 0)):
        sync = torch.cuda.synchronize if profile.device == "cuda" else (lambda: None)
        t0 = time.perf_counter()
        xi = x.detach().requires_grad_(input_grad)
        with torch.enable_grad():
            y = conv_relu_pool(xi, weight, bias, spec)
        sync()
        t1 = time.perf_counter()
        fwd = t1 - t0
        fwd += profile.emulate(fwd)
        t1 = time.perf_counter()
        g = torch.from_numpy(grad).to(profile.device)
        grads = torch.autograd.grad(y, [weight, bias] + ([xi] if input_grad else []),
                                    grad_outputs=g)
        weight.grad, bias.grad = grads[0], grads[1]
        optimizer.step()
        sync()
        bwd = time.perf_counter() - t1
        bwd += profile.emulate(bwd)
        if attempt or not warmup:
            forward.append(fwd)
            backward.append(bwd)
    return {"forward_s": float(np.median(forward)), "backward_s": float(np.median(backward))}


def time_store(path: str, arrays: Sequence[str], repeats: int, which: str = "all",
               deps: Sequence[Any] = ()) -> list[list[float]]:
    """Time reads and writes of Zarr arrays the master created: ``[dir, chunks, bytes, s]``.

    Accesses, per array: the whole array, its first half of channel chunks,
    one chunk (writes are chunk-aligned, as the engine's are).  ``which``:
    ``"all"``, or ``"full"`` (whole-array accesses only: the concurrency probe).
    ``dir`` is 0 for reads, 1 for writes.
    """
    from storage.arrays import open_cached

    rows: list[list[float]] = []
    for name in arrays:
        array = open_cached(path, name)
        shape, chunk = array.shape, array.chunks
        n_chunks = math.ceil(shape[1] / chunk[1])
        spans = [n_chunks] if which == "full" else sorted({n_chunks, max(1, n_chunks // 2), 1})
        for span in spans:
            stop = min(shape[1], span * chunk[1])
            selection = (slice(None), slice(0, stop))
            data = np.random.default_rng(0).standard_normal(
                (shape[0], stop, *shape[2:])).astype(array.dtype)
            for direction in (1, 0):
                times = []
                for _ in range(repeats + 1):
                    t0 = time.perf_counter()
                    if direction:
                        array[selection] = data
                    else:
                        array[selection]
                    times.append(time.perf_counter() - t0)
                rows.append([direction, span, data.nbytes, float(np.median(times[1:]))])
    return rows


def time_dataset(path: str, batch: int, repeats: int, deps: Sequence[Any] = ()) -> float:
    """Median seconds of one random batch through ``read_batch`` (warm cache, as in training)."""
    from storage.datasets import open_dataset_info, read_batch

    samples = open_dataset_info(path).train_samples
    rng = np.random.default_rng(1)
    times = []
    for _ in range(repeats + 1):
        indices = rng.choice(samples, size=min(batch, samples), replace=batch > samples)
        t0 = time.perf_counter()
        read_batch(path, "train", indices)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:]))


def noop(*args: Any, deps: Sequence[Any] = ()) -> int:
    """A trivial task (its deps arrive as arguments, as the engine's receipts do)."""
    return 0


# -- probing the master ----------------------------------------------------------------


def _repeats_for(seconds: float) -> tuple[int, bool]:
    """Repeats and whether to warm up, for a measurement of about ``seconds``."""
    if seconds < 0.05:
        return 5, True
    if seconds < 0.5:
        return 3, True
    if seconds < 3.0:
        return 2, True
    return 1, False


def _estimate_s(spec: ConvLayerSpec, batch: int, kernels: int) -> float:
    out_px = spec.conv_height * spec.conv_width
    macs = batch * out_px * kernels * spec.in_channels * spec.kernel_size ** 2
    return 3 * 2 * macs / _BUDGET_FLOPS


def probe_master(network: NetworkSpec, batch: int, threads: int = 1, conv: bool = True,
                 dataset: str | None = None) -> MasterProbe:
    """Time the master's own work in this process with ``threads`` torch threads.

    ``conv``: also time every conv layer whole (what ``strategy: reference``
    runs); the dense head is always timed (forward, backward, SGD step).  The
    process's torch thread count is restored afterwards.
    """
    from pipeline.network import dense_head
    from tasks.worker_state import configure_process

    before = torch.get_num_threads()
    configure_process(threads)
    try:
        timings = []
        if conv:
            for index, layer in enumerate(network.conv):
                repeats, warmup = _repeats_for(_estimate_s(layer, batch, layer.kernels) / threads)
                r = time_shard(layer, batch, layer.kernels, network.dtype, index > 0, repeats,
                               warmup)
                timings.append(ShardTiming(index, layer.kernels, 1, r["forward_s"],
                                           r["backward_s"]))
        dense_s = _time_dense(dense_head(network)[0], network, batch)
        read_s = time_dataset(dataset, batch, 5) if dataset else None
    finally:
        torch.set_num_threads(before)
    return MasterProbe(threads, batch, dense_s, timings, read_s, created=time.time())


def _time_dense(head: torch.nn.Module, network: NetworkSpec, batch: int,
                repeats: int = 7) -> float:
    """Median seconds of the dense head's forward, backward and SGD step (DenseHead.step)."""
    dtype = getattr(torch, network.dtype)
    features = torch.randn(batch, network.flat_features, dtype=dtype)
    labels = torch.randint(0, network.classes, (batch,))
    optimizer = torch.optim.SGD(head.parameters(), lr=1e-3, momentum=0.9, weight_decay=5e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        x = features.detach().clone().requires_grad_(True)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(head(x), labels)
        loss.backward()
        optimizer.step()
        x.grad.numpy()
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:]))


# -- probing the cluster ---------------------------------------------------------------


class _Submitter:
    """Pinned, impure submissions with unique keys (as the engine submits)."""

    def __init__(self, client: Any, slots: Sequence[Any]) -> None:
        self.client, self.slots = client, list(slots)
        self.tag = uuid.uuid4().hex[:8]
        self.count = 0

    def __call__(self, function: Any, index: int, *args: Any, **kwargs: Any) -> Any:
        slot = self.slots[index]
        self.count += 1
        return self.client.submit(function, *args, workers=[slot.address],
                                  resources={slot.resource: 1}, allow_other_workers=False,
                                  pure=False, key=f"probe-{function.__name__}-{self.tag}-"
                                  f"{self.count}", **kwargs)


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
        if _estimate_s(layer, batch, k) < 0.5 or k == quantum:
            rounds.append((n, [k] * n))
        k *= 2
    # a point between the share of n workers and the whole layer, for uneven splits
    if n > 1:
        middle = quantum * int(round((layer.kernels / n + layer.kernels) / 2 / quantum))
        if middle not in shares and 0 < middle < layer.kernels and \
                _estimate_s(layer, batch, middle) < 1.0:
            rounds.append((n, [middle] * n))
    return rounds


def probe_compute(client: Any, slots: Sequence[Any], network: NetworkSpec, batch: int,
                  quantum: int) -> list[WorkerProbe]:
    """Shard times per worker: rounds in lockstep, each after the previous one."""
    submit = _Submitter(client, slots)
    n = len(slots)
    previous: list[Any] = []
    jobs = []
    for index, layer in enumerate(network.conv):
        for active, counts in _kernel_points(layer, n, quantum, batch):
            current = []
            for worker, k in enumerate(counts[:active]):
                repeats, warmup = _repeats_for(_estimate_s(layer, batch, k))
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


def _nonneg_fit(rows: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (dropping negative ones, refitting)."""
    keep = list(range(rows.shape[1]))
    coef = np.zeros(rows.shape[1])
    while keep:
        solution, *_ = np.linalg.lstsq(rows[:, keep], t, rcond=None)
        if (solution >= 0).all():
            coef[keep] = solution
            return coef
        keep.pop(int(np.argmin(solution)))
    return coef


def fit_store(rows: Sequence[Sequence[float]], direction: int) -> tuple[float, float, float]:
    """``(latency, per-chunk s, bandwidth B/s)`` from ``time_store`` rows of one direction."""
    data = np.array([r for r in rows if int(r[0]) == direction], dtype=float)
    design = np.stack([np.ones(len(data)), data[:, 1], data[:, 2]], axis=1)
    latency, chunk, per_byte = _nonneg_fit(design, data[:, 3])
    if per_byte <= 0:  # degenerate fit: charge the bytes instead of the chunks
        per_byte = float(np.median(data[:, 3] / data[:, 2]))
    return float(latency), float(chunk), float(1.0 / per_byte)


def probe_store(client: Any, slots: Sequence[Any], network: NetworkSpec, batch: int,
                quantum: int, workspace_dir: str | None = None, dataset: str | None = None,
                repeats: int = 3) -> StoreProbe:
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
    shapes = [(layer.in_channels, layer.in_height, layer.in_width) for layer in network.conv[1:]]
    shapes += [(layer.kernels, layer.out_height, layer.out_width) for layer in network.conv]
    for worker in range(len(slots)):
        names[worker] = []
        for i, (channels, h, w) in enumerate(shapes):
            for kind, chunk in (("q", min(quantum, channels)), ("whole", channels)):
                name = f"w{worker}/{kind}{i}"
                create_array(root, name, (batch, channels, h, w), (batch, chunk, h, w),
                             network.dtype)
                names[worker].append(name)
    submit = _Submitter(client, slots)
    try:
        solo = client.gather(submit(time_store, 0, path, names[0], repeats))
        read = fit_store(solo, 0)
        write = fit_store(solo, 1)
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
        concurrent_write_bw=max(concurrent[1], write[2]), dataset_read_s=dataset_s)


def probe_dask(client: Any, slots: Sequence[Any], layers: int = 2, round_trips: int = 30,
               levels: int = 12, repeats: int = 3) -> DaskProbe:
    """Round trip, per-level cost of dependent chains and empty steps for 1..n workers.

    The chains are recorded as measured; ``hop`` and ``task`` come from the
    empty engine steps (:func:`fit_overhead`), which is what the model charges.
    """
    submit = _Submitter(client, slots)
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
            t0 = time.perf_counter()
            previous: list[Any] = []
            for _level in range(levels):
                previous = [submit(noop, w, deps=previous) for w in range(active)]
            client.gather(previous)
            runs.append((time.perf_counter() - t0 - round_trip) / (levels - 1))
        level_s.append([active, float(np.median(runs))])
    skeleton = [[active, skeleton_step(client, slots[:active], layers)]
                for active in range(1, n + 1)]
    hop, task = fit_overhead(skeleton, round_trip, layers)
    return DaskProbe(round_trip, hop, task, level_s, skeleton, layers)


def fit_overhead(skeleton: Sequence[Sequence[float]], round_trip: float, layers: int
                 ) -> tuple[float, float]:
    """``(hop, task)`` so that the model's overhead reproduces the empty engine steps.

    The cost model charges a step ``round_trip + (2L - 1) hop + 2 L P task``
    (:mod:`pipeline.costmodel.kernel`); fitted (non-negative least squares)
    to empty steps measured with ``P = 1..n`` workers and the round trip
    measured alone.  One worker leaves one equation: it all goes to ``hop``.
    """
    ps = np.array([p for p, _ in skeleton], float)
    rest = np.array([t for _, t in skeleton], float) - round_trip
    hops = 2 * layers - 1
    if len(ps) < 2:
        return max(float(rest[0]) / max(hops, 1), 0.0), 0.0
    hop, task = _nonneg_fit(np.stack([np.full_like(ps, hops), 2 * layers * ps], axis=1), rest)
    return float(hop), float(task)


def skeleton_step(client: Any, slots: Sequence[Any], layers: int, steps: int = 8) -> float:
    """Median step time of the engine's task graph with no-op tasks (pure orchestration).

    Mirrors ``KernelParallelEngine.step``: submit the forward levels (each
    task on the level below and its own previous backward), gather them with
    the pending backward, then submit the backward levels top-down and return.
    """
    submit = _Submitter(client, slots)
    previous_backward: dict[tuple[int, int], Any] = {}
    pending: list[Any] = []
    ends = []
    last = time.perf_counter()
    for _ in range(steps + 1):
        forward: list[list[Any]] = []
        for layer in range(layers):
            below = forward[layer - 1] if layer else []
            forward.append([submit(noop, i, deps=below + [f for f in
                                   [previous_backward.get((layer, i))] if f is not None])
                            for i in range(len(slots))])
        client.gather(pending + [f for level in forward for f in level])
        above: list[Any] = []
        pending = []
        for layer in reversed(range(layers)):
            current = [submit(noop, i, deps=above) for i in range(len(slots))]
            for i, future in enumerate(current):
                previous_backward[(layer, i)] = future
            pending += current
            above = current
        now = time.perf_counter()
        ends.append(now - last)
        last = now
    client.gather(pending)
    return float(np.median(ends[1:]))


# -- the whole probe and its cache --------------------------------------------------------


def probe_key(network: NetworkSpec, batch: int, quantum: int, workers: Sequence[Any],
              workspace: str, dataset: str | None, extra: str = "") -> str:
    """Cache key: everything that changes the probe's figures (see the module doc)."""
    identity = {"version": PROBE_VERSION, "host": socket.gethostname(),
                "network": asdict(network), "batch": batch, "quantum": quantum,
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
                  quantum: int, workspace_dir: str | None = None,
                  dataset: str | None = None) -> ClusterProbe:
    """Measure everything the model needs on ``slots`` (see the module doc)."""
    from pipeline.cluster import all_local

    started = time.perf_counter()
    workers = probe_compute(client, slots, network, batch, quantum)
    store = probe_store(client, slots, network, batch, quantum, workspace_dir, dataset)
    dask_probe = probe_dask(client, slots, layers=len(network.conv))
    master = probe_master(network, batch, threads=1, conv=False, dataset=dataset)
    where = workspace_location(all_local(list(slots)), workspace_dir)
    key = probe_key(network, batch, quantum, slot_identity(slots), where, dataset)
    return ClusterProbe(key, time.time(), socket.gethostname(), asdict(network), batch, quantum,
                        workers, store, dask_probe, master, time.perf_counter() - started)


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
                 quantum: int, workspace_dir: str | None = None, dataset: str | None = None,
                 refresh: bool = False, cache: bool = True) -> ClusterProbe:
    """:func:`probe_cluster`, reusing a JSON file of an earlier identical probe."""
    from pipeline.cluster import all_local

    where = workspace_location(all_local(list(slots)), workspace_dir)
    key = probe_key(network, batch, quantum, slot_identity(slots), where, dataset)
    path = os.path.join(cache_dir(), f"cluster-{key}.json")
    if cache and not refresh:
        data = _load(path)
        if data is not None and data.get("version") == PROBE_VERSION:
            return cluster_probe_from_dict(data)
    result = probe_cluster(client, slots, network, batch, quantum, workspace_dir, dataset)
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
                        cache: bool = True) -> MasterProbe:
    """:func:`probe_master` (conv layers included), reusing an earlier identical probe."""
    key = probe_key(network, batch, 0, [("master", threads)], "none", dataset)
    path = os.path.join(cache_dir(), f"master-{key}.json")
    if cache and not refresh:
        data = _load(path)
        if data is not None and data.get("key") == key:
            return MasterProbe(**{**data, "timings": [ShardTiming(**t) for t in data["timings"]]})
    result = probe_master(network, batch, threads, conv=True, dataset=dataset)
    result.key = key
    if cache:
        _save(path, asdict(result))
    return result
