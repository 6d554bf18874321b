"""Kernel-parallel training on a worker: its shards, the dense head, and their ops.

Each op reads its inputs, computes, and hands on its outputs (tasks/layout.py says
which slots exist). Own tensors that a later op of the same step on this worker
needs stay in memory (`KernelWork.kept`), each for as many ops as take it:

- ``conv-forward l``: the layer input is the batch (the layer reads the images,
  read from the dataset by sample index) or the WHOLE output of its source layer,
  every holder's slice concatenated: its own from memory, the others' from the
  workspace; where several layers this worker holds read it, the first gathers it
  and the others reuse it. A layer that adds a residual takes its own channels of
  that layer's output from memory (tied splits: the same worker holds them). Its
  output stays in memory for this worker's later ops (readers, adders, the head)
  and goes to the workspace only if another worker reads it.
- ``dense-head`` (the master): gathers the last layer's outputs, reads the labels,
  runs forward, loss, backward and SGD, and hands each shard its gradient slice.
- ``conv-backward l``: sums its channels' gradient, in a fixed order: the partial
  input gradients of each layer reading l (readers in layer order, each reader's
  holders in worker order), the residual terms' gradients of each layer adding l
  (local), the head's slice for the last layer, each folded into the running sum
  as it is read and dropped then; runs the shard's backward (the
  input and kernel gradients in one call, as autograd), hands the input gradient's
  slices on to the holders of its source layer, then steps SGD.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from storage import checkpoints
from storage.datasets import read_batch, read_labels
from tasks.conv_shard import ConvShard, make_shard
from tasks.graph_shard import COUNTER, GraphShard, buffer_names, checkpoint_key, parameter_names
from tasks.dense_head import DenseHead
from tasks.layout import CONV_BACKWARD, CONV_FORWARD, DENSE_HEAD, KernelLayout, StepOp
from tasks.receipts import TaskClock
from tasks.run_state import RunState, WorkerSide
from tasks.specs import Arithmetic, NetworkSpec


@dataclass
class KernelWork:
    """A worker's work in a kernel-parallel run: its shards and, on the master, the head."""

    shards: dict[int, ConvShard | GraphShard]  # by layer, the layers it holds kernels of
    head: DenseHead | None  # on the master
    keys: list[str]  # each conv layer's module name
    uses: dict[str, int]  # ops per step on this worker that take each kept tensor
    kept: dict[str, torch.Tensor] = field(default_factory=dict)  # own tensors between ops
    left: dict[str, int] = field(default_factory=dict)  # takes left of each kept tensor

    def keep(self, key: str, tensor: torch.Tensor, uses: int = 1) -> None:
        """Keep `tensor` for the next `uses` takes (none: not kept)."""
        if uses > 0:
            self.kept[key], self.left[key] = tensor, uses

    def take(self, key: str) -> torch.Tensor:
        """A kept tensor, forgotten at its last take."""
        tensor = self.kept[key]
        self.left[key] -= 1
        if not self.left[key]:
            del self.kept[key], self.left[key]
        return tensor


def kept_uses(layout: KernelLayout, network: NetworkSpec, me: int) -> dict[str, int]:
    """How many ops of a step on worker `me` take each of its kept tensors:
    ``act/<l>`` (its own slice of layer l's output: the first of its readers here, each
    layer adding it, the head for the last layer) and ``input/<l>`` (layer l's whole
    output, gathered once for every reader of it here; ``input/-1``: the images)."""
    uses: dict[str, int] = {}
    last = layout.layers - 1
    for layer in range(-1, layout.layers):
        readers = [r for r in network.readers(layer) if me in layout.holders(r)]
        uses[f"input/{layer}"] = len(readers)
        if layer >= 0 and me in layout.holders(layer):
            uses[f"act/{layer}"] = (min(1, len(readers)) + len(network.adders(layer))
                                    + (layer == last and me == layout.master))
    return uses


def load(layout: KernelLayout, me: int, network: NetworkSpec, checkpoint_path: str, step: int,
         arithmetic: Arithmetic, device: str) -> KernelWork:
    """This worker's shards (and the head, on the master) from checkpoint `step`."""
    optimizer = arithmetic.optimizer
    keys = network.conv_keys()
    shards = {}
    for layer, row in enumerate(layout.shards):
        shard, spec = row[me], network.conv[layer]
        if shard.size:
            def read(kind: str, name: str) -> np.ndarray:
                start, stop = (0, 1) if name == COUNTER else (shard.start, shard.stop)
                return checkpoints.read_slice(checkpoint_path, step, kind,
                                              checkpoint_key(spec, keys[layer], name),
                                              start, stop)
            params = parameter_names(spec)
            weights = {name: read("weights", name) for name in params + buffer_names(spec)}
            momentum = {name: read("momentum", name) for name in params}
            shards[layer] = make_shard(spec, shard, keys[layer], weights, momentum, optimizer,
                                       device)
    head = None
    if me == layout.master:  # the dense layers' tensors only, not the whole network's
        dense = {f"{name}.{tensor}" for name in network.dense_names
                 for tensor in ("weight", "bias")}
        head = DenseHead(network, optimizer,
                         checkpoints.read_tensors(checkpoint_path, step, "weights", dense),
                         checkpoints.read_tensors(checkpoint_path, step, "momentum", dense),
                         device, arithmetic.seed)
    return KernelWork(shards, head, keys, kept_uses(layout, network, me))


def save(work: KernelWork, me: int, checkpoint_path: str, step: int) -> None:
    """Write this worker's shards (and the head) into checkpoint `step`: each tensor's
    slice of its channels; batch norm's counter (one per layer) by the holder of the
    first channel."""
    for shard in work.shards.values():
        for kind, tensors in shard.state().items():
            for name, value in tensors.items():
                if name == COUNTER and shard.shard.start:
                    continue
                checkpoints.write_slice(checkpoint_path, step, kind, shard.checkpoint_key(name),
                                        0 if name == COUNTER else shard.shard.start, value)
    if work.head is not None:
        for kind, tensors in work.head.state().items():
            for key, value in tensors.items():
                checkpoints.write_slice(checkpoint_path, step, kind, key, 0, value)


def conv_forward(run: RunState, op: StepOp, step: int, indices: np.ndarray,
                 clock: TaskClock) -> None:
    work: KernelWork = run.work
    layer = op.layer
    spec = run.network.conv[layer]
    with clock.op(CONV_FORWARD, layer):
        x = _layer_input(run, layer, step, indices, clock)
        residual = None if spec.residual is None else work.take(f"act/{spec.residual}")
        with clock.phase("compute") as phase:
            y = work.shards[layer].forward(x, input_grad=run.network.source(layer) >= 0,
                                           residual=residual)
        run.emulate(clock, phase.seconds)
        work.keep(f"act/{layer}", y, work.uses[f"act/{layer}"])
        run.mover.write(f"act/{layer}/{run.me}", step, y, clock)


def _layer_input(run: RunState, layer: int, step: int, indices: np.ndarray,
                 clock: TaskClock) -> torch.Tensor:
    """Conv layer `layer`'s input: the images, or its source layer's whole output;
    kept for the other readers of it on this worker."""
    work: KernelWork = run.work
    source = run.network.source(layer)
    key = f"input/{source}"
    if key in work.kept:
        return work.take(key)
    if source < 0:
        with clock.phase("dataset") as phase:
            images = read_batch(run.paths.dataset, "train", indices,
                                run.paths.dataset_identity)[0]
            phase.nbytes = images.nbytes
            images = run.augmentation.apply(images, indices, step)
            x = torch.from_numpy(images).to(run.profile.device)
    else:
        x = _gather(run, source, step, clock)
    work.keep(key, x, work.uses[key] - 1)
    return x


def dense_head(run: RunState, op: StepOp, step: int, indices: np.ndarray,
               clock: TaskClock) -> None:
    work: KernelWork = run.work
    layout: KernelLayout = run.layout
    assert work.head is not None, "the dense head runs on the master only"
    last = layout.layers - 1
    with clock.op(DENSE_HEAD):
        features = _gather(run, last, step, clock)
        with clock.phase("dataset") as phase:
            labels = read_labels(run.paths.dataset, "train", indices,
                                 run.paths.dataset_identity)
            phase.nbytes = labels.nbytes
        with clock.phase("compute") as phase:
            loss, grad = work.head.step(features, torch.from_numpy(labels).to(features.device),
                                        step)
        run.emulate(clock, phase.seconds)
        clock.receipt.loss = float(loss)
        for e in layout.holders(last):
            shard = layout.shards[last][e]
            part = grad[:, shard.start:shard.stop]
            if e == run.me:
                work.keep("grad", part)
            else:
                run.mover.write(f"grad/{e}", step, part, clock)


def conv_backward(run: RunState, op: StepOp, step: int, indices: np.ndarray,
                  clock: TaskClock) -> None:
    work: KernelWork = run.work
    layout: KernelLayout = run.layout
    layer = op.layer
    shard = work.shards[layer]
    with clock.op(CONV_BACKWARD, layer):
        grad, summing = _output_gradient(run, layer, step, clock)
        with clock.phase("compute") as phase:
            input_grad = shard.input_gradient(grad)
            residual_grad = shard.residual_gradient()
        run.emulate(clock, summing + phase.seconds)
        if residual_grad is not None:  # for the added layer's backward, here (tied)
            work.keep(f"residual/{layer}", residual_grad)
        source = run.network.source(layer)
        if input_grad is not None:  # hand it on first: other workers wait for it
            for e in layout.holders(source):
                below = layout.shards[source][e]
                part = input_grad[:, below.start:below.stop]
                if e == run.me:
                    work.keep(f"partial/{layer}", part)
                else:
                    run.mover.write(f"partial/{layer}/{run.me}/{e}", step, part, clock)
        with clock.phase("compute") as phase:
            shard.update(step)
        run.emulate(clock, phase.seconds)


@dataclass(frozen=True)
class _Part:
    """One part of an output gradient, taken from memory (`take`) or read from the
    workspace (`slot`, already waited for)."""

    take: str = ""
    slot: str = ""


def _output_parts(run: RunState, layer: int) -> list[_Part]:
    """The parts of the gradient of this worker's channels of `layer`'s output, in the
    order they are summed (module doc)."""
    layout: KernelLayout = run.layout
    parts = []
    for reader in run.network.readers(layer):
        parts += [_Part(take=f"partial/{reader}") if e == run.me
                  else _Part(slot=f"partial/{reader}/{e}/{run.me}")
                  for e in layout.holders(reader)]
    parts += [_Part(take=f"residual/{adder}") for adder in run.network.adders(layer)]
    if layer == layout.layers - 1:
        parts.append(_Part(take="grad") if run.me == layout.master
                     else _Part(slot=f"grad/{run.me}"))
    if not parts:
        raise RuntimeError(f"conv layer {layer}: no later layer or head uses its output")
    return parts


def _output_gradient(run: RunState, layer: int, step: int, clock: TaskClock
                     ) -> tuple[torch.Tensor, float]:
    """The gradient of this worker's channels of `layer`'s output and the seconds its
    sum computed. The parts (`_output_parts`) are summed in their fixed order, each
    folded into the running sum as it is taken or read and dropped then, so that at
    most the sum and one part read are alive besides what was kept (not every part
    at once while the conv backward allocates). The sum is added into in place only
    once it is a tensor of this op's own: a read's, or the first add's result; never a
    kept part, which may be a view of a larger tensor (the own slice of a reader's
    input gradient, of the head's features gradient). Every slot is waited for first,
    then read: the op's compute stays one stretch after its waits, as the timeline
    models it (the probe reads spreads per stretch), and waiting holds no memory."""
    work: KernelWork = run.work
    parts = _output_parts(run, layer)
    for part in parts:
        if part.slot:
            run.mover.wait(part.slot, step, clock)
    total: torch.Tensor | None = None
    own = False  # whether `total` is this op's own tensor, which may change in place
    summing = 0.0
    for part in parts:
        tensor = work.take(part.take) if part.take else run.mover.read_ready(part.slot, clock)
        if total is None:
            total, own = tensor, bool(part.slot)
            continue
        with clock.phase("compute") as phase:  # the reduce-scatter's sum
            total, own = fold(total, own, tensor, bool(part.slot))
        summing += phase.seconds
        del tensor
    assert total is not None
    return total, summing


def fold(total: torch.Tensor, own: bool, part: torch.Tensor, part_own: bool
         ) -> tuple[torch.Tensor, bool]:
    """`total + part`, bit for bit, and whether it is a tensor of the caller's own:
    added into `total` in place where it is own, else into `part` where that is (IEEE
    addition commutes exactly), else a new tensor."""
    if own:
        return total.add_(part), True
    if part_own:
        return part.add_(total), True
    return total + part, True


def _gather(run: RunState, layer: int, step: int, clock: TaskClock) -> torch.Tensor:
    """Every shard's output of `layer` along channels: own from memory, others' read."""
    work: KernelWork = run.work
    parts = [work.take(f"act/{layer}") if e == run.me
             else run.mover.read(f"act/{layer}/{e}", step, clock)
             for e in run.layout.holders(layer)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


#: What `kernel` (and `single`, its one-worker case) runs on a worker.
KERNEL_SIDE = WorkerSide(load, save, {CONV_FORWARD: conv_forward, DENSE_HEAD: dense_head,
                                      CONV_BACKWARD: conv_backward})
