"""Peak memory per device: what a worker holds, counted op by op.

Why a count rather than a rule of thumb: measured, a worker holding half of a
network's kernels held as much as plain PyTorch
holding all of it. Where the bytes go depends on what the engine keeps between ops
(a full-size input gradient kept alive by the own slice that views it, the
partials and reads a backward op holds until it ends, the flat gradient and its
reduced copy), so the model walks each device's ops in the engine's order and tracks
every tensor the implementation allocates and frees (`Live`), as of the code measured
(a shard keeps less than autograd keeps and drops its
kernel gradients once stepped, `data` hands its gradient on range by range, the
master reads only the dense layers); the peak of that walk, plus what a process
holds before any tensor, is the prediction.

Per device, by kind (`Footprint.parts` at the peak):

- ``baseline``: a bare Python process that imported torch, dask, zarr and xarray
  (286 MB measured here: `PROCESS_BASELINE`); for a worker, a child forked from one
  that imported what a worker imports, as the workers are forked (182 MB:
  `WORKER_BASELINE`);
- ``runtime``: what the project's process holds beyond that with no network to
  speak of (a Dask worker running the tasks; or the training process itself for
  `reference`): measured (`MemoryConstants`); a process that runs autograd's engine
  (the master's dense head, a replica) holds what its first backward allocated too;
- ``load``: the checkpoint read at the start (the dense layers' and its shards'
  slices on the master, a shard's slices elsewhere, the whole network's on a replica
  and in `reference`), the share still resident (`MemoryConstants.load_retained`);
- ``weights``, ``gradients``, ``momentum``: the device's parameters (its kernels'
  shards, the dense head on the master, a whole replica for `data`);
- ``activations``: tensors a forward keeps for its backward;
- ``backward``: gradients in flight (pool/ReLU backward, input gradients);
- ``exchange``: slots read from and copies written to the workspace, and flat
  gradients of the reduction;
- ``workspace``: the convolution library's scratch, a fitted multiple of a conv
  op's output (and input gradient) (`MemoryConstants.conv_workspace`).

What comes and goes within a step is scaled by a fitted retention (the allocator
keeps freed pages), except what glibc maps apart (tensors above its mmap threshold):
the peak of resident memory, not of live tensors.

Pure: a function of the network, the batch, the element size and the split, by the
kind of work a device holds (`kernel_footprint`, `replica_footprint`,
`reference_footprint`); each strategy says which count is its own
(`Strategy.peak_memory`, pipeline/strategies/). `fits` and `move_to_fit`
(pipeline/placement/memory_fit.py) use it to keep a split inside each device's capacity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .network import ConvLayer, Network

__all__ = ["MIB", "MB", "PROCESS_BASELINE", "WORKER_BASELINE",
           "MemoryConstants", "Footprint", "Live", "kernel_footprint", "replica_footprint",
           "reference_footprint", "kernel_device_peak", "replica_device_peak",
           "hybrid_device_peak", "reference_peak", "DEFAULT_CONSTANTS"]

MIB = 2 ** 20
MB = 10 ** 6
#: A bare process that imported torch, dask, zarr and xarray (measured on this
#: project's machine): subtracted from a peak to give "working" memory.
PROCESS_BASELINE = 286 * 10 ** 6
#: A child forked from a bare process that imported what a worker imports
#: (`tasks.memory.WORKER_MODULES`: no xarray or pandas; pipeline/records/memory.py's worker
#: baseline, Intel host): what a worker forked from the embedded cluster's fork server
#: starts with. Less than the unforked process (259 MB): a forked child maps its
#: parent's library pages only once it touches them.
WORKER_BASELINE = 182 * 10 ** 6
#: Bytes of a max-pool index (int64).
INDEX_BYTES = 8
#: Bytes per element of a shard's mask of where its output is positive (bool).
MASK_BYTES = 1


@dataclass(frozen=True)
class MemoryConstants:
    """What the count cannot derive from shapes, measured (benchmarks/memory_fit.py).

    worker_runtime : bytes a Dask worker process running the project's tasks holds
        beyond `worker_baseline`, whatever the network (the worker's own state, modules the
        tasks import, oneDNN's kernels, the allocator's retained pages).
    client_runtime : the same for the training process that runs `reference` in
        itself (it also holds the run's records and the dataset's index).
    conv_workspace : the convolution library's scratch while a conv op runs (oneDNN
        reorders to and from its blocked layouts): this multiple of the op's output
        in forward, of its output gradient plus input gradient in backward.
    retention : what a process holds of the bytes that come and go within a step,
        per byte counted: glibc keeps freed chunks below its mmap threshold in its
        arenas, so resident memory stays above the live tensors (`retained`).
    mmap_threshold : above it glibc maps a tensor apart and hands it back when freed
        (its dynamic threshold rises to at most 32 MiB): the surplus of `retention`
        falls away there (`retained`; measured, not fitted).
    load_retained : the fraction of the checkpoint it read at the start that a
        process still holds (Zarr decodes it chunk by chunk, a channel quantum at a
        time, on the heap): a shard its slices, the master also the dense layers,
        a replica and `reference` the whole network's weights and momentum.
    The runtimes, the workspace, the retention and the checkpoint's share kept were
    fitted together (benchmarks/memory_fit.py, docs/model.md): the runtimes on the
    small network, whose tensors are a few MB; the others on the paper network;
    refitted after shrink 9 (workers without torch.optim, whose import of
    torch._dynamo had been 74-76 MB of every worker's runtime; a shard's kernel
    gradients and ReLU mask; a replica's gradient range by range) on both networks at
    batch 32 and the small one at 128, and again with autograd's engine and the mmap
    threshold counted, on the median of three or more runs per case
    (docs/benchmarks.md, "Memory per worker"); refitted again with the workers forked
    from one server, which no
    longer hold the command's own modules (about 60 MB each), on the medians of
    three runs of every case, the paper network at batch 32 and the small one at 128
    (docs/benchmarks.md, "Memory per worker"); and again once the workers
    no longer ran the command's main module and their baseline was a forked child (a
    worker's runtime now includes the library pages its work touches), on the medians
    of two runs of every case, both networks at batch 32 and the small one at 128
    (docs/benchmarks.md, "Memory per worker").
    gpu_context : device memory a CUDA context takes before any tensor (an
        assumption, not measured here).
    """

    baseline: float = PROCESS_BASELINE
    worker_baseline: float = WORKER_BASELINE
    worker_runtime: float = 45 * 10 ** 6
    client_runtime: float = 130 * 10 ** 6
    conv_workspace: float = 0.25
    retention: float = 1.75
    load_retained: float = 0.5
    autograd_runtime: float = 5.5 * 10 ** 6
    mmap_threshold: float = 32 * MIB
    gpu_context: float = 500 * 10 ** 6


DEFAULT_CONSTANTS = MemoryConstants()


@dataclass
class Live:
    """Tensors alive on a device, by name and kind, and the peak of their sum."""

    sizes: dict[str, tuple[str, float]] = field(default_factory=dict)
    total: float = 0.0
    peak: float = 0.0
    at_peak: list[tuple[str, float]] = field(default_factory=list)  # (kind, bytes) each

    def alloc(self, name: str, kind: str, nbytes: float) -> None:
        if nbytes <= 0:
            return
        self.free(name)
        self.sizes[name] = (kind, float(nbytes))
        self.total += nbytes
        if self.total > self.peak:
            self.peak = self.total
            self.at_peak = list(self.sizes.values())

    def free(self, *names: str) -> None:
        for name in names:
            entry = self.sizes.pop(name, None)
            if entry is not None:
                self.total -= entry[1]

    def transient(self, name: str, kind: str, nbytes: float) -> None:
        """A tensor that lives only while one operation runs."""
        self.alloc(name, kind, nbytes)
        self.free(name)

    def by_kind(self) -> dict[str, float]:
        parts: dict[str, float] = {}
        for kind, nbytes in self.sizes.values():
            parts[kind] = parts.get(kind, 0.0) + nbytes
        return parts


@dataclass(frozen=True)
class Footprint:
    """Predicted peak bytes per device (baseline and runtime included) and what the
    peak consists of."""

    per_device: list[float]
    parts: list[dict[str, float]]

    def working(self, baseline: float = PROCESS_BASELINE) -> list[float]:
        """The peaks less the bare process ("working" memory)."""
        return [p - baseline for p in self.per_device]

    @property
    def largest(self) -> float:
        return max(self.per_device) if self.per_device else 0.0


def _layer_sizes(layer: ConvLayer, batch: int, kernels: float, s: int) -> dict[str, float]:
    conv = layer.conv_elements(batch, kernels) * s
    pooled = layer.output_elements(batch, kernels) * s
    return {"input": layer.input_elements(batch) * s, "z": conv,
            "relu": conv if layer.pool > 1 else 0.0, "y": pooled,
            "index": (layer.output_elements(batch, kernels) * INDEX_BYTES
                      if layer.pool > 1 else 0.0),
            "mask": layer.output_elements(batch, kernels) * MASK_BYTES}


#: Kinds held for the whole run; every other kind comes and goes within a step.
LASTING = ("weights", "gradients", "momentum")


def retained(nbytes: float, retention: float, threshold: float) -> float:
    """What a process holds for a tensor of `nbytes` that comes and goes within a step:
    `retention` times it on glibc's heap, below its mmap `threshold`; a tensor above
    the threshold is mapped apart and handed back when freed, so its surplus falls
    away, one byte per byte above the threshold. Never less for a larger tensor, so a
    device's predicted peak never rises as its share shrinks (placement moves units
    off a device on that promise)."""
    surplus = (retention - 1.0) * min(nbytes, threshold)
    if nbytes > threshold:
        surplus = max(0.0, surplus - (nbytes - threshold))
    return nbytes + surplus


def _finish(live: Live, extra: dict[str, float], retention: float = 1.0,
            threshold: float = math.inf) -> tuple[float, dict[str, float]]:
    """The peak with the process's own bytes (`extra`), by kind; each tensor that comes
    and goes within a step as `retained` (the allocator keeps freed pages)."""
    parts = dict(extra)
    for kind, nbytes in live.at_peak:
        kept = nbytes if kind in LASTING else retained(nbytes, retention, threshold)
        parts[kind] = parts.get(kind, 0.0) + kept
    return sum(parts.values()), parts


def kernel_device_peak(network: Network, batch: int, counts: Sequence[float], master: bool,
                       holders: Sequence[Sequence[int]] | None = None, s: int = 4,
                       constants: MemoryConstants = DEFAULT_CONSTANTS,
                       gpu: bool = False) -> tuple[float, dict[str, float]]:
    """A `kernel` (or `single`) device's peak: `counts[l]` kernels of conv layer l,
    the dense head if `master`. `holders[l]` lists the kernel counts of every device
    of layer l (whose slices this device reads and writes); None: this device alone.

    The walk follows tasks/kernel_ops.py and tasks/conv_shard.py: forward gathers the
    layer input (its own output and the others' read, concatenated; with no other
    holder the own output is the input), keeps the input, a mask of where its output
    is positive and the pool's indices until that layer's backward (the conv output,
    over which the ReLU ran in place, is freed once pooled; without a pool it is the
    output), and keeps the output only until the layer above has gathered it; the
    master reads only the dense layers from the checkpoint, gathers the features and
    keeps its gradient slice (a view of the whole gradient); backward sums the upper
    layer's partials (held, with what was read, until the op ends), runs pool/ReLU
    backward into the conv output's gradient (freeing the mask and the indices), then
    the full-size input gradient and the kernel gradients in one call; the input
    gradient's own slice (a view) keeps it alive until the layer below has read it,
    and the kernel gradients live until the shard's SGD step right after (only the
    dense head's persist between steps).
    """
    layers = network.conv
    holders = holders or [[c] for c in counts]
    last = len(layers) - 1
    live = Live()
    conv_params = [layer.params(int(k)) if k else 0 for layer, k in zip(layers, counts)]
    params = sum(conv_params)
    read = 2 * s * params
    dense = network.dense_params() if master else 0
    params += dense
    read += 2 * s * dense
    live.alloc("weights", "weights", params * s)
    live.alloc("momentum", "momentum", params * s)
    live.alloc("gradients", "gradients", dense * s)
    ws = constants.conv_workspace
    held = [l for l, k in enumerate(counts) if k]
    for l in held:
        sizes = _layer_sizes(layers[l], batch, counts[l], s)
        if l == 0:
            live.alloc("x0", "activations", sizes["input"])
        else:
            below = _layer_sizes(layers[l - 1], batch, 1, s)["y"]
            others = sum(holders[l - 1]) - counts[l - 1]
            if others:  # torch.cat of the own output and the others' read
                live.alloc(f"read{l}", "exchange", below * others)
                live.alloc(f"x{l}", "activations", sizes["input"])
                live.free(f"read{l}", f"y{l - 1}")
            else:  # the own output is the input
                live.free(f"y{l - 1}")
                live.alloc(f"x{l}", "activations", sizes["input"])
        live.alloc(f"z{l}", "activations", sizes["z"])
        live.transient(f"ws{l}", "workspace", ws * sizes["z"])
        if layers[l].pool > 1:
            live.alloc(f"y{l}", "activations", sizes["y"])
            live.alloc(f"index{l}", "activations", sizes["index"])
            live.alloc(f"mask{l}", "activations", sizes["mask"])
            live.free(f"z{l}")
        else:  # the ReLU ran in place: the conv output is the layer's output
            live.free(f"z{l}")
            live.alloc(f"y{l}", "activations", sizes["y"])
            live.alloc(f"mask{l}", "activations", sizes["mask"])
        if not (counts[l + 1] if l < last else master):
            # written to the workspace for the other holders, then dropped
            live.free(f"y{l}")
    feature = _layer_sizes(layers[last], batch, 1, s)["y"]
    if master:
        others = sum(holders[last]) - counts[last]
        live.alloc("features-read", "exchange", feature * others)
        live.alloc("features", "backward", feature * sum(holders[last]))
        live.free("features-read", f"y{last}")
        live.alloc("dense", "backward", batch * sum(d.out_features for d in network.dense) * s * 3)
        live.alloc("grad-features", "backward", feature * sum(holders[last]))
        live.free("dense", "features")
        live.transient("grad-copies", "exchange", feature * max(others, 0))
        if not counts[last]:
            live.free("grad-features")
    for l in reversed(held):
        sizes = _layer_sizes(layers[l], batch, counts[l], s)
        per_kernel_y = _layer_sizes(layers[l], batch, 1, s)["y"]
        if l < last:
            parts = len([k for k in holders[l + 1] if k])
            own = 1 if counts[l + 1] else 0
        else:
            parts, own = 1, 1 if master else 0
        live.alloc(f"grad-in{l}", "exchange", (parts - own) * per_kernel_y * counts[l])
        if parts > 1:  # the reduce-scatter's sum
            live.alloc(f"grad-y{l}", "backward", sizes["y"])
        live.alloc(f"grad-z{l}", "backward", sizes["z"])
        live.free(f"mask{l}", f"index{l}")
        if l > 0:
            live.alloc(f"partial{l}", "backward", sizes["input"])
        live.alloc(f"grad-w{l}", "gradients", conv_params[l] * s)
        live.transient(f"ws-b{l}", "workspace", ws * (sizes["input"] + sizes["z"]))
        if l > 0:
            copies = (sum(holders[l - 1]) - counts[l - 1]) / max(sum(holders[l - 1]), 1)
            live.transient(f"partial-copy{l}", "exchange", sizes["input"] * copies)
        live.free(f"grad-in{l}", f"grad-y{l}", "grad-features", f"partial{l + 1}",
                  f"x{l}", f"grad-z{l}", f"grad-w{l}")
    live.free("partial0")
    if gpu:
        return _finish(live, {"context": constants.gpu_context})
    runtime = constants.worker_runtime + (constants.autograd_runtime if master else 0.0)
    return _finish(live, {"baseline": constants.worker_baseline, "runtime": runtime,
                          "load": constants.load_retained * read}, constants.retention,
                   constants.mmap_threshold)


def _replica_walk(live: Live, network: Network, rows: int, s: int, ws: float) -> None:
    """Forward and backward of a whole replica (nn.Sequential) on `rows` samples, as
    autograd keeps it: per conv layer its input, the ReLU output and the pool's
    indices (the conv output is freed once ReLU ran); the gradients appear during
    backward (set to None before each step)."""
    layers = network.conv
    for l, layer in enumerate(layers):
        sizes = _layer_sizes(layer, rows, layer.out_channels, s)
        if l == 0:
            live.alloc("x0", "activations", sizes["input"])
        live.alloc(f"z{l}", "activations", sizes["z"])
        live.transient(f"ws{l}", "workspace", ws * sizes["z"])
        live.alloc(f"relu{l}", "activations", sizes["relu"])
        if sizes["relu"]:
            live.free(f"z{l}")
        live.alloc(f"index{l}", "activations", sizes["index"])
        live.alloc(f"x{l + 1}", "activations", sizes["y"])
    live.alloc("dense", "activations", rows * sum(d.out_features for d in network.dense) * s * 2)
    live.alloc("grads-dense", "gradients", network.dense_params() * s)
    live.free("dense")
    last = len(layers)
    live.alloc(f"grad-x{last}", "backward", _layer_sizes(layers[-1], rows, layers[-1].out_channels,
                                                        s)["y"])
    for l in reversed(range(len(layers))):
        layer = layers[l]
        sizes = _layer_sizes(layer, rows, layer.out_channels, s)
        live.alloc(f"grad-relu{l}", "backward", sizes["relu"] or sizes["z"])
        live.free(f"grad-x{l + 1}", f"x{l + 1}", f"index{l}")
        live.alloc(f"grad-z{l}", "backward", sizes["z"])
        live.free(f"grad-relu{l}", f"relu{l}", f"z{l}")
        if l > 0:
            live.alloc(f"grad-x{l}", "backward", sizes["input"])
        live.transient(f"ws-b{l}", "workspace", ws * (sizes["input"] + sizes["z"]))
        live.alloc(f"grads{l}", "gradients", layer.params() * s)
        live.free(f"grad-z{l}")
    live.free("x0")


def _reduction(live: Live, nbytes: float, devices: int) -> None:
    """tasks/data_ops.py's reduction of a flat gradient of `nbytes` over `devices`
    (`data`, and `hybrid`'s conv trunk): each other device's range copied out of the
    parameters' .grad and written, one at a time; the own range copied and the .grad
    dropped; the other devices' ranges of its own read and summed; every other summed
    range read and gathered with the own into a flat copy, which becomes the .grad."""
    share = nbytes / devices
    grads = [name for name in list(live.sizes) if name.startswith("grads")]
    for _ in range(devices - 1):
        live.transient("range-copy", "exchange", share)
    live.alloc("own", "exchange", share)
    live.free(*grads)
    live.alloc("reads", "exchange", share * (devices - 1))
    live.alloc("own-sum", "exchange", share)
    live.free("reads", "own")
    live.alloc("gathered-reads", "exchange", share * (devices - 1))
    live.alloc("gathered", "gradients", nbytes)
    live.free("gathered-reads", "own-sum")


def replica_device_peak(network: Network, batch: int, rows: int, devices: int, s: int = 4,
                        constants: MemoryConstants = DEFAULT_CONSTANTS, gpu: bool = False
                        ) -> tuple[float, dict[str, float]]:
    """A `data` device's peak: a whole replica (weights, momentum; gradients from
    its backward on) on `rows` of the batch, then the reduction of tasks/data_ops.py
    (`_reduction`)."""
    live = Live()
    params = network.params() * s
    live.alloc("weights", "weights", params)
    live.alloc("momentum", "momentum", params)
    if rows:
        _replica_walk(live, network, rows, s, constants.conv_workspace)
    else:
        live.alloc("grads", "gradients", params)
    _reduction(live, params, devices)
    extra = ({"context": constants.gpu_context} if gpu else
             {"baseline": constants.worker_baseline,
              "runtime": constants.worker_runtime + constants.autograd_runtime,
              "load": constants.load_retained * 2 * network.params() * s})
    return _finish(live, extra, 1.0 if gpu else constants.retention, constants.mmap_threshold)


def hybrid_device_peak(network: Network, batch: int, rows: int, devices: int, s: int = 4,
                       constants: MemoryConstants = DEFAULT_CONSTANTS, gpu: bool = False
                       ) -> tuple[float, dict[str, float]]:
    """A `hybrid` device's peak, counted more coarsely than `kernel` and `data` (not
    validated by measurement): the conv trunk as a `data` replica on `rows` samples,
    the device's slice (1/devices of the neurons) of every dense layer with its
    gradients and momentum, the gathered features of the whole batch and their
    gradient, and the reduction of the trunk's gradients."""
    live = Live()
    trunk = network.conv_params() * s
    dense = network.dense_params() * s / devices
    for kind in ("weights", "gradients", "momentum"):
        live.alloc(f"dense-{kind}", kind, dense)
    live.alloc("weights", "weights", trunk)
    live.alloc("momentum", "momentum", trunk)
    features = network.features * s
    live.alloc("features", "exchange", features * batch)
    live.alloc("grad-features", "exchange", features * batch / devices)
    trunk_only = Network(network.conv, (), network.name)
    if rows:
        _replica_walk(live, trunk_only, rows, s, constants.conv_workspace)
    live.free("features", "grad-features")
    _reduction(live, trunk, devices)
    extra = ({"context": constants.gpu_context} if gpu else
             {"baseline": constants.worker_baseline,
              "runtime": constants.worker_runtime + constants.autograd_runtime,
              "load": constants.load_retained * 2 * network.params() * s})
    return _finish(live, extra, 1.0 if gpu else constants.retention, constants.mmap_threshold)


def reference_peak(network: Network, batch: int, s: int = 4,
                   constants: MemoryConstants = DEFAULT_CONSTANTS) -> tuple[float, dict[str, float]]:
    """Plain PyTorch in the training process: a replica on the whole batch."""
    live = Live()
    params = network.params() * s
    live.alloc("weights", "weights", params)
    live.alloc("momentum", "momentum", params)
    _replica_walk(live, network, batch, s, constants.conv_workspace)
    return _finish(live, {"baseline": constants.baseline, "runtime": constants.client_runtime,
                          "load": constants.load_retained * 2 * network.params() * s},
                   constants.retention, constants.mmap_threshold)


DevicePeak = Callable[..., tuple[float, dict[str, float]]]


def kernel_footprint(network: Network, batch: int,
                     counts: Sequence[Sequence[int]] | None = None, s: int = 4,
                     master: int = 0, constants: MemoryConstants = DEFAULT_CONSTANTS,
                     gpu: Sequence[bool] | None = None) -> Footprint:
    """Each device's peak under a kernel split: `counts` ``[layer][device]``, None for
    the whole network on one device; `master`, the device with the dense head; `gpu[d]`:
    device d is a GPU (its device memory: tensors and a CUDA context, no process
    baseline)."""
    counts = counts or [[layer.out_channels] for layer in network.conv]
    devices = len(counts[0])
    gpus = list(gpu or [False] * devices)
    keys = [(tuple(row[d] for row in counts), d == master, gpus[d]) for d in range(devices)]
    return _alike_once(keys, lambda mine, on_master, on_gpu: kernel_device_peak(
        network, batch, list(mine), on_master, counts, s, constants, on_gpu))


def replica_footprint(device_peak: DevicePeak, network: Network, batch: int,
                      rows: Sequence[int] | None = None, s: int = 4,
                      constants: MemoryConstants = DEFAULT_CONSTANTS,
                      gpu: Sequence[bool] | None = None) -> Footprint:
    """Each device's peak of replicas counted by `device_peak` (`replica_device_peak`,
    `hybrid_device_peak`) with `rows` of the batch each (None: the whole batch on one)."""
    rows = list(rows) if rows else [batch]
    gpus = list(gpu or [False] * len(rows))
    return _alike_once(list(zip(rows, gpus)), lambda r, on_gpu: device_peak(
        network, batch, r, len(rows), s, constants, on_gpu))


def reference_footprint(network: Network, batch: int, s: int = 4,
                        constants: MemoryConstants = DEFAULT_CONSTANTS) -> Footprint:
    """The training process's own peak (`reference_peak`), as a one-device footprint."""
    peak, parts = reference_peak(network, batch, s, constants)
    return Footprint([peak], [parts])


def _alike_once(keys: list[tuple], count: DevicePeak) -> Footprint:
    """The footprint of devices described by `keys`, counting devices alike in key once
    (a thousand equal devices cost a few counts)."""
    memo: dict[tuple, tuple[float, dict[str, float]]] = {}
    for key in keys:
        if key not in memo:
            memo[key] = count(*key)
    return Footprint([memo[key][0] for key in keys], [memo[key][1] for key in keys])


def element_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name ("float32", "float64", "float16", ...)."""
    digits = "".join(ch for ch in dtype if ch.isdigit())
    return max(1, int(digits) // 8) if digits else 4


def fmt_bytes(nbytes: float) -> str:
    """Bytes as MB/GB with three significant figures (decimal units, as Dask's)."""
    if not math.isfinite(nbytes):
        return "unlimited"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes:.0f} B"
