"""tests/torchvision_models.py, the plain-PyTorch transcription of torchvision's
AlexNet, VGG and ResNet that the zoo is measured against: at width 1 it has
torchvision's state_dict (tests/data/torchvision_keys.json, in order) and
torchvision's published parameter counts; `width` scales channels by its rule;
dropout modules can be swapped without moving an index; the initialisation is
torchvision's. Networks at width 1 are built on the meta device (no memory, no time)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from torch import nn

from tests.torchvision_models import (PRESETS, alexnet, build, resnet, scale,
                                      state_dict_shapes, vgg)

KEYS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                         "torchvision_keys.json")

#: torchvision 0.28.0's own figures: the "num_params" of each model's IMAGENET1K_V1
#: weights in torchvision/models/alexnet.py, vgg.py and resnet.py (1000 classes).
TORCHVISION_PARAMETERS = {
    "alexnet": 61_100_840, "vgg11": 132_863_336, "vgg16": 138_357_544,
    "vgg11_bn": 132_868_840, "vgg16_bn": 138_365_992,
    "resnet18": 11_689_512, "resnet50": 25_557_032,
}
# resnet20 at 10 classes, counted by hand (weights; a BN has 2 * channels):
#   stem    3*16*9 + 2*16                                         =     464
#   layer1  3 * (2 * 16*16*9 + 2 * 2*16)                          =  14_016
#   layer2  16*32*9 + 32*32*9 + 2*64 + (16*32 + 64)               =  14_528
#           + 2 * (2 * 32*32*9 + 2*64)                            =  37_120
#   layer3  32*64*9 + 64*64*9 + 2*128 + (32*64 + 128)             =  57_728
#           + 2 * (2 * 64*64*9 + 2*128)                           = 147_968
#   fc      64*10 + 10                                            =     650
#                                                          total  = 272_474
RESNET20_CIFAR10_PARAMETERS = 272_474


def _on_meta(name: str, **kwargs) -> nn.Module:
    with torch.device("meta"):
        return build(name, **kwargs)


def _parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


@pytest.fixture(scope="module")
def torchvision_keys() -> dict[str, list[tuple[str, list[int]]]]:
    with open(KEYS_FILE, encoding="utf-8") as f:
        return {name: [tuple(entry) for entry in entries] for name, entries in json.load(f).items()}


@pytest.mark.parametrize("name", PRESETS)
def test_width_one_has_torchvisions_keys_and_shapes_in_order(name, torchvision_keys):
    got = [tuple(entry) for entry in state_dict_shapes(_on_meta(name))]
    assert got == torchvision_keys[name]


def test_the_key_list_holds_what_torchvisions_source_says(torchvision_keys):
    """Facts read off torchvision's definitions, independent of the transcription:
    entry counts (a BN has 5 entries, num_batches_tracked included; a conv without
    bias 1; a conv or Linear with bias 2) and a few keys with their shapes."""
    counts = {name: len(entries) for name, entries in torchvision_keys.items()}
    assert counts == {
        "alexnet": 5 * 2 + 3 * 2, "vgg11": 8 * 2 + 3 * 2, "vgg16": 13 * 2 + 3 * 2,
        "vgg11_bn": 8 * 7 + 3 * 2, "vgg16_bn": 13 * 7 + 3 * 2,
        # stem conv + BN, blocks (BasicBlock 2 conv + 2 BN, Bottleneck 3 + 3),
        # projection shortcuts (conv + BN), fc
        "resnet18": 6 + 8 * 12 + 3 * 6 + 2, "resnet50": 6 + 16 * 18 + 4 * 6 + 2,
        "resnet20": 6 + 9 * 12 + 2 * 6 + 2,
    }
    facts = {
        "alexnet": {"features.0.weight": [64, 3, 11, 11], "features.10.bias": [256],
                    "classifier.1.weight": [4096, 9216], "classifier.6.weight": [1000, 4096]},
        "vgg16_bn": {"features.1.num_batches_tracked": [], "features.41.running_var": [512],
                     "classifier.0.weight": [4096, 25088], "classifier.3.bias": [4096]},
        "resnet18": {"layer2.0.downsample.0.weight": [128, 64, 1, 1],
                     "layer4.1.bn2.running_mean": [512], "fc.weight": [1000, 512]},
        "resnet50": {"conv1.weight": [64, 3, 7, 7], "layer1.0.downsample.0.weight": [256, 64, 1, 1],
                     "layer2.0.conv2.weight": [128, 128, 3, 3], "fc.weight": [1000, 2048]},
        "resnet20": {"conv1.weight": [16, 3, 3, 3], "layer3.0.downsample.1.weight": [64],
                     "fc.weight": [1000, 64]},
    }
    for name, expected in facts.items():
        table = dict(torchvision_keys[name])
        assert {key: table.get(key) for key in expected} == expected, name
    assert not any("layer1.0.downsample" in key for key, _ in torchvision_keys["resnet18"])
    assert not any("maxpool" in key for key, _ in torchvision_keys["resnet20"])


@pytest.mark.parametrize("name", sorted(TORCHVISION_PARAMETERS))
def test_parameter_counts_are_torchvisions(name):
    assert _parameters(_on_meta(name)) == TORCHVISION_PARAMETERS[name]


def test_resnet20_has_the_parameters_counted_by_hand():
    assert _parameters(resnet("resnet20", num_classes=10)) == RESNET20_CIFAR10_PARAMETERS


@pytest.mark.parametrize("channels,width,scaled", [
    (64, 0.25, 16), (64, 1.0, 64), (3, 0.5, 2), (5, 0.5, 3), (64, 0.3, 19),
    (4096, 0.125, 512), (16, 0.01, 1), (192, 0.25, 48)])
def test_scale_rounds_to_the_nearest_integer_halves_up_and_at_least_one(channels, width, scaled):
    assert scale(channels, width) == scaled


def test_quarter_width_scales_convs_hidden_widths_and_the_flattened_features():
    quarter = {name: _shapes(_on_meta(name, width=0.25, num_classes=10))
               for name in ("alexnet", "vgg16_bn", "resnet18", "resnet50", "resnet20")}
    expected = {
        "alexnet": {"features.0.weight": (16, 3, 11, 11), "features.3.weight": (48, 16, 5, 5),
                    "features.6.weight": (96, 48, 3, 3), "features.10.weight": (64, 64, 3, 3),
                    "classifier.1.weight": (1024, 64 * 36), "classifier.4.weight": (1024, 1024),
                    "classifier.6.weight": (10, 1024)},
        "vgg16_bn": {"features.0.weight": (16, 3, 3, 3), "features.1.running_mean": (16,),
                     "features.40.weight": (128, 128, 3, 3), "classifier.0.weight": (1024, 128 * 49),
                     "classifier.6.weight": (10, 1024)},
        "resnet18": {"conv1.weight": (16, 3, 7, 7), "layer2.0.downsample.0.weight": (32, 16, 1, 1),
                     "layer4.1.conv2.weight": (128, 128, 3, 3), "fc.weight": (10, 128)},
        "resnet50": {"layer1.0.conv1.weight": (16, 16, 1, 1), "layer1.0.conv3.weight": (64, 16, 1, 1),
                     "layer1.0.downsample.0.weight": (64, 16, 1, 1),
                     "layer4.2.conv3.weight": (512, 128, 1, 1), "fc.weight": (10, 512)},
        "resnet20": {"conv1.weight": (4, 3, 3, 3), "layer2.0.downsample.0.weight": (8, 4, 1, 1),
                     "layer3.2.bn2.weight": (16,), "fc.weight": (10, 16)},
    }
    for name, shapes in expected.items():
        assert {key: quarter[name][key] for key in shapes} == shapes, name


def test_a_width_that_does_not_divide_rounds_each_layer_then_flattens():
    """At width 0.3 each layer is rounded on its own (256 -> 77, 4096 -> 1229), and
    the flattened count is the last conv's channels times the pooled area."""
    shapes = {name: _shapes(_on_meta(name, width=0.3, num_classes=10))
              for name in ("alexnet", "vgg11", "resnet50")}
    assert shapes["alexnet"]["classifier.1.weight"] == (1229, 77 * 36)
    assert shapes["vgg11"]["classifier.0.weight"] == (1229, 154 * 49)
    assert shapes["resnet50"]["fc.weight"] == (10, 154 * 4)
    assert shapes["resnet50"]["layer3.0.conv2.weight"] == (77, 77, 3, 3)


@pytest.mark.parametrize("name", PRESETS)
def test_an_eighth_width_network_runs_forward_and_backward(name):
    side = 64 if name == "alexnet" else 32
    torch.manual_seed(0)
    model = build(name, num_classes=10, width=1 / 8)
    logits = model(torch.randn(2, 3, side, side))
    assert logits.shape == (2, 10)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


class RecordedDropout(nn.Dropout):
    """A stand-in dropout that records which rate each instance was made with."""

    made: list[float] = []

    def __init__(self, p: float) -> None:
        super().__init__(p)
        RecordedDropout.made.append(p)


@pytest.mark.parametrize("name,dropouts,linears", [("alexnet", [0, 3], [1, 4, 6]),
                                                   ("vgg11", [2, 5], [0, 3, 6]),
                                                   ("vgg16_bn", [2, 5], [0, 3, 6])])
def test_the_dropout_module_goes_where_torchvision_puts_dropout(name, dropouts, linears):
    RecordedDropout.made = []
    model = build(name, num_classes=10, width=1 / 16, dropout=0.3, dropout_module=RecordedDropout)
    kinds = [type(m) for m in model.classifier]
    assert [i for i, kind in enumerate(kinds) if kind is RecordedDropout] == dropouts
    assert [i for i, kind in enumerate(kinds) if kind is nn.Linear] == linears
    assert RecordedDropout.made == [0.3, 0.3]


def test_no_dropout_keeps_the_modules_so_no_index_moves():
    off = alexnet(num_classes=10, width=1 / 16, dropout=0.0)
    assert [m.p for m in off.classifier if isinstance(m, nn.Dropout)] == [0.0, 0.0]
    assert _shapes(off).keys() == _shapes(alexnet(num_classes=10, width=1 / 16)).keys()
    x = torch.randn(2, 3, 64, 64)
    assert torch.equal(off.train()(x), off.eval()(x))  # p=0: training mode drops nothing


def _std_ratio(weight: torch.Tensor, expected_std: float) -> float:
    return weight.double().std().item() / expected_std


def test_vgg_initialisation_is_torchvisions():
    torch.manual_seed(0)
    model = vgg("vgg11_bn", num_classes=10, width=0.5)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    for conv in convs[2:]:  # kaiming normal, fan_out, ReLU gain: std sqrt(2 / fan_out)
        fan_out = conv.out_channels * conv.kernel_size[0] * conv.kernel_size[1]
        assert 0.9 < _std_ratio(conv.weight, math.sqrt(2 / fan_out)) < 1.1
    assert all(torch.count_nonzero(conv.bias) == 0 for conv in convs)
    for bn in (m for m in model.modules() if isinstance(m, nn.BatchNorm2d)):
        assert torch.all(bn.weight == 1) and torch.all(bn.bias == 0)
    for linear in (m for m in model.modules() if isinstance(m, nn.Linear)):
        assert torch.all(linear.bias == 0)
    assert 0.95 < _std_ratio(model.classifier[0].weight, 0.01) < 1.05


def test_resnet_initialisation_is_torchvisions_without_zero_init_residual():
    torch.manual_seed(0)
    model = resnet("resnet18", num_classes=10, width=0.5)
    for conv in (m for m in model.modules() if isinstance(m, nn.Conv2d) and m.weight.numel() > 4000):
        fan_out = conv.out_channels * conv.kernel_size[0] * conv.kernel_size[1]
        assert 0.9 < _std_ratio(conv.weight, math.sqrt(2 / fan_out)) < 1.1
    for bn in (m for m in model.modules() if isinstance(m, nn.BatchNorm2d)):
        assert torch.all(bn.weight == 1) and torch.all(bn.bias == 0)  # bn2 too: not zeroed
    assert torch.count_nonzero(model.fc.bias) == 10  # the fc keeps PyTorch's default


def test_alexnet_keeps_pytorchs_default_initialisation():
    torch.manual_seed(0)
    model = alexnet(num_classes=10, width=0.25)
    first = model.features[0]
    bound = 1 / math.sqrt(3 * 11 * 11)  # kaiming_uniform(a=sqrt(5)) and the bias: 1/sqrt(fan_in)
    assert first.weight.abs().max() <= bound and first.weight.abs().max() > 0.9 * bound
    assert torch.count_nonzero(model.classifier[6].bias) == 10


def _branch(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The block's residual branch, module by module, as torchvision's forward runs it."""
    out = torch.relu(block.bn1(block.conv1(x)))
    if hasattr(block, "conv3"):
        out = torch.relu(block.bn2(block.conv2(out)))
        return block.bn3(block.conv3(out))
    return block.bn2(block.conv2(out))


@pytest.mark.parametrize("name,stage,index,identity", [
    ("resnet20", "layer1", 1, True), ("resnet20", "layer2", 0, False),
    ("resnet50", "layer1", 0, False), ("resnet50", "layer3", 1, True)])
def test_a_block_adds_its_shortcut_then_applies_relu(name, stage, index, identity):
    """relu(branch(x) + shortcut(x)): the input itself in an identity block, the
    projection (1x1 conv with the stride, BN) where the shape changes."""
    torch.manual_seed(0)
    model = resnet(name, num_classes=10, width=0.25).eval()
    block = getattr(model, stage)[index]
    assert (block.downsample is None) == identity
    x = torch.randn(2, block.conv1.in_channels, 8, 8)  # both signs: a ReLU misplaced shows
    shortcut = x if identity else block.downsample(x)
    assert torch.equal(block(x.clone()), torch.relu(_branch(block, x) + shortcut))


@pytest.mark.parametrize("name,side,last_stage,last_side", [
    ("resnet20", 32, "layer3", 8), ("resnet18", 64, "layer4", 2), ("resnet50", 64, "layer4", 2)])
def test_the_stem_downsamples_as_torchvisions(name, side, last_stage, last_side):
    """ImageNet stem: 7x7/2 conv and 3x3/2 max-pool (side / 4), then strides 2 per
    later stage; the CIFAR stem keeps the side (no max-pool)."""
    model = resnet(name, num_classes=10, width=1 / 8)
    seen = {}
    getattr(model, last_stage).register_forward_hook(lambda m, i, out: seen.update(side=out.shape[-1]))
    model(torch.randn(2, 3, side, side))
    assert seen["side"] == last_side


@pytest.mark.parametrize("maker,name", [(vgg, "vgg13"), (resnet, "resnet34")])
def test_an_unknown_preset_is_named(maker, name):
    with pytest.raises(ValueError, match=name):
        maker(name)
