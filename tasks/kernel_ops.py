"""Kernel-parallel training on a worker: its shards, the dense head, and their ops.

Each op reads its inputs, computes, and hands on its outputs (tasks/layout.py says
which slots exist; own slices stay in `KernelWork.kept`):

- ``conv-forward l``: the layer input is the batch (l = 0, read from the dataset
  by sample index) or every shard's output of layer l-1 concatenated: its own from
  memory, the others' from the workspace. Its pooled output stays in memory for its
  own next op and goes to the workspace only if another worker reads it.
- ``dense-head`` (the master): gathers the last layer's outputs, reads the labels,
  runs forward, loss, backward and SGD, and hands each shard its gradient slice.
- ``conv-backward l``: takes its channels' gradient (from the head, or the sum of
  every upper shard's partial input gradient, in shard order), computes pool/ReLU
  backward and the input and kernel gradients (one call, as autograd), hands the
  input gradient's slices on to the layer below, then steps SGD.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from storage import checkpoints
from storage.datasets import read_batch, read_labels
from tasks.conv_shard import ConvShard
from tasks.dense_head import DenseHead
from tasks.layout import CONV_BACKWARD, CONV_FORWARD, DENSE_HEAD, KernelLayout, StepOp
from tasks.receipts import TaskClock
from tasks.run_state import RunState, WorkerSide
from tasks.specs import Arithmetic, NetworkSpec


@dataclass
class KernelWork:
    """A worker's work in a kernel-parallel run: its shards and, on the master, the head."""

    shards: dict[int, ConvShard]  # by layer, the layers it holds kernels of
    head: DenseHead | None  # on the master
    keys: list[str]  # each conv layer's module index in the equivalent nn.Sequential
    kept: dict[str, torch.Tensor] = field(default_factory=dict)  # own slices between ops


def load(layout: KernelLayout, me: int, network: NetworkSpec, checkpoint_path: str, step: int,
         arithmetic: Arithmetic, device: str) -> KernelWork:
    """This worker's shards (and the head, on the master) from checkpoint `step`."""
    optimizer = arithmetic.optimizer
    keys = network.conv_keys()
    shards = {}
    for layer, row in enumerate(layout.shards):
        shard = row[me]
        if shard.size:
            state = {kind: {name: checkpoints.read_slice(checkpoint_path, step, kind,
                                                         f"{keys[layer]}.{name}", shard.start,
                                                         shard.stop)
                            for name in ("weight", "bias")}
                     for kind in checkpoints.KINDS}
            shards[layer] = ConvShard(network.conv[layer], shard, keys[layer], state["weights"],
                                      state["momentum"], optimizer, device)
    head = None
    if me == layout.master:  # the dense layers' tensors only, not the whole network's
        dense = {f"{name}.{tensor}" for name in network.dense_names
                 for tensor in ("weight", "bias")}
        head = DenseHead(network, optimizer,
                         checkpoints.read_tensors(checkpoint_path, step, "weights", dense),
                         checkpoints.read_tensors(checkpoint_path, step, "momentum", dense),
                         device, arithmetic.seed)
    return KernelWork(shards, head, keys)


def save(work: KernelWork, me: int, checkpoint_path: str, step: int) -> None:
    """Write this worker's shards (and the head) into checkpoint `step`."""
    for shard in work.shards.values():
        for kind, tensors in shard.state().items():
            for name, value in tensors.items():
                checkpoints.write_slice(checkpoint_path, step, kind, f"{shard.key}.{name}",
                                        shard.shard.start, value)
    if work.head is not None:
        for kind, tensors in work.head.state().items():
            for key, value in tensors.items():
                checkpoints.write_slice(checkpoint_path, step, kind, key, 0, value)


def conv_forward(run: RunState, op: StepOp, step: int, indices: np.ndarray,
                 clock: TaskClock) -> None:
    work: KernelWork = run.work
    layout: KernelLayout = run.layout
    layer, last = op.layer, layout.layers - 1
    with clock.op(CONV_FORWARD, layer):
        if layer == 0:
            with clock.phase("dataset") as phase:
                images = read_batch(run.paths.dataset, "train", indices)[0]
                phase.nbytes = images.nbytes
                x = torch.from_numpy(images).to(run.profile.device)
        else:
            x = _gather(run, layer - 1, step, clock)
        with clock.phase("compute") as phase:
            y = work.shards[layer].forward(x, input_grad=layer > 0)
        run.emulate(clock, phase.seconds)
        if (run.me in layout.holders(layer + 1) if layer < last else run.me == layout.master):
            work.kept[f"act/{layer}"] = y
        run.mover.write(f"act/{layer}/{run.me}", step, y, clock)


def dense_head(run: RunState, op: StepOp, step: int, indices: np.ndarray,
               clock: TaskClock) -> None:
    work: KernelWork = run.work
    layout: KernelLayout = run.layout
    assert work.head is not None, "the dense head runs on the master only"
    last = layout.layers - 1
    with clock.op(DENSE_HEAD):
        features = _gather(run, last, step, clock)
        with clock.phase("dataset") as phase:
            labels = read_labels(run.paths.dataset, "train", indices)
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
                work.kept["grad"] = part
            else:
                run.mover.write(f"grad/{e}", step, part, clock)


def conv_backward(run: RunState, op: StepOp, step: int, indices: np.ndarray,
                  clock: TaskClock) -> None:
    work: KernelWork = run.work
    layout: KernelLayout = run.layout
    layer, last = op.layer, layout.layers - 1
    shard = work.shards[layer]
    with clock.op(CONV_BACKWARD, layer):
        if layer == last:
            parts = [work.kept.pop("grad") if run.me == layout.master
                     else run.mover.read(f"grad/{run.me}", step, clock)]
        else:
            parts = [work.kept.pop(f"partial/{layer + 1}") if e == run.me
                     else run.mover.read(f"partial/{layer + 1}/{e}/{run.me}", step, clock)
                     for e in layout.holders(layer + 1)]
        with clock.phase("compute") as phase:
            grad = parts[0]
            for part in parts[1:]:  # the reduce-scatter's sum, in shard order
                grad = grad + part
            input_grad = shard.input_gradient(grad)
        run.emulate(clock, phase.seconds)
        if input_grad is not None:  # hand it on first: other workers wait for it
            for e in layout.holders(layer - 1):
                below = layout.shards[layer - 1][e]
                part = input_grad[:, below.start:below.stop]
                if e == run.me:
                    work.kept[f"partial/{layer}"] = part
                else:
                    run.mover.write(f"partial/{layer}/{run.me}/{e}", step, part, clock)
        with clock.phase("compute") as phase:
            shard.update()
        run.emulate(clock, phase.seconds)


def _gather(run: RunState, layer: int, step: int, clock: TaskClock) -> torch.Tensor:
    """Every shard's output of `layer` along channels: own from memory, others' read."""
    work: KernelWork = run.work
    parts = [work.kept.pop(f"act/{layer}") if e == run.me
             else run.mover.read(f"act/{layer}/{e}", step, clock)
             for e in run.layout.holders(layer)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


#: What `kernel` (and `single`, its one-worker case) runs on a worker.
KERNEL_SIDE = WorkerSide(load, save, {CONV_FORWARD: conv_forward, DENSE_HEAD: dense_head,
                                      CONV_BACKWARD: conv_backward})
