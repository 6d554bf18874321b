"""Value types shared by the master and the workers.

They live here, in the lowest layer that needs them, so that `tasks` never imports
`pipeline`. All are small frozen dataclasses: they travel inside Dask task arguments
and must pickle cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConvLayerSpec:
    """One convolutional layer: conv -> ReLU -> max-pool (pool 1 means no pooling)."""

    in_channels: int
    kernels: int
    kernel_size: int = 5
    padding: int = 2
    pool: int = 2
    in_height: int = 32
    in_width: int = 32

    @property
    def conv_height(self) -> int:
        return self.in_height + 2 * self.padding - self.kernel_size + 1

    @property
    def conv_width(self) -> int:
        return self.in_width + 2 * self.padding - self.kernel_size + 1

    @property
    def out_height(self) -> int:
        return self.conv_height // self.pool

    @property
    def out_width(self) -> int:
        return self.conv_width // self.pool

    def macs(self, batch: int, kernels: int) -> int:
        """Multiply-accumulates of the forward convolution of `kernels` kernels."""
        return (batch * self.conv_height * self.conv_width * kernels * self.in_channels
                * self.kernel_size ** 2)


@dataclass(frozen=True)
class NetworkSpec:
    """A CNN: a stack of conv layers, then flatten -> dense layers -> class logits.

    `sequential_indices` gives the position of every parameterised module in the
    equivalent `torch.nn.Sequential`, which is how checkpoints name their arrays
    (e.g. ``"0.weight"``) so that plain PyTorch can load them.
    """

    conv: tuple[ConvLayerSpec, ...]
    hidden: tuple[int, ...] = ()
    classes: int = 10
    dtype: str = "float32"

    @property
    def flat_features(self) -> int:
        last = self.conv[-1]
        return last.kernels * last.out_height * last.out_width

    def conv_module_index(self, layer: int) -> int:
        """Index of conv layer `layer` in the equivalent nn.Sequential."""
        index = 0
        for previous in self.conv[:layer]:
            index += 3 if previous.pool > 1 else 2
        return index

    def dense_module_indices(self) -> list[int]:
        """Indices of the Linear modules in the equivalent nn.Sequential."""
        index = self.conv_module_index(len(self.conv)) + 1  # +1 for Flatten
        indices = []
        for _ in self.hidden:
            indices.append(index)
            index += 2  # Linear, ReLU
        indices.append(index)
        return indices


@dataclass(frozen=True)
class ShardRange:
    """The kernels [start, stop) of one conv layer that one worker owns."""

    layer: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class OptimizerSpec:
    """SGD hyper-parameters, applied identically to every shard and the dense head."""

    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    nesterov: bool = False


@dataclass(frozen=True)
class Arithmetic:
    """How a worker computes: SGD for every parameter, the conv
    layers' learning rate scaled by `conv_lr_scale` (hybrid), and whether replicas
    report a fingerprint of their weights every step (to check they stay identical)."""

    optimizer: OptimizerSpec
    conv_lr_scale: float = 1.0
    check_replicas: bool = False

    def conv_optimizer(self) -> OptimizerSpec:
        o = self.optimizer
        return OptimizerSpec(o.lr * self.conv_lr_scale, o.momentum, o.weight_decay, o.nesterov)


@dataclass(frozen=True)
class RunPaths:
    """Where one run's bytes live: dataset, activation workspace, checkpoints."""

    dataset: str
    workspace: str
    checkpoints: str
