"""One worker's shard of one conv layer: its kernels, their SGD state, its compute.

A shard is the kernels [start, stop) of a conv layer, with everything that follows
the conv on those channels (batch norm, the residual sum, ReLU, poolings: they work
channel by channel). Its weights, bias and momentum live on the worker's device for
the whole run (weights never travel in kernel-parallel training, docs/methods.md §1).

Two kinds (`make_shard` picks): `ConvShard`, the paper family's layer (conv, ReLU,
a max-pool whose window is its stride), whose forward keeps what that step's
backward needs and no more (the layer input, where the layer's output is positive
and the pool's indices) and whose backward runs autograd's own kernels by hand, so
the arithmetic stays plain PyTorch's bit for bit; and `GraphShard`
(tasks/graph_shard.py), any other layer (stride, no bias, batch norm in training
mode, a residual sum, any poolings). Calibration times either as training runs it.
Moving
tensors in and out is the step's business (tasks/step_task.py); this module only
computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tasks.graph_shard import (BN, COUNTER, GraphShard, buffer_names, checkpoint_key,
                               conv_backward, parameter_names)
from tasks.optim import make_sgd, momentum_of, restore_momentum, weights_of
from tasks.pooling import max_pool_with_indices
from tasks.specs import ConvLayerSpec, OptimizerSpec, ShardRange
from tasks.worker_state import current_profile, release_freed_memory


def plain_window(spec: ConvLayerSpec) -> int:
    """A paper-family layer's max-pool window (= its stride; 1: no pool)."""
    return spec.pooling[0].window if spec.pooling else 1


def relu_pool(z: torch.Tensor, spec: ConvLayerSpec
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ReLU in place over the conv output `z` (which then holds the ReLU's output),
    then the max-pool: the pooled output and its indices (None without a pool)."""
    relu = F.relu_(z)
    window = plain_window(spec)
    if window <= 1:
        return relu, None
    return max_pool_with_indices(relu, window)  # PyTorch's results, its faster kernel


def relu_pool_backward(grad_y: torch.Tensor, positive: torch.Tensor,
                       indices: torch.Tensor | None, spec: ConvLayerSpec,
                       conv_shape: torch.Size) -> torch.Tensor:
    """The conv output's gradient from the layer output's, as autograd computes it for
    ``MaxPool2d(ReLU(z))`` (max_pool2d_with_indices_backward, then the ReLU's
    threshold_backward on its own output), bit for bit, from less: where the layer's
    output is positive (`positive`, a bool per output element) instead of the ReLU's
    whole output (the conv output's size, 4x the pooled output's in 4 bytes a value).

    Why it is the same: the pool's backward puts each output element's gradient where
    its window's maximum was and zeros elsewhere, and the ReLU's output there is the
    pooled output itself; so zeroing the pooled gradient where the output is not
    positive, then scattering it, gives what scattering then zeroing gives. The pool's
    kernel reads only the shape of its input argument: an unfilled tensor stands in.
    """
    grad = torch.where(positive, grad_y, 0)
    if indices is None:  # no pool: the ReLU's backward alone
        return grad
    size = [plain_window(spec)] * 2
    return torch.ops.aten.max_pool2d_with_indices_backward(
        grad, grad.new_empty(conv_shape), size, size, [0, 0], [1, 1], False, indices)


@dataclass
class _Saved:
    """What a forward keeps for its backward: the layer input, where the layer's output
    is positive and the pool's indices (less than plain PyTorch's autograd, which
    keeps the ReLU's whole output), and not the conv output (freed once pooled) nor
    the pooled output (its reader holds it). The backward frees all three and keeps
    only the kernel gradients for `update`."""

    x: torch.Tensor | None  # layer input
    positive: torch.Tensor | None  # the layer output > 0 (bool)
    indices: torch.Tensor | None  # the max-pool's
    conv_shape: torch.Size  # the conv output's
    input_grad: bool  # whether the layer below needs the input gradient
    grads: tuple[torch.Tensor, torch.Tensor] | None = None  # the kernels', the biases'


class ConvShard:
    """Kernels [start, stop) of one paper-family conv layer, with their optimizer.

    `weights` and `momentum` hold the shard's tensors by name (`parameter_names`,
    `buffer_names`); `state` gives them back the same way."""

    def __init__(self, spec: ConvLayerSpec, shard: ShardRange, key: str,
                 weights: dict[str, np.ndarray], momentum: dict[str, np.ndarray],
                 optimizer: OptimizerSpec, device: str) -> None:
        self.spec, self.shard, self.key = spec, shard, key
        self.weight = torch.from_numpy(weights["weight"]).to(device).requires_grad_(True)
        self.bias = torch.from_numpy(weights["bias"]).to(device).requires_grad_(True)
        self.optimizer = make_sgd([self.weight, self.bias], optimizer)
        restore_momentum(self.optimizer, self.named(), momentum)
        self._saved: _Saved | None = None

    def named(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "bias": self.bias}

    def checkpoint_key(self, name: str) -> str:
        return checkpoint_key(self.spec, self.key, name)

    def forward(self, x: torch.Tensor, input_grad: bool,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """Conv + ReLU + pool of this shard's kernels; keeps what backward needs."""
        assert residual is None, "a paper-family layer adds no residual"
        with torch.no_grad():
            z = F.conv2d(x, self.weight, self.bias, padding=self.spec.padding)
            y, indices = relu_pool(z, self.spec)
            self._saved = _Saved(x, y > 0, indices, z.shape, input_grad)
        return y

    def input_gradient(self, grad_y: torch.Tensor) -> torch.Tensor | None:
        """Backward through pool, ReLU and conv; the input gradient if the layer has one.

        The input, kernel and bias gradients come from ONE ``convolution_backward``, as
        autograd computes them: two calls (the input gradient, then the kernels') had
        oneDNN reorder the same operands twice, 1.1-1.15x a small-network step's compute.
        The kernel gradients wait for `update`, so that a step hands the input gradient
        on (other workers wait for it) before its SGD step.
        """
        saved = self._saved
        if saved is None:
            raise RuntimeError(f"backward of layer {self.shard.layer} before its forward")
        assert saved.positive is not None and saved.x is not None, \
            "input_gradient runs once per forward"
        with torch.no_grad():
            grad_z = relu_pool_backward(grad_y, saved.positive, saved.indices, self.spec,
                                        saved.conv_shape)
        saved.positive = saved.indices = None  # not needed any more: free them now
        grad_x, grad_w, grad_b = conv_backward(grad_z, saved.x, self.weight, self.spec,
                                               (saved.input_grad, True, True))
        saved.x = None
        saved.grads = (grad_w, grad_b)
        return grad_x

    def residual_gradient(self) -> torch.Tensor | None:
        """The gradient of the residual term added to this shard's channels (None: the
        layer adds none), once `input_gradient` ran."""
        return None

    def update(self, step: int) -> None:
        """Step `step`'s SGD update (its learning rate) with the kernel gradients
        `input_gradient` computed."""
        saved = self._saved
        if saved is None or saved.grads is None:
            raise RuntimeError(f"update of layer {self.shard.layer} before input_gradient")
        self._saved = None
        self.weight.grad, self.bias.grad = saved.grads
        self.optimizer.step(step)
        # Dropped now, not at the next step: the next backward's kernel gradient would
        # otherwise be made while this one is still alive (twice the shard's weights).
        self.optimizer.zero_grad()

    def state(self) -> dict[str, dict[str, np.ndarray]]:
        """Weights and momentum by parameter name ("weight", "bias"), as numpy."""
        return {"weights": weights_of(self.named()),
                "momentum": momentum_of(self.optimizer, self.named())}


def make_shard(spec: ConvLayerSpec, shard: ShardRange, key: str,
               weights: dict[str, np.ndarray], momentum: dict[str, np.ndarray],
               optimizer: OptimizerSpec, device: str) -> ConvShard | GraphShard:
    """The shard of `spec`'s kernels [start, stop): the paper family's fast path where
    the layer is of it, the general one otherwise."""
    kind = ConvShard if spec.plain else GraphShard
    return kind(spec, shard, key, weights, momentum, optimizer, device)


def initial_tensors(spec: ConvLayerSpec, kernels: int, generator: torch.Generator,
                    dtype: str) -> dict[str, np.ndarray]:
    """Tensors for a shard of `kernels` kernels that calibration times: small random
    kernels, zero biases, batch norm at its initialisation."""
    torch_dtype = getattr(torch, dtype)
    weights = {"weight": (0.05 * torch.randn(kernels, spec.in_channels, spec.kernel_size,
                                             spec.kernel_size, generator=generator,
                                             dtype=torch_dtype)).numpy()}
    for name in parameter_names(spec)[1:] + buffer_names(spec):
        one = name in (BN + "weight", BN + "running_var")
        weights[name] = (np.zeros(1, dtype=dtype) if name == COUNTER
                         else np.full(kernels, 1.0 if one else 0.0, dtype=dtype))
    return weights


def calibrate_layer(spec: ConvLayerSpec, batch: int, sizes: list[int], dtype: str,
                    input_grad: bool, repeats: int = 3) -> dict:
    """`time_layer`, then its tensors' pages handed back: the run's steps must not
    start on calibration's (`release_freed_memory`)."""
    timed = time_layer(spec, batch, sizes, dtype, input_grad, repeats)
    release_freed_memory()
    return timed


def time_layer(spec: ConvLayerSpec, batch: int, sizes: list[int], dtype: str,
               input_grad: bool, repeats: int = 3) -> dict:
    """Seconds of a layer's forward, backward and update for shards of each of
    `sizes` kernels, as training runs them (a `ConvShard` on this worker's device,
    its real shapes).

    Per size: one warm-up, then rounds until stable (`WorkerProfile.time_rounds`),
    each synchronised before the clock is read; emulated slowness included. Two
    sizes give a shard's fixed cost apart from its cost per kernel. Returns
    ``points``: ``[kernels, median seconds]`` per size, and every round.
    """
    profile = current_profile()
    generator = torch.Generator().manual_seed(0)
    torch_dtype = getattr(torch, dtype)
    x = torch.randn(batch, spec.in_channels, spec.in_height, spec.in_width,
                    generator=generator, dtype=torch_dtype).to(profile.device)
    points, rounds = [], []
    for kernels in sizes:
        weights = initial_tensors(spec, kernels, generator, dtype)
        momentum = {name: np.zeros_like(weights[name]) for name in parameter_names(spec)}
        shard = make_shard(spec, ShardRange(0, 0, kernels), "calibration", weights, momentum,
                           OptimizerSpec(lr=1e-6), profile.device)
        grad = torch.ones(batch, kernels, spec.out_height, spec.out_width, dtype=torch_dtype,
                          device=profile.device)
        residual = None if spec.residual is None else torch.randn(
            batch, kernels, spec.conv_height, spec.conv_width, generator=generator,
            dtype=torch_dtype).to(profile.device)

        def one_round() -> None:
            shard.forward(x, input_grad=input_grad, residual=residual)
            shard.input_gradient(grad)
            shard.residual_gradient()
            shard.update(0)

        times = profile.time_rounds(one_round, repeats)
        points.append([kernels, float(np.median(times))])
        rounds.append(times)
    return {"worker": profile.name, "points": points, "rounds": rounds,
            "speed": profile.speed, "device": profile.device, "threads": profile.threads}
