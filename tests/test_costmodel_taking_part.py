"""Which devices the model prices in a step: those that take part, as the engine runs it.

A replica given no sample leaves the run (pipeline/strategies/replicas.py), also
through the workspace; a hybrid's dense layer is split by neurons over the devices,
so one with fewer neurons than devices is held, gathered and reduced by its holders
only. And a `kernel` device's workspace writes and reads follow one another (one
thread runs its ops), which is what the model prices. Pure: no cluster."""

from __future__ import annotations

import pytest

from pipeline.costmodel import DeviceSpec, LinkSpec, StoreSpec, predict
from pipeline.costmodel import collectives as col
from pipeline.costmodel.builders import marques_cifar
from pipeline.costmodel.compute import dense_time
from pipeline.costmodel.hybrid import dense_layer_exchange, dense_split, holders
from pipeline.strategies import strategy_named

FAST = DeviceSpec(flops=2e12, mem_bw=2e11, name="fast")
SLOW = DeviceSpec(flops=2e11, mem_bw=2e10, name="slow")
STORE = StoreSpec(write_bw=5e9, read_bw=8e9, latency=1e-4, client_read_bw=2e9,
                  read_chunk=1e-5, write_chunk=2e-5)
LINK = LinkSpec.from_bandwidth(1.25e9, latency=2e-5)


@pytest.mark.parametrize("strategy", ["data", "hybrid"])
@pytest.mark.parametrize("timeline", ["auto", "reference"])
def test_a_device_given_no_sample_leaves_the_step_through_the_store(strategy, timeline):
    """A run's recorded shares with a worker given none (a calibrated placement left it
    out): the engine's layout holds the other workers only, so their step is priced,
    not one with the idle device in every gradient range, dense slice and exchange."""
    net = marques_cifar(8, 16, hidden=(64,))
    with_idle = predict(strategy, net, 32, [FAST, SLOW, FAST], LINK, STORE,
                        batch_shares=[16, 0, 16], timeline=timeline)
    alone = predict(strategy, net, 32, [FAST, FAST], LINK, STORE, batch_shares=[16, 16],
                    timeline=timeline)
    assert with_idle.step_time == pytest.approx(alone.step_time, rel=1e-12)
    assert with_idle.details["bytes_moved"] == pytest.approx(alone.details["bytes_moved"])
    assert with_idle.details["batch_shares"] == [16, 0, 16]  # every device's, for memory


def test_a_dense_layer_with_fewer_neurons_than_devices_is_split_over_its_holders():
    """The engine's split (tasks.replica_layout.split_counts): the larger counts first,
    so the first ten of sixteen devices hold the ten logits, the others none."""
    net = marques_cifar(8, 16, hidden=(40,))
    split = dense_split(net, 16)
    assert split == [[3] * 8 + [2] * 8, [1] * 10 + [0] * 6]
    assert holders(split) == [16, 10]


def test_the_dense_layers_exchange_runs_among_their_holders():
    """A hidden layer's input gathered (and its gradient reduced) among the holders of
    it and of the layer before; the logits gathered among their ten holders, not
    among all sixteen devices."""
    net, b, s = marques_cifar(8, 16, hidden=(40,)), 32.0, 4
    hidden, logits = b * 40 * s, b * 10 * s
    expected = (col.ring_allgather(hidden, 16, LINK) + col.ring_reduce_scatter(hidden, 16, LINK)
                + col.ring_allgather(logits, 10, LINK))
    assert dense_layer_exchange(net, b, [16, 10], LINK, s) == pytest.approx(expected, rel=1e-15)
    assert expected < dense_layer_exchange(net, b, [16, 16], LINK, s)


@pytest.mark.parametrize("scheme", ["a", "b", "c"])
def test_a_device_holding_no_dense_neuron_computes_only_its_trunk(scheme):
    """Sixteen equal devices, ten logits: each of the first ten computes its one neuron
    on every sub-step's rows (one per device's share: `dense_batch: worker`), the last six no dense work at all (each was priced 10/16 of
    a neuron, and every dense exchange over all sixteen)."""
    net, batch, K = marques_cifar(8, 16), 64, 16
    p = predict("hybrid", net, batch, [FAST] * K, LINK, scheme=scheme, dense_batch="worker")
    compute = p.breakdown["compute"]
    assert p.details["dense_holders"] == [10]
    assert compute[:10] == [compute[0]] * 10 and compute[10:] == [compute[10]] * 6
    one = K * dense_time(FAST, net.dense, batch / K, 1 / 10).total  # a sub-step per share
    assert compute[0] - compute[10] == pytest.approx(one, rel=1e-9)


def test_an_even_dense_split_prices_as_before():
    """Every layer divisible by the devices: each holds 1/K of every layer, as the
    model always priced it (the Krizhevsky check's 2, 4 and 8 K20s are such)."""
    net, batch, K = marques_cifar(8, 16, hidden=(64,)), 64, 2
    p = predict("hybrid", net, batch, [FAST] * K, LINK, scheme="a", dense_batch="full")
    whole = dense_time(FAST, net.dense, batch, 1 / K)
    assert p.breakdown["master"] == pytest.approx(whole.total, rel=1e-12)


def test_a_hybrid_devices_memory_holds_its_share_of_the_devices_taking_part():
    """Three devices, one given no rows: the two others each hold half of the dense
    layers, as a run on those two does (each was counted a third). `data`'s peak holds
    a whole gradient's worth of ranges at any device count: no such test for it."""
    net = marques_cifar(8, 16, hidden=(4096,))
    hybrid = strategy_named("hybrid")
    with_idle = hybrid.peak_memory(net, 2, [[1, 0, 1]]).per_device
    alone = hybrid.peak_memory(net, 2, [[1, 1]]).per_device
    assert [with_idle[0], with_idle[2]] == pytest.approx(alone, rel=1e-12)
