"""A `kernel` (or `single`) device's memory walk over any layer graph: the zoo's
networks (batch norm, residual sums, strides, any poolings, dense dropout), as
tasks/kernel_ops.py runs them with tasks/graph_shard.py. kernel_memory.py keeps the
paper family's walk and calls this one for every other network."""

from __future__ import annotations

from typing import Sequence

from .kernel_memory_fold import fold_parts, output_parts
from .memory import Holds, Live, fast_path, layer_sizes, mask_draw_bytes, tail_sizes
from .network import Network

__all__ = ["GraphWalk"]


class GraphWalk:
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
    gradients, the head's slice), each folded into the sum as it is read and dropped
    then (kernel_memory_fold.py), runs the tail backward into the conv output's
    gradient (and a `GraphShard`'s residual term's gradient, kept for the added layer's
    backward here: the split is tied), then the input gradient, whose own slice keeps
    it alive until the source layer's backward, and the kernel gradients until its SGD
    step."""

    def __init__(self, live: Live, network: Network, batch: int, counts: Sequence[float],
                 holders: Sequence[Sequence[int]], master: bool, s: int, ws: float,
                 me: int = 0) -> None:
        self.live, self.holds = live, Holds(live)
        self.me = me  # the device's index in `holders`: its place in each sum's order
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
            live.transient(f"draw{j}", "backward", batch * width * mask_draw_bytes(s))
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
            grad = fold_parts(self.live, output_parts(
                self.network, self.holders, self.me, self.master, l,
                self.output_bytes(l, 1) * self.counts[l]), f"grad-y{l}", sizes["y"])
            if fast_path(layer):
                self.live.alloc(f"grad-z{l}", "backward", sizes["z"])
                self.live.free(f"mask{l}", f"index{l}")
            else:
                self._tail_backward(l, sizes["z"])
            self._conv_backward(l, sizes, conv_params[l])
            self.live.free(grad, f"grad-z{l}", f"grad-w{l}", f"stats{l}",
                           f"z{l}")
            self.holds.release(self.inputs[l])
            if not fast_path(layer):
                self.holds.release(f"y{l}")
        self.live.free("grad-features")

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
