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

- ``baseline``: a bare Python process that imported the pipeline, as the client does
  (310 MB on the Intel host: `PROCESS_BASELINE`); for a worker, a child forked from one
  that imported what a worker imports, as the workers are forked (184 MB:
  `WORKER_BASELINE`); a run's prediction measures both on its own machine
  (pipeline/records/memory.py);
- ``runtime``: what the project's process holds beyond that with no network to
  speak of (a Dask worker running the tasks; or the training process itself for
  `reference`): a tiny run's working memory, measured per machine as the baselines
  are (`MemoryConstants`); a process that runs autograd's engine
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
- ``workspace``: the convolution library's scratch, a multiple of a conv op's output
  (and input gradient) measured per machine (`MemoryConstants.conv_workspace`).

What comes and goes within a step is scaled by a retention (the allocator keeps freed
pages; glibc's and the code's, fitted), except what glibc maps apart (tensors above its
mmap threshold): the peak of resident memory, not of live tensors.

Pure: a function of the network, the batch, the element size and the split. This
module holds what every count shares (the constants, `Live`, `Footprint`, a layer's
tensor sizes, what a process retains); the counts by the kind of work a device holds
are apart, one walk each: pipeline/costmodel/kernel_memory.py (`kernel_footprint`:
shards of kernels) and pipeline/costmodel/replica_memory.py (`replica_footprint`,
`reference_footprint`: whole replicas). Each strategy says which count is its own
(`Strategy.peak_memory`, pipeline/strategies/). `fits` and `move_to_fit`
(pipeline/placement/memory_fit.py) use it to keep a split inside each device's capacity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from .network import ConvLayer, Network

__all__ = ["MIB", "MB", "PROCESS_BASELINE", "WORKER_BASELINE", "MemoryConstants", "Footprint",
           "Live", "Holds", "DevicePeak", "layer_sizes", "tail_sizes", "fast_path",
           "paper_family", "retained", "finish_peak", "alike_once", "element_bytes",
           "fmt_bytes", "DEFAULT_CONSTANTS"]

MIB = 2 ** 20
MB = 10 ** 6
#: A bare process that imported the pipeline (`tasks.memory.CLIENT_IMPORTS`), the
#: client's baseline: measured on the Intel host with the libraries read from disk. A
#: run's prediction takes the machine's own (pipeline/records/memory.py's
#: `machine_memory_constants`); this figure is the fallback, and predict-only sweeps'.
PROCESS_BASELINE = 310 * 10 ** 6
#: A child forked from a bare process that imported what a worker imports
#: (`tasks.memory.WORKER_MODULES`: no xarray or pandas; pipeline/records/memory.py's worker
#: baseline, Intel host): what a worker forked from the embedded cluster's fork server
#: starts with. Less than the unforked process (259 MB): a forked child maps its
#: parent's library pages only once it touches them. Measured per machine as the
#: client's is.
WORKER_BASELINE = 184 * 10 ** 6
#: Bytes of a max-pool index (int64).
INDEX_BYTES = 8
#: Bytes per element of a shard's mask of where its output is positive (bool).
MASK_BYTES = 1
#: Bytes per element of a dropout mask's draw: float32 uniforms (tasks/network.py).
DRAW_BYTES = 4


def mask_draw_bytes(s: int) -> int:
    """Bytes per element a dropout mask's draw holds for a moment beside the mask of
    ``s``-byte elements: none where the mask is float32 (the draw is compared and
    scaled in place into it), the float32 draw where the mask is another dtype."""
    return 0 if s == DRAW_BYTES else DRAW_BYTES


@dataclass(frozen=True)
class MemoryConstants:
    """What the count cannot derive from shapes: measured on the machine at hand where
    they follow the machine, fitted where they are the code's and glibc's alone.

    worker_runtime : bytes a Dask worker process running the project's tasks holds
        beyond `worker_baseline`, whatever the network (the worker's own state, modules the
        tasks import, oneDNN's kernels, the allocator's retained pages).
    client_runtime : the same for the training process that runs `reference` in
        itself (it also holds the run's records and the dataset's index).
    conv_workspace : the convolution library's scratch while a conv op runs (oneDNN
        reorders the input and the output to and from its blocked layouts, a copy
        each): this multiple of the op's output in forward, of its output gradient plus
        input gradient in backward. It follows the CPU (oneDNN picks its kernels and
        layouts by the instruction set), so a run's prediction measures it on its
        machine (`pipeline.records.memory.machine_memory_constants`,
        records/conv_workspace.py: a few layers' passes in a fresh process, pooled);
        the figure here is the Intel host's, where it measures 1.19-1.33 over eight
        processes (with oneDNN held to AVX2 1.20, to SSE4.1 0.94-0.98).
    retention : what a process holds of the bytes that come and go within a step,
        per byte counted: glibc keeps freed chunks below its mmap threshold in its
        arenas, so resident memory stays above the live tensors (`retained`).
    mmap_threshold : above it glibc maps a tensor apart and hands it back when freed
        (its dynamic threshold rises to at most 32 MiB): the surplus of `retention`
        falls away there (`retained`; measured, not fitted).
    load_retained : the fraction of the checkpoint it read at the start that a
        process still holds (read tensor by tensor into fresh arrays on the heap,
        storage/chunk_files.py): a shard its slices, the master also the dense
        layers, a replica and `reference` the whole network's weights and momentum.
    The runtimes are measured per machine too (a tiny run's working memory,
    records/memory_runtime.py: 48 and 92 MB on the Intel host); the figures here (the
    fit's 48 and 116 MB beyond the 184 and 310 MB bare processes of that machine) stay
    for predict-only sweeps and where they cannot be measured.
    `retention` and `load_retained` are the code's and glibc's, not the machine's: the
    sizes and order of what a step allocates and frees, and of the arrays a checkpoint
    is read into, follow the network, the batch and the split; what the heap keeps of
    them follows glibc's malloc (one arena per worker, `MALLOC_ARENA_MAX=1`; its trim
    and mmap thresholds), the same on every Linux machine with glibc; the one part of
    a step that follows the CPU, the conv's scratch, is `conv_workspace`, measured.
    So they are fitted, once, with every other constant as measured
    (`python -m benchmarks.memory_fit --compare FILES --fit`), on the medians of two
    runs of every case of the small network at batch 32 and 128, the paper network at
    32 and resnet20 (width 1 and 0.5) and vgg11 at 32 and 128, each case measured with
    the environment's libraries read from disk, not from the page cache pip left them
    in (docs/model.md, "Memory per device"): 93 of those 93 figures within 15 % with a
    retention of 1.6 and half the checkpoint kept. (A workspace of 0.5 fitted together
    with a retention of 1.7 kept 92: it took the scratch as 0.4x what is measured, the
    larger retention on every other transient making up for it on these runs; the
    measured workspace beside a retention of 1.7 keeps 91.) A process on another C
    library (musl, macOS) keeps freed memory otherwise: there these two are assumptions.
    gpu_context : device memory a CUDA context takes before any tensor (an
        assumption, not measured here).
    gpu_conv_workspace : `conv_workspace` on a GPU, whose convs run in cuDNN, not
        oneDNN: an assumption (no GPU here), the figure once fitted for the CPU.
    """

    baseline: float = PROCESS_BASELINE
    worker_baseline: float = WORKER_BASELINE
    worker_runtime: float = 48 * 10 ** 6
    client_runtime: float = 116 * 10 ** 6
    conv_workspace: float = 1.25
    retention: float = 1.6
    load_retained: float = 0.5
    autograd_runtime: float = 5.5 * 10 ** 6
    mmap_threshold: float = 32 * MIB
    gpu_context: float = 500 * 10 ** 6
    gpu_conv_workspace: float = 0.5

    def workspace(self, gpu: bool) -> float:
        """The conv workspace factor of a GPU device or a CPU one (the CPU's measured:
        it says nothing of cuDNN's)."""
        return self.gpu_conv_workspace if gpu else self.conv_workspace


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


def layer_sizes(layer: ConvLayer, batch: int, kernels: float, s: int) -> dict[str, float]:
    """The bytes of each tensor of conv layer `layer` holding `kernels` kernels on `batch`
    samples of `s`-byte elements (input, conv output, ReLU output, pooled output, the
    pool's indices, the ReLU's mask)."""
    conv = layer.conv_elements(batch, kernels) * s
    pooled = layer.output_elements(batch, kernels) * s
    return {"input": layer.input_elements(batch) * s, "z": conv,
            "relu": conv if layer.pool > 1 else 0.0, "y": pooled,
            "index": (layer.output_elements(batch, kernels) * INDEX_BYTES
                      if layer.pool > 1 else 0.0),
            "mask": layer.output_elements(batch, kernels) * MASK_BYTES}


def fast_path(layer: ConvLayer) -> bool:
    """Whether the engine runs `layer` on its paper-family fast path (tasks/conv_shard.py's
    `ConvShard`: a stride-1 conv with a bias, ReLU, at most one max-pool whose window is
    its stride, fed by the layer before, nothing added), which keeps less than autograd;
    every other layer runs as a `GraphShard` (tasks/graph_shard.py)."""
    pools = layer.pooling
    simple_pool = not pools or (len(pools) == 1 and pools[0].kind == "max"
                                and pools[0].window == pools[0].stride
                                and pools[0].padding == 0)
    return (layer.stride in (1, (1, 1)) and layer.bias and not layer.batch_norm
            and layer.relu and simple_pool and layer.source is None and layer.residual is None)


def paper_family(network: Network) -> bool:
    """Whether every layer is on the fast path and the dense head has no dropout: the
    networks the walks counted first, whose figures were measured and stay as they are."""
    return all(fast_path(layer) for layer in network.conv) and not any(network.dropout)


def tail_sizes(layer: ConvLayer, batch: int, kernels: float, s: int) -> dict[str, list[float]]:
    """The bytes of what follows a conv on `kernels` channels, in order (`tail`: batch
    norm's output, the residual sum, the ReLU's output, each pooling's output; `saved`:
    whether the tail's own backward keeps it, as autograd saves it; `index`: each max
    pool's int64 indices), and batch norm's per-channel mean and inverse deviation
    (`stats`). The last tensor of `tail` is the layer's output."""
    conv = layer.conv_elements(batch, kernels) * s
    tail: list[float] = []
    saved: list[bool] = []
    if layer.batch_norm:
        tail.append(conv)
        saved.append(False)
    if layer.residual is not None:
        tail.append(conv)
        saved.append(False)
    if layer.relu:
        tail.append(conv)
        saved.append(True)  # the ReLU's backward reads its output
    index = []
    for pool, pooled in zip(layer.pooling, layer.pooled_elements(batch, kernels)):
        if tail:
            saved[-1] = True  # every pooling's backward reads its input
        tail.append(pooled * s)
        saved.append(False)
        index.append(pooled * INDEX_BYTES if pool.kind == "max" else 0.0)
    stats = 2 * kernels * s if layer.batch_norm else 0.0
    return {"tail": tail, "saved": saved, "index": index, "stats": [stats]}


class Holds:
    """Tensors of a `Live` that several later ops hold (a layer's output its readers
    keep as their input): each is freed when the last holder lets go."""

    def __init__(self, live: Live) -> None:
        self.live = live
        self.count: dict[str, int] = {}

    def alloc(self, name: str, kind: str, nbytes: float, holders: int) -> None:
        """Allocate `name`, freed at once if nothing holds it (written and dropped)."""
        self.live.alloc(name, kind, nbytes)
        self.count[name] = holders
        if holders <= 0:
            self.release(name)

    def release(self, name: str) -> None:
        left = self.count.get(name, 0) - 1
        self.count[name] = left
        if left <= 0:
            self.live.free(name)


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


def finish_peak(live: Live, extra: dict[str, float], retention: float = 1.0,
            threshold: float = math.inf) -> tuple[float, dict[str, float]]:
    """The peak with the process's own bytes (`extra`), by kind; each tensor that comes
    and goes within a step as `retained` (the allocator keeps freed pages)."""
    parts = dict(extra)
    for kind, nbytes in live.at_peak:
        kept = nbytes if kind in LASTING else retained(nbytes, retention, threshold)
        parts[kind] = parts.get(kind, 0.0) + kept
    return sum(parts.values()), parts


#: A count of one device's peak: ``(bytes, bytes by kind)``.
DevicePeak = Callable[..., tuple[float, dict[str, float]]]


def alike_once(keys: list[tuple], count: DevicePeak) -> Footprint:
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
