"""Value types shared by the master and the workers.

They live here, in the lowest layer that needs them, so that `tasks` never imports
`pipeline`. All are small frozen dataclasses: they travel inside Dask task arguments
and must pickle cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tasks.augment import Augmentation
from tasks.lr_schedule import LrSchedule, lr_at


#: Pooling kinds: PyTorch's max_pool2d and avg_pool2d (count_include_pad, floor mode, as
#: nn.MaxPool2d and nn.AvgPool2d default to), and adaptive_avg_pool2d to a square.
POOL_KINDS = ("max", "avg", "adaptive_avg")


@dataclass(frozen=True)
class PoolSpec:
    """One pooling over each channel apart: ``window``/``stride``/``padding`` as
    nn.MaxPool2d's and nn.AvgPool2d's; for ``adaptive_avg`` the output's side is
    ``window`` (nn.AdaptiveAvgPool2d(window))."""

    kind: str = "max"
    window: int = 2
    stride: int = 2
    padding: int = 0

    def out_size(self, size: int) -> int:
        if self.kind == "adaptive_avg":
            return self.window
        return (size + 2 * self.padding - self.window) // self.stride + 1


@dataclass(frozen=True)
class ConvLayerSpec:
    """One conv layer and what follows it on the same channels, in this order:
    conv (``stride``, ``padding``, a bias or none) -> batch norm (training mode) ->
    + the output of layer ``residual`` (a residual block's shortcut) -> ReLU -> each
    pooling of ``pooling``.

    Everything after the conv works channel by channel, which is why a kernel split
    carries it with no exchange: a worker that holds kernels [a, b) holds the batch
    norm, the sum and the pooling of channels [a, b) too (docs/methods.md).

    ``pool`` is the paper's family's shorthand (a max-pool whose window equals its
    stride; 1: none); ``pools``, when given, replaces it with any poolings. ``source``
    is the layer whose output the conv reads (None: the layer before; -1: the
    images), so that a residual block's shortcut can read the block's input. ``name``
    and ``bn_name`` are the conv's and batch norm's module names in the plain-PyTorch
    network (their state_dict prefixes, e.g. ``layer1.0.conv1``); `NetworkSpec`
    fills them in for the paper's family.
    """

    in_channels: int
    kernels: int
    kernel_size: int = 5
    padding: int = 2
    pool: int = 2
    in_height: int = 32
    in_width: int = 32
    stride: int = 1
    bias: bool = True
    batch_norm: bool = False
    relu: bool = True
    pools: tuple[PoolSpec, ...] | None = None
    source: int | None = None
    residual: int | None = None
    name: str = ""
    bn_name: str = ""

    @property
    def pooling(self) -> tuple[PoolSpec, ...]:
        """The poolings after the ReLU, in order."""
        if self.pools is not None:
            return self.pools
        return (PoolSpec("max", self.pool, self.pool),) if self.pool > 1 else ()

    @property
    def plain(self) -> bool:
        """Whether the layer is of the paper's family (stride-1 conv with a bias, ReLU,
        at most one max-pool whose window is its stride, fed by the layer before):
        the fast path of the shards and what the performance model prices."""
        pools = self.pooling
        simple_pool = not pools or (len(pools) == 1 and pools[0].kind == "max"
                                    and pools[0].window == pools[0].stride
                                    and pools[0].padding == 0)
        return (self.stride == 1 and self.bias and not self.batch_norm and self.relu
                and simple_pool and self.source is None and self.residual is None)

    @property
    def conv_height(self) -> int:
        return (self.in_height + 2 * self.padding - self.kernel_size) // self.stride + 1

    @property
    def conv_width(self) -> int:
        return (self.in_width + 2 * self.padding - self.kernel_size) // self.stride + 1

    @property
    def out_height(self) -> int:
        size = self.conv_height
        for pool in self.pooling:
            size = pool.out_size(size)
        return size

    @property
    def out_width(self) -> int:
        size = self.conv_width
        for pool in self.pooling:
            size = pool.out_size(size)
        return size

    def macs(self, batch: int, kernels: int) -> int:
        """Multiply-accumulates of the forward convolution of `kernels` kernels."""
        return (batch * self.conv_height * self.conv_width * kernels * self.in_channels
                * self.kernel_size ** 2)


@dataclass(frozen=True)
class NetworkSpec:
    """A CNN: conv layers (a chain, or a graph of residual blocks), then flatten ->
    dense layers -> class logits.

    Names: every conv and batch norm carries its module name in the plain-PyTorch
    network (`tasks/network.py`), the checkpoints' keys; ``dense_names`` are the dense
    layers'. Left empty they are the equivalent `torch.nn.Sequential`'s indices
    (``"0.weight"``, the paper's family). ``dropout[j]`` is the dropout probability on
    dense layer j's input (empty: none). ``init`` names the initialisation:
    ``pytorch`` (the modules' defaults), ``vgg`` or ``resnet`` (torchvision's).
    """

    conv: tuple[ConvLayerSpec, ...]
    hidden: tuple[int, ...] = ()
    classes: int = 10
    dtype: str = "float32"
    dense_names: tuple[str, ...] = ()
    dropout: tuple[float, ...] = ()
    init: str = "pytorch"
    preset: str = ""

    def __post_init__(self) -> None:
        if self.conv and not self.conv[0].name:  # the paper family's: Sequential indices
            object.__setattr__(self, "conv", tuple(
                replace(layer, name=str(self.conv_module_index(l)))
                for l, layer in enumerate(self.conv)))
        if not self.dense_names:
            object.__setattr__(self, "dense_names",
                               tuple(str(i) for i in self.dense_module_indices()))
        check_network(self)

    @property
    def flat_features(self) -> int:
        last = self.conv[-1]
        return last.kernels * last.out_height * last.out_width

    @property
    def plain(self) -> bool:
        """Whether every layer is of the paper's family (`ConvLayerSpec.plain`) and
        the dense layers have no dropout."""
        return all(layer.plain for layer in self.conv) and not any(self.dropout)

    def source(self, layer: int) -> int:
        """The layer whose output conv layer `layer` reads (-1: the images)."""
        given = self.conv[layer].source
        return layer - 1 if given is None else given

    def readers(self, layer: int) -> list[int]:
        """The conv layers that read the whole output of `layer` (-1: the images)."""
        return [l for l in range(len(self.conv)) if self.source(l) == layer]

    def adders(self, layer: int) -> list[int]:
        """The conv layers that add the output of `layer` to theirs (its channels)."""
        return [l for l, spec in enumerate(self.conv) if spec.residual == layer]

    def tied_groups(self) -> list[list[int]]:
        """Layers that must share one kernel split, because a residual sum adds their
        channels one to one: each layer with every layer it adds or is added to."""
        group = list(range(len(self.conv)))

        def root(l: int) -> int:
            while group[l] != l:
                l = group[l]
            return l

        for l, spec in enumerate(self.conv):
            if spec.residual is not None:
                group[root(l)] = root(spec.residual)
        groups: dict[int, list[int]] = {}
        for l in range(len(self.conv)):
            groups.setdefault(root(l), []).append(l)
        return sorted(groups.values())

    def conv_keys(self) -> list[str]:
        """Each conv layer's module name (its state_dict prefix)."""
        return [layer.name for layer in self.conv]

    def conv_module_index(self, layer: int) -> int:
        """Index of conv layer `layer` in the paper family's nn.Sequential."""
        index = 0
        for previous in self.conv[:layer]:
            index += 2 + len(previous.pooling)
        return index

    def dense_module_indices(self) -> list[int]:
        """Indices of the Linear modules in the paper family's nn.Sequential."""
        index = self.conv_module_index(len(self.conv)) + 1  # +1 for Flatten
        indices = []
        for _ in self.hidden:
            indices.append(index)
            index += 2  # Linear, ReLU
        indices.append(index)
        return indices

    def dense_dropout(self, j: int) -> float:
        return self.dropout[j] if j < len(self.dropout) else 0.0


def check_network(network: NetworkSpec) -> None:
    """Raise ValueError where the layers do not fit together: a source or residual
    that is not an earlier layer, channels or sizes that do not match."""
    for l, layer in enumerate(network.conv):
        source = network.source(l)
        if not -1 <= source < l:
            raise ValueError(f"conv layer {l}: its input must be an earlier layer, "
                             f"got {source}")
        if source >= 0:
            before = network.conv[source]
            if (before.kernels, before.out_height, before.out_width) != (
                    layer.in_channels, layer.in_height, layer.in_width):
                raise ValueError(f"conv layer {l}: its input {layer.in_channels}x"
                                 f"{layer.in_height}x{layer.in_width} is not layer "
                                 f"{source}'s output")
        if layer.conv_height < 1 or layer.conv_width < 1 or layer.out_height < 1 \
                or layer.out_width < 1:
            raise ValueError(f"conv layer {l}: the input {layer.in_height}x"
                             f"{layer.in_width} is too small for its kernel and pooling")
        if layer.residual is not None:
            if not 0 <= layer.residual < l:
                raise ValueError(f"conv layer {l}: the residual must be an earlier layer")
            added = network.conv[layer.residual]
            if (added.kernels, added.out_height, added.out_width) != (
                    layer.kernels, layer.conv_height, layer.conv_width):
                raise ValueError(f"conv layer {l}: layer {layer.residual}'s output does "
                                 "not match its channels and size")


def lone_batch_norm(network: NetworkSpec, rows: int) -> int | None:
    """The first conv layer whose batch norm, trained on `rows` samples, would see one
    value per channel; None where every batch norm sees more.

    Why: a batch norm in training normalises each channel by its mean and variance
    over rows x height x width values, and PyTorch refuses one value ("Expected more
    than 1 value per channel when training"), which has no variance. Batch norm
    follows the conv (`ConvLayerSpec`), so its input is the conv's output,
    ``conv_height`` x ``conv_width``; a network whose features reach 1x1 (ResNets on
    32-pixel images: layer4) needs two rows there. No rows run no batch norm.
    """
    if rows < 1:
        return None
    for l, layer in enumerate(network.conv):
        if layer.batch_norm and rows * layer.conv_height * layer.conv_width == 1:
            return l
    return None


def batch_norm_rows(network: NetworkSpec) -> int:
    """The fewest samples the network can train on (`lone_batch_norm`): 2 where a batch
    norm's input is 1x1, else 1. A replica that normalises over its own rows, and any
    timing of the network on a few rows, needs at least this many."""
    return 1 if lone_batch_norm(network, 1) is None else 2


def batch_norm_name(network: NetworkSpec, layer: int) -> str:
    """How a message names conv layer `layer`'s batch norm: its module name (the
    checkpoint's key), the conv layer's index and its input's size."""
    spec = network.conv[layer]
    name = spec.bn_name or spec.name
    return (f"batch norm {name} (after conv layer {layer}, on "
            f"{spec.conv_height}x{spec.conv_width} features)")


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
    """SGD hyper-parameters, applied identically to every shard and the dense head;
    `lr` is the base rate, which `schedule` moves step by step (tasks/lr_schedule.py)."""

    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    nesterov: bool = False
    schedule: LrSchedule = LrSchedule()

    def lr_at(self, step: int) -> float:
        """The learning rate of step `step` (the run's, counted from 0)."""
        return lr_at(step, self.lr, self.schedule)

    @property
    def kind(self) -> tuple[bool, bool, bool]:
        """What of this SGD changes a step's time, not its numbers: whether it keeps
        momentum, decays weights, and looks ahead (Nesterov, with momentum only)."""
        return self.momentum > 0, self.weight_decay > 0, self.nesterov and self.momentum > 0


@dataclass(frozen=True)
class Arithmetic:
    """How a worker computes: SGD for every parameter, the conv
    layers' learning rate scaled by `conv_lr_scale` (hybrid), and whether replicas
    report a fingerprint of their weights every step (to check they stay identical)."""

    optimizer: OptimizerSpec
    conv_lr_scale: float = 1.0
    check_replicas: bool = False
    seed: int = 0  # the run's: dropout masks are drawn from it (tasks/network.py)
    augmentation: Augmentation = Augmentation()  # of the training images (tasks/augment.py)

    def conv_optimizer(self) -> OptimizerSpec:
        """The conv layers' SGD: the base rate scaled, the same schedule (as torch's
        schedulers scale every parameter group's own base rate)."""
        return replace(self.optimizer, lr=self.optimizer.lr * self.conv_lr_scale)


@dataclass(frozen=True)
class RunPaths:
    """Where one run's bytes live: dataset, activation workspace, checkpoints; and what
    the dataset store holds (`DatasetInfo.identity`, "" for any), which every read checks."""

    dataset: str
    workspace: str
    checkpoints: str
    dataset_identity: str = ""
