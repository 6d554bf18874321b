"""`data` and `hybrid` priced on the zoo: synchronised batch norm's exchanges (over
links and through the workspace), the replicas' lockstep at them, and dense dropout
on the hybrid's parts. Pure: no cluster."""

from __future__ import annotations

import dataclasses
import math

import pytest

from pipeline.config.run_config import load_run_config
from pipeline.costmodel import DeviceSpec, LinkSpec, Options, StoreSpec, predict
from pipeline.costmodel import collectives as col
from pipeline.costmodel.compute import DROPOUT_BACKWARD, DROPOUT_FORWARD, LayerTime
from pipeline.costmodel.compute import conv_time
from pipeline.costmodel.data import GRADIENT_SUM, gradient_sums, layer_times, replica_pass
from pipeline.costmodel.builders import marques_cifar
from pipeline.strategies import strategy_named
from tests.test_costmodel_zoo import zoo_network
from tests.test_prediction import _synthetic_probe

GPU = DeviceSpec(flops=1.95e13, mem_bw=1.555e12, conv_efficiency=0.6, dense_efficiency=0.8,
                 mem_efficiency=0.8, name="gpu")
STORE = StoreSpec(write_bw=5e9, read_bw=8e9, latency=1e-4, client_read_bw=2e9,
                  read_chunk=1e-5, write_chunk=2e-5)


def _link(latency: float) -> LinkSpec:
    return LinkSpec.from_bandwidth(1.25e10, latency=latency)


@pytest.mark.parametrize("strategy", ["data", "hybrid"])
def test_sync_batch_norm_is_one_small_allreduce_per_layer_each_way(strategy, monkeypatch):
    """Each batch-norm layer: an allreduce of 2 values per channel forward and one
    backward, on the critical path (equal replicas: no wait besides them)."""
    net, p, link = zoo_network("resnet20"), 8, _link(2e-5)
    sizes: list[float] = []
    fastest = col.fastest_allreduce

    def counted(n: float, devices: int, on: LinkSpec) -> float:
        sizes.append(n)
        return fastest(n, devices, on)

    monkeypatch.setattr(col, "fastest_allreduce", counted)
    synced = predict(strategy, net, 64, [GPU] * p, link)
    assert sorted(sizes) == sorted(2 * c.out_channels * 4 for c in net.conv if c.batch_norm)
    local = predict(strategy, net, 64, [GPU] * p, link, batch_norm="local")
    each_way = sum(fastest(n, p, link) for n in sizes)
    assert synced.details["batch_norm_exchanges"] == pytest.approx(2 * each_way)
    assert local.details["batch_norm_exchanges"] == 0.0
    assert synced.step_time - local.step_time == pytest.approx(2 * each_way, rel=1e-9)
    parts = ("compute_critical", "master", "communication", "storage", "overhead")
    assert sum(synced.breakdown[k] for k in parts) == pytest.approx(synced.step_time)
    assert synced.breakdown["compute_critical"] == pytest.approx(
        local.breakdown["compute_critical"])


def test_small_allreduces_go_by_recursive_doubling_at_many_devices():
    link = _link(5e-6)
    n = 2 * 256 * 4  # a ResNet-50 layer's two values per channel
    assert col.fastest_allreduce(n, 4096, link) == col.recursive_doubling_allreduce(n, 4096, link)
    assert col.fastest_allreduce(n, 4096, link) == pytest.approx(12 * (5e-6 + n * link.beta))
    big = 100e6
    assert col.fastest_allreduce(big, 8, link) == col.rhd_allreduce(big, 8, link)
    assert col.rhd_allreduce(big, 8, link) < col.recursive_doubling_allreduce(big, 8, link)


@pytest.mark.parametrize("preset", ["resnet20", "resnet50", "vgg16_bn", "alexnet"])
@pytest.mark.parametrize("strategy", ["data", "hybrid"])
def test_the_zoo_predicts_finite_steps_that_grow_with_latency(preset, strategy):
    net = zoo_network(preset)
    normed = any(c.batch_norm for c in net.conv)
    steps = {}
    for p in (2, 16):
        for latency in (1e-6, 1e-4):
            for batch_norm in ("sync", "local"):
                step = predict(strategy, net, 64, [GPU] * p, _link(latency),
                               batch_norm=batch_norm).step_time
                assert math.isfinite(step) and step > 0
                steps[p, latency, batch_norm] = step
    for p in (2, 16):
        assert steps[p, 1e-4, "sync"] > steps[p, 1e-6, "sync"]
        cost = {lat: steps[p, lat, "sync"] - steps[p, lat, "local"] for lat in (1e-6, 1e-4)}
        if normed:  # latency-bound: 100x the latency, nearly 100x the exchanges' cost
            assert 0 < cost[1e-6] < cost[1e-4]
            assert cost[1e-4] / cost[1e-6] > 50
        else:
            assert cost[1e-6] == cost[1e-4] == 0.0
    if normed:  # log2(p) rounds each: 4 at 16 devices against 1 at 2
        grown = [steps[p, 1e-4, "sync"] - steps[p, 1e-4, "local"] for p in (2, 16)]
        assert grown[1] / grown[0] == pytest.approx(4, rel=0.05)


def test_replicas_meet_at_every_exchange():
    """Unequal replicas: each stretch between exchanges ends with the slowest."""
    a = [LayerTime(1.0, 2.0), LayerTime(0.0, 0.0)]
    b = [LayerTime(0.0, 0.0), LayerTime(1.0, 2.0)]
    apart = replica_pass([a, b])
    assert (apart.forward, apart.end, apart.ready) == (1.0, 3.0, [3.0, 3.0])
    met = replica_pass([a, b], [0.5, 0.0])
    # forward: both wait for a's layer 0 (1 s) and the exchange, then b's layer 1
    assert met.forward == 2.5
    # backward: b's layer 1 (2 s), the exchange, a's layer 0 (2 s)
    assert met.ready == [7.0, 4.5] and met.end == 7.0 and met.exchanges == 1.0


def test_a_residual_blocks_input_gradient_is_summed_over_its_consumers():
    """A block's input feeds its first conv and its shortcut (the sum, or a projection):
    autograd sums the two gradients before the layer's backward; a chain sums none."""
    net = zoo_network("resnet18")
    sums = gradient_sums(net)
    projection = next(l for l, c in enumerate(net.conv) if c.kernel == 1)
    assert sums[0] == 1  # the stem: read by layer1.0's conv1, added by its conv2
    assert sums[net.source(projection)] == 1  # read by conv1 and the projection
    assert sums[projection] == 0 and sums[-1] == 0  # added once; read by the head only
    assert sum(sums) == 8  # one per block
    assert gradient_sums(marques_cifar()) == [0, 0]
    device, batch = DeviceSpec(flops=1e12, mem_bw=1e10), 8
    for l, (layer, timed) in enumerate(zip(net.conv, layer_times(device, net, batch))):
        alone = conv_time(device, layer, batch, input_grad=l > 0)
        extra = device.stream_time(GRADIENT_SUM * sums[l] * layer.output_elements(batch))
        assert timed.forward == alone.forward
        assert timed.backward == pytest.approx(alone.backward + extra, rel=1e-12)
        assert timed.backward_input == pytest.approx(alone.backward_input + extra, rel=1e-12)


def test_one_replica_and_local_batch_norm_exchange_nothing():
    net = zoo_network("resnet20")
    for strategy in ("data", "hybrid"):
        alone = [predict(strategy, net, 32, [GPU], _link(1e-4), batch_norm=bn).step_time
                 for bn in ("sync", "local")]
        assert alone[0] == alone[1]
        through = [predict(strategy, net, 32, [GPU] * 2, _link(1e-4), STORE, batch_norm=bn)
                   for bn in ("sync", "local")]
        assert through[0].step_time > through[1].step_time
        assert through[0].details["bytes_moved"] > through[1].details["bytes_moved"]


def test_an_unknown_batch_norm_is_refused_by_name():
    with pytest.raises(ValueError, match="batch_norm 'global'"):
        Options(batch_norm="global")


def test_hybrid_dense_dropout_is_priced_on_every_slice_through_the_store():
    """The engine masks each part's rows of a dense layer's whole input on every
    worker (tasks/hybrid_ops.py): the dropout's stream, forward and backward."""
    net = zoo_network("alexnet", 0.125)
    plain = dataclasses.replace(net, dropout=())
    masked = [j for j in range(len(net.dense)) if net.dense_dropout(j) > 0]
    assert masked
    batch = 16
    dropped, kept = (predict("hybrid", n, batch, [GPU] * 2, _link(1e-5), STORE, scheme="b")
                     for n in (net, plain))
    extra = sum(GPU.stream_time((DROPOUT_FORWARD + DROPOUT_BACKWARD) * batch
                                * net.dense[j].in_features) for j in masked)
    for with_mask, without in zip(dropped.breakdown["compute"], kept.breakdown["compute"]):
        assert with_mask - without == pytest.approx(extra, rel=1e-6)
    assert dropped.step_time > kept.step_time


@pytest.mark.parametrize("batch_norm", ["sync", "local"])
def test_a_runs_batch_norm_reaches_the_model(batch_norm, monkeypatch):
    config = load_run_config("configs/small.yaml", ["strategy=data", "cluster.workers=2",
                                                    f"train.batch_norm={batch_norm}"])
    strategy = strategy_named("data")
    seen: list[Options] = []
    monkeypatch.setattr(strategy, "model", lambda *args: seen.append(args[-1]))
    probe = _synthetic_probe(fixed_s=0.0, per_kernel_s=5e-4, slow=1.0)
    strategy.predict_run(config, probe, probe.costmodel_network(), {})
    assert [options.batch_norm for options in seen] == [batch_norm]
