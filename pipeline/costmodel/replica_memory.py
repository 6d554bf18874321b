"""Peak memory of a device holding whole replicas (`data`, `hybrid`'s conv trunk) and
of the training process running `reference`: autograd's walk of the network
(`_replica_walk` for the paper family's chain, `_graph_replica_walk` for any other),
then the flat gradient's reduction of tasks/data_ops.py.

Apart from the kernel count (kernel_memory.py) because a replica's tensors are
autograd's and its exchange is the reduction's, not a shard's gathers.
"""

from __future__ import annotations

from typing import Sequence

from .memory import (DEFAULT_CONSTANTS, DevicePeak, Footprint, Holds, Live, mask_draw_bytes,
                     MemoryConstants, alike_once, finish_peak, layer_sizes, paper_family,
                     tail_sizes)
from .network import Network


def _walk(live: Live, network: Network, rows: int, s: int, ws: float,
          sync_batch_norm: bool) -> None:
    """A whole replica's forward and backward: the paper family's walk as measured
    (`_replica_walk`), any other network's by `_graph_replica_walk`."""
    if paper_family(network):
        _replica_walk(live, network, rows, s, ws)
    else:
        _graph_replica_walk(live, network, rows, s, ws, sync_batch_norm)


def _graph_replica_walk(live: Live, network: Network, rows: int, s: int, ws: float,
                        sync_batch_norm: bool) -> None:
    """Autograd's walk of `SpecNetwork` (tasks/network.py) on any layer graph, `rows`
    samples: per layer, the conv keeps its input (the source layer's output, one tensor
    for all its readers), batch norm the conv output and per-channel statistics, the
    ReLU its output, every pooling its input and a max pool its indices; what no
    backward reads is freed once the next tensor exists (a residual term's layer output
    once the last adder ran). Synchronised batch norm (`data`, `hybrid`) also makes a
    conv-sized deviation in forward (its backward writes the input gradient in place,
    with no temporary of that size). The
    dense head: the dropped inputs and their masks (a float64 draw). Backward: each
    layer's output gradient (summed over its readers and adders as they come), its
    tail's, the conv output's, the input gradient and the parameters' gradients."""
    holds = Holds(live)
    layers = network.conv
    readers = [len(network.readers(l)) for l in range(-1, len(layers))]  # [l + 1]
    last = len(layers) - 1
    holds.alloc("y-1", "activations", layers[0].input_elements(rows) * s, readers[0])
    for l, layer in enumerate(layers):
        conv = layer_sizes(layer, rows, layer.out_channels, s)["z"]
        live.alloc(f"z{l}", "activations", conv)
        live.transient(f"ws{l}", "workspace", ws * conv)
        if layer.batch_norm and sync_batch_norm:
            live.transient(f"deviation{l}", "workspace", conv)
        tail = tail_sizes(layer, rows, layer.out_channels, s)
        sizes, saved, index = tail["tail"], tail["saved"], tail["index"]
        live.alloc(f"stats{l}", "activations", tail["stats"][0])
        names = [f"z{l}"] + [f"t{l}.{i}" for i in range(len(sizes) - 1)] + [f"y{l}"]
        keeps = [layer.batch_norm] + saved
        first_pool = len(sizes) - len(index)
        uses = readers[l + 1] + len(network.adders(l)) + (l == last)
        for i, nbytes in enumerate(sizes):
            if i < len(sizes) - 1:
                live.alloc(names[i + 1], "activations", nbytes)
            else:
                holds.alloc(f"y{l}", "activations", nbytes, uses + (1 if saved[i] else 0))
            if i >= first_pool:
                live.alloc(f"index{l}.{i}", "activations", index[i - first_pool])
            if not keeps[i]:
                live.free(names[i])
        if not sizes:
            holds.alloc(f"y{l}", "activations", conv, uses)
            live.free(f"z{l}")
        if layer.residual is not None:  # the term's last adder has run
            for adder in network.adders(layer.residual)[-1:]:
                if adder == l:
                    holds.release(f"y{layer.residual}")
    _dense_walk(live, network, rows, s)
    holds.release(f"y{last}")
    live.alloc(f"grad-y{last}", "backward", layers[-1].output_elements(rows) * s)
    for l in reversed(range(len(layers))):
        layer = layers[l]
        conv = layer_sizes(layer, rows, layer.out_channels, s)["z"]
        live.alloc(f"tail-grad{l}", "backward", conv)
        live.free(f"grad-y{l}", *[f"t{l}.{i}" for i in range(len(layer.pooling) + 3)],
                  *[f"index{l}.{i}" for i in range(len(layer.pooling) + 3)])
        if layer.residual is not None and f"grad-y{layer.residual}" not in live.sizes:
            live.alloc(f"grad-y{layer.residual}", "backward",
                       layers[layer.residual].output_elements(rows) * s)
        live.alloc(f"grad-z{l}", "backward", conv)
        live.free(f"tail-grad{l}", f"z{l}", f"stats{l}")
        src = network.source(l)
        if src >= 0:
            name = f"grad-y{src}"
            nbytes = layer.input_elements(rows) * s
            if name in live.sizes:  # accumulated into the gradient already there
                live.transient(f"grad-x{l}", "backward", nbytes)
            else:
                live.alloc(name, "backward", nbytes)
        live.transient(f"ws-b{l}", "workspace", ws * (layer.input_elements(rows) * s + conv))
        live.alloc(f"grads{l}", "gradients", layer.params() * s)
        live.free(f"grad-z{l}")
        holds.release(f"y{src}")
        if holds.count.get(f"y{l}", 0) > 0:  # the ReLU's output, read by its backward
            holds.release(f"y{l}")


def _dense_walk(live: Live, network: Network, rows: int, s: int) -> None:
    """The dense head on `rows` samples under autograd: what it keeps (the layers'
    inputs and outputs, a dropout's mask and dropped input, its float32 draw for a
    moment where the mask is of another dtype) until its backward, then the dense gradients."""
    for j, dense in enumerate(network.dense):
        if network.dense_dropout(j) > 0:
            live.transient(f"draw{j}", "activations", rows * dense.in_features * mask_draw_bytes(s))
            live.alloc(f"dropout{j}", "activations", 2 * rows * dense.in_features * s)
    live.alloc("dense", "activations", rows * sum(d.out_features for d in network.dense) * s * 2)
    live.alloc("grads-dense", "gradients", network.dense_params() * s)
    live.free("dense", *[f"dropout{j}" for j in range(len(network.dense))])


def _replica_walk(live: Live, network: Network, rows: int, s: int, ws: float) -> None:
    """Forward and backward of a whole replica (nn.Sequential) on `rows` samples, as
    autograd keeps it: per conv layer its input, the ReLU output and the pool's
    indices (the conv output is freed once ReLU ran); the gradients appear during
    backward (set to None before each step)."""
    layers = network.conv
    for l, layer in enumerate(layers):
        sizes = layer_sizes(layer, rows, layer.out_channels, s)
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
    live.alloc(f"grad-x{last}", "backward", layer_sizes(layers[-1], rows, layers[-1].out_channels,
                                                       s)["y"])
    for l in reversed(range(len(layers))):
        layer = layers[l]
        sizes = layer_sizes(layer, rows, layer.out_channels, s)
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


def _replica_finish(live: Live, network: Network, s: int, constants: MemoryConstants,
                    gpu: bool) -> tuple[float, dict[str, float]]:
    """A replica worker's peak: on a GPU its tensors and a CUDA context; on a CPU also
    the forked worker, its runtime with autograd's engine, and the checkpoint's share
    it still holds (the whole network's weights and momentum)."""
    extra = ({"context": constants.gpu_context} if gpu else
             {"baseline": constants.worker_baseline,
              "runtime": constants.worker_runtime + constants.autograd_runtime,
              "load": constants.load_retained * _checkpoint_bytes(network, s)})
    return finish_peak(live, extra, 1.0 if gpu else constants.retention, constants.mmap_threshold)


def _checkpoint_bytes(network: Network, s: int) -> float:
    """What a replica reads from the checkpoint: weights and momentum, and batch norm's
    running statistics."""
    return (2 * network.params() + network.conv_buffers()) * s


def replica_device_peak(network: Network, batch: int, rows: int, devices: int, s: int = 4,
                        constants: MemoryConstants = DEFAULT_CONSTANTS, gpu: bool = False
                        ) -> tuple[float, dict[str, float]]:
    """A `data` device's peak: a whole replica (weights, momentum; gradients from
    its backward on) on `rows` of the batch, then the reduction of tasks/data_ops.py
    (`_reduction`)."""
    live = Live()
    params = network.params() * s
    live.alloc("weights", "weights", params)
    live.alloc("buffers", "weights", network.conv_buffers() * s)
    live.alloc("momentum", "momentum", network.momentum_elements(params))
    if rows:
        _walk(live, network, rows, s, constants.workspace(gpu), True)
    else:
        live.alloc("grads", "gradients", params)
    _reduction(live, params, devices)
    return _replica_finish(live, network, s, constants, gpu)


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
        live.alloc(f"dense-{kind}", kind,
                   network.momentum_elements(dense) if kind == "momentum" else dense)
    live.alloc("weights", "weights", trunk)
    live.alloc("buffers", "weights", network.conv_buffers() * s)
    live.alloc("momentum", "momentum", network.momentum_elements(trunk))
    features = network.features * s
    live.alloc("features", "exchange", features * batch)
    live.alloc("grad-features", "exchange", features * batch / devices)
    trunk_only = Network(network.conv, (), network.name)
    if rows:
        _walk(live, trunk_only, rows, s, constants.workspace(gpu), True)
    live.free("features", "grad-features")
    _reduction(live, trunk, devices)
    return _replica_finish(live, network, s, constants, gpu)


def reference_peak(network: Network, batch: int, s: int = 4,
                   constants: MemoryConstants = DEFAULT_CONSTANTS) -> tuple[float, dict[str, float]]:
    """Plain PyTorch in the training process: a replica on the whole batch, and the
    heap it keeps from what it does that a worker does not (`reference_extras`)
    beside what its checkpoint's read at the start left (``load``). Those come one
    after another and each one's freed bytes serve the next, so the heap keeps the
    largest of them, not their sum: VGG-11 at a quarter width measured 259-285 MB
    working at batch 32 and 294-295 at 128, where their sum predicted 337 and 388
    and the largest 260 and 311 (`memory-peaks-zoo-2026-11-29-run*.jsonl`)."""
    live = Live()
    params = network.params() * s
    live.alloc("weights", "weights", params)
    live.alloc("buffers", "weights", network.conv_buffers() * s)
    live.alloc("momentum", "momentum", network.momentum_elements(params))
    _walk(live, network, batch, s, constants.conv_workspace, False)
    kept = {"load": constants.load_retained * _checkpoint_bytes(network, s),
            **reference_extras(network, s, constants)}
    largest = max(kept, key=lambda name: kept[name])
    return finish_peak(live, {"baseline": constants.baseline, "runtime": constants.client_runtime,
                              largest: kept[largest]},
                       constants.retention, constants.mmap_threshold)


def reference_extras(network: Network, s: int = 4,
                     constants: MemoryConstants = DEFAULT_CONSTANTS) -> dict[str, float]:
    """Copies of the largest weight tensor the training process makes, one tensor at a
    time, and keeps on glibc's heap after (below its mmap threshold; above it, a copy
    is mapped apart and handed back): torch.optim's SGD step makes ``grad +
    weight_decay * param`` a new tensor (and Nesterov's look-ahead another, both
    alive at once), where the workers' SGD adds the decay in place (tasks/optim.py);
    and a checkpoint's completion reads each tensor back for its checksum, one array
    at a time (storage/checkpoints.mark_complete), which for `reference` runs in the
    training process. Each is one hole of the heap `reference_peak` counts once: VGG-11
    at a quarter width (one 25.7 MB dense matrix) measured 263-264 MB working without
    weight decay and 259-285 MB with it (`memory-peaks-vgg11-weight-decay-2026-11-29.jsonl`)."""
    largest = network.largest_tensor() * s
    if largest > constants.mmap_threshold:
        return {}
    copies = int(network.weight_decay) + int(network.momentum and network.nesterov)
    return {"update copies": copies * largest, "checksum read": largest}


def replica_footprint(device_peak: DevicePeak, network: Network, batch: int,
                      rows: Sequence[int] | None = None, s: int = 4,
                      constants: MemoryConstants = DEFAULT_CONSTANTS,
                      gpu: Sequence[bool] | None = None) -> Footprint:
    """Each device's peak of replicas counted by `device_peak` (`replica_device_peak`,
    `hybrid_device_peak`) with `rows` of the batch each (None: the whole batch on one).
    The reduction's ranges and hybrid's dense slices are shared by the devices given
    rows: one given none leaves the run (`prediction.taking_part`)."""
    rows = list(rows) if rows else [batch]
    gpus = list(gpu or [False] * len(rows))
    taking = max(sum(1 for r in rows if r > 0), 1)
    return alike_once(list(zip(rows, gpus)), lambda r, on_gpu: device_peak(
        network, batch, r, taking, s, constants, on_gpu))


def reference_footprint(network: Network, batch: int, s: int = 4,
                        constants: MemoryConstants = DEFAULT_CONSTANTS) -> Footprint:
    """The training process's own peak (`reference_peak`), as a one-device footprint."""
    peak, parts = reference_peak(network, batch, s, constants)
    return Footprint([peak], [parts])
