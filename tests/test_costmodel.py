"""Tests of the analytical performance model (pipeline.costmodel)."""

from __future__ import annotations

import math
import random

import pytest

from pipeline.costmodel import (
    IDEAL_LINK,
    DaskOverhead,
    DeviceSpec,
    Gemm,
    LayerTable,
    LinkSpec,
    Options,
    StoreSpec,
    TrunkTime,
    alexnet,
    apportion,
    conv_net,
    device_from_layer_timings,
    effective_rate,
    fit_hockney,
    krizhevsky_k20_setup,
    krizhevsky_speedups,
    marques_cifar,
    overhead_from_measurements,
    predict,
    speedup,
    split_kernels_minmax,
    split_kernels_proportional,
    store_from_measurements,
)
from pipeline.costmodel import collectives as col
from pipeline.costmodel.compute import conv_time
from pipeline.costmodel.kernel import workspace_bytes
from pipeline.costmodel.krizhevsky import PUBLISHED_SINGLE_STEP, PUBLISHED_SPEEDUPS
from pipeline.costmodel.replicas import hybrid_parts
from pipeline.costmodel.network import Network
from pipeline.probe.tables import costmodel_network
from tasks.layout import layout_from_counts
from tasks.layout import workspace_bytes as engine_bytes
from tasks.replica_layout import DataLayout, HybridLayout
from tasks.specs import ConvLayerSpec, NetworkSpec
from tasks.zoo import build_preset

CPU = DeviceSpec(flops=90e9, mem_bw=10e9, name="cpu")
STORE = StoreSpec(write_bw=1.9e9, read_bw=0.8e9, latency=1e-3)
OVERHEAD = overhead_from_measurements(11.5e-3)
LAN = LinkSpec.from_bandwidth(1e9, latency=1e-4)


# -- network counting ---------------------------------------------------------

def test_alexnet_parameters_match_torchvision():
    net = alexnet()
    assert net.params() == 61_100_840
    assert abs(net.params() - 61.1e6) / 61.1e6 < 0.005
    assert net.conv_params() == 2_469_696
    assert net.features == 9216


def test_alexnet_macs():
    net = alexnet()
    # by hand: 55^2*64*363 + 27^2*192*1600 + 13^2*(384*1728 + 256*3456 + 256*2304)
    assert net.conv_macs() == 655_566_528
    assert 0.65e9 < net.conv_macs() < 0.72e9
    assert 0.66e9 < net.macs() < 0.72e9  # 714.2 M with the dense layers


def test_marques_network_by_hand():
    net = marques_cifar(500, 1500)
    c1, c2 = net.conv
    assert c1.params() == 500 * 3 * 25 + 500
    assert c2.params() == 1500 * 500 * 25 + 1500
    assert net.dense[0].params() == 1500 * 8 * 8 * 10 + 10
    assert net.params() == 38_000 + 18_751_500 + 960_010
    assert c1.out_hw == (16, 16) and c2.out_hw == (8, 8)
    assert net.conv_macs() == 32 * 32 * 500 * 75 + 16 * 16 * 1500 * 12500


def test_conv_products_have_forward_macs():
    layer = marques_cifar().conv[1]
    b, k = 16, 300
    fwd = layer.forward(b, k)
    assert fwd.macs == b * layer.macs(k)
    assert layer.backward_input(b, k).macs == fwd.macs
    assert layer.backward_weight(b, k).macs == fwd.macs
    assert (fwd.m, fwd.n, fwd.k) == (b * 16 * 16, k, 500 * 25)


def test_generic_constructor_chains_shapes():
    net = conv_net([8, 16, 32], hidden=[64])
    assert [c.in_channels for c in net.conv] == [3, 8, 16]
    assert net.conv[-1].out_hw == (4, 4)
    assert net.dense[0].in_features == 32 * 4 * 4 and net.dense[-1].out_features == 10


# -- devices and collectives ---------------------------------------------------

def test_roofline_takes_the_slower_side():

    dev = DeviceSpec(flops=1e12, mem_bw=1e11)
    big = Gemm(4096, 4096, 4096)
    assert dev.gemm_time(big) == pytest.approx(2 * 4096**3 / 1e12)
    thin = Gemm(1, 4096, 4096)  # matrix-vector: memory-bound
    assert dev.gemm_time(thin) == pytest.approx(4 * thin.elements() / 1e11)


@pytest.mark.parametrize("p", [2, 3, 4, 8, 16])
def test_collectives_closed_forms(p):
    a, b, g, n = 3e-5, 1 / 6e9, 1 / 50e9, 12_345_678.0
    link = LinkSpec(a, b, g)
    lg = math.ceil(math.log2(p))
    f = (p - 1) / p
    assert col.ring_allreduce(n, p, link) == pytest.approx(2 * (p - 1) * a + 2 * f * n * b + f * n * g)
    assert col.rhd_allreduce(n, p, link) == pytest.approx(2 * lg * a + 2 * f * n * b + f * n * g)
    assert col.ring_allgather(n, p, link) == pytest.approx((p - 1) * a + f * n * b)
    assert col.ring_reduce_scatter(n, p, link) == pytest.approx((p - 1) * a + f * n * (b + g))
    assert col.binomial_broadcast(n, p, link) == pytest.approx(lg * (a + n * b))
    assert col.linear_broadcast(n, p, link) == pytest.approx((p - 1) * (a + n * b))
    assert col.alltoall(n, p, link) == pytest.approx((p - 1) * (a + n / p * b))


def test_collectives_free_for_one_process():
    link = LinkSpec(1e-3, 1e-9, 1e-10)
    for fn in (col.ring_allreduce, col.rhd_allreduce, col.ring_allgather, col.ring_reduce_scatter,
               col.binomial_broadcast, col.linear_broadcast, col.alltoall, col.binomial_reduce):
        assert fn(1e6, 1, link) == 0.0
        assert fn(0, 4, link) == 0.0


def test_rhd_beats_ring_on_latency_only():
    latency_only, bandwidth_only = LinkSpec(alpha=1e-3), LinkSpec(beta=1e-9)
    assert col.rhd_allreduce(1e6, 16, latency_only) < col.ring_allreduce(1e6, 16, latency_only)
    assert col.rhd_allreduce(1e6, 16, bandwidth_only) == pytest.approx(col.ring_allreduce(1e6, 16, bandwidth_only))


# -- limits ---------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["kernel", "data", "hybrid"])
def test_one_device_equals_single_with_ideal_links(strategy):
    net = marques_cifar(50, 150)
    one = predict("single", net, 32, CPU)
    p = predict(strategy, net, 32, [CPU], IDEAL_LINK)
    assert p.step_time == pytest.approx(one.step_time, rel=1e-12)
    assert p.breakdown["communication"] == 0.0 and p.breakdown["storage"] == 0.0


@pytest.mark.parametrize("strategy", ["data", "hybrid"])
def test_one_device_no_communication_even_on_slow_link(strategy):
    p = predict(strategy, marques_cifar(50, 150), 32, [CPU], LinkSpec(1.0, 1e-3, 1e-3))
    assert p.breakdown["communication"] == 0.0


@pytest.mark.parametrize("P", [2, 3, 4])
def test_ideal_network_time_is_pure_compute(P):
    net = marques_cifar(64, 192)
    k = predict("kernel", net, 32, [CPU] * P, IDEAL_LINK)
    # beside compute, only the holders' joins of the shards they gather (overhead)
    assert k.step_time == pytest.approx(k.breakdown["compute_critical"] + k.breakdown["master"]
                                        + k.breakdown["overhead"])
    assert k.breakdown["storage"] == 0 and k.breakdown["communication"] == 0
    d = predict("data", net, 32 * P, [CPU] * P, IDEAL_LINK)
    assert d.step_time == pytest.approx(d.breakdown["compute_max"])
    h = predict("hybrid", net, 32 * P, [CPU] * P, IDEAL_LINK)
    assert h.step_time == pytest.approx(h.breakdown["compute_critical"] + h.breakdown["master"])


@pytest.mark.parametrize("P", [2, 3, 4, 8])
@pytest.mark.parametrize("store", [None, STORE])
def test_kernel_speedup_at_most_P_on_equal_devices(P, store):
    net = marques_cifar()
    for link in (IDEAL_LINK, LAN):
        assert speedup("kernel", net, 32, [CPU] * P, link, store) <= P + 1e-9


@pytest.mark.parametrize("strategy", ["single", "kernel", "data", "hybrid"])
def test_breakdown_adds_up(strategy):
    net = marques_cifar(100, 300)
    devs = [CPU, DeviceSpec(flops=200e9, mem_bw=20e9)]
    p = predict(strategy, net, 64, devs, LAN, STORE, overhead=OVERHEAD)
    b = p.breakdown
    parts = b["compute_critical"] + b["communication"] + b["storage"] + b["master"] + b["overhead"]
    assert parts == pytest.approx(p.step_time)
    assert len(b["compute"]) == (1 if strategy == "single" else 2)


# -- trends of METHODS §1 and §3 -------------------------------------------------

def _kernel_speedup(net, batch, link=LAN, P=4):
    return speedup("kernel", net, batch, [CPU] * P, link, STORE, overhead=OVERHEAD)


def test_kernel_speedup_rises_with_kernels():
    s = [_kernel_speedup(marques_cifar(k, 3 * k), 32) for k in (25, 100, 500)]
    assert s[0] < s[1] < s[2]


def test_kernel_speedup_rises_with_batch():
    net = marques_cifar(100, 300)
    s = [_kernel_speedup(net, b) for b in (8, 32, 128)]
    assert s[0] < s[1] < s[2]


def test_kernel_speedup_falls_with_slower_links():
    net = marques_cifar()
    s = [_kernel_speedup(net, 32, LinkSpec.from_bandwidth(bw, 1e-4)) for bw in (10e9, 1e9, 1e8)]
    assert s[0] > s[1] > s[2]


def test_data_parallel_traffic_independent_of_batch():
    net = marques_cifar(100, 300)
    small = predict("data", net, 32, [CPU] * 4, LAN)
    large = predict("data", net, 512, [CPU] * 4, LAN)
    assert small.breakdown["communication"] == pytest.approx(large.breakdown["communication"])
    assert small.details["allreduce_bytes"] == 4 * net.params()
    assert large.step_time > small.step_time


def test_data_overlap_and_algorithms():
    net = alexnet()
    gpus = [DeviceSpec(flops=3.5e12, mem_bw=2e11, conv_efficiency=0.4)] * 8
    link = LinkSpec.from_bandwidth(6e9, 1e-3)
    plain = predict("data", net, 1024, gpus, link)
    over = predict("data", net, 1024, gpus, link, overlap=True)
    rhd = predict("data", net, 1024, gpus, link, allreduce="rhd")
    assert over.step_time < plain.step_time
    assert rhd.step_time < plain.step_time  # fewer latency terms, same bytes


def test_data_gradient_buckets_pay_the_collectives_latency_once_a_bucket():
    """With overlap, layers' gradients (last layer first) fill buckets of at least
    `bucket_mb`, as DDP's: one all-reduce a bucket, started when its earliest layer's
    backward is done. 0 is one a layer; a bucket larger than every gradient is one
    all-reduce after the last layer's backward."""
    from pipeline.costmodel.collectives import ring_allreduce
    from pipeline.costmodel.data import ReplicaPass, allreduce_schedule
    mib, p, link = 2 ** 20, 1024, LinkSpec.from_bandwidth(1e9, 5e-6)
    grads = [1 * mib, 3 * mib, 2 * mib, 4 * mib]  # forward order
    ready = [0.04, 0.03, 0.02, 0.01]  # backward: the last layer's gradient first
    replicas = ReplicaPass(devices=p, forward=0.005, ready=ready, end=0.04)
    ring = lambda n: ring_allreduce(n, p, link)  # noqa: E731
    # one a layer: each waits for its layer and for the one before it on the channel
    per_layer = 0.0
    for i in (3, 2, 1, 0):
        per_layer = max(per_layer, ready[i]) + ring(grads[i])
    assert allreduce_schedule(replicas, grads, link, "ring", True) == per_layer
    assert allreduce_schedule(replicas, grads, link, "ring", True, 0.0) == per_layer
    # 5 MiB buckets: layers 3 and 2 (6 MiB) once layer 2 is done, then 1 and 0 (4 MiB,
    # what is left) once layer 0 is
    two = max(ready[2] + ring(6 * mib), ready[0]) + ring(4 * mib)
    assert allreduce_schedule(replicas, grads, link, "ring", True, 5 * mib) == two
    one = ready[0] + ring(10 * mib)
    assert allreduce_schedule(replicas, grads, link, "ring", True, 1e9) == one
    # at 1024 devices a ring's latencies (10 ms) outlast a layer's backward (10 ms)
    assert two < per_layer
    # and through predict(): DDP's 25 MiB on a deep network at many devices
    net, gpus = alexnet(), [DeviceSpec(flops=3.5e12, mem_bw=2e11, conv_efficiency=0.4)] * 512
    layered = predict("data", net, 512 * 32, gpus, link, overlap=True)
    bucketed = predict("data", net, 512 * 32, gpus, link, overlap=True, bucket_mb=25)
    assert bucketed.step_time < layered.step_time


def test_data_proportional_batch_helps_unequal_devices():
    net = marques_cifar(50, 150)
    devs = [CPU, DeviceSpec(flops=3 * 90e9, mem_bw=10e9)]
    eq = predict("data", net, 128, devs, LAN)
    prop = predict("data", net, 128, devs, LAN, batch_split="proportional")
    assert prop.step_time < eq.step_time
    assert sum(prop.details["batch_shares"]) == 128


def test_model_parallel_traffic_grows_with_batch_in_hybrid():
    net = alexnet()
    gpus = [DeviceSpec(flops=3.5e12, mem_bw=2e11)] * 4
    link = LinkSpec.from_bandwidth(6e9, 1e-5)
    small = predict("hybrid", net, 4 * 32, gpus, link)
    large = predict("hybrid", net, 4 * 256, gpus, link)
    assert large.details["dense_comm"] > small.details["dense_comm"]


@pytest.mark.parametrize("scheme", ["a", "b", "c"])
@pytest.mark.parametrize("dense_batch", ["worker", "full"])
def test_hybrid_schemes_run_and_overlap_helps(scheme, dense_batch):
    st = krizhevsky_k20_setup()
    gpus = [st.gpu] * 4
    p = predict("hybrid", st.network, 512, gpus, st.link, scheme=scheme, dense_batch=dense_batch)
    assert p.step_time > predict("hybrid", st.network, 512, gpus, IDEAL_LINK, scheme=scheme).breakdown["compute_critical"]
    if scheme in ("b", "c"):
        q = predict("hybrid", st.network, 512, gpus, st.link, scheme=scheme, dense_batch=dense_batch, overlap_dense=False)
        assert p.step_time < q.step_time


# -- kernel splits ------------------------------------------------------------------

def test_apportion_sums_and_quantum():
    assert apportion(1500, [1, 1, 1]) == [500, 500, 500]
    c = apportion(1500, [1, 2, 3.5], quantum=16)
    assert sum(c) == 1500
    assert sum(1 for x in c if x % 16) <= 1
    assert apportion(10, [1, 0]) == [10, 0]


def test_proportional_split_follows_rates():
    net = marques_cifar()
    devs = [CPU, DeviceSpec(flops=270e9, mem_bw=10e9)]
    assert split_kernels_proportional(net, devs) == [[125, 375], [375, 1125]]


def _slow_link_case():
    fast = LinkSpec.from_bandwidth(10e9, 1e-4)
    slow = LinkSpec.from_bandwidth(10e6, 5e-3)
    a = DeviceSpec(flops=90e9, mem_bw=10e9, link=fast)
    b = DeviceSpec(flops=270e9, mem_bw=10e9, link=slow)  # fast device, slow link
    return marques_cifar(), [a, b], StoreSpec(write_bw=2e9, read_bw=2e9, latency=1e-3)


def test_minmax_beats_proportional_when_fast_device_has_slow_link():
    net, devs, store = _slow_link_case()
    prop = predict("kernel", net, 32, devs, store=store)
    mm = predict("kernel", net, 32, devs, store=store, split="minmax")
    assert mm.step_time < 0.9 * prop.step_time
    # the fast device behind the slow link is given less than its compute share
    assert mm.kernel_counts[0][1] < prop.kernel_counts[0][1]
    for layer, row in zip(net.conv, mm.kernel_counts):
        assert sum(row) == layer.out_channels


def test_minmax_never_worse_than_proportional():
    rng = random.Random(7)
    for _ in range(25):
        P = rng.randint(2, 5)
        devs = [
            DeviceSpec(
                flops=rng.uniform(20e9, 400e9), mem_bw=rng.uniform(5e9, 50e9),
                link=LinkSpec.from_bandwidth(rng.choice([30e6, 300e6, 3e9]), rng.uniform(0, 5e-3)),
            )
            for _ in range(P)
        ]
        net = marques_cifar(rng.choice([64, 128, 500]), rng.choice([192, 512, 1500]))
        batch, q = rng.choice([8, 32, 128]), rng.choice([1, 8, 32])
        store = rng.choice([None, STORE])
        prop = predict("kernel", net, batch, devs, LAN, store, quantum=q)
        counts = split_kernels_minmax(net, batch, devs, LAN, store, quantum=q)
        mm = predict("kernel", net, batch, devs, LAN, store, kernel_counts=counts)
        assert mm.step_time <= prop.step_time * (1 + 1e-12)
        for layer, row in zip(net.conv, counts):
            assert sum(row) == layer.out_channels
            assert sum(1 for k in row if k % q) <= 1


@pytest.mark.parametrize("counts,master", [([[4, 4], [8, 8]], 0), ([[4, 4], [8, 8]], 1),
                                          ([[2, 4, 2], [8, 0, 8]], 2), ([[8, 0], [16, 0]], 1)])
def test_kernel_bytes_equal_the_engines_slots(counts, master):
    """The model's traffic, derived on its own, equals the engine's formula
    (tasks.layout.workspace_bytes, which the run's measured bytes must meet)."""

    net, B = marques_cifar(8, 16), 4
    spec = NetworkSpec((ConvLayerSpec(3, 8), ConvLayerSpec(8, 16, in_height=16, in_width=16)))
    layout = layout_from_counts([f"w{i}" for i in range(len(counts[0]))], counts, master)
    expected = sum(r + w for r, w in engine_bytes(layout, spec, B, 4))
    assert workspace_bytes(net, B, counts, master) == expected
    p = predict("kernel", net, B, [CPU] * len(counts[0]), LAN, STORE, kernel_counts=counts,
                master=master)
    assert p.details["bytes_moved"] == expected


def test_kernel_bytes_by_hand():
    """METHODS §1 with own slices kept in memory: two equal halves, master 0."""
    net, B = marques_cifar(8, 16), 4
    c1, c2 = net.conv
    half1, half2 = c1.output_elements(B, 4), c2.output_elements(B, 8)
    # act1 both ways, act2 of worker 1 to the master, its gradient back,
    # the partial of layer 2 both ways (each the other's half of act1's channels)
    elements = 2 * half1 + half2 + half2 + 2 * half1
    assert workspace_bytes(net, B, [[4, 4], [8, 8]], 0) == 2 * 4 * elements  # read + written
    assert workspace_bytes(net, B, [[8], [16]], 0) == 0  # one device: nothing moves


def test_bad_kernel_counts_rejected():
    with pytest.raises(ValueError):
        predict("kernel", marques_cifar(), 8, [CPU, CPU], kernel_counts=[[250, 249], [750, 750]])


# -- calibration ------------------------------------------------------------------

def test_calibrated_device_reproduces_its_timings():
    net = marques_cifar()
    c1, c2 = net.conv
    timings = {"conv1": (c1, 16, 50, 0.02), "conv2": (c2, 16, 100, 1.5)}
    dev = device_from_layer_timings(timings, first_layer="conv1")
    assert conv_time(dev, c2, 16, 100).forward + conv_time(dev, c2, 16, 100).backward == pytest.approx(1.5)
    t1 = conv_time(dev, c1, 16, 50, input_grad=False)
    assert t1.forward + t1.backward == pytest.approx(0.02)
    assert dev.rate("conv", "conv2") == pytest.approx(effective_rate(c2, 16, 100, 1.5))
    # proportional split follows the measured per-layer speeds
    slow = device_from_layer_timings({"conv1": (c1, 16, 50, 0.04), "conv2": (c2, 16, 100, 1.5)}, first_layer="conv1")
    assert split_kernels_proportional(net, [dev, slow]) == [[333, 167], [750, 750]]


def test_fit_hockney_recovers_parameters():
    sizes = [1e3, 1e5, 1e6, 1e7, 1e8]
    link = fit_hockney(sizes, [2e-3 + n / 8e8 for n in sizes])
    assert link.alpha == pytest.approx(2e-3, rel=1e-6)
    assert link.bandwidth == pytest.approx(8e8, rel=1e-6)


def test_store_and_overhead_builders():
    st = store_from_measurements(1.9e9, 0.8e9, 1e-3)
    assert (st.client_bw("write"), st.client_bw("read"), st.latency) == (1.9e9, 0.8e9, 1e-3)
    ov = overhead_from_measurements(2e-3, sync=5e-4)
    assert isinstance(ov, DaskOverhead) and (ov.task, ov.sync, ov.hop) == (2e-3, 5e-4, 2e-2)
    net = marques_cifar(50, 150)
    without = predict("kernel", net, 8, [CPU] * 2, LAN, st)
    # equal devices: a step starts a task gap later on each; each of its four
    # exchanges has one read on the critical path, and every read checks its slot's
    # marker (`sync`), whether it waited for the slot or found it written
    with_task = predict("kernel", net, 8, [CPU] * 2, LAN, st, overhead=DaskOverhead(task=0.01))
    assert with_task.step_time - without.step_time == pytest.approx(0.01)
    with_sync = predict("kernel", net, 8, [CPU] * 2, LAN, st, overhead=DaskOverhead(sync=1e-3))
    assert with_sync.step_time - without.step_time == pytest.approx(4e-3)
    # through the scheduler every one of the 2 L exchanges is a hop on the critical path
    hops = predict("kernel", net, 8, [CPU] * 2, LAN, st, overhead=DaskOverhead(hop=0.02),
                   sync="scheduler")
    assert hops.step_time - without.step_time == pytest.approx(4 * 0.02)
    # overhead beside the hops: the holders' joins of the shards they gather
    assert hops.breakdown["overhead"] - without.breakdown["overhead"] == pytest.approx(4 * 0.02)


# -- Krizhevsky reproduction --------------------------------------------------------

@pytest.mark.parametrize("dense_batch", ["worker", "full"])
def test_krizhevsky_hybrid_speedups_within_15_percent(dense_batch):
    pred = krizhevsky_speedups((2, 4, 8), dense_batch=dense_batch)
    for k, s in pred.items():
        published = PUBLISHED_SPEEDUPS[(k, dense_batch)]
        assert abs(s - published) / published < 0.15, (k, s, published)
    assert pred[2] < pred[4] < pred[8] < 8


def test_krizhevsky_single_gpu_step_plausible():
    st = krizhevsky_k20_setup()
    t = predict("single", st.network, 128, st.gpu).step_time
    assert abs(t - PUBLISHED_SINGLE_STEP) / PUBLISHED_SINGLE_STEP < 0.15


def test_krizhevsky_needs_linear_broadcast():
    """With a tree broadcast the model would overshoot 8 GPUs: the owner's link is the bottleneck."""
    st = krizhevsky_k20_setup()
    tree = predict("hybrid", st.network, 1024, [st.gpu] * 8, st.link, options=st.options, broadcast="binomial")
    lin = predict("hybrid", st.network, 1024, [st.gpu] * 8, st.link, options=st.options)
    assert tree.step_time < lin.step_time


def test_unknown_names_rejected():
    net = marques_cifar(8, 16)
    with pytest.raises(ValueError):
        predict("pipeline", net, 8, CPU)
    with pytest.raises(ValueError):
        predict("hybrid", net, 8, [CPU, CPU], scheme="z")
    with pytest.raises(TypeError):
        predict("data", net, 8, [CPU], options=Options(), not_an_option=1)


def test_device_rates_per_kind():
    dev = DeviceSpec.from_rates(100e9, dense_rate=300e9)
    assert dev.rate("conv") == pytest.approx(100e9) and dev.rate("dense") == pytest.approx(300e9)
    net = marques_cifar(50, 150)
    faster_dense = predict("single", net, 32, dev).breakdown["master"]
    plain = predict("single", net, 32, DeviceSpec.from_rates(100e9)).breakdown["master"]
    assert faster_dense == pytest.approx(plain / 3)


# -- measured tables, chunked store, dataset reads (the engine's data path) -------------

def test_layer_table_interpolates_and_extrapolates():
    table = LayerTable.from_points(64, [(4, 2.0, 3.0), (16, 2.5, 4.0), (32, 5.0, 8.0), (16, 2.7, 4.2)])
    assert table.kernels == (4, 16, 32)
    assert table.times(16, 64) == pytest.approx((2.6, 4.1))  # duplicates: median
    assert table.times(2, 64) == (2.0, 3.0)  # below the first point: its fixed cost
    assert table.times(24, 64)[0] == pytest.approx(2.6 + (5.0 - 2.6) / 2)
    assert table.times(48, 64)[0] == pytest.approx(5.0 + (5.0 - 2.6) / 16 * 16)
    assert table.times(32, 128) == pytest.approx((10.0, 16.0))  # linear in the batch
    assert table.times(0, 64) == (0.0, 0.0)
    with pytest.raises(ValueError):
        LayerTable(64, (8, 4), (1.0, 1.0), (1.0, 1.0))


def test_measured_table_replaces_rate_in_every_strategy():
    net = marques_cifar(8, 16)
    tables = {"conv1": LayerTable(32, (8,), (0.01,), (0.02,)), "conv2": LayerTable(32, (4, 16), (0.01, 0.03), (0.02, 0.07))}
    dev = DeviceSpec(flops=1e9, layer_tables=tables)
    single = predict("single", net, 32, dev)
    assert single.breakdown["compute_critical"] == pytest.approx(0.01 + 0.02 + 0.03 + 0.07)
    split = predict("kernel", net, 32, [dev, dev], kernel_counts=[[4, 4], [8, 8]])
    # equal devices in lockstep: one device's convs are the critical compute;
    # conv1 at 4 kernels costs its smallest point's, conv2 at 8 is interpolated
    conv2 = (0.01 + (0.03 - 0.01) * 4 / 12) + (0.02 + (0.07 - 0.02) * 4 / 12)
    assert split.breakdown["compute_critical"] == pytest.approx(0.01 + 0.02 + conv2)


def test_a_measured_table_holds_the_probes_update_and_another_optimizer_adjusts_it():
    """The probe's runs step with the config's default SGD (11 accesses a parameter);
    plain SGD (3) takes 8 passes of the layer's parameters out of the measured backward,
    at the device's memory rate; the defaults leave the table as measured."""
    layer = marques_cifar(8, 16).conv[1]
    table = LayerTable(32, (4, 16), (0.01, 0.03), (0.02, 0.07))
    dev = DeviceSpec(flops=1e9, mem_bw=1e10, bytes_per_elem=4,
                     layer_tables={layer.name: table})
    as_measured = conv_time(dev, layer, 32, 16)
    assert as_measured.backward == pytest.approx(0.07)
    plain = conv_time(dev, layer, 32, 16, accesses=3)
    assert as_measured.backward - plain.backward == pytest.approx(
        dev.stream_time(8 * layer.params(16)))
    assert plain.forward == as_measured.forward


def test_every_access_is_one_operation_and_own_slices_are_free():
    """Each read or write of a slot pays the store's latency and one chunk; a device's
    own slices cost nothing; layer 1 and nothing else reads the dataset."""
    net, B = marques_cifar(8, 16), 4
    store = StoreSpec(write_bw=math.inf, read_bw=math.inf, latency=1.0, read_chunk=10.0,
                      write_chunk=100.0)
    dataset = StoreSpec(write_bw=math.inf, read_bw=math.inf, latency=1000.0)
    dev = DeviceSpec(flops=math.inf)
    p = predict("kernel", net, B, [dev, dev], store=store, kernel_counts=[[4, 4], [8, 8]],
                dataset=dataset)
    io = [sum(end - start for start, end, kind in lane if kind == "io")
          for lane in p.details["timeline"]]
    # worker 1: the batch, act1 out and the master's in, act2 out, grad in, partial out/in
    # master 0: the batch, act1 out and in, act2 in, grad out, partial out/in
    assert io == [pytest.approx(1000 + 3 * 101 + 3 * 11)] * 2
    single = predict("kernel", net, B, [dev], store=store, kernel_counts=[[8], [16]],
                     dataset=dataset)
    assert single.step_time == pytest.approx(1000) and single.breakdown["storage"] == \
        pytest.approx(1000)
    alone = predict("single", net, B, dev, dataset=dataset)
    assert alone.breakdown["storage"] == pytest.approx(1000) and alone.step_time == \
        pytest.approx(1000)


def test_timed_batch_reads_replace_the_dataset_store_per_device_and_count():
    """Where the probe timed a device's batch read in the runs that timed its shard
    (per count of the first layer) or its trunk, the model reads the batch in that
    time, not the dataset store's; interpolated between counts, nearest beyond them,
    in proportion to the batch; the same on the fast and the op-by-op timeline."""
    net, B = marques_cifar(8, 16), 4
    dataset = StoreSpec(write_bw=math.inf, read_bw=math.inf, latency=1000.0)
    table = LayerTable(B, (2, 6), (0.0, 0.0), (0.0, 0.0), dataset=(10.0, 30.0))
    assert [table.dataset_time(k, B) for k in (1, 2, 4, 6, 8)] == [10, 10, 20, 30, 30]
    assert table.dataset_time(4, 2 * B) == 40 and table.dataset_time(0, B) is None
    assert LayerTable(B, (2,), (0.0,), (0.0,)).dataset_time(2, B) is None
    timed = DeviceSpec(flops=math.inf, layer_tables={net.conv[0].name: table})
    plain = DeviceSpec(flops=math.inf)
    for timeline in ("fast", "reference"):
        options = Options(dataset=dataset, timeline=timeline)
        p = predict("kernel", net, B, [timed, plain], options=options,
                    kernel_counts=[[4, 4], [8, 8]])
        first_io = [next(end - start for start, end, kind in lane if kind == "io")
                    for lane in p.details["timeline"]]
        assert first_io == pytest.approx([20.0, 1000.0])  # timed at 4 kernels; the store's
    alone = predict("single", net, B, timed, dataset=dataset)
    assert alone.breakdown["storage"] == pytest.approx(30.0)  # every kernel: 8, past 6
    trunk = DeviceSpec(flops=math.inf, trunk=TrunkTime(B, 0.0, 0.0, dataset=8.0))
    assert trunk.trunk.dataset_time(2) == 4.0 and TrunkTime(B, 0.0, 0.0).dataset_time(2) is None
    for strategy in ("data", "hybrid"):
        for timeline in ("fast", "reference"):
            options = Options(dataset=dataset, timeline=timeline)
            steps = [predict(strategy, net, B, [dev, dev], store=STORE, options=options).step_time
                     for dev in (plain, trunk)]
            # 2 rows each, read at once: the store's 1000 s, or the trunk's 8 s at 4 rows
            assert steps[0] - steps[1] == pytest.approx(1000.0 - 4.0), (strategy, timeline)


def test_minmax_keeps_a_minimum_per_device():
    net = marques_cifar(64, 128)
    slow = DeviceSpec(flops=1e9, mem_bw=10e9)
    fast = DeviceSpec(flops=1e12, mem_bw=10e9)
    free = split_kernels_minmax(net, 32, [fast, slow], LAN, STORE, quantum=8)
    kept = split_kernels_minmax(net, 32, [fast, slow], LAN, STORE, quantum=8, min_units=1)
    assert any(row[1] == 0 for row in free)
    assert all(row[1] == 8 for row in kept) and all(sum(r) == c.out_channels for r, c in zip(kept, net.conv))


# -- data and hybrid through the store, as the engine runs them --------------------------

def _replica_networks(name: str) -> tuple[Network, NetworkSpec]:
    """The cost model's network and the engine's spec of the same network."""
    if name == "resnet20":  # batch norm after every conv, residual sums
        spec = build_preset("resnet20", (3, 32, 32), 10, "float32", 0.25, 0.5)
        return costmodel_network(spec), spec
    spec = NetworkSpec((ConvLayerSpec(3, 8), ConvLayerSpec(8, 16, in_height=16, in_width=16)))
    return marques_cifar(8, 16), spec  # conv 8 and 16, one dense layer to 10 classes


@pytest.mark.parametrize("network,batch_norm", [("paper", "sync"), ("resnet20", "sync"),
                                                ("resnet20", "local")])
@pytest.mark.parametrize("strategy,shares,scheme", [
    ("data", [6, 5, 5], "a"), ("data", [16], "a"),
    ("hybrid", [7, 5, 4], "a"), ("hybrid", [7, 5, 4], "b"), ("hybrid", [9, 7, 0], "c")])
def test_replica_strategies_move_the_engines_bytes(strategy, shares, scheme, network,
                                                   batch_norm):
    """The model's traffic through the store, derived on its own, equals the engine's
    slots (tasks.layout.workspace_bytes: sync batch norm's exchanges included), and its
    parts are the engine's parts."""
    net, spec = _replica_networks(network)
    # a worker given no rows leaves the run: the layout is over the others
    # (pipeline.strategies.replicas.DataStrategy.plan), the neurons split evenly
    taking = tuple(n for n in shares if n > 0)
    names = tuple(f"w{i}" for i in range(len(taking)))
    split = [[4, 3, 3]] if len(shares) == 3 else [[10]]
    if strategy == "data":
        layout = DataLayout(names, taking, batch_norm=batch_norm)
    else:
        neurons = tuple(map(tuple, split)) if len(taking) == len(shares) else ((5, 5),)
        layout = HybridLayout(names, taking, neurons, scheme, batch_norm=batch_norm)
        assert hybrid_parts(taking, scheme) == [[(e, b - a) for e, a, b in part]
                                                for part in layout.parts()]
    expected = sum(r + w for r, w in engine_bytes(layout, spec, sum(shares), 4))
    p = predict(strategy, net, sum(shares), [CPU] * len(shares), LAN, STORE,
                batch_shares=shares, dense_split=split, scheme=scheme, batch_norm=batch_norm)
    assert p.details["bytes_moved"] == expected
    parts = ("compute_critical", "master", "communication", "storage", "overhead")
    assert sum(p.breakdown[k] for k in parts) == pytest.approx(p.step_time)
    assert p.breakdown["storage"] > 0 or len(shares) == 1


def test_one_replica_through_the_store_is_single_plus_its_update():
    net = marques_cifar(50, 150)
    one = predict("data", net, 16, [CPU], LAN, STORE)
    alone = predict("single", net, 16, CPU)
    assert one.details["bytes_moved"] == 0
    assert one.step_time == pytest.approx(alone.step_time, rel=0.02)
    two = predict("data", net, 16, [CPU, CPU], LAN, STORE)
    assert two.step_time < one.step_time  # half the batch each, a small gradient to sum
