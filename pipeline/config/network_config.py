"""The `network` part of a run config, and the `NetworkSpec` it gives for a dataset.

Three ways to say a network, one at a time: ``preset`` (the zoo, tasks/zoo.py), a list
of ``conv`` layers (the paper's family: conv, ReLU, max-pool each), or ``layers``, a
user's own network of conv layers, poolings and residual blocks (configs/
custom_resnet.yaml). ``width`` scales any of them; ``dropout`` is the dense layers'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipeline.config.schema import ConfigError, FieldError, check_range, described
from tasks.specs import ConvLayerSpec, NetworkSpec
from tasks.zoo import EXPANSION, PRESETS, NetworkBuilder, build_preset, scaled


@dataclass
class ConvLayerConfig:
    kernels: int = described(doc="the layer's kernels (output channels)")
    size: int = described(5, "the kernel's height and width")
    padding: int = described(2, "zeros added on each side of the input")
    pool: int = described(2, "the max-pool's window and stride after the ReLU (1: none)")

    def __post_init__(self) -> None:
        for name in ("kernels", "size", "pool"):
            check_range(self, name, low=1)
        check_range(self, "padding", low=0)


#: The fields of `LayerConfig` each kind of layer has no use for.
IGNORED_BY = {"conv": ("planes",),
              "pool": ("planes", "bias", "batch_norm", "relu"),
              "block": ("size", "padding", "bias", "batch_norm", "relu")}


@dataclass
class LayerConfig:
    """One entry of a user's own network: a conv layer, a pooling or a residual block."""

    conv: int | None = described(None, "a conv layer of this many kernels")
    pool: Literal["max", "avg", "adaptive_avg"] | None = described(
        None, "a pooling after the conv layer before it: `max`, `avg`, or `adaptive_avg` "
        "(to a `size` x `size` output)")
    block: Literal["basic", "bottleneck"] | None = described(
        None, "a residual block as torchvision's BasicBlock or Bottleneck, with a "
        "projection shortcut where the shape changes")
    planes: int | None = described(None, "a block's width (its output: planes, x4 for a "
                                   "bottleneck)")
    size: int | None = described(None, "the kernel's or window's side (conv: 3; pool: 2; "
                                 "adaptive_avg: the output's side, 1, and no stride or padding)")
    stride: int | None = described(None, "the stride (conv and block: 1; pool: its size)")
    padding: int | None = described(None, "zeros on each side (conv: size // 2; pool: 0, "
                                    "at most size // 2)")
    bias: bool = described(True, "the conv has a bias")
    batch_norm: bool = described(False, "batch norm after the conv")
    relu: bool = described(True, "ReLU after the conv (and batch norm)")

    def __post_init__(self) -> None:
        given = [name for name in ("conv", "pool", "block") if getattr(self, name) is not None]
        if len(given) != 1:
            raise FieldError("conv", "each layer is one of `conv: kernels`, `pool: kind` or "
                             f"`block: kind`, got {given or 'none'}")
        if self.block is not None and self.planes is None:
            raise FieldError("planes", "a block needs its planes")
        kind = "conv" if self.conv is not None else "pool" if self.pool is not None else "block"
        for name in IGNORED_BY[kind]:  # given, it would do nothing: say so
            if getattr(self, name) != getattr(LayerConfig, name):
                raise FieldError(name, f"a {kind} layer has no {name} (it is a field of "
                                 f"{', '.join(k for k, v in IGNORED_BY.items() if name not in v)})")
        for name in ("stride", "padding") if self.pool == "adaptive_avg" else ():
            if getattr(self, name) is not None:  # adaptive pooling takes only its output size
                raise FieldError(name, f"an adaptive_avg pool has no {name} (its size is "
                                 "the output's side)")
        for name in ("conv", "planes", "size", "stride"):
            check_range(self, name, low=1)
        check_range(self, "padding", low=0)
        if self.pool in ("max", "avg") and (self.padding or 0) > (self.size or 2) // 2:
            raise FieldError("padding", f"a pooling's padding is at most half its "
                             f"size ({self.size or 2} // 2 = {(self.size or 2) // 2}), as "
                             f"PyTorch's pooling takes it, got {self.padding}")


@dataclass
class NetworkConfig:
    preset: str | None = described(
        None, "a network of the zoo: " + ", ".join(f"`{p}`" for p in PRESETS) + " (with "
        "torchvision's names; on the command line it replaces the file's network and the "
        "overrides before it, and an override of its layers after it is refused: "
        "`network.width` scales them)")
    conv: list[ConvLayerConfig] = described(
        factory=lambda: [ConvLayerConfig(32), ConvLayerConfig(64)],
        doc="the conv layers, in order (conv, ReLU, max-pool each)")
    layers: list[LayerConfig] | None = described(
        None, "a network of your own, in place of `conv`: conv layers, poolings and "
        "residual blocks (configs/custom_resnet.yaml)")
    hidden: list[int] = described(factory=list, doc="the dense head's hidden layers' widths")
    classes: int = described(10, "the dense head's outputs")
    width: float = described(1.0, "scales every conv layer's channels and every hidden "
                             "dense layer's width (rounded, at least 1)")
    dropout: float | None = described(
        None, "dropout on the dense layers' inputs where the network has it (null: the "
        "preset's own, 0.5 for alexnet and vgg; for `conv`/`layers` networks, after each "
        "hidden layer; 0: none)")
    dtype: Literal["float32", "float64"] = described("float32", "the weights' and "
                                                     "activations' precision")

    def __post_init__(self) -> None:
        if self.preset is not None and self.preset not in PRESETS:
            raise FieldError("preset", f"expected one of {', '.join(PRESETS)}, got "
                             f"{self.preset!r}")
        if self.preset is not None and self.layers:
            raise FieldError("layers", "give a preset or your own layers, not both")
        if self.layers is not None and not self.layers:
            raise FieldError("layers", "at least one conv layer or block is needed (null: "
                             "the `conv` layers)")
        if self.layers and self.layers[0].pool is not None:
            raise FieldError("layers.0.pool", "a pooling follows a conv layer or block, and "
                             "this is the first layer")
        if not self.conv and not self.layers and self.preset is None:
            raise FieldError("conv", "at least one conv layer is needed")
        for index, width in enumerate(self.hidden):
            if width < 1:
                raise FieldError(f"hidden.{index}", f"expected an integer >= 1, got {width}")
        check_range(self, "classes", low=1)
        check_range(self, "width", low=0, low_open=True)
        check_range(self, "dropout", low=0, high=1, high_open=True)

    def spec(self, image_shape: tuple[int, int, int]) -> NetworkSpec:
        """The network's shapes, given the dataset's (channels, height, width)."""
        try:
            if self.preset is not None:
                return build_preset(self.preset, image_shape, self.classes, self.dtype,
                                    self.width, 0.5 if self.dropout is None else self.dropout)
            if self.layers:
                return self._custom(image_shape)
        except FieldError:  # not a matter of the images' size
            raise
        except ValueError as problem:
            what = f"preset: {self.preset}" if self.preset is not None else "layers: the network"
            raise ConfigError(f"network.{what} does not fit images of {image_shape[1]}x"
                              f"{image_shape[2]} ({problem}; data.image_size sets the "
                              "synthetic images' side)") from None
        return self._paper_family(image_shape)

    def _hidden_and_dropout(self) -> tuple[list[int], list[float]]:
        hidden = [scaled(width, self.width) for width in self.hidden]
        p = self.dropout or 0.0
        return hidden, [0.0] + [p] * len(hidden)

    def _paper_family(self, image_shape: tuple[int, int, int]) -> NetworkSpec:
        channels, height, width = image_shape
        layers = []
        for layer in self.conv:
            spec = ConvLayerSpec(channels, scaled(layer.kernels, self.width), layer.size,
                                 layer.padding, layer.pool, height, width)
            if spec.out_height < 1 or spec.out_width < 1:
                raise ConfigError(
                    f"network.conv.{len(layers)}: the image is only {height}x{width} here, "
                    "too small for this kernel/pool")
            layers.append(spec)
            channels, height, width = spec.kernels, spec.out_height, spec.out_width
        hidden, dropout = self._hidden_and_dropout()
        return NetworkSpec(tuple(layers), tuple(hidden), self.classes, self.dtype,
                           dropout=tuple(dropout) if any(dropout) else ())

    def _custom(self, image_shape: tuple[int, int, int]) -> NetworkSpec:
        """A user's own network, named as an nn.Sequential of its modules (a conv, its
        batch norm, ReLU and each pooling take an index each; a block takes one, and
        its modules are named as torchvision's inside it)."""
        builder, index = NetworkBuilder(*image_shape), 0
        for i, layer in enumerate(self.layers or []):
            _check_first_block(builder, layer, i, self.width)
            try:
                index = _add_layer(builder, layer, index, self.width)
            except ValueError as problem:
                raise ConfigError(f"network.layers.{i}: {problem}") from None
        if builder.tip < 0:
            raise ConfigError("network.layers: at least one conv layer or block is needed")
        hidden, dropout = self._hidden_and_dropout()
        names = [str(index + 1 + 2 * j) for j in range(len(hidden) + 1)]  # after a Flatten
        return builder.network(hidden, self.classes, self.dtype, names, dropout)


def _check_first_block(builder: NetworkBuilder, layer: LayerConfig, i: int, width: float
                       ) -> None:
    """Refuse a block whose shortcut would be the images themselves (the first layer,
    stride 1, as many output channels as the images have): its residual sum adds a
    layer's output, and the images are no layer's (FieldError naming it)."""
    if layer.block is None or layer.planes is None or builder.tip >= 0:
        return
    out = scaled(layer.planes, width) * EXPANSION[layer.block]
    if (layer.stride or 1) == 1 and out == builder.channels:
        raise FieldError(f"network.layers.{i}.block", f"a {layer.block} block of {out} "
                         f"output channels and stride 1 on the images' {builder.channels} "
                         "channels would add the images themselves as its shortcut, which no "
                         "strategy holds: put a conv layer before it")


def _add_layer(builder: NetworkBuilder, layer: LayerConfig, index: int, width: float) -> int:
    """Add one entry of `layers` to `builder`; the next free module index."""
    if layer.conv is not None:
        size = layer.size or 3
        builder.conv(scaled(layer.conv, width), size, layer.stride or 1,
                     size // 2 if layer.padding is None else layer.padding, layer.bias,
                     layer.batch_norm, layer.relu, name=str(index),
                     bn_name=str(index + 1) if layer.batch_norm else "")
        return index + 1 + layer.batch_norm + layer.relu
    if layer.pool is not None:
        size = layer.size or (1 if layer.pool == "adaptive_avg" else 2)
        builder.pool(layer.pool, size, layer.stride, layer.padding or 0)
        return index + 1
    assert layer.block is not None and layer.planes is not None
    builder.block(layer.block, scaled(layer.planes, width), layer.stride or 1, str(index))
    return index + 1
