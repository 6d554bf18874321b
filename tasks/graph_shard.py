"""A worker's shard of any conv layer: the general path of kernel-parallel training.

`ConvShard` (tasks/conv_shard.py) is the paper family's fast path; `GraphShard` here
takes every other layer: a conv with any stride and padding, with a bias or none,
then batch norm in training mode, a residual sum, ReLU and any poolings, all on the
shard's channels. Also here: the names of a shard's tensors and their checkpoint
keys, and the conv's backward by hand, which both kinds share.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tasks.network import BUFFER_COUNTER, backward_from, pool
from tasks.optim import make_sgd, momentum_of, restore_momentum, weights_of
from tasks.specs import ConvLayerSpec, OptimizerSpec, ShardRange

#: nn.BatchNorm2d's defaults, which the plain-PyTorch network uses.
BN_EPS = 1e-5
BN_MOMENTUM = 0.1
#: A shard's batch-norm tensors are named ``bn.<tensor>`` (`checkpoint_key`).
BN = "bn."
COUNTER = BN + BUFFER_COUNTER


def parameter_names(spec: ConvLayerSpec) -> list[str]:
    """A shard's parameters: the kernels, the bias if any, batch norm's scale and shift."""
    names = ["weight"] + (["bias"] if spec.bias else [])
    return names + ([BN + "weight", BN + "bias"] if spec.batch_norm else [])


def buffer_names(spec: ConvLayerSpec) -> list[str]:
    """A shard's buffers: batch norm's running statistics and its counter."""
    return [BN + "running_mean", BN + "running_var", COUNTER] if spec.batch_norm else []


def checkpoint_key(spec: ConvLayerSpec, conv_key: str, name: str) -> str:
    """The checkpoint key of a shard's tensor `name` (``bias``, ``bn.running_var``):
    under the conv's module name `conv_key` or the batch norm's."""
    if name.startswith(BN):
        return f"{spec.bn_name}.{name.removeprefix(BN)}"
    return f"{conv_key}.{name}"


def conv_backward(grad_z: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                  spec: ConvLayerSpec, want: tuple[bool, bool, bool]
                  ) -> tuple[torch.Tensor | None, ...]:
    """Input, weight and bias gradients of the conv (those `want` asks for).

    Without autograd: called on a weight that requires grad, the op would record a
    graph node saving the weight, the input and `grad_z` on its results, and the
    weight's own gradient pointing back at the weight is a cycle through C++ that
    Python's collector cannot see. Every calibrated shard then stayed in memory for
    the worker's life (its weights, gradient, momentum, input and `grad_z`), and each
    training step kept the last step's inputs and `grad_z` alive.
    """
    padding, stride = [spec.padding, spec.padding], [spec.stride, spec.stride]
    bias_sizes = [weight.shape[0]] if spec.bias else None
    with torch.no_grad():
        return torch.ops.aten.convolution_backward(
            grad_z, x, weight, bias_sizes, stride, padding, [1, 1], False, [0, 0], 1, want)


@dataclass
class _GraphSaved:
    """What a `GraphShard`'s forward keeps: the layer input (for the conv's backward),
    the tail's leaves (the conv output, the residual term) and its output, whose
    autograd graph holds what the tail's backward needs."""

    x: torch.Tensor | None
    z: torch.Tensor  # the conv output: a leaf of the tail's graph
    shortcut: torch.Tensor | None  # the residual term: a leaf too
    out: torch.Tensor  # the layer output, with its graph
    input_grad: bool
    grads: dict[str, torch.Tensor] | None = None  # the parameters', by name
    residual_grad: torch.Tensor | None = None


class GraphShard:
    """Kernels [start, stop) of any conv layer: conv (stride, padding, bias or none) ->
    batch norm in training mode over the shard's channels -> + the residual term (the
    shard's channels of layer ``residual``'s output) -> ReLU -> poolings.

    Batch norm's statistics are per channel, so a shard's are the whole layer's for
    its channels: exact with no exchange. The tail after the conv runs under autograd
    (PyTorch's own ops, as nn.BatchNorm2d and the functional poolings run them); the
    conv's backward is one ``convolution_backward`` by hand, as for `ConvShard`.
    Its interface is `ConvShard`'s.
    """

    def __init__(self, spec: ConvLayerSpec, shard: ShardRange, key: str,
                 weights: dict[str, np.ndarray], momentum: dict[str, np.ndarray],
                 optimizer: OptimizerSpec, device: str) -> None:
        self.spec, self.shard, self.key = spec, shard, key
        self.params = {name: torch.from_numpy(np.array(weights[name])).to(device)
                       .requires_grad_(True) for name in parameter_names(spec)}
        self.weight, self.bias = self.params["weight"], self.params.get("bias")
        self.buffers = {name: torch.from_numpy(np.array(weights[name])).to(device)
                        for name in buffer_names(spec) if name != COUNTER}
        self.batches_tracked = (int(np.asarray(weights[COUNTER]).reshape(-1)[0])
                                if spec.batch_norm else 0)
        self.optimizer = make_sgd(list(self.params.values()), optimizer)
        restore_momentum(self.optimizer, self.named(), momentum)
        self._saved: _GraphSaved | None = None

    def named(self) -> dict[str, torch.Tensor]:
        return dict(self.params)

    def checkpoint_key(self, name: str) -> str:
        return checkpoint_key(self.spec, self.key, name)

    def forward(self, x: torch.Tensor, input_grad: bool,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output on this shard's channels; `residual`: the residual term
        (this shard's channels of layer ``residual``'s output) where the layer adds one."""
        spec = self.spec
        if (residual is None) != (spec.residual is None):
            raise ValueError(f"layer {self.shard.layer}: a residual term is "
                             f"{'missing' if residual is None else 'not expected'}")
        with torch.no_grad():
            z = F.conv2d(x, self.weight, self.bias, spec.stride, spec.padding)
        z.requires_grad_(True)
        shortcut = None
        with torch.enable_grad():
            out = z
            if spec.batch_norm:
                out = F.batch_norm(out, self.buffers[BN + "running_mean"],
                                   self.buffers[BN + "running_var"], self.params[BN + "weight"],
                                   self.params[BN + "bias"], True, BN_MOMENTUM, BN_EPS)
                self.batches_tracked += 1
            if residual is not None:
                shortcut = residual.detach().requires_grad_(True)
                out = out + shortcut
            if spec.relu:
                out = F.relu(out)
            for pooling in spec.pooling:
                out = pool(out, pooling)
        self._saved = _GraphSaved(x, z, shortcut, out, input_grad)
        return out.detach()

    def input_gradient(self, grad_y: torch.Tensor) -> torch.Tensor | None:
        """Backward through the tail (autograd) and the conv (by hand): the input
        gradient if the layer has one; the parameters' gradients wait for `update`, the
        residual term's for `residual_gradient`."""
        saved = self._saved
        if saved is None or saved.x is None:
            raise RuntimeError(f"backward of layer {self.shard.layer} before its forward")
        tail = [p for name, p in self.params.items() if name.startswith(BN)]
        if saved.out is saved.z:  # nothing after the conv
            grad_z = grad_y
        else:
            backward_from(saved.out, grad_y)
            grad_z = saved.z.grad
        grads = {name: p.grad for name, p in self.params.items() if name.startswith(BN)}
        for p in tail:
            p.grad = None
        saved.residual_grad = None if saved.shortcut is None else saved.shortcut.grad
        grad_x, grad_w, grad_b = conv_backward(grad_z, saved.x, self.weight, self.spec,
                                               (saved.input_grad, True, self.bias is not None))
        grads["weight"] = grad_w
        if self.bias is not None:
            grads["bias"] = grad_b
        saved.x, saved.grads = None, grads
        saved.z = saved.out = saved.shortcut = None  # type: ignore[assignment]
        return grad_x

    def residual_gradient(self) -> torch.Tensor | None:
        saved = self._saved
        if saved is None or saved.grads is None:
            raise RuntimeError(f"residual gradient of layer {self.shard.layer} before "
                               "its backward")
        grad, saved.residual_grad = saved.residual_grad, None
        return grad

    def update(self, step: int) -> None:
        """Step `step`'s SGD update (its learning rate) of every parameter with the
        gradients `input_gradient` made."""
        saved = self._saved
        if saved is None or saved.grads is None:
            raise RuntimeError(f"update of layer {self.shard.layer} before input_gradient")
        self._saved = None
        for name, param in self.params.items():
            param.grad = saved.grads[name]
        self.optimizer.step(step)
        self.optimizer.zero_grad()

    def state(self) -> dict[str, dict[str, np.ndarray]]:
        """Parameters, running statistics and the counter (one row), and the
        parameters' momentum, as numpy by name."""
        weights = weights_of(self.named())
        weights.update(weights_of(self.buffers))
        if self.spec.batch_norm:
            weights[COUNTER] = np.full(1, self.batches_tracked,
                                       dtype=weights["weight"].dtype)
        return {"weights": weights, "momentum": momentum_of(self.optimizer, self.named())}
