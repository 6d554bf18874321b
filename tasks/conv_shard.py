"""Worker-side tasks of kernel-parallel training: one conv layer's shard.

A shard is the kernels [start, stop) of one conv layer. Its weights, bias and SGD
momentum live on the worker (see `worker_state`); activations and gradients travel
through the run's Zarr workspace. Every task returns only a `Receipt`.

Forward keeps what backward needs (the autograd graph from the layer input to the
pooled output) in the worker's memory until that step's backward runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from storage import checkpoints
from storage.arrays import IOMeter, open_cached
from storage.datasets import read_batch
from storage.workspace import GRAD_TOP, act_path, partial_path
from tasks.receipts import Receipt
from tasks.specs import ConvLayerSpec, OptimizerSpec, RunPaths, ShardRange
from tasks.worker_state import WorkerProfile, current_profile, drop_run, get_shard, put_shard


@dataclass
class ShardState:
    """Everything a worker keeps about its shard of one conv layer."""

    spec: ConvLayerSpec
    shard: ShardRange
    index: int  # position of this shard among the layer's shards
    key: str  # module index in the equivalent nn.Sequential, e.g. "0"
    weight: torch.Tensor
    bias: torch.Tensor
    optimizer: torch.optim.SGD
    saved: tuple[torch.Tensor | None, torch.Tensor] | None = None  # (input, output)


def conv_relu_pool(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   spec: ConvLayerSpec) -> torch.Tensor:
    """The per-shard computation: conv, ReLU, then max-pool on the device."""
    y = F.relu(F.conv2d(x, weight, bias, padding=spec.padding))
    if spec.pool > 1:
        y = F.max_pool2d(y, spec.pool)
    return y


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _receipt(phase: str, state_layer: int, shard_index: int, step: int,
             profile: WorkerProfile, io: IOMeter, compute_s: float, emulated_s: float,
             start: float) -> Receipt:
    return Receipt(
        phase=phase, layer=state_layer, shard=shard_index, step=step, worker=profile.name,
        compute_s=compute_s + emulated_s, emulated_s=emulated_s, read_s=io.read_s,
        write_s=io.write_s, read_bytes=io.read_bytes, write_bytes=io.write_bytes,
        start=start, end=time.time(),
    )


def init_shard(run_id: str, spec: ConvLayerSpec, shard: ShardRange, shard_index: int,
               key: str, optimizer: OptimizerSpec, checkpoint_path: str,
               step: int) -> Receipt:
    """Load a shard's weights and momentum from checkpoint `step` onto this worker."""
    start = time.time()
    profile = current_profile()
    weight, bias = (
        torch.from_numpy(checkpoints.read_slice(checkpoint_path, step, "weights",
                                                f"{key}.{name}", shard.start, shard.stop))
        .to(profile.device).requires_grad_(True)
        for name in ("weight", "bias")
    )
    sgd = torch.optim.SGD([weight, bias], lr=optimizer.lr, momentum=optimizer.momentum,
                          weight_decay=optimizer.weight_decay, nesterov=optimizer.nesterov)
    if optimizer.momentum and step > 0:
        for param, name in ((weight, "weight"), (bias, "bias")):
            buffer = checkpoints.read_slice(checkpoint_path, step, "momentum",
                                            f"{key}.{name}", shard.start, shard.stop)
            sgd.state[param]["momentum_buffer"] = torch.from_numpy(buffer).to(profile.device)
    put_shard(run_id, shard.layer, ShardState(spec, shard, shard_index, key, weight, bias, sgd))
    return Receipt("init", shard.layer, shard_index, step, profile.name, start=start,
                   end=time.time(), extra={"device": profile.device,
                                           "threads": profile.threads,
                                           "speed": profile.speed})


def conv_forward(run_id: str, layer: int, step: int, paths: RunPaths,
                 indices: np.ndarray | None, deps: list[Any] = ()) -> Receipt:
    """Forward of this worker's shard of `layer`; writes its channels of act/<layer>.

    Layer 0 reads the batch's images from the dataset store by sample index; later
    layers read the whole previous activation from the workspace.
    """
    start = time.time()
    profile = current_profile()
    state: ShardState = get_shard(run_id, layer)
    io = IOMeter()
    if layer == 0:
        t0 = time.perf_counter()
        images, _labels = read_batch(paths.dataset, "train", indices)
        io.read_s += time.perf_counter() - t0
        io.read_bytes += images.nbytes
        x = torch.from_numpy(images).to(profile.device)
    else:
        x = torch.from_numpy(io.read(open_cached(paths.workspace, act_path(layer - 1)))
                             ).to(profile.device).requires_grad_(True)
    t0 = time.perf_counter()
    with torch.enable_grad():
        y = conv_relu_pool(x, state.weight, state.bias, state.spec)
    _sync(profile.device)
    compute_s = time.perf_counter() - t0
    emulated_s = profile.emulate(compute_s)
    state.saved = (x if layer > 0 else None, y)
    output = y.detach().to("cpu").numpy()
    io.write(open_cached(paths.workspace, act_path(layer)),
             (slice(None), slice(state.shard.start, state.shard.stop)), output)
    return _receipt("forward", layer, state.index, step, profile, io, compute_s,
                    emulated_s, start)


def conv_backward(run_id: str, layer: int, step: int, paths: RunPaths, top: bool,
                  upper_shards: int, deps: list[Any] = ()) -> Receipt:
    """Backward and SGD update of this worker's shard of `layer`.

    The output gradient slice is read from grad_top (the last conv layer) or summed
    from the channel slices of every upper shard's partial input gradient: that sum
    is the reduce-scatter, done by the readers. Layers above 0 then write their own
    partial input gradient for the layer below.
    """
    start = time.time()
    profile = current_profile()
    state: ShardState = get_shard(run_id, layer)
    if state.saved is None:
        raise RuntimeError(f"run {run_id}: backward of layer {layer} before its forward")
    io = IOMeter()
    channels = (slice(None), slice(state.shard.start, state.shard.stop))
    if top:
        grad = io.read(open_cached(paths.workspace, GRAD_TOP), channels)
    else:
        grad = None
        for upper in range(upper_shards):
            part = io.read(open_cached(paths.workspace, partial_path(layer + 1, upper)),
                           channels)
            grad = part if grad is None else np.add(grad, part, out=grad)
    x, y = state.saved
    state.saved = None
    t0 = time.perf_counter()
    g = torch.from_numpy(grad).to(profile.device)
    inputs = [state.weight, state.bias] + ([x] if x is not None else [])
    grads = torch.autograd.grad(y, inputs, grad_outputs=g)
    state.weight.grad, state.bias.grad = grads[0], grads[1]
    state.optimizer.step()
    _sync(profile.device)
    compute_s = time.perf_counter() - t0
    emulated_s = profile.emulate(compute_s)
    if x is not None:
        io.write(open_cached(paths.workspace, partial_path(layer, state.index)), ...,
                 grads[2].to("cpu").numpy())
    return _receipt("backward", layer, state.index, step, profile, io, compute_s,
                    emulated_s, start)


def save_shard(run_id: str, layer: int, checkpoint_path: str, step: int,
               deps: list[Any] = ()) -> Receipt:
    """Write this shard's weights and momentum into checkpoint `step`."""
    start = time.time()
    profile = current_profile()
    state: ShardState = get_shard(run_id, layer)
    for param, name in ((state.weight, "weight"), (state.bias, "bias")):
        key = f"{state.key}.{name}"
        checkpoints.write_slice(checkpoint_path, step, "weights", key, state.shard.start,
                                param.detach().to("cpu").numpy())
        buffer = state.optimizer.state.get(param, {}).get("momentum_buffer")
        if buffer is None:
            buffer = torch.zeros_like(param)
        checkpoints.write_slice(checkpoint_path, step, "momentum", key, state.shard.start,
                                buffer.detach().to("cpu").numpy())
    return Receipt("checkpoint", layer, state.index, step, profile.name, start=start,
                   end=time.time())


def release_run(run_id: str) -> int:
    """Free a finished run's shards on this worker."""
    return drop_run(run_id)


def calibrate_layer(spec: ConvLayerSpec, batch: int, kernels: int, dtype: str,
                    repeats: int = 2, needs_input_grad: bool = True) -> dict:
    """Time forward+backward of `kernels` kernels of a layer at its real shapes.

    The master shares out each layer's kernels in proportion to the measured speed.
    Returns the median seconds (emulation included) and what it measured.
    """
    profile = current_profile()
    torch_dtype = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, spec.in_channels, spec.in_height, spec.in_width,
                    generator=generator, dtype=torch_dtype).to(profile.device)
    x.requires_grad_(needs_input_grad)
    weight = (0.05 * torch.randn(kernels, spec.in_channels, spec.kernel_size,
                                 spec.kernel_size, generator=generator, dtype=torch_dtype)
              ).to(profile.device).requires_grad_(True)
    bias = torch.zeros(kernels, dtype=torch_dtype, device=profile.device, requires_grad=True)
    times = []
    for attempt in range(repeats + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        y = conv_relu_pool(x, weight, bias, spec)
        inputs = [weight, bias] + ([x] if needs_input_grad else [])
        torch.autograd.grad(y, inputs, grad_outputs=torch.ones_like(y))
        _sync(profile.device)
        elapsed = time.perf_counter() - t0
        elapsed += profile.emulate(elapsed)
        if attempt:
            times.append(elapsed)
    return {"worker": profile.name, "seconds": float(np.median(times)), "kernels": kernels,
            "speed": profile.speed, "device": profile.device}
