"""torchvision's AlexNet, VGG and ResNet in plain PyTorch, with a width knob: the
yardstick the zoo's builder and its checkpoints are measured against.

torchvision itself cannot be imported here (its 0.28.0 wheel, the one built for
torch 2.13.0, fails against the CPU build of torch), so its model definitions are
transcribed from its source: torchvision/models/alexnet.py, vgg.py and resnet.py of
the torchvision 0.28.0 wheel (git_version 8fb87713a24951e639c494b0f2a8a81b5f8e33a6 in
its torchvision/version.py). Module tree, attribute names and their order,
Sequential indices, forward and initialisation are torchvision's, so at width 1 a
network here has torchvision's state_dict keys, in its order, and, built after the
same `torch.manual_seed`, torchvision's initial weights bit for bit (modules are
created, and then initialised, in torchvision's order). That was checked by running
those three files of the wheel themselves (their package imports stubbed): same
keys, shapes and order, same seeded weights, same outputs, for the seven presets
torchvision has; resnet20 against torchvision's own BasicBlock and `_make_layer`.
tests/data/torchvision_keys.json is this module's table at width 1 and 1000 classes
(`python -m tests.torchvision_models` writes it).

What is added to torchvision:

* `width` scales channels and hidden widths by `scale` (nearest integer, at least 1):
  AlexNet's conv channels and its two hidden dense layers; VGG's cfg channels and
  its two hidden dense layers; ResNet's stem and each stage's `planes` (a block's
  output is `planes * expansion` of the scaled planes). The flattened feature count
  follows from the scaled channels.
* `dropout_module`, a callable `p -> nn.Module` put where torchvision puts
  `nn.Dropout(p=dropout)`, so a test can put in a dropout whose masks it controls;
  `dropout=0` keeps the modules (with p=0), so no Sequential index moves.
* `resnet20`, the CIFAR network of He et al. 2016, which torchvision lacks, built
  the torchvision way: a 3x3 stride-1 stem of 16 channels with no max-pool
  (`maxpool` is an `nn.Identity`, which has no state), three stages of three basic
  blocks (16, 32, 64 planes, strides 1, 2, 2), projection shortcuts where
  torchvision's `_make_layer` puts them (stride != 1 or a change of channels).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch
from torch import nn

#: Makes the module put where torchvision has `nn.Dropout(p=dropout)`.
DropoutFactory = Callable[[float], nn.Module]

#: VGG's layer configurations (torchvision's `cfgs`): a channel count is a 3x3 conv
#: (with BN in the _bn variants) and ReLU, "M" a 2x2 max-pool of stride 2.
VGG_CFGS: dict[str, list[Union[int, str]]] = {
    "A": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "D": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
}
#: VGG preset -> (cfg, batch norm).
VGG_PRESETS: dict[str, tuple[str, bool]] = {
    "vgg11": ("A", False), "vgg16": ("D", False),
    "vgg11_bn": ("A", True), "vgg16_bn": ("D", True),
}
#: ResNet preset -> (block name, stem form, [(planes, blocks, stride) per stage]).
RESNET_PRESETS: dict[str, tuple[str, str, list[tuple[int, int, int]]]] = {
    "resnet18": ("basic", "imagenet", [(64, 2, 1), (128, 2, 2), (256, 2, 2), (512, 2, 2)]),
    "resnet50": ("bottleneck", "imagenet", [(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)]),
    "resnet20": ("basic", "cifar", [(16, 3, 1), (32, 3, 2), (64, 3, 2)]),
}
#: Every preset this module builds.
PRESETS: tuple[str, ...] = ("alexnet", *VGG_PRESETS, *RESNET_PRESETS)


def scale(channels: int, width: float) -> int:
    """`channels` scaled by `width`, rounded to the nearest integer (halves up), at
    least 1: the rule every conv's channels and every hidden dense width follow."""
    return max(1, math.floor(channels * width + 0.5))


class AlexNet(nn.Module):
    """torchvision's AlexNet (the single-column network of "One weird trick")."""

    def __init__(self, num_classes: int = 1000, width: float = 1.0, dropout: float = 0.5,
                 dropout_module: DropoutFactory = nn.Dropout) -> None:
        super().__init__()
        c1, c2, c3, c4, c5 = (scale(n, width) for n in (64, 192, 384, 256, 256))
        hidden = scale(4096, width)
        self.features = nn.Sequential(
            nn.Conv2d(3, c1, kernel_size=11, stride=4, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(c1, c2, kernel_size=5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(c2, c3, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(c3, c4, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(c4, c5, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            dropout_module(dropout),
            nn.Linear(c5 * 6 * 6, hidden),
            nn.ReLU(inplace=True),
            dropout_module(dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def vgg_features(cfg: list[Union[int, str]], batch_norm: bool, width: float) -> nn.Sequential:
    """torchvision's `make_layers`, channels scaled: conv (BN) ReLU per number, a
    2x2/2 max-pool per "M"."""
    layers: list[nn.Module] = []
    in_channels = 3
    for v in cfg:
        if v == "M":
            layers += [nn.MaxPool2d(kernel_size=2, stride=2)]
            continue
        out_channels = scale(int(v), width)
        conv2d = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1)
        if batch_norm:
            layers += [conv2d, nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True)]
        else:
            layers += [conv2d, nn.ReLU(inplace=True)]
        in_channels = out_channels
    return nn.Sequential(*layers)


class VGG(nn.Module):
    """torchvision's VGG with `init_weights=True`: features, a 7x7 adaptive average
    pool, and the classifier Linear ReLU Dropout Linear ReLU Dropout Linear."""

    def __init__(self, features: nn.Sequential, num_classes: int = 1000, width: float = 1.0,
                 dropout: float = 0.5, dropout_module: DropoutFactory = nn.Dropout) -> None:
        super().__init__()
        hidden = scale(4096, width)
        self.features = features
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(scale(512, width) * 7 * 7, hidden),
            nn.ReLU(True),
            dropout_module(dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(True),
            dropout_module(dropout),
            nn.Linear(hidden, num_classes),
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """torchvision's 3x3 convolution with padding 1 and no bias."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """torchvision's 1x1 convolution with no bias (the projection shortcut's)."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class ResidualBlock(nn.Module):
    """torchvision's block forward: relu(branch(x) + shortcut(x)), the shortcut the
    input itself or, where the block changes the shape, `downsample(x)`."""

    downsample: Optional[nn.Module]
    relu: nn.ReLU

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        """The residual branch, up to and including its last BN."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.branch(x)
        identity = x if self.downsample is None else self.downsample(x)
        out += identity
        return self.relu(out)


class BasicBlock(ResidualBlock):
    """Two 3x3 convs with BN; the stride is on the first; ReLU after the addition."""

    expansion: int = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.bn2(self.conv2(out))


class Bottleneck(ResidualBlock):
    """1x1, 3x3 (with the stride: torchvision's "ResNet V1.5"), 1x1 to
    `planes * 4`, each with BN; ReLU after the addition."""

    expansion: int = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.bn3(self.conv3(out))


BLOCKS: dict[str, type[Union[BasicBlock, Bottleneck]]] = {"basic": BasicBlock,
                                                          "bottleneck": Bottleneck}


class ResNet(nn.Module):
    """torchvision's ResNet (groups 1, base width 64, no dilation, zero_init_residual
    False), its stages given as (planes, blocks, stride); the "cifar" stem is a 3x3
    stride-1 conv and no max-pool, the "imagenet" one torchvision's 7x7/2 conv and
    3x3/2 max-pool. The stages are `layer1`.. in order."""

    def __init__(self, block: type[Union[BasicBlock, Bottleneck]], stem: str,
                 stages: list[tuple[int, int, int]], num_classes: int = 1000,
                 width: float = 1.0) -> None:
        super().__init__()
        self.inplanes = scale(stages[0][0], width)
        if stem == "imagenet":
            self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        else:
            self.conv1 = conv3x3(3, self.inplanes)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool: nn.Module = (nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
                                   if stem == "imagenet" else nn.Identity())
        self.stage_names: list[str] = []
        for index, (planes, blocks, stride) in enumerate(stages, start=1):
            name = f"layer{index}"
            setattr(self, name, self._make_layer(block, scale(planes, width), blocks, stride))
            self.stage_names.append(name)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(self.inplanes, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, block: type[Union[BasicBlock, Bottleneck]], planes: int,
                    blocks: int, stride: int = 1) -> nn.Sequential:
        """torchvision's `_make_layer`: a projection shortcut (1x1 conv with the
        stride, BN) on the first block when the stride or the channel count changes;
        it is created before the block, as torchvision creates it."""
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        for _ in range(1, blocks):
            layers.append(block(self.inplanes, planes))
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for name in self.stage_names:
            x = getattr(self, name)(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


def alexnet(num_classes: int = 1000, width: float = 1.0, dropout: float = 0.5,
            dropout_module: DropoutFactory = nn.Dropout) -> AlexNet:
    """torchvision's `alexnet()` (PyTorch's default initialisation), scaled."""
    return AlexNet(num_classes, width, dropout, dropout_module)


def vgg(name: str, num_classes: int = 1000, width: float = 1.0, dropout: float = 0.5,
        dropout_module: DropoutFactory = nn.Dropout) -> VGG:
    """torchvision's `vgg11`, `vgg16`, `vgg11_bn` or `vgg16_bn`, scaled; the features
    are made before the classifier, as torchvision's `_vgg` makes them."""
    if name not in VGG_PRESETS:
        raise ValueError(f"unknown VGG {name!r}: one of {sorted(VGG_PRESETS)}")
    cfg, batch_norm = VGG_PRESETS[name]
    return VGG(vgg_features(VGG_CFGS[cfg], batch_norm, width), num_classes, width,
               dropout, dropout_module)


def resnet(name: str, num_classes: int = 1000, width: float = 1.0) -> ResNet:
    """torchvision's `resnet18` or `resnet50` (ImageNet form), or `resnet20` (CIFAR
    form, built the torchvision way), scaled."""
    if name not in RESNET_PRESETS:
        raise ValueError(f"unknown ResNet {name!r}: one of {sorted(RESNET_PRESETS)}")
    block, stem, stages = RESNET_PRESETS[name]
    return ResNet(BLOCKS[block], stem, stages, num_classes, width)


def build(name: str, num_classes: int = 1000, width: float = 1.0, dropout: float = 0.5,
          dropout_module: DropoutFactory = nn.Dropout) -> nn.Module:
    """Any preset by name; ResNets have no dropout, so they ignore those two."""
    if name == "alexnet":
        return alexnet(num_classes, width, dropout, dropout_module)
    if name in VGG_PRESETS:
        return vgg(name, num_classes, width, dropout, dropout_module)
    return resnet(name, num_classes, width)


def state_dict_shapes(model: nn.Module) -> list[tuple[str, list[int]]]:
    """The model's state_dict as ordered (key, shape) pairs: the form of
    tests/data/torchvision_keys.json."""
    return [(key, list(value.shape)) for key, value in model.state_dict().items()]


if __name__ == "__main__":  # writes tests/data/torchvision_keys.json
    import json
    import os

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "torchvision_keys.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with torch.device("meta"):
        table = {name: state_dict_shapes(build(name)) for name in PRESETS}
    with open(path, "w", encoding="utf-8") as f:  # one (key, shape) a line
        f.write("{\n" + ",\n".join(
            f"{json.dumps(name)}: [\n" + ",\n".join(json.dumps(entry) for entry in entries) + "\n]"
            for name, entries in table.items()) + "\n}\n")
