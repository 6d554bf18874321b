"""The cost model's network of every zoo preset: the engine's shapes, torchvision's
parameter counts and multiply-adds, and what its layers beyond the paper family cost."""

from __future__ import annotations

import pytest

from pipeline.costmodel import (DeviceSpec, LinkSpec, Network, Pool, apportion, predict,
                                split_kernels_minmax, split_kernels_proportional)
from pipeline.costmodel.compute import (BATCH_NORM_BACKWARD, BATCH_NORM_FORWARD,
                                        RESIDUAL_FORWARD, after_conv_elements, conv_time,
                                        dense_time)
from pipeline.costmodel.builders import marques_cifar
from pipeline.costmodel.data import GRADIENT_SUM, gradient_sums
from pipeline.costmodel.kernel import workspace_bytes
from pipeline.costmodel.network import ConvLayer, DenseLayer
from pipeline.probe.tables import costmodel_network
from tasks.layout import layout_from_counts
from tasks.layout import workspace_bytes as engine_bytes
from tasks.zoo import build_preset

#: torchvision's parameter counts and forward multiply-adds at 3x224x224, 1000 classes
#: (resnet20 at 3x32x32, 10 classes: He et al.'s CIFAR network).
TORCHVISION = {"alexnet": (61_100_840, 0.714e9), "vgg11": (132_863_336, 7.609e9),
               "vgg16": (138_357_544, 15.47e9), "vgg16_bn": (138_365_992, 15.47e9),
               "resnet18": (11_689_512, 1.814e9), "resnet50": (25_557_032, 4.089e9),
               "resnet20": (272_474, 0.0408e9)}


def zoo_network(preset: str, width: float = 1.0) -> Network:
    small = preset in ("resnet20", "marques")
    size, classes = (32, 10) if small else (224, 1000)
    return costmodel_network(build_preset(preset, (3, size, size), classes, "float32",
                                          width, 0.5))


@pytest.mark.parametrize("preset", sorted(TORCHVISION))
def test_every_preset_has_torchvisions_parameters_and_work(preset):
    net = zoo_network(preset)
    params, macs = TORCHVISION[preset]
    assert net.params() == params
    assert net.macs() == pytest.approx(macs, rel=2e-3)


def test_the_paper_network_is_the_one_the_model_always_priced():
    ours = zoo_network("marques")
    theirs = marques_cifar()
    assert [(c.out_channels, c.out_hw, c.conv_hw) for c in ours.conv] == \
        [(c.out_channels, c.out_hw, c.conv_hw) for c in theirs.conv]
    device = DeviceSpec(flops=1e10, mem_bw=1e10)
    for a, b in zip(ours.conv, theirs.conv):
        assert conv_time(device, a, 32) == conv_time(device, b, 32)


def test_a_resnet_keeps_its_graph_and_ties():
    net = zoo_network("resnet18")
    # layer1.0: conv 1 reads the stem, conv 2 adds the stem's output to its own
    assert net.source(1) == 0 and net.conv[2].residual == 0
    # layer2.0's projection (a 1x1 stride-2 conv) reads the block's input
    projection = next(l for l, c in enumerate(net.conv) if c.kernel == 1)
    assert net.conv[projection].stride == 2 and net.source(projection) == 4
    assert [0, 2, 4] == net.tied_groups()[0][:3]
    assert net.conv[-1].pooling[-1] == Pool("adaptive_avg", 1, 1, 0)
    assert net.features == 512 and net.dense[0].in_features == 512
    assert net.conv_buffers() == 2 * sum(c.out_channels for c in net.conv)


def test_alexnet_and_vgg_carry_their_dropout():
    assert zoo_network("alexnet").dropout[:2] == (0.5, 0.5)
    assert zoo_network("vgg11").dense_dropout(1) == 0.5


def test_what_follows_a_conv_is_priced_by_its_bytes():
    plain = ConvLayer(8, 4, (8, 8), kernel=3, padding=1, pool=2)
    normed = ConvLayer(8, 4, (8, 8), kernel=3, padding=1, pool=1, batch_norm=True,
                       residual=0)
    conv_el = 2 * 4 * 8 * 8
    # the paper family's: ReLU fused into the max-pool's read
    assert after_conv_elements(plain, 2, 4) == 2 * conv_el + conv_el / 4
    assert after_conv_elements(plain, 2, 4, backward=True) == 2 * conv_el + conv_el / 4
    assert after_conv_elements(normed, 2, 4) == (BATCH_NORM_FORWARD + RESIDUAL_FORWARD
                                                 + 2) * conv_el
    assert after_conv_elements(normed, 2, 4, backward=True) == (BATCH_NORM_BACKWARD
                                                                + 2) * conv_el
    streamed = DeviceSpec(flops=1e30, mem_bw=1e9)
    assert conv_time(streamed, normed, 2, 4, input_grad=False).forward > \
        conv_time(streamed, ConvLayer(8, 4, (8, 8), kernel=3, padding=1, pool=1), 2, 4,
                  input_grad=False).forward


def test_dropout_costs_the_dense_head_its_stream():
    device = DeviceSpec(flops=1e30, mem_bw=1e9)
    head = [DenseLayer(4096, 4096), DenseLayer(4096, 10)]
    bare = dense_time(device, head, 64)
    dropped = dense_time(device, head, 64, dropout=(0.5, 0.5))
    assert dropped.forward > bare.forward and dropped.backward > bare.backward
    assert dense_time(device, head, 64, dropout=(0.0,)) == bare


def tied_counts(net: Network, devices: int, pattern: tuple[int, ...]) -> list[list[int]]:
    """An uneven split of every tied group's kernels over `devices`, the same row for
    each layer of a group: weights `pattern` in turn (a 0 leaves a device idle)."""
    weights = [pattern[(d + g) % len(pattern)] for g in range(len(net.conv))
               for d in range(devices)]
    rows: list[list[int]] = [[] for _ in net.conv]
    for g, group in enumerate(net.tied_groups()):
        mine = weights[g * devices:(g + 1) * devices]
        if not any(mine):
            mine = [1] * devices
        row = apportion(net.conv[group[0]].out_channels, mine)
        for l in group:
            rows[l] = row
    return rows


#: Uneven splits (device weights in turn; 0: idle) and the master for each.
UNEVEN = [(3, (1, 2, 3), 0), (3, (3, 0, 1), 2), (4, (1, 0, 0, 2), 1), (2, (0, 1), 0)]


@pytest.mark.parametrize("preset", ["marques", "alexnet", "vgg11", "vgg16", "vgg11_bn",
                                    "vgg16_bn", "resnet18", "resnet50", "resnet20"])
def test_kernel_bytes_equal_the_engines_slots_on_the_zoo(preset):
    """The model's traffic on the layer graph (each layer reads its source, a block's
    input goes to its first conv and its shortcut, gradients come back from every
    reader) equals the engine's slots (tasks.layout.workspace_bytes) at uneven splits."""
    spec = build_preset(preset, (3, 32, 32) if preset in ("resnet20", "marques")
                        else (3, 64, 64), 10, "float32", 0.125, 0.5)
    net, batch = costmodel_network(spec), 2
    for p, pattern, master in UNEVEN:
        counts = tied_counts(net, p, pattern)
        layout = layout_from_counts([f"w{i}" for i in range(p)], counts, master)
        expected = sum(r + w for r, w in engine_bytes(layout, spec, batch, 4))
        assert workspace_bytes(net, batch, counts, master) == expected


def test_kernel_counts_that_untie_a_residual_sum_are_refused_naming_the_layers():
    net = zoo_network("resnet20", 0.25)
    group = next(g for g in net.tied_groups() if len(g) > 1)
    counts = tied_counts(net, 2, (1, 1))
    counts[group[1]] = [counts[group[1]][0] + 1, counts[group[1]][1] - 1]
    first, other = net.conv[group[0]].name, net.conv[group[1]].name
    with pytest.raises(ValueError, match=f"conv layers {first} and {other} are added"):
        predict("kernel", net, 8, [DeviceSpec(flops=1e12)] * 2, kernel_counts=counts)


def _calibrated_pair(net: Network) -> list[DeviceSpec]:
    """Two devices whose calibrated rates differ from layer to layer (the second twice
    as fast as the first on every third layer, slower on the others)."""
    return [DeviceSpec(flops=1e12, layer_rates={c.name: 1e12 for c in net.conv}),
            DeviceSpec(flops=1e12, layer_rates={c.name: 2e12 if l % 3 == 1 else 0.6e12
                                                for l, c in enumerate(net.conv)})]


@pytest.mark.parametrize("split", ["proportional", "minmax"])
def test_every_split_gives_a_tied_group_one_row(split):
    """Tied layers timed apart would get different rows; one row per group, from the
    group's summed cost, so the split predicts and places as the engine runs it."""
    net = zoo_network("resnet18", 0.125)
    devices = _calibrated_pair(net)
    if split == "proportional":
        counts = split_kernels_proportional(net, devices, quantum=2)
    else:
        counts = split_kernels_minmax(net, 8, devices, LinkSpec.from_bandwidth(1e9), None, 2)
    for group in net.tied_groups():
        assert all(counts[l] == counts[group[0]] for l in group)
        assert sum(counts[group[0]]) == net.conv[group[0]].out_channels
    assert any(len(set(row)) > 1 for row in counts)  # the devices differ: uneven rows
    assert predict("kernel", net, 8, devices, kernel_counts=counts).step_time > 0


def test_a_tied_groups_proportional_row_follows_its_summed_seconds():
    """Two layers of a group, one device faster on each: the row is in proportion to the
    inverse of each device's seconds over both layers."""
    net = zoo_network("resnet20", 0.25)
    group = next(g for g in net.tied_groups() if len(g) > 1)
    devices = _calibrated_pair(net)
    seconds = [sum(net.conv[l].macs() / d.rate("conv", net.conv[l].name) for l in group)
               for d in devices]
    row = split_kernels_proportional(net, devices)[group[0]]
    alone = apportion(net.conv[group[0]].out_channels, [1e12, 0.6e12])
    assert row != alone  # the first layer's rates alone would give another row
    assert row == apportion(net.conv[group[0]].out_channels, [1 / s for s in seconds])


def test_single_prices_the_whole_resnet_layer_by_layer():
    """`single` on resnet20: each conv as its own (no input gradient for the stem, which
    reads the images), the sums of gradients where an output has two consumers (a
    block's input feeds the block and its shortcut), the dense head, summed."""
    net = zoo_network("resnet20")
    device = DeviceSpec(flops=1e11, mem_bw=2e10)
    by_hand = sum(conv_time(device, c, 32, input_grad=l > 0).total
                  + device.stream_time(GRADIENT_SUM * sums * c.output_elements(32))
                  for l, (c, sums) in enumerate(zip(net.conv, gradient_sums(net))))
    assert sum(gradient_sums(net)) == 9  # every block's input: 9 blocks
    head = dense_time(device, net.dense, 32).total
    one = predict("single", net, 32, device)
    assert one.step_time == pytest.approx(by_hand + head, rel=1e-12)
    assert one.breakdown["master"] == pytest.approx(head, rel=1e-9)
    assert sum(c.batch_norm for c in net.conv) == len(net.conv)  # batch norm priced too
