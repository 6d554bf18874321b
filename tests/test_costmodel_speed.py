"""What makes the model fast leaves its figures as they were.

- a conv layer's shapes are computed once and kept (a sweep asks for them millions
  of times), and a prediction or peak on layers whose shapes are kept equals, to the
  bit, one on freshly built layers;
- equal devices given as one object, or as equal copies, are the same devices: the
  same kinds, the same step to the bit;
- zoo and paper points on the fast timeline give the op-by-op simulation's step
  (`Options(timeline="reference")`), and their peaks are those of fresh layers.
"""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.costmodel import DeviceSpec, Network, marques_cifar, predict
from pipeline.costmodel import network as network_module
from pipeline.costmodel import timeline as timeline_module
from pipeline.costmodel.devices import distinct
from pipeline.costmodel.kernel_memory import kernel_footprint
from pipeline.costmodel.network import ConvLayer
from tests.test_costmodel_fast import GPU, LINK, SLOW, STORE, _same
from tests.test_costmodel_zoo import zoo_network


def _fresh(network: Network) -> Network:
    """The same network with every conv layer built anew (no shape kept yet)."""
    return dataclasses.replace(network, conv=tuple(dataclasses.replace(layer)
                                                   for layer in network.conv))


def _points() -> list[tuple[str, Network, int]]:
    """A few zoo and paper points: (strategy, network, devices)."""
    resnet = zoo_network("resnet18", 0.125)
    vgg = zoo_network("vgg11_bn", 0.125)
    paper = marques_cifar(48, 96)
    return [("kernel", resnet, 4), ("kernel", vgg, 3), ("kernel", paper, 5),
            ("data", resnet, 4), ("hybrid", vgg, 4), ("hybrid", paper, 3)]


def test_a_conv_layers_shapes_are_computed_once(monkeypatch) -> None:
    calls = []
    real_pair = network_module._pair
    monkeypatch.setattr(network_module, "_pair", lambda v: calls.append(v) or real_pair(v))
    layer = ConvLayer(3, 8, (33, 31), kernel=(5, 3), stride=2, padding=1, pool=2)
    first = (layer.conv_hw, layer.out_hw, layer.patch, layer.pooling)
    made = len(calls)
    for _ in range(3):
        assert (layer.conv_hw, layer.out_hw, layer.patch, layer.pooling) == first
    assert len(calls) == made
    assert first == ((16, 16), (8, 8), 45, layer.pooling) and len(layer.pooling) == 1


@pytest.mark.parametrize("strategy, network, p", _points(),
                         ids=lambda v: getattr(v, "name", None) or str(v))
def test_kept_shapes_and_equal_copies_give_the_same_prediction(strategy, network, p) -> None:
    batch = 16
    kept = predict(strategy, network, batch, [GPU] * p, LINK, None)
    again = predict(strategy, network, batch, [GPU] * p, LINK, None)
    fresh = predict(strategy, _fresh(network), batch,
                    [dataclasses.replace(GPU) for _ in range(p)], LINK, None)
    for other in (again, fresh):
        assert other.step_time == kept.step_time
        assert other.breakdown == kept.breakdown


@pytest.mark.parametrize("strategy, network, p",
                         [point for point in _points() if point[0] == "kernel"],
                         ids=lambda v: getattr(v, "name", None) or str(v))
def test_zoo_and_paper_points_keep_the_simulations_step_and_peaks(strategy, network, p
                                                                  ) -> None:
    batch = 16
    for store in (None, STORE):
        fast = predict(strategy, network, batch, [GPU] * p, LINK, store)
        reference = predict(strategy, _fresh(network), batch, [GPU] * p, LINK, store,
                            timeline="reference")
        _same(fast, reference)
    counts = fast.kernel_counts
    assert kernel_footprint(network, batch, counts) == \
        kernel_footprint(_fresh(network), batch, counts)


def test_distinct_finds_equal_devices_by_identity_and_by_comparison() -> None:
    copy = dataclasses.replace(GPU)
    devices = [GPU, SLOW, copy, GPU, dataclasses.replace(SLOW), copy, GPU]
    kinds, kind_of = distinct(devices)
    assert kinds == [GPU, SLOW] and kinds[0] is GPU and kinds[1] is SLOW
    assert kind_of == [0, 1, 0, 0, 1, 0, 0]
    odd = DeviceSpec(flops=1e12, name="odd")
    assert distinct([odd, GPU, odd]) == ([odd, GPU], [0, 1, 0])


def test_a_fast_predictions_lanes_read_as_the_lists_they_stand_for() -> None:
    """`details["timeline"]` on the fast path is built when read: each lane, a slice,
    a negative index and equality give what a list of the lanes gives."""
    lanes = predict("kernel", marques_cifar(48, 96), 16, [GPU] * 3, LINK, STORE).details[
        "timeline"]
    as_list = [lanes[d] for d in range(len(lanes))]
    assert len(lanes) == 3 and lanes == as_list and as_list == lanes
    assert lanes[-1] == as_list[2] and lanes[1:] == as_list[1:]
    assert all(kind in ("compute", "io", "wait", "overhead", "master")
               for lane in lanes for _, _, kind in lane)
    assert all(start < end for lane in as_list for start, end, _ in lane)


def test_the_reference_timeline_without_spread_walks_no_deviations(monkeypatch) -> None:
    """`kernel` op by op (`timeline="reference"`) on devices whose compute does not
    spread: no clock carries a deviation, so the periodic pruning of common ones has
    nothing to do. It walked every clock and every slot all the same, 32 meetings
    apart: P^2 meetings a step times P clocks and slots grew the reference to P^3
    (256 devices: 104 s, 6.7 s without the walk; `python -m benchmarks.predict_speed`,
    whose reference runs to 512 devices, did not finish in 10 minutes). With a
    spread the pruning runs, and the step is the same either way it is reached."""
    walked = []
    real = timeline_module._variance
    monkeypatch.setattr(timeline_module, "_variance", lambda noise: walked.append(1) or
                        real(noise))
    network = marques_cifar(48, 96)
    plain = predict("kernel", network, 64, [GPU] * 64, LINK, None, timeline="reference")
    assert walked == []
    fast = predict("kernel", network, 64, [GPU] * 64, LINK, None)
    assert plain.step_time == pytest.approx(fast.step_time, rel=1e-9)
    spread = dataclasses.replace(GPU, spread=0.2)
    predict("kernel", network, 64, [spread] * 8, LINK, None, timeline="reference")
    assert walked  # the pruning and Clark's maxima read deviations where there are some
