"""Peak memory of a device holding shards of kernels (`kernel`, `single`): the walk
of tasks/kernel_ops.py and tasks/conv_shard.py, op by op.

Apart from the replicas' count (replica_memory.py) because a shard's walk (inputs
gathered from the other holders, partial gradients summed, the master's dense head)
shares nothing with a whole replica's but the bookkeeping in memory.py.

Two walks: the paper family's (a chain of fast-path layers, `ConvShard`), as measured
and fitted; and `GraphWalk` for every other network (the zoo: `GraphShard` layers with
batch norm, residual sums, strides and any poolings, a layer graph, dense dropout),
which walks fast-path layers as `ConvShard` holds them too.
"""

from __future__ import annotations

from typing import Sequence

from .memory import (DEFAULT_CONSTANTS, Footprint, Live, MemoryConstants, alike_once,
                     fast_path, finish_peak, layer_sizes, paper_family)
from .kernel_memory_fold import fold_parts, fold_positions, output_parts
from .kernel_memory_graph import GraphWalk
from .network import ConvLayer, Network


def kernel_device_peak(network: Network, batch: int, counts: Sequence[float], master: bool,
                       holders: Sequence[Sequence[int]] | None = None, s: int = 4,
                       constants: MemoryConstants = DEFAULT_CONSTANTS,
                       gpu: bool = False, me: int = 0) -> tuple[float, dict[str, float]]:
    """A `kernel` (or `single`) device's peak: `counts[l]` kernels of conv layer l,
    the dense head if `master`. `holders[l]` lists the kernel counts of every device
    of layer l (whose slices this device reads and writes), `me` this device's index
    in them (its place in the order its output gradients are summed); None: this
    device alone.

    The walk follows tasks/kernel_ops.py and tasks/conv_shard.py: forward gathers the
    layer input (its own output and the others' read, concatenated; with no other
    holder the own output is the input), keeps the input, a mask of where its output
    is positive and the pool's indices until that layer's backward (the conv output,
    over which the ReLU ran in place, is freed once pooled; without a pool it is the
    output), and keeps the output only until the layer above has gathered it; the
    master reads only the dense layers from the checkpoint, gathers the features and
    keeps its gradient slice (a view of the whole gradient); backward sums the upper
    layer's partials, each folded into the sum as it is read and dropped then
    (kernel_memory_fold.py; the sum, or the one part, held until the op ends), runs pool/ReLU
    backward into the conv output's gradient (freeing the mask and the indices), then
    the full-size input gradient and the kernel gradients in one call; the input
    gradient's own slice (a view) keeps it alive until the layer below has read it,
    and the kernel gradients live until the shard's SGD step right after (only the
    dense head's persist between steps).
    """
    holders = holders or [[c] for c in counts]
    live = Live()
    conv_params, read = _parameters(live, network, counts, master, s)
    ws = constants.workspace(gpu)
    if paper_family(network):
        _forward(live, network.conv, batch, counts, holders, master, s, ws)
        if master:
            _dense_head(live, network, batch, counts, holders, s)
        _backward(live, network, batch, counts, holders, master, conv_params, s, ws, me)
    else:
        walk = GraphWalk(live, network, batch, counts, holders, master, s, ws, me)
        walk.forward()
        if master:
            walk.dense_head()
        walk.backward(conv_params)
    if gpu:
        return finish_peak(live, {"context": constants.gpu_context})
    # the master's head and a `GraphShard`'s tail run autograd's engine
    autograd = master or any(k and not fast_path(layer) for layer, k in zip(network.conv, counts))
    runtime = constants.worker_runtime + (constants.autograd_runtime if autograd else 0.0)
    return finish_peak(live, {"baseline": constants.worker_baseline, "runtime": runtime,
                              "load": constants.load_retained * read}, constants.retention,
                       constants.mmap_threshold)


def _parameters(live: Live, network: Network, counts: Sequence[float], master: bool, s: int
                ) -> tuple[list[int], float]:
    """The device's weights and momentum (its kernels' shards, the dense head on the
    master) and the dense head's gradients, which persist between steps; returns each
    conv layer's parameters and the bytes the device reads from the checkpoint."""
    conv_params = [layer.params(int(k)) if k else 0 for layer, k in zip(network.conv, counts)]
    params = sum(conv_params)
    buffers = sum(layer.buffers(int(k)) for layer, k in zip(network.conv, counts) if k)
    read = 2 * s * params + s * buffers
    live.alloc("buffers", "weights", buffers * s)  # batch norm's running statistics
    dense = network.dense_params() if master else 0
    params += dense
    read += 2 * s * dense
    live.alloc("weights", "weights", params * s)
    live.alloc("momentum", "momentum", network.momentum_elements(params) * s)
    live.alloc("gradients", "gradients", dense * s)
    return conv_params, read


def _forward(live: Live, layers: Sequence[ConvLayer], batch: int, counts: Sequence[float],
             holders: Sequence[Sequence[int]], master: bool, s: int, ws: float) -> None:
    """Forward over the layers the device holds kernels of: the input gathered, the
    conv, the pool (or the ReLU in place), the output dropped once written for the
    other holders when the layer above is not the device's own."""
    last = len(layers) - 1
    for l in [l for l, k in enumerate(counts) if k]:
        sizes = layer_sizes(layers[l], batch, counts[l], s)
        if l == 0:
            live.alloc("x0", "activations", sizes["input"])
        else:
            below = layer_sizes(layers[l - 1], batch, 1, s)["y"]
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


def _dense_head(live: Live, network: Network, batch: int, counts: Sequence[float],
                holders: Sequence[Sequence[int]], s: int) -> None:
    """The master's dense head: the features gathered (the others' read), forward and
    backward of the dense layers, the features' gradient kept as the own slice's view
    and written for the other holders."""
    layers = network.conv
    last = len(layers) - 1
    feature = layer_sizes(layers[last], batch, 1, s)["y"]
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


def _backward(live: Live, network: Network, batch: int, counts: Sequence[float],
              holders: Sequence[Sequence[int]], master: bool, conv_params: Sequence[int],
              s: int, ws: float, me: int) -> None:
    """Backward over the held layers, top down: the upper layer's partials folded into
    their sum as they are read, pool/ReLU backward, the input gradient and the kernel
    gradients in one call, the input gradient's copies written for the layer below's
    other holders."""
    layers = network.conv
    for l in reversed([l for l, k in enumerate(counts) if k]):
        sizes = layer_sizes(layers[l], batch, counts[l], s)
        per_kernel_y = layer_sizes(layers[l], batch, 1, s)["y"]
        parts = output_parts(network, holders, me, master, l, per_kernel_y * counts[l])
        grad = fold_parts(live, parts, f"grad-y{l}", sizes["y"])
        live.alloc(f"grad-z{l}", "backward", sizes["z"])
        live.free(f"mask{l}", f"index{l}")
        if l > 0:
            live.alloc(f"partial{l}", "backward", sizes["input"])
        live.alloc(f"grad-w{l}", "gradients", conv_params[l] * s)
        live.transient(f"ws-b{l}", "workspace", ws * (sizes["input"] + sizes["z"]))
        if l > 0:
            copies = (sum(holders[l - 1]) - counts[l - 1]) / max(sum(holders[l - 1]), 1)
            live.transient(f"partial-copy{l}", "exchange", sizes["input"] * copies)
        live.free(grad, f"x{l}", f"grad-z{l}", f"grad-w{l}")


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
    places = fold_positions(counts)
    keys = [(tuple(row[d] for row in counts), d == master, gpus[d], places[d])
            for d in range(devices)]
    first: dict[tuple, int] = {}  # devices alike in all but their index: the first's
    for d, key in enumerate(keys):
        first.setdefault(key, d)
    return alike_once(keys, lambda *key: kernel_device_peak(
        network, batch, list(key[0]), key[1], counts, s, constants, key[2], first[key]))
