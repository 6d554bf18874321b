"""A worker's memory rate (pipeline/probe/replica_rates.py, tasks/update_rate.py) and
what the model prices by it: a replica's update, its gradients' flattening and the
reduction's sums, and the dense head's element-wise part taken out of its rate."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch

from pipeline.costmodel import DeviceSpec, predict
from pipeline.costmodel.builders import marques_cifar
from pipeline.costmodel.compute import (DEFAULT_UPDATE_ACCESSES, FLATTEN_ACCESSES,
                                        REPLICA_UPDATE_ACCESSES, UPDATE_ACCESSES,
                                        dense_stream_elements, dense_time, sum_accesses,
                                        update_accesses)
from pipeline.costmodel.kernel_context import KernelContext
from pipeline.probe.replica_rates import memory_bandwidth, replica_parameters
from pipeline.probe.results import WorkerProbe, master_device
from pipeline.config.run_config import build_run_config
from pipeline.probe.tables import MIN_PRODUCT_SHARE, dense_flops, head_rate, model_network
from pipeline.strategies.base import network_for
from tasks.update_rate import time_update
from tasks.zoo import build_preset
from tests.test_costmodel_replicas_zoo import STORE, _link
from tests.test_prediction import _synthetic_probe

NET = marques_cifar()
CPU = DeviceSpec(flops=5e10, bytes_per_elem=4)


def test_an_update_timed_in_process_gives_a_memory_rate_a_cpu_can_have():
    timed = time_update(1 << 18, 2, "float32", start_at=time.time())
    assert timed["loops"] >= 1 and timed["elements"] == 1 << 18
    rate = memory_bandwidth(timed["seconds_per_element"], "float32")
    assert 1e8 < rate < 1e13


def test_the_rate_is_the_updates_bytes_over_its_time():
    assert memory_bandwidth(1e-9, "float32") == pytest.approx(REPLICA_UPDATE_ACCESSES * 4 / 1e-9)
    assert memory_bandwidth(1e-9, "float64") == pytest.approx(REPLICA_UPDATE_ACCESSES * 8 / 1e-9)
    with pytest.raises(ValueError, match="no time"):
        memory_bandwidth(0.0, "float32")


def test_a_replica_updates_every_parameter_of_the_network():
    spec = build_preset("resnet20", (3, 32, 32), 10, "float32")
    # torchvision's resnet20 for CIFAR: 0.27 M parameters (batch norm's weights included)
    assert 265_000 < replica_parameters(spec) < 275_000


@pytest.mark.parametrize("strategy", ["data", "hybrid"])
def test_a_finite_memory_rate_prices_the_replicas_update_and_sums(strategy):
    """The same devices, streams free against streams at 10 GB/s: each replica's step
    grows by at least its update (gather and SGD over every parameter it reduces)."""
    slow = dataclasses.replace(CPU, mem_bw=1e10)
    free, priced = (predict(strategy, NET, 64, [dev] * 2, _link(1e-5), STORE, scheme="b")
                    for dev in (CPU, slow))
    params = (sum(c.params() for c in NET.conv)
              + (sum(d.params() for d in NET.dense) if strategy == "data" else 0))
    update = slow.stream_time(REPLICA_UPDATE_ACCESSES * params)
    assert priced.step_time - free.step_time >= update


def test_the_update_streams_a_pass_per_part_of_the_sgd_step():
    """WorkerSGD's passes (tasks/optim.py): the weight's step (3 accesses), weight
    decay added into the gradient (3), the momentum buffer scaled and added to (2 + 3),
    Nesterov's look-ahead (3); the probe times momentum without weight decay."""
    assert update_accesses() == DEFAULT_UPDATE_ACCESSES == 11
    assert update_accesses(momentum=True, weight_decay=False) == UPDATE_ACCESSES == 8
    assert update_accesses(momentum=False, weight_decay=False) == 3
    assert update_accesses(momentum=False, weight_decay=True) == 6
    assert update_accesses(True, True, nesterov=True) == 14
    config = build_run_config({"train": {"momentum": 0.0, "weight_decay": 0.0}})
    assert model_network(config, network_for(config)).update_accesses() == 3


@pytest.mark.parametrize("strategy", ["data", "hybrid"])
def test_weight_decay_costs_a_replica_its_pass_over_the_parameters(strategy):
    """The same replicas with and without weight decay: each step differs by the
    decay's pass (3 accesses) over what a worker updates (`data`: its whole replica;
    `hybrid`, scheme a: its trunk and its half of each dense layer), at the memory rate."""
    slow = dataclasses.replace(CPU, mem_bw=1e10)
    plain = dataclasses.replace(NET, weight_decay=False)
    with_decay, without = (predict(strategy, net, 64, [slow] * 2, _link(1e-5), STORE, scheme="a")
                           for net in (NET, plain))
    dense = sum(d.params() for d in NET.dense)
    params = sum(c.params() for c in NET.conv) + (dense if strategy == "data" else dense / 2)
    assert with_decay.step_time - without.step_time == pytest.approx(
        slow.stream_time(3 * params), rel=1e-6)


def test_sums_read_two_and_write_one_per_addition():
    assert [sum_accesses(p) for p in (1, 2, 3, 4)] == [0, 3, 6, 9]


def test_a_measured_trunk_holds_its_flattening_a_dense_head_does_not():
    from pipeline.costmodel.devices import TrunkTime
    from pipeline.costmodel.replicas import flatten_time
    dev = dataclasses.replace(CPU, mem_bw=1e10)
    measured = dataclasses.replace(dev, trunk=TrunkTime(64, 0.01, 0.02))
    assert flatten_time(dev, 1000, 500) == dev.stream_time(FLATTEN_ACCESSES * 1500)
    assert flatten_time(measured, 1000, 500) == dev.stream_time(FLATTEN_ACCESSES * 500)


def test_a_tabled_layers_sum_of_gradient_parts_is_in_its_table():
    probe = _synthetic_probe(fixed_s=0.001, per_kernel_s=0.0001, slow=1.0)
    devices = [dataclasses.replace(d, mem_bw=1e9) for d in probe.device_specs()]
    net = probe.costmodel_network()
    ctx = KernelContext(net, 32, tuple(devices), _link(1e-5), STORE, ((16, 16), (32, 32)))
    assert ctx.summing_elements(0, 16) > 0  # layer 2's two holders hand partials back
    assert ctx.summing_time(devices[0], 0, 16) == 0.0  # in the measured backward
    untabled = dataclasses.replace(devices[0], layer_tables={})
    assert ctx.summing_time(untabled, 0, 16) == untabled.stream_time(ctx.summing_elements(0, 16))


def test_the_dense_heads_rate_leaves_out_its_element_wise_part():
    """Priced back at the same memory rate, the head takes exactly the time measured."""
    net = marques_cifar()
    seconds, mem_bw = 1.0, 2e9  # products compute-bound at this rate (no roofline)
    rate = head_rate(net, 128, seconds, mem_bw)
    assert rate > dense_flops(net, 128) / seconds
    dev = DeviceSpec(flops=rate, mem_bw=mem_bw)
    assert dense_time(dev, net.dense, 128, dropout=net.dropout).total == pytest.approx(seconds)
    # a memory rate measured far too low cannot make the products free
    floor = head_rate(net, 128, seconds, 1e3)
    assert floor == pytest.approx(dense_flops(net, 128) / (MIN_PRODUCT_SHARE * seconds))
    assert head_rate(net, 128, seconds) == pytest.approx(dense_flops(net, 128) / seconds)
    assert sum(dense_stream_elements(net.dense, 128, dropout=net.dropout)) > 0


def test_a_probe_without_memory_rates_prices_streams_as_free():
    probe = _synthetic_probe(fixed_s=0.001, per_kernel_s=0.0001, slow=1.0)
    assert all(math.isinf(d.mem_bw) for d in probe.device_specs())
    rated = dataclasses.replace(probe, workers=[dataclasses.replace(w, memory_bw=3e9)
                                                for w in probe.workers])
    assert [d.mem_bw for d in rated.device_specs()] == [3e9, 3e9]
    assert master_device(probe.master, probe.costmodel_network(), 3e9).mem_bw == 3e9
    assert WorkerProbe("w", "a", 1, 1.0).memory_bw is None


def test_the_dense_head_timed_on_a_replicas_rows_grows_with_them():
    """On one thread, as a worker times it: torch's threads waiting for each other on
    a loaded machine once read 4 and 64 rows alike (72 ms each, not 1 and 2)."""
    from tasks.dense_head import time_dense_head
    spec = build_preset("vgg11", (3, 32, 32), 10, "float32", 1 / 16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        few, many = (time_dense_head(spec, rows, start_at=time.time())["seconds"]
                     for rows in (4, 256))
    finally:
        torch.set_num_threads(threads)
    assert 0 < few < many


def test_a_replica_takes_its_dense_layers_from_the_head_timed_on_its_rows():
    """The trunk's timing of the head replaces the dense rate's, in proportion to the
    rows, each dense layer keeping its share; without one the rate stands."""
    from pipeline.costmodel.data import replica_times
    from pipeline.costmodel.devices import TrunkTime
    net = marques_cifar()
    convs = len(NET.conv)
    timed = dataclasses.replace(CPU, trunk=TrunkTime(32, 0.01, 0.02, dense=0.004))
    untimed = dataclasses.replace(CPU, trunk=TrunkTime(32, 0.01, 0.02))
    (with_head,), (without,) = (replica_times([d], net, [16]) for d in (timed, untimed))
    assert sum(t.forward + t.backward for t in with_head[convs:]) == pytest.approx(0.002)
    assert sum(t.forward + t.backward for t in with_head[:convs]) == pytest.approx(0.015)
    assert with_head[:convs] == without[:convs]
    plain = dense_time(CPU, net.dense[:1], 16, input_grad=True)
    assert without[convs].forward == pytest.approx(plain.forward)
    shares = [t.forward / (t.forward + t.backward) for t in (with_head[convs], without[convs])]
    assert shares[0] == pytest.approx(shares[1])


def test_hybrids_dense_slices_run_at_the_rate_of_the_head_timed_on_a_replicas_rows():
    """A hybrid device's slices of the dense layers take the measured head's rate (its
    rows, every replica at once) over the master's, in both hybrid models; without a
    timed head the master's rate stands."""
    from pipeline.costmodel.compute import measured_head_factor
    from pipeline.costmodel.devices import TrunkTime
    net = marques_cifar()
    head = dense_time(CPU, net.dense, 32, dropout=tuple(
        net.dense_dropout(j) for j in range(len(net.dense))))
    modelled = head.forward + head.backward
    slow = dataclasses.replace(CPU, trunk=TrunkTime(32, 0.01, 0.02, dense=1.5 * modelled))
    untimed = dataclasses.replace(CPU, trunk=TrunkTime(32, 0.01, 0.02))
    assert measured_head_factor(slow, net) == pytest.approx(1.5)
    assert measured_head_factor(untimed, net) == measured_head_factor(CPU, net) == 1.0
    # through the workspace, the engine's ops: the dense slices are the `master` part
    store = [predict("hybrid", net, 64, [dev] * 2, _link(1e-4), STORE).breakdown["master"]
             for dev in (untimed, slow)]
    assert store[1] == pytest.approx(1.5 * store[0], rel=0.05)
    # over links, the collectives' model: its dense sub-steps likewise
    links = [predict("hybrid", net, 64, [dev] * 2, _link(1e-4)).breakdown["master"]
             for dev in (untimed, slow)]
    assert links[1] == pytest.approx(1.5 * links[0], rel=0.05)


def test_hybrids_dense_slices_take_its_own_ops_where_the_probe_timed_them():
    """Timed as a hybrid run runs them (`TrunkTime.hybrid_head`: a device's neurons on
    the whole batch), the dense ops set its slices' scale over the replica's head;
    both hybrid models take it."""
    from pipeline.costmodel.compute import dense_slice_time, hybrid_head_factor
    from pipeline.costmodel.devices import TrunkTime
    net = marques_cifar()
    neurons = [layer.out_features // 2 for layer in net.dense]
    slices = [dense_slice_time(CPU, net, j, 64, 0.5) for j in range(len(net.dense))]
    modelled = sum(t.forward + t.backward for t in slices)
    head = dense_time(CPU, net.dense, 32, dropout=tuple(
        net.dense_dropout(j) for j in range(len(net.dense))))
    replica_head = 1.5 * (head.forward + head.backward)  # the replica's head: 1.5x
    own = dataclasses.replace(CPU, trunk=TrunkTime(32, 0.01, 0.02, dense=replica_head,
                                                   hybrid_head=3 * modelled,
                                                   hybrid_head_batch=64))
    without = dataclasses.replace(own, trunk=dataclasses.replace(own.trunk, hybrid_head=None))
    assert hybrid_head_factor(own, net, neurons) == pytest.approx(3.0)
    assert hybrid_head_factor(without, net, neurons) == pytest.approx(1.5)
    for store in (STORE, None):
        masters = [predict("hybrid", net, 64, [dev] * 2, _link(1e-4), store).breakdown["master"]
                   for dev in (without, own)]
        assert masters[1] == pytest.approx(2 * masters[0], rel=0.05)


def test_a_holder_joins_a_gathered_inputs_shards_at_the_memory_rate():
    """The engine's `_gather` concatenates the shards of a layer's output (read each,
    write the whole); with one holder the output is used as it is."""
    dev = dataclasses.replace(CPU, mem_bw=1e10)
    split = KernelContext(NET, 32, (dev, dev), None, None, ((16, 16), (32, 32)))
    whole = NET.conv[0].output_elements(32)
    assert split.gather_time(dev, 0) == dev.stream_time(2 * whole) > 0
    assert split.gather_time(dev, -1) == 0.0  # the images: read, not joined
    alone = KernelContext(NET, 32, (dev, dev), None, None, ((32, 0), (32, 32)))
    assert alone.gather_time(dev, 0) == 0.0


@pytest.mark.parametrize("timeline", ["reference", "fast"])
def test_the_kernel_step_waits_for_its_joins(timeline, monkeypatch):
    """Two equal holders of every layer: each joins layer 1's shards before layer 2,
    the master the last layer's before the head, and the step waits for both."""
    dev = dataclasses.replace(CPU, mem_bw=1e10)
    net = marques_cifar(8, 16)
    options = {"timeline": "reference"} if timeline == "reference" else {}

    def step() -> float:
        return predict("kernel", net, 32, [dev, dev], _link(1e-5), STORE,
                       kernel_counts=[[4, 4], [8, 8]], **options).step_time

    joined = step()
    monkeypatch.setattr(KernelContext, "gather_time", lambda self, dev, l: 0.0)
    assert joined - step() == pytest.approx(
        sum(dev.stream_time(2 * layer.output_elements(32)) for layer in net.conv), rel=1e-9)
