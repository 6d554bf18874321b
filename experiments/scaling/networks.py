"""The network of a scaling point: a zoo preset at its own image size, conv layers, or
a network of your own (``layers``, as a run config's ``network.layers``).

A scaling sweep names what is trained as a run config does (``network.preset``,
``network.width``), and the cost model gets the network the engine would build:
`tasks.zoo.build_preset` converted by `pipeline.probe.tables.costmodel_network`,
its shapes checked against the engine's. The zoo trains at ImageNet's 3x224x224
and 1000 classes (``resnet20`` at CIFAR's 3x32x32 and 10), as the networks were
designed; ``marques``, conv layers and ``layers`` take ``image``, ``channels`` and
``hidden``, and ``layers`` is built by the run config's own builder
(`pipeline.config.network_config.NetworkConfig.spec`), so it is the network a run of
those layers trains.

Why apart from :mod:`experiments.scaling.config`: the file's schema and its loading
are one job, which network a description means is another.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Literal

from pipeline.config.network_config import LayerConfig, NetworkConfig
from pipeline.config.schema import ConfigError, described, to_dict
from pipeline.costmodel import Network, alexnet, conv_net, sequential
from pipeline.probe.tables import costmodel_network
from tasks.zoo import PRESETS, build_preset, scaled

__all__ = ["ConvDesc", "NetworkDesc", "check_network", "network_of", "zoo_shape"]


@dataclass
class ConvDesc:
    """One conv layer (as ``network.conv`` of a run config, plus strides for AlexNet-like nets)."""

    kernels: int = described(doc="the layer's kernels (output channels)")
    size: int = described(5, "the kernel's height and width")
    padding: int = described(2, "zeros added on each side of the input")
    pool: int = described(2, "the max-pool's window (1: none)")
    stride: int = described(1, "the convolution's stride")
    pool_stride: int | None = described(None, "the max-pool's stride (null: its window)")


@dataclass
class NetworkDesc:
    """The network: a ``preset`` of the zoo (`tasks.zoo.PRESETS`) or conv layers.

    Neither given: Marques et al.'s 500/1500 network (5x5 convolutions with
    padding 2, ReLU, 2x2 max-pool). ``hidden``, ``image`` and ``channels`` apply to
    conv layers and to ``marques``; the other presets take their own images
    (`ZOO_IMAGES`: ImageNet's 3x224x224, ``resnet20`` CIFAR's 3x32x32) and
    ``width`` scales their channels as in training (`tasks.zoo.scaled`).
    """

    preset: Literal[PRESETS] | None = described(
        None, "a zoo network (`marques`, `alexnet`, `vgg11`, `vgg16`, `vgg11_bn`, `vgg16_bn`, "
        "`resnet18`, `resnet50`, `resnet20`) at its own image size; null with no `conv`: "
        "`marques`")
    conv: list[ConvDesc] | None = described(None, "conv layers, instead of a preset")
    layers: list[LayerConfig] | None = described(
        None, "a network of your own, as a run config's `network.layers` (conv layers, "
        "poolings, residual blocks), instead of a preset or `conv`")
    hidden: list[int] = described(factory=list, doc="the dense head's hidden widths (conv "
                                  "layers and marques only)")
    classes: int | None = described(None, "the outputs (null: the preset's: 1000 at ImageNet "
                                    "size, else 10)")
    image: int | None = described(None, "the input's height and width (conv layers and "
                                  "marques only; null: 32)")
    channels: int | None = described(None, "the input's channels (conv layers and marques "
                                     "only; null: 3)")
    width: float = described(1.0, "a preset's channels and its own hidden widths scaled by "
                             "this (as `network.width` of a run), above 0, at most 64")


# The network -----------------------------------------------------------------------


#: The zoo presets' own images (channels, side) and classes; the rest take ImageNet's.
ZOO_IMAGES = {"resnet20": (3, 32, 10)}
IMAGENET = (3, 224, 1000)
#: Presets that take ``hidden``, ``image`` and ``channels`` (as conv layers do).
SHAPED_PRESETS = (None, "marques")


def zoo_shape(preset: str) -> tuple[int, int, int]:
    """A zoo preset's (channels, image side, classes): ImageNet's unless it has its own."""
    return ZOO_IMAGES.get(preset, IMAGENET)


#: The widest scaling: 64x a preset's channels (AlexNet's 384 conv kernels x 64 is
#: 24576); 1e300 passed and the model overflowed.
MAX_WIDTH = 64


def check_network(desc: NetworkDesc) -> None:
    """Raise a ConfigError naming the field for a network the model cannot build, or
    for a field the chosen network does not take (a silently ignored field would
    predict another network than the one the user described)."""
    if desc.preset is not None and desc.conv is not None:
        raise ConfigError("network.conv: give either network.preset or conv layers, not both")
    if desc.layers is not None:
        _check_own_layers(desc)
    if desc.preset not in SHAPED_PRESETS:
        _check_zoo_fields(desc)
    if not math.isfinite(desc.width) or not 0 < desc.width <= MAX_WIDTH:
        raise ConfigError(f"network.width: expected a number in (0, {MAX_WIDTH}], got "
                          f"{desc.width!r}")
    if desc.conv is not None and desc.layers is None:
        _check_conv_layers(desc.conv, desc.width)
    for i, size in enumerate(desc.hidden):
        if size < 1:
            raise ConfigError(f"network.hidden.{i}: expected at least 1, got {size}")
    if desc.classes is not None and desc.classes < 1:
        raise ConfigError(f"network.classes: expected at least 1, got {desc.classes}")
    if (desc.image or 1) < 1 or (desc.channels or 1) < 1:
        raise ConfigError("network.image, network.channels: expected at least 1")


def _check_zoo_fields(desc: NetworkDesc) -> None:
    """A zoo preset has its own dense layers and images."""
    channels, side, _ = zoo_shape(desc.preset)
    if desc.hidden:
        raise ConfigError(f"network.hidden: {desc.preset} has its own dense layers")
    for name, own in (("image", side), ("channels", channels)):
        if getattr(desc, name) not in (None, own):
            raise ConfigError(f"network.{name}: {desc.preset} takes its own {channels}x"
                              f"{side}x{side} images (image and channels are for marques "
                              "and conv layers)")


def _check_own_layers(desc: NetworkDesc) -> None:
    """``layers`` alone (no preset, no ``conv``), checked as a run config checks them."""
    if desc.preset is not None:
        raise ConfigError("network.layers: give either network.preset or your own layers, "
                          "not both")
    if desc.conv is not None:
        raise ConfigError("network.conv: give either conv layers or network.layers, not both")
    try:
        _own_config(desc)
    except ConfigError as error:
        raise ConfigError(f"network.{error}") from None


def _own_config(desc: NetworkDesc) -> NetworkConfig:
    """The run config's network of these layers (its checks: one line naming the field)."""
    return NetworkConfig(layers=desc.layers, hidden=list(desc.hidden),
                         classes=desc.classes or 10, width=desc.width)


def _check_conv_layers(layers: list[ConvDesc], width: float) -> None:
    if width != 1:
        raise ConfigError("network.width: scales a preset; conv layers give their kernels")
    if not layers:
        raise ConfigError("network.conv: at least one conv layer is needed")
    for i, layer in enumerate(layers):
        for name in ("kernels", "size", "pool", "stride"):
            if getattr(layer, name) < 1:
                raise ConfigError(f"network.conv.{i}.{name}: expected at least 1, got "
                                  f"{getattr(layer, name)}")
        if layer.padding < 0:
            raise ConfigError(f"network.conv.{i}.padding: expected >= 0, got {layer.padding}")
        if layer.pool_stride is not None and layer.pool_stride < 1:
            raise ConfigError(f"network.conv.{i}.pool_stride: expected at least 1, got "
                              f"{layer.pool_stride}")


_NETWORKS: dict[str, Network] = {}


def _zoo_network(desc: NetworkDesc) -> Network:
    """A zoo preset as the engine builds it (`tasks.zoo.build_preset`), at its own
    image size, converted for the cost model."""
    channels, side, classes = zoo_shape(desc.preset)
    spec = build_preset(desc.preset, (channels, side, side), desc.classes or classes,
                        "float32", desc.width)
    return costmodel_network(spec)


def _build_network(desc: NetworkDesc) -> Network:
    """The cost model's network. ``alexnet`` at full width is the network of the
    Krizhevsky check (`pipeline.costmodel.alexnet`: the zoo's without its dropout,
    which costs 0.1 % of a step), and ``marques`` keeps its ``hidden``, ``image`` and
    ``channels``; every other preset is the zoo's."""
    if desc.preset == "alexnet" and desc.width == 1:
        return alexnet(classes=desc.classes or 1000)
    if desc.preset not in SHAPED_PRESETS:
        return _zoo_network(desc)
    if desc.layers is not None:  # as a run builds them, at this image
        image = desc.image or 32
        try:
            spec = _own_config(desc).spec((desc.channels or 3, image, image))
        except ConfigError as error:  # a run's words, less its dataset's hint
            why = str(error).split("; data.image_size")[0].removeprefix("network.")
            raise ConfigError(f"network.{why}; network.image sets the side)") from None
        return costmodel_network(spec)
    if desc.conv is None:  # Marques et al.'s network (pipeline.costmodel.marques_cifar)
        return conv_net([scaled(500, desc.width), scaled(1500, desc.width)],
                        in_channels=desc.channels or 3, image=desc.image or 32,
                        hidden=desc.hidden,
                        classes=desc.classes or 10, name="marques_500_1500")
    specs = [dict(out_channels=c.kernels, kernel=c.size, padding=c.padding, pool=c.pool,
                  stride=c.stride, pool_stride=c.pool_stride) for c in desc.conv]
    image = desc.image or 32
    return sequential(desc.channels or 3, (image, image), specs,
                      [*desc.hidden, desc.classes or 10],
                      name="/".join(str(c.kernels) for c in desc.conv))


def network_of(desc: NetworkDesc) -> Network:
    """The cost model's network (cached: the points of a sweep share a few networks)."""
    key = json.dumps(to_dict(desc), sort_keys=True)
    if key not in _NETWORKS:
        _NETWORKS[key] = _build_network(desc)
    return _NETWORKS[key]
