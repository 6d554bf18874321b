"""Peak memory of a device holding shards of kernels (`kernel`, `single`): the walk
of tasks/kernel_ops.py and tasks/conv_shard.py, op by op.

Apart from the replicas' count (replica_memory.py) because a shard's walk (inputs
gathered from the other holders, partial gradients summed, the master's dense head)
shares nothing with a whole replica's but the bookkeeping in memory.py.

Two walks: the paper family's (a chain of fast-path layers, `ConvShard`), as measured
and fitted; and `_GraphWalk` for every other network (the zoo: `GraphShard` layers with
batch norm, residual sums, strides and any poolings, a layer graph, dense dropout),
which walks fast-path layers as `ConvShard` holds them too.
"""

from __future__ import annotations

from typing import Sequence

from .memory import (DEFAULT_CONSTANTS, MASK_BYTES, Footprint, Holds, Live, MemoryConstants,
                     alike_once, fast_path, finish_peak, layer_sizes, paper_family, tail_sizes)
from .network import ConvLayer, Network


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
    holders = holders or [[c] for c in counts]
    live = Live()
    conv_params, read = _parameters(live, network, counts, master, s)
    ws = constants.conv_workspace
    if paper_family(network):
        _forward(live, network.conv, batch, counts, holders, master, s, ws)
        if master:
            _dense_head(live, network, batch, counts, holders, s)
        _backward(live, network.conv, batch, counts, holders, master, conv_params, s, ws)
        live.free("partial0")
    else:
        walk = _GraphWalk(live, network, batch, counts, holders, master, s, ws)
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
    live.alloc("momentum", "momentum", params * s)
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


def _backward(live: Live, layers: Sequence[ConvLayer], batch: int, counts: Sequence[float],
              holders: Sequence[Sequence[int]], master: bool, conv_params: Sequence[int],
              s: int, ws: float) -> None:
    """Backward over the held layers, top down: the upper layer's partials read and
    summed, pool/ReLU backward, the input gradient and the kernel gradients in one
    call, the input gradient's copies written for the layer below's other holders."""
    last = len(layers) - 1
    for l in reversed([l for l, k in enumerate(counts) if k]):
        sizes = layer_sizes(layers[l], batch, counts[l], s)
        per_kernel_y = layer_sizes(layers[l], batch, 1, s)["y"]
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


class _GraphWalk:
    """A device's walk over any layer graph (tasks/kernel_ops.py with tasks/graph_shard.py
    for the layers off the fast path), in the engine's order: forward up, the head on the
    master, backward down.

    Forward, per layer held: its input (the images, or its source layer's whole output:
    the own output itself where no other device holds any of it, else a gathered copy
    shared by the readers here), held by each reader until its backward; the conv output;
    then either the fast path's output, mask and indices (`ConvShard`, as the paper
    walk), or a `GraphShard`'s tail under autograd: batch norm's output, the residual
    sum, the ReLU's output and each pooling's, of which it keeps the conv output, what
    each backward reads (the ReLU's output, every pooling's input and a max pool's
    indices), batch norm's per-channel statistics, and its output until its own
    backward. A layer's output is held by its readers, its adders (the residual term is
    a view of it until the adder's backward) and the head. Backward sums the parts of
    the output's gradient (the readers' partial input gradients, the adders' residual
    gradients, the head's slice), runs the tail backward into the conv output's
    gradient (and a `GraphShard`'s residual term's gradient, kept for the added layer's
    backward here: the split is tied), then the input gradient, whose own slice keeps
    it alive until the source layer's backward, and the kernel gradients until its SGD
    step."""

    def __init__(self, live: Live, network: Network, batch: int, counts: Sequence[float],
                 holders: Sequence[Sequence[int]], master: bool, s: int, ws: float) -> None:
        self.live, self.holds = live, Holds(live)
        self.network, self.batch, self.counts = network, batch, counts
        self.holders, self.master, self.s, self.ws = holders, master, s, ws
        self.mine = [l for l, k in enumerate(counts) if k]
        self.last = len(network.conv) - 1
        self.inputs: dict[int, str] = {}  # each held layer's input, by name

    def others(self, layer: int) -> float:
        """Kernels of `layer` on the other devices."""
        return sum(self.holders[layer]) - self.counts[layer]

    def my_readers(self, layer: int) -> list[int]:
        return [r for r in self.network.readers(layer) if self.counts[r]]

    def output_bytes(self, layer: int, kernels: float) -> float:
        return self.network.conv[layer].output_elements(self.batch, kernels) * self.s

    # forward ----------------------------------------------------------------------------

    def forward(self) -> None:
        for l in self.mine:
            layer = self.network.conv[l]
            x = self._input(l)
            sizes = layer_sizes(layer, self.batch, self.counts[l], self.s)
            self.live.alloc(f"z{l}", "activations", sizes["z"])
            self.live.transient(f"ws{l}", "workspace", self.ws * sizes["z"])
            if fast_path(layer):
                self._fast_tail(l, sizes)
            else:
                self._graph_tail(l)
            self.inputs[l] = x

    def _input(self, l: int) -> str:
        """The name of layer l's input, gathered or read at its first reader here."""
        src = self.network.source(l)
        readers = self.my_readers(src)
        layer = self.network.conv[l]
        whole = layer.input_elements(self.batch) * self.s
        if src < 0:
            name = "images"
        elif not self.others(src):
            return f"y{src}"  # the own output is the input, held until this backward
        else:
            name = f"x{src}"
        if name not in self.holds.count:  # the first reader here gathers it
            if src >= 0:
                read = whole * self.others(src) / sum(self.holders[src])
                self.live.alloc(f"read{l}", "exchange", read)
            self.holds.alloc(name, "activations", whole, len(readers))
            self.live.free(f"read{l}")
            if src >= 0 and self.counts[src]:
                self.holds.release(f"y{src}")  # the gather's use of the own output
        return name

    def _output_holders(self, l: int, own_backward: bool) -> int:
        """How many later ops here hold layer l's own output."""
        readers = self.my_readers(l)
        held = len(readers) if not self.others(l) else min(1, len(readers))
        held += len([a for a in self.network.adders(l) if self.counts[a]])
        held += 1 if (l == self.last and self.master) else 0
        return held + (1 if own_backward else 0)

    def _fast_tail(self, l: int, sizes: dict[str, float]) -> None:
        """`ConvShard`: the pooled output, the indices and the mask; the conv output freed."""
        live = self.live
        self.holds.alloc(f"y{l}", "activations", sizes["y"], self._output_holders(l, True))
        live.alloc(f"index{l}", "activations", sizes["index"])
        live.alloc(f"mask{l}", "activations", sizes["mask"])
        live.free(f"z{l}")
        self.holds.release(f"y{l}")  # made: only its holders keep it

    def _graph_tail(self, l: int) -> None:
        """`GraphShard`: the tail under autograd, each tensor freed once the next exists
        unless its backward reads it (then held until the layer's backward)."""
        live = self.live
        tail = tail_sizes(self.network.conv[l], self.batch, self.counts[l], self.s)
        sizes, saved, index = tail["tail"], tail["saved"], tail["index"]
        live.alloc(f"stats{l}", "activations", tail["stats"][0])
        first_pool = len(sizes) - len(index)
        for i, nbytes in enumerate(sizes):
            if i < len(sizes) - 1:
                live.alloc(f"t{l}.{i}", "activations", nbytes)
            else:  # the layer's output, held by the shard until its backward
                self.holds.alloc(f"y{l}", "activations", nbytes, self._output_holders(l, True))
            if i >= first_pool:
                live.alloc(f"index{l}.{i}", "activations", index[i - first_pool])
            if i and not saved[i - 1]:
                live.free(f"t{l}.{i - 1}")
        if not sizes:  # nothing follows the conv: its output is the layer's
            self.holds.alloc(f"y{l}", "activations", 0.0, self._output_holders(l, True))

    # the dense head ---------------------------------------------------------------------

    def dense_head(self) -> None:
        """The master's head: the features gathered, the dense layers' forward and
        backward (dropout's masks: a float64 draw over the whole batch, kept as the
        network's dtype with the dropped input), the features' gradient kept as the own
        slice's view and written for the other holders."""
        live, network, s, batch = self.live, self.network, self.s, self.batch
        last = self.last
        whole = self.output_bytes(last, sum(self.holders[last]))
        if self.others(last):
            live.alloc("features-read", "exchange", whole * self.others(last)
                       / sum(self.holders[last]))
            live.alloc("features", "backward", whole)
            live.free("features-read")
        dropped = [d.in_features for j, d in enumerate(network.dense)
                   if network.dense_dropout(j) > 0]
        for j, width in enumerate(dropped):
            live.transient(f"draw{j}", "backward", batch * width * (8 + MASK_BYTES))
            live.alloc(f"dropout{j}", "backward", 2 * batch * width * s)
        live.alloc("dense", "backward", batch * sum(d.out_features for d in network.dense) * s * 3)
        live.alloc("grad-features", "backward", whole)
        live.free("dense", "features", *[f"dropout{j}" for j in range(len(dropped))])
        if self.counts[last]:
            self.holds.release(f"y{last}")
        live.transient("grad-copies", "exchange", whole * self.others(last)
                       / max(sum(self.holders[last]), 1))
        if not self.counts[last]:
            live.free("grad-features")

    # backward ---------------------------------------------------------------------------

    def backward(self, conv_params: Sequence[int]) -> None:
        for l in reversed(self.mine):
            layer = self.network.conv[l]
            sizes = layer_sizes(layer, self.batch, self.counts[l], self.s)
            taken = self._output_gradient(l, sizes["y"])
            if fast_path(layer):
                self.live.alloc(f"grad-z{l}", "backward", sizes["z"])
                self.live.free(f"mask{l}", f"index{l}")
            else:
                self._tail_backward(l, sizes["z"])
            self._conv_backward(l, sizes, conv_params[l])
            self.live.free(*taken, f"grad-y{l}", f"grad-z{l}", f"grad-w{l}", f"stats{l}",
                           f"z{l}")
            self.holds.release(self.inputs[l])
            if not fast_path(layer):
                self.holds.release(f"y{l}")
        self.live.free("grad-features")

    def _output_gradient(self, l: int, own_bytes: float) -> list[str]:
        """The parts of the gradient of the own channels of l's output, summed; returns
        the names the op holds until it ends."""
        live, per_kernel = self.live, self.output_bytes(l, 1)
        parts, held = 0, []
        for reader in self.network.readers(l):
            own = 1 if self.counts[reader] else 0
            if own:
                held.append(f"partial{reader}")
            parts += len([k for k in self.holders[reader] if k])
            reads = len([k for k in self.holders[reader] if k]) - own
            live.alloc(f"grad-in{l}.{reader}", "exchange", reads * per_kernel * self.counts[l])
            held.append(f"grad-in{l}.{reader}")
        for adder in self.network.adders(l):
            parts += 1
            held.append(f"residual{adder}")
        if l == self.last:
            parts += 1
            if self.master:
                held.append("grad-features")
            else:
                live.alloc("grad-head", "exchange", own_bytes)
                held.append("grad-head")
        if parts > 1:  # the reduce-scatter's sum
            live.alloc(f"grad-y{l}", "backward", own_bytes)
        return held

    def _tail_backward(self, l: int, conv_bytes: float) -> None:
        """Autograd through the poolings, the ReLU, the sum and batch norm (each saved
        tensor freed as its node runs) into the conv output's gradient; the residual
        term's gradient (a copy: the sum hands one gradient to both terms) kept for
        the added layer's backward."""
        live, layer = self.live, self.network.conv[l]
        tensors = len(tail_sizes(layer, 1, 1, self.s)["tail"])
        if layer.batch_norm or layer.residual is not None:
            live.alloc(f"tail-grad{l}", "backward", conv_bytes)
        live.free(*[f"t{l}.{i}" for i in range(tensors)],
                  *[f"index{l}.{i}" for i in range(tensors)])
        if layer.residual is not None:
            live.alloc(f"residual{l}", "backward", conv_bytes)
        live.alloc(f"grad-z{l}", "backward", conv_bytes)
        live.free(f"tail-grad{l}")

    def _conv_backward(self, l: int, sizes: dict[str, float], params: float) -> None:
        """The input gradient (full size: its own slice keeps it alive until the source
        layer's backward here) and the kernel gradients in one call; the input
        gradient's slices for the other holders of the source written."""
        live, src = self.live, self.network.source(l)
        if src >= 0:
            live.alloc(f"partial{l}", "backward", sizes["input"])
        live.alloc(f"grad-w{l}", "gradients", params * self.s)
        live.transient(f"ws-b{l}", "workspace", self.ws * (sizes["input"] + sizes["z"]))
        if src >= 0:
            copies = self.others(src) / max(sum(self.holders[src]), 1)
            live.transient(f"partial-copy{l}", "exchange", sizes["input"] * copies)
            if not self.counts[src]:
                live.free(f"partial{l}")


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
    return alike_once(keys, lambda mine, on_master, on_gpu: kernel_device_peak(
        network, batch, list(mine), on_master, counts, s, constants, on_gpu))
