"""The cost model's network of every zoo preset: the engine's shapes, torchvision's
parameter counts and multiply-adds, and what its layers beyond the paper family cost."""

from __future__ import annotations

import pytest

from pipeline.costmodel import DeviceSpec, Network, Pool
from pipeline.costmodel.compute import (BATCH_NORM_BACKWARD, BATCH_NORM_FORWARD,
                                        RESIDUAL_FORWARD, after_conv_elements, conv_time,
                                        dense_time)
from pipeline.costmodel.builders import marques_cifar
from pipeline.costmodel.network import ConvLayer, DenseLayer
from pipeline.probe.tables import costmodel_network
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
