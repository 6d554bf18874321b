"""What a worker does in a step: run the ops the step graph gave it, in order.

`init_run` loads the worker's shards (and, on the master, the dense head) from a
checkpoint and keeps them on the worker's device; `run_ops` runs ops of one step;
`save_run` writes the worker's part of a checkpoint; `release_run` forgets the run.

Each op reads its inputs, computes, and hands on its outputs (see tasks/layout.py
for which slots exist):

- ``conv-forward l``: the layer input is the batch (l = 0, read from the dataset
  by sample index) or the concatenation of every shard's output of layer l-1: its
  own from memory, the others' from the workspace. Its pooled output stays in
  memory for its own next op and goes to the workspace only if another worker
  reads it.
- ``dense-head`` (the master): gathers the last layer's outputs, reads the labels,
  runs forward, loss, backward and SGD, and hands each shard its gradient slice.
- ``conv-backward l``: takes its channels' gradient (from the head, or the sum of
  every upper shard's partial input gradient, in shard order), computes kernel
  gradients, steps SGD, and for l > 0 hands each shard of layer l-1 its slice of
  the partial input gradient.

A task returns only a `Receipt`; tensors never pass through Dask.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from distributed import get_worker

from storage import checkpoints
from storage.datasets import read_batch, read_labels
from storage.exchange import Exchange
from tasks.conv_shard import ConvShard
from tasks.dense_head import DenseHead
from tasks.layout import (CONV_BACKWARD, CONV_FORWARD, DENSE_HEAD, Layout, Slot, StepOp,
                          exchange_slots, worker_ops)
from tasks.receipts import Receipt, TaskClock
from tasks.specs import NetworkSpec, OptimizerSpec, RunPaths
from tasks.worker_state import (WorkerProfile, current_profile, drop_run, get_run,
                                prepare_thread, put_run)


@dataclass
class RunState:
    """One run as one worker holds it between tasks."""

    run_id: str
    layout: Layout
    me: int
    network: NetworkSpec
    paths: RunPaths
    profile: WorkerProfile
    exchange: Exchange
    slots: dict[str, Slot]
    shards: dict[int, ConvShard]
    head: DenseHead | None
    wait_timeout: float
    ops: list[StepOp]  # this worker's ops of every step, in order
    next_op: tuple[int, int] | None = None  # (step, index into ops) expected next
    kept: dict[str, torch.Tensor] = field(default_factory=dict)  # own slices between ops
    staging: dict[str, torch.Tensor] = field(default_factory=dict)  # pinned host buffers


# Tasks -----------------------------------------------------------------------------------


def init_run(run_id: str, layout: Layout, me: int, network: NetworkSpec, batch: int,
             paths: RunPaths, optimizer: OptimizerSpec, from_step: int,
             conv_keys: list[str], wait_timeout: float) -> Receipt:
    """Load this worker's shards (and the head, on the master) from checkpoint `from_step`."""
    profile = current_profile()
    receipt = Receipt("init", profile.name, from_step, _now())
    shards = {}
    for layer, row in enumerate(layout.shards):
        shard = row[me]
        if shard.size:
            key = conv_keys[layer]
            state = {kind: {name: checkpoints.read_slice(paths.checkpoints, from_step, kind,
                                                         f"{key}.{name}", shard.start, shard.stop)
                            for name in ("weight", "bias")}
                     for kind in checkpoints.KINDS}
            shards[layer] = ConvShard(network.conv[layer], shard, key, state["weights"],
                                      state["momentum"], optimizer, profile.device)
    head = None
    if me == layout.master:
        weights = checkpoints.read_tensors(paths.checkpoints, from_step, "weights")
        momentum = checkpoints.read_tensors(paths.checkpoints, from_step, "momentum")
        head = DenseHead(network, optimizer, weights, momentum, profile.device)
    slots = {slot.name: slot for slot in exchange_slots(layout, network, batch)}
    put_run(run_id, RunState(run_id, layout, me, network, paths, profile,
                             Exchange(paths.workspace), slots, shards, head, wait_timeout,
                             worker_ops(layout, me)))
    receipt.end = _now()
    receipt.extra = {"device": profile.device, "threads": profile.threads,
                     "speed": profile.speed}
    return receipt


def run_ops(run_id: str, step: int, ops: tuple[StepOp, ...], indices: np.ndarray,
            task: str = "", deps: tuple = ()) -> Receipt:
    """Run `ops` of `step` on this worker; `deps` only orders the task (Dask waits)."""
    prepare_thread()
    run: RunState = get_run(run_id)
    _check_order(run, step, ops)
    receipt = Receipt(task, run.profile.name, step, _now())
    clock = TaskClock(receipt, run.profile.synchronize)
    for op in ops:
        OPS[op.kind](run, op.layer, step, indices, clock)
    receipt.end = _now()
    return receipt


def save_run(run_id: str, checkpoint_path: str, step: int) -> Receipt:
    """Write this worker's shards (and the head, on the master) into checkpoint `step`."""
    run: RunState = get_run(run_id)
    receipt = Receipt("checkpoint", run.profile.name, step, _now())
    for shard in run.shards.values():
        for kind, tensors in shard.state().items():
            for name, value in tensors.items():
                checkpoints.write_slice(checkpoint_path, step, kind, f"{shard.key}.{name}",
                                        shard.shard.start, value)
    if run.head is not None:
        for kind, tensors in run.head.state().items():
            for key, value in tensors.items():
                checkpoints.write_slice(checkpoint_path, step, kind, key, 0, value)
    receipt.end = _now()
    return receipt


def release_run(run_id: str) -> bool:
    """Free a finished run's state on this worker."""
    return drop_run(run_id)


# Ops -------------------------------------------------------------------------------------


def conv_forward(run: RunState, layer: int, step: int, indices: np.ndarray,
                 clock: TaskClock) -> None:
    last = run.layout.layers - 1
    with clock.op(CONV_FORWARD, layer):
        if layer == 0:
            with clock.phase("dataset") as phase:
                images = read_batch(run.paths.dataset, "train", indices)[0]
                phase.nbytes = images.nbytes
                x = torch.from_numpy(images).to(run.profile.device)
        else:
            x = _gather(run, layer - 1, step, clock)
        with clock.phase("compute") as phase:
            y = run.shards[layer].forward(x, input_grad=layer > 0)
        _emulate(run, clock, phase.end - phase.start)
        if (run.me in run.layout.holders(layer + 1) if layer < last
                else run.me == run.layout.master):
            run.kept[f"act/{layer}"] = y
        _write(run, f"act/{layer}/{run.me}", step, y, clock)


def dense_head(run: RunState, layer: int, step: int, indices: np.ndarray,
               clock: TaskClock) -> None:
    assert run.head is not None, "the dense head runs on the master only"
    last = run.layout.layers - 1
    receipt = clock.receipt
    with clock.op(DENSE_HEAD):
        features = _gather(run, last, step, clock)
        with clock.phase("dataset") as phase:
            labels = read_labels(run.paths.dataset, "train", indices)
            phase.nbytes = labels.nbytes
        with clock.phase("compute") as phase:
            loss, grad = run.head.step(features, torch.from_numpy(labels).to(features.device))
        _emulate(run, clock, phase.end - phase.start)
        receipt.loss = float(loss)
        for e in run.layout.holders(last):
            shard = run.layout.shards[last][e]
            part = grad[:, shard.start:shard.stop]
            if e == run.me:
                run.kept["grad"] = part
            else:
                _write(run, f"grad/{e}", step, part, clock)


def conv_backward(run: RunState, layer: int, step: int, indices: np.ndarray,
                  clock: TaskClock) -> None:
    last = run.layout.layers - 1
    shard = run.shards[layer]
    with clock.op(CONV_BACKWARD, layer):
        if layer == last:
            grad = (run.kept.pop("grad") if run.me == run.layout.master
                    else _read(run, f"grad/{run.me}", step, clock))
            parts = [grad]
        else:
            parts = [run.kept.pop(f"partial/{layer + 1}") if e == run.me
                     else _read(run, f"partial/{layer + 1}/{e}/{run.me}", step, clock)
                     for e in run.layout.holders(layer + 1)]
        with clock.phase("compute") as phase:
            grad = parts[0]
            for part in parts[1:]:  # the reduce-scatter's sum, in shard order
                grad = grad + part
            input_grad = shard.input_gradient(grad)
        _emulate(run, clock, phase.end - phase.start)
        if input_grad is not None:  # hand it on first: other workers wait for it
            for e in run.layout.holders(layer - 1):
                below = run.layout.shards[layer - 1][e]
                part = input_grad[:, below.start:below.stop]
                if e == run.me:
                    run.kept[f"partial/{layer}"] = part
                else:
                    _write(run, f"partial/{layer}/{run.me}/{e}", step, part, clock)
        with clock.phase("compute") as phase:
            shard.update()
        _emulate(run, clock, phase.end - phase.start)


OPS = {CONV_FORWARD: conv_forward, DENSE_HEAD: dense_head, CONV_BACKWARD: conv_backward}


# Moving tensors --------------------------------------------------------------------------


def _gather(run: RunState, layer: int, step: int, clock: TaskClock) -> torch.Tensor:
    """Every shard's output of `layer` along channels: own from memory, others' read."""
    parts = [run.kept.pop(f"act/{layer}") if e == run.me
             else _read(run, f"act/{layer}/{e}", step, clock)
             for e in run.layout.holders(layer)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _read(run: RunState, slot: str, step: int, clock: TaskClock) -> torch.Tensor:
    with clock.phase("wait", slot=slot):
        run.exchange.wait(slot, step, run.wait_timeout, _task_cancelled)
    with clock.phase("read", slot=slot) as phase:
        data = run.exchange.read(slot)
        phase.nbytes = data.nbytes
        tensor = torch.from_numpy(data).to(run.profile.device)
    return tensor


def _write(run: RunState, slot: str, step: int, tensor: torch.Tensor, clock: TaskClock) -> None:
    """Write `tensor` to `slot` if the layout has that slot (another worker reads it)."""
    if slot not in run.slots:
        return
    with clock.phase("write", slot=slot) as phase:
        data = _to_host(run, slot, tensor)
        phase.nbytes = data.nbytes
        run.exchange.write(slot, step, data)


def _to_host(run: RunState, slot: str, tensor: torch.Tensor) -> np.ndarray:
    """A contiguous host copy; from a GPU through a pinned buffer kept per slot."""
    if tensor.device.type == "cpu":
        return np.ascontiguousarray(tensor.detach().numpy())
    buffer = run.staging.get(slot)
    if buffer is None or buffer.shape != tensor.shape:
        buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        run.staging[slot] = buffer
    buffer.copy_(tensor.detach(), non_blocking=True)
    run.profile.synchronize()
    return buffer.numpy()


def _emulate(run: RunState, clock: TaskClock, compute_s: float) -> None:
    """On an emulated slow device, sleep so the compute appears `speed` times as fast."""
    if run.profile.emulated:
        start = _now()
        run.profile.emulate(compute_s)
        clock.add("emulated", start, _now())


def _check_order(run: RunState, step: int, ops: tuple[StepOp, ...]) -> None:
    """Ops must arrive exactly in step-graph order (tasks are queued by priority)."""
    expected_step, index = run.next_op or (step, 0)
    expected = run.ops[index:index + len(ops)]
    if step != expected_step or list(ops) != expected:
        raise RuntimeError(
            f"run {run.run_id}: worker got {[str(o) for o in ops]} of step {step}, expected "
            f"{[str(o) for o in expected]} of step {expected_step}: tasks ran out of order")
    index += len(ops)
    run.next_op = (step + 1, 0) if index == len(run.ops) else (step, index)


def _task_cancelled() -> bool:
    """Whether Dask released the task this thread runs (e.g. its client went away)."""
    try:
        worker = get_worker()
        task = worker.state.tasks.get(worker.get_current_task())
    except (ValueError, AttributeError, KeyError):
        return False
    return task is None or task.state in ("cancelled", "released", "forgotten")


def _now() -> float:
    return time.time()
