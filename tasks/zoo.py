"""The network zoo: AlexNet, VGG and ResNet as torchvision defines them, and the paper's
network, as `NetworkSpec`s with torchvision's module names.

`build_preset` gives a named network for an image shape; `NetworkBuilder` is what
it (and a user's own network in YAML, pipeline/config/custom_network.py) builds with:
conv layers, poolings, residual blocks and dense layers, each named as the
plain-PyTorch module that holds its tensors, so that a checkpoint's keys are
torchvision's (``features.0.weight``, ``layer2.0.downsample.0.weight``, ``fc.bias``)
and ``torchvision.models.resnet18(num_classes=10).load_state_dict`` takes them.

``width`` scales every conv layer's channels and every hidden dense layer's width
(`scaled`: rounded half up, at least 1) so that small versions train on a few cores;
a residual stage's output channels stay its scaled ``planes`` times the block's
expansion, as torchvision computes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from tasks.specs import ConvLayerSpec, NetworkSpec, PoolSpec

PRESETS = ("marques", "alexnet", "vgg11", "vgg16", "vgg11_bn", "vgg16_bn", "resnet18",
           "resnet50", "resnet20")

#: torchvision's VGG configurations: channels of each conv, "M" a 2x2 max-pool.
VGG_CONFIGS = {
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
              512, 512, 512, "M"],
}
#: (block, blocks per stage, planes per stage, stem channels, ImageNet stem)
RESNETS = {
    "resnet18": ("basic", (2, 2, 2, 2), (64, 128, 256, 512), 64, True),
    "resnet50": ("bottleneck", (3, 4, 6, 3), (64, 128, 256, 512), 64, True),
    "resnet20": ("basic", (3, 3, 3), (16, 32, 64), 16, False),
}
EXPANSION = {"basic": 1, "bottleneck": 4}


def scaled(channels: int, width: float) -> int:
    """`channels` times `width`, rounded half up, at least 1."""
    return max(1, math.floor(channels * width + 0.5))


def _conv_label(name: str) -> str:
    """A conv layer as a message names it: by its module name (``features.0``, or a
    custom network's index ``3``), which alone reads as a number."""
    return f"conv layer {name}" if name else "a conv layer"


@dataclass
class NetworkBuilder:
    """Builds a network layer by layer, tracking the running output's shape.

    The *tip* is the layer whose output the next layer reads (-1: the images).
    """

    channels: int
    height: int
    width: int
    layers: list[ConvLayerSpec] = field(default_factory=list)
    tip: int = -1

    def conv(self, kernels: int, size: int, stride: int = 1, padding: int = 0,
             bias: bool = True, batch_norm: bool = False, relu: bool = True,
             name: str = "", bn_name: str = "", source: int | None = None,
             residual: int | None = None) -> int:
        """Append a conv layer reading `source` (default: the tip); it becomes the tip.
        Its index."""
        source = self.tip if source is None else source
        channels, height, width = self.shape_of(source)
        before = len(self.layers) - 1  # a source of None means this one
        layer = ConvLayerSpec(channels, kernels, size, padding, 1, height, width,
                              stride=stride, bias=bias, batch_norm=batch_norm, relu=relu,
                              pools=(), source=None if source == before else source, residual=residual, name=name,
                              bn_name=bn_name)
        if layer.conv_height < 1 or layer.conv_width < 1:
            raise ValueError(f"{_conv_label(name)}: its input is only {height}x{width}, "
                             f"too small for a {size}x{size} kernel with stride {stride}")
        self.layers.append(layer)
        self.tip = len(self.layers) - 1
        return self.tip

    def pool(self, kind: str, window: int, stride: int | None = None, padding: int = 0
             ) -> None:
        """A pooling after the tip's ReLU (the tip must be a conv layer)."""
        if self.tip < 0:
            raise ValueError("a pooling needs a conv layer before it")
        pool = PoolSpec(kind, window, window if stride is None else stride, padding)
        last = self.layers[self.tip]
        if kind != "adaptive_avg" and pool.out_size(min(last.out_height, last.out_width)) < 1:
            raise ValueError(f"the {kind} pool of window {window} after "
                             f"{_conv_label(last.name)}: its input is only "
                             f"{last.out_height}x{last.out_width}")
        self.layers[self.tip] = replace(last, pools=(*last.pooling, pool))

    def shape_of(self, layer: int) -> tuple[int, int, int]:
        """(channels, height, width) of a layer's output (-1: the images)."""
        if layer < 0:
            return self.channels, self.height, self.width
        spec = self.layers[layer]
        return spec.kernels, spec.out_height, spec.out_width

    def block(self, kind: str, planes: int, stride: int, prefix: str) -> None:
        """A residual block as torchvision's BasicBlock or Bottleneck (ResNet v1.5: the
        stride on the 3x3 conv), with a projection shortcut (``downsample``: 1x1 conv
        and batch norm) where the shape changes."""
        block_input = self.tip
        channels = self.shape_of(block_input)[0]
        out = planes * EXPANSION[kind]
        bn = dict(bias=False, batch_norm=True)
        if kind == "basic":
            self.conv(planes, 3, stride, 1, name=f"{prefix}.conv1", bn_name=f"{prefix}.bn1",
                      **bn)
            inner = self.tip
        else:
            self.conv(planes, 1, 1, 0, name=f"{prefix}.conv1", bn_name=f"{prefix}.bn1", **bn)
            self.conv(planes, 3, stride, 1, name=f"{prefix}.conv2", bn_name=f"{prefix}.bn2",
                      **bn)
            inner = self.tip
        shortcut = block_input
        if stride != 1 or channels != out:
            shortcut = self.conv(out, 1, stride, 0, relu=False, source=block_input,
                                 name=f"{prefix}.downsample.0",
                                 bn_name=f"{prefix}.downsample.1", **bn)
        last = "conv2" if kind == "basic" else "conv3"
        bn_last = "bn2" if kind == "basic" else "bn3"
        self.conv(out, 3 if kind == "basic" else 1, 1, 1 if kind == "basic" else 0,
                  source=inner, residual=shortcut, name=f"{prefix}.{last}",
                  bn_name=f"{prefix}.{bn_last}", **bn)

    def network(self, hidden: list[int], classes: int, dtype: str, dense_names: list[str],
                dropout: list[float], init: str = "pytorch", preset: str = ""
                ) -> NetworkSpec:
        return NetworkSpec(tuple(self.layers), tuple(hidden), classes, dtype,
                           tuple(dense_names), tuple(dropout), init, preset)


def build_preset(preset: str, image_shape: tuple[int, int, int], classes: int, dtype: str,
                 width: float = 1.0, dropout: float = 0.5) -> NetworkSpec:
    """The zoo network `preset` for images of `image_shape` (channels, height, width).

    Raises ValueError (naming the layer) where the images are too small for it."""
    builder = NetworkBuilder(*image_shape)
    if preset == "alexnet":
        return _alexnet(builder, classes, dtype, width, dropout)
    if preset.startswith("vgg"):
        return _vgg(builder, preset, classes, dtype, width, dropout)
    if preset in RESNETS:
        return _resnet(builder, preset, classes, dtype, width)
    if preset == "marques":
        return _marques(builder, classes, dtype, width)
    raise ValueError(f"unknown network preset {preset!r}; expected one of {', '.join(PRESETS)}")


def _marques(builder: NetworkBuilder, classes: int, dtype: str, width: float) -> NetworkSpec:
    """The paper's network (Marques et al.): 5x5 convs of 500 and 1500 kernels (pad 2),
    each with ReLU and a 2x2 max-pool, then one dense layer; named as an nn.Sequential."""
    for kernels in (500, 1500):
        builder.conv(scaled(kernels, width), 5, 1, 2)
        builder.pool("max", 2)
    return NetworkSpec(tuple(builder.layers), (), classes, dtype, preset="marques")


def _alexnet(builder: NetworkBuilder, classes: int, dtype: str, width: float,
             dropout: float) -> NetworkSpec:
    """torchvision's AlexNet (single column): features, avgpool to 6x6, classifier."""
    plan = [(64, 11, 4, 2, True), (192, 5, 1, 2, True), (384, 3, 1, 1, False),
            (256, 3, 1, 1, False), (256, 3, 1, 1, True)]
    index = 0
    for kernels, size, stride, padding, pooled in plan:
        builder.conv(scaled(kernels, width), size, stride, padding, name=f"features.{index}")
        index += 2
        if pooled:
            builder.pool("max", 3, 2)
            index += 1
    builder.pool("adaptive_avg", 6)
    hidden = [scaled(4096, width)] * 2
    return builder.network(hidden, classes, dtype,
                           ["classifier.1", "classifier.4", "classifier.6"],
                           [dropout, dropout, 0.0], preset="alexnet")


def _vgg(builder: NetworkBuilder, preset: str, classes: int, dtype: str, width: float,
         dropout: float) -> NetworkSpec:
    """torchvision's VGG: 3x3 convs (with a bias, and batch norm for ``_bn``), 2x2
    max-pools, avgpool to 7x7, classifier of two 4096-wide layers."""
    batch_norm = preset.endswith("_bn")
    index = 0
    for item in VGG_CONFIGS[preset.removesuffix("_bn")]:
        if item == "M":
            builder.pool("max", 2)
            index += 1
            continue
        builder.conv(scaled(item, width), 3, 1, 1, batch_norm=batch_norm,
                     name=f"features.{index}",
                     bn_name=f"features.{index + 1}" if batch_norm else "")
        index += 3 if batch_norm else 2
    builder.pool("adaptive_avg", 7)
    hidden = [scaled(4096, width)] * 2
    return builder.network(hidden, classes, dtype,
                           ["classifier.0", "classifier.3", "classifier.6"],
                           [0.0, dropout, dropout], init="vgg", preset=preset)


def _resnet(builder: NetworkBuilder, preset: str, classes: int, dtype: str, width: float
            ) -> NetworkSpec:
    """torchvision's ResNet: ImageNet stem (7x7/2 conv, 3x3/2 max-pool) or the CIFAR
    one of He et al. (3x3 conv), stages of residual blocks, global average pool, fc."""
    kind, blocks, planes, stem, imagenet = RESNETS[preset]
    bn = dict(bias=False, batch_norm=True, name="conv1", bn_name="bn1")
    if imagenet:
        builder.conv(scaled(stem, width), 7, 2, 3, **bn)
        builder.pool("max", 3, 2, 1)
    else:
        builder.conv(scaled(stem, width), 3, 1, 1, **bn)
    for stage, (count, stage_planes) in enumerate(zip(blocks, planes)):
        for b in range(count):
            stride = 2 if stage > 0 and b == 0 else 1
            builder.block(kind, scaled(stage_planes, width), stride, f"layer{stage + 1}.{b}")
    builder.pool("adaptive_avg", 1)
    return builder.network([], classes, dtype, ["fc"], [], init="resnet", preset=preset)
