"""The model's fast paths give the reference's predictions.

- ``kernel``: the timeline computed a phase of all devices at a time
  (costmodel/timeline_fast.py) against the op-by-op simulation
  (``Options(timeline="reference")``), with and without a store, Dask overheads,
  both sync modes, a dataset, another master, min-max splits, idle devices;
- ``single``, ``data``, ``hybrid``: equal devices timed once against the same devices
  made distinct by name (so every device is timed on its own, as before), over
  allreduce algorithms, overlap, schemes a/b/c, dense batch full/worker, with and
  without a store (through the store also the fast timeline against the op-by-op
  one).

Every prediction is compared on its step time, critical-path parts, per-device
compute and bytes moved, to a relative 1e-9 of the step. 1 to 16 devices, equal and
unequal (two kinds; one device with a link of its own sends ``kernel`` to the
reference path, which must then agree with itself).
"""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.costmodel import (DaskOverhead, DeviceSpec, LinkSpec, Options, Prediction,
                                StoreSpec, alexnet, marques_cifar, predict)
from pipeline.costmodel.builders import conv_net
from pipeline.probe.tables import costmodel_network
from tasks.zoo import build_preset
from tests.test_costmodel_zoo import tied_counts, zoo_network

GPU = DeviceSpec(flops=1.95e13, mem_bw=1.555e12, conv_efficiency=0.6, dense_efficiency=0.8,
                 mem_efficiency=0.8, name="gpu")
SLOW = DeviceSpec(flops=2e12, mem_bw=3e11, conv_efficiency=0.5, name="slow")
LINK = LinkSpec.from_bandwidth(1.25e9, latency=5e-6)
STORE = StoreSpec(write_bw=5e9, read_bw=8e9, latency=1e-4, client_read_bw=2e9,
                  read_chunk=1e-5, write_chunk=2e-5)
DASK = DaskOverhead(task=1e-3, sync=2e-3, hop=3e-3)
#: A marker's look at a written slot shorter than noticing one (`DaskOverhead.check`).
LOOKED = DaskOverhead(task=1e-3, sync=2e-3, hop=3e-3, check=3e-4)
SMALL = conv_net([8, 24], image=16, hidden=[32], name="small")
PARTS = ("compute_critical", "master", "communication", "storage", "overhead", "compute_max")


def _same(fast: Prediction, reference: Prediction) -> None:
    """Equal to a relative 1e-9 of the step: the step, its parts, compute, bytes."""
    scale = 1e-9 * reference.step_time
    assert fast.step_time == pytest.approx(reference.step_time, rel=1e-9, abs=0)
    for part in PARTS:
        assert fast.breakdown[part] == pytest.approx(reference.breakdown[part], abs=scale), part
    assert fast.breakdown["compute"] == pytest.approx(reference.breakdown["compute"], rel=1e-12)
    moved = reference.details.get("bytes_moved")
    if moved is not None:
        assert fast.details["bytes_moved"] == pytest.approx(moved, rel=1e-12)


def _devices(p: int, mix: str) -> list[DeviceSpec]:
    """`p` equal devices, or a mix of two kinds (every third one slow)."""
    if mix == "equal":
        return [GPU] * p
    return [SLOW if d % 3 == 1 else GPU for d in range(p)]


def _one_by_one(devices: list[DeviceSpec]) -> list[DeviceSpec]:
    """The same devices, each unequal to every other: timed one by one."""
    return [dataclasses.replace(dev, name=f"{dev.name}#{d}") for d, dev in enumerate(devices)]


KERNEL_OPTIONS = [
    {},
    {"overhead": DASK},
    {"overhead": LOOKED},
    {"overhead": DASK, "sync": "scheduler"},
    {"dataset": STORE, "overhead": DASK},
    {"split": "minmax", "quantum": 4},
    {"master": -1},
    {"idle": True},
]


def _kernel_options(option: dict, p: int, network) -> dict:
    """`option` for `p` devices: the last device as master, or a split leaving the
    upper half idle in every layer."""
    option = dict(option)
    if option.pop("master", 0) == -1:
        option["master"] = p - 1
    if option.pop("idle", False):
        busy = max(1, (p + 1) // 2)
        option["kernel_counts"] = [
            [layer.out_channels // busy + (1 if d < layer.out_channels % busy else 0)
             if d < busy else 0 for d in range(p)] for layer in network.conv]
    return option


@pytest.mark.parametrize("p", [1, 2, 5, 16])
@pytest.mark.parametrize("mix", ["equal", "unequal"])
@pytest.mark.parametrize("store", [None, STORE], ids=["links", "store"])
@pytest.mark.parametrize("option", KERNEL_OPTIONS, ids=lambda o: "-".join(o) or "plain")
def test_kernel_fast_timeline_is_the_simulation(p: int, mix: str, store, option: dict) -> None:
    network = marques_cifar(48, 96)
    devices = _devices(p, mix)
    kw = _kernel_options(option, p, network)
    for batch in (1, 64):
        fast = predict("kernel", network, batch, devices, LINK, store, **kw)
        reference = predict("kernel", network, batch, devices, LINK, store,
                            timeline="reference", **kw)
        _same(fast, reference)


def test_kernel_fast_timeline_on_a_deep_network_at_odd_sizes() -> None:
    """AlexNet's five conv layers: kernels not dividing evenly over 7 and 10 devices."""
    for p in (7, 10):
        for store in (None, STORE):
            fast = predict("kernel", alexnet(), 32, [GPU] * p, LINK, store, overhead=DASK)
            reference = predict("kernel", alexnet(), 32, [GPU] * p, LINK, store,
                                overhead=DASK, timeline="reference")
            _same(fast, reference)


def test_kernel_devices_on_their_own_links_take_the_reference_path() -> None:
    """Different links make read seconds depend on reader and source: no fast path."""
    devices = [GPU, dataclasses.replace(GPU, link=LinkSpec.from_bandwidth(1e8, 1e-4)), GPU]
    fast = predict("kernel", marques_cifar(48, 96), 16, devices, LINK, STORE, overhead=DASK)
    reference = predict("kernel", marques_cifar(48, 96), 16, devices, LINK, STORE,
                        overhead=DASK, timeline="reference")
    assert fast.details["timeline"] == reference.details["timeline"]
    _same(fast, reference)


def test_kernel_fast_timeline_keeps_each_lanes_io_and_waits() -> None:
    """A lane of ``details["timeline"]`` holds the same I/O and waiting seconds."""
    kw = {"overhead": DASK, "dataset": STORE}
    fast = predict("kernel", marques_cifar(48, 96), 64, [GPU] * 5, LINK, STORE, **kw)
    reference = predict("kernel", marques_cifar(48, 96), 64, [GPU] * 5, LINK, STORE,
                        timeline="reference", **kw)

    def seconds(p: Prediction, kind: str) -> list[float]:
        return [sum(end - start for start, end, k in lane if k == kind)
                for lane in p.details["timeline"]]

    for kind in ("io", "wait", "compute"):
        assert seconds(fast, kind) == pytest.approx(seconds(reference, kind), rel=1e-9)


REPLICA_OPTIONS = [
    {"allreduce": "ring", "overlap": False},
    {"allreduce": "rhd", "overlap": True},
    {"scheme": "a", "dense_batch": "full"},
    {"scheme": "a", "dense_batch": "worker"},
    {"scheme": "b", "dense_batch": "worker", "broadcast": "linear"},
    {"scheme": "b", "dense_batch": "full", "overlap_dense": False},
    {"scheme": "c", "dense_batch": "worker", "batch_split": "proportional"},
    {"scheme": "c", "dense_batch": "full", "overhead": DASK, "sync": "scheduler"},
    {"scheme": "b", "dense_batch": "worker", "sync": "scheduler", "dataset": STORE},
]


@pytest.mark.parametrize("p", [1, 2, 5, 16])
@pytest.mark.parametrize("mix", ["equal", "unequal"])
@pytest.mark.parametrize("strategy", ["single", "data", "hybrid"])
@pytest.mark.parametrize("option", REPLICA_OPTIONS, ids=lambda o: "-".join(map(str, o.values())))
def test_equal_replicas_timed_once_over_links(p: int, mix: str, strategy: str,
                                              option: dict) -> None:
    devices = _devices(p, mix)
    fast = predict(strategy, SMALL, 64, devices, LINK, None, Options(**option))
    reference = predict(strategy, SMALL, 64, _one_by_one(devices), LINK, None, Options(**option))
    _same(fast, reference)


@pytest.mark.parametrize("p", [1, 3, 8])
@pytest.mark.parametrize("mix", ["equal", "unequal"])
@pytest.mark.parametrize("strategy", ["data", "hybrid"])
@pytest.mark.parametrize("option", REPLICA_OPTIONS[2:], ids=lambda o: "-".join(map(str, o.values())))
def test_equal_replicas_through_the_store(p: int, mix: str, strategy: str, option: dict) -> None:
    devices = _devices(p, mix)
    kw = {"overhead": DASK, **option}
    fast = predict(strategy, SMALL, 32, devices, LINK, STORE, **kw)
    reference = predict(strategy, SMALL, 32, _one_by_one(devices), LINK, STORE,
                        timeline="reference", **kw)
    _same(fast, reference)


@pytest.mark.parametrize("p", [2, 5])
@pytest.mark.parametrize("mix", ["equal", "unequal"])
@pytest.mark.parametrize("strategy", ["data", "hybrid"])
@pytest.mark.parametrize("option", [{"scheme": "a"}, {"scheme": "c", "batch_split": "proportional"},
                                    {"scheme": "b", "sync": "scheduler"}],
                         ids=lambda o: "-".join(map(str, o.values())))
def test_sync_batch_norm_through_the_store(p: int, mix: str, strategy: str, option: dict) -> None:
    """Every batch-norm layer's exchanges, forward and backward, a phase of all devices
    at a time as op by op (ResNet-20 at a quarter width: 19 batch norms, residual sums)."""
    net = costmodel_network(build_preset("resnet20", (3, 32, 32), 10, "float32", 0.25, 0.5))
    devices = _devices(p, mix)
    kw = {"overhead": DASK, "dataset": STORE, **option}
    fast = predict(strategy, net, 16, devices, LINK, STORE, **kw)
    reference = predict(strategy, net, 16, _one_by_one(devices), LINK, STORE,
                        timeline="reference", **kw)
    _same(fast, reference)
    local = predict(strategy, net, 16, devices, LINK, STORE, batch_norm="local", **kw)
    assert fast.step_time > local.step_time


@pytest.mark.parametrize("strategy", ["data", "hybrid"])
def test_replicas_through_the_store_with_a_short_look_at_written_slots(strategy: str) -> None:
    net = costmodel_network(build_preset("resnet20", (3, 32, 32), 10, "float32", 0.25, 0.5))
    devices = _devices(3, "unequal")
    kw = {"overhead": LOOKED, "dataset": STORE}
    fast = predict(strategy, net, 16, devices, LINK, STORE, **kw)
    reference = predict(strategy, net, 16, _one_by_one(devices), LINK, STORE,
                        timeline="reference", **kw)
    _same(fast, reference)
    # each marked read costs the look, not noticing: the step shrinks
    assert fast.step_time < predict(strategy, net, 16, devices, LINK, STORE, overhead=DASK,
                                    dataset=STORE).step_time


def test_a_step_that_takes_no_time() -> None:
    """Infinitely fast devices on free links: no segment at all, a zero step."""
    free = DeviceSpec(flops=float("inf"))
    counts = [[4, 4], [8, 8]]
    fast = predict("kernel", marques_cifar(8, 16), 4, [free] * 2, kernel_counts=counts)
    reference = predict("kernel", marques_cifar(8, 16), 4, [free] * 2, kernel_counts=counts,
                        timeline="reference")
    assert fast.step_time == reference.step_time == 0.0
    assert fast.breakdown == reference.breakdown


#: Zoo networks at test widths: residual graphs (a block's input read by its first conv
#: and its projection, tied splits) and chains with batch norm, strides and dropout.
ZOO = {"resnet20": zoo_network("resnet20", 0.25), "resnet18": zoo_network("resnet18", 0.125),
       "vgg11_bn": zoo_network("vgg11_bn", 0.125), "alexnet": zoo_network("alexnet", 0.25)}

ZOO_OPTIONS = KERNEL_OPTIONS[:4] + [{"split": "minmax", "quantum": 2}, {"master": -1},
                                    {"uneven": True}]


#: Devices, their mix and the store: each option takes two of them in turn.
ZOO_CLUSTERS = [(1, "equal", STORE), (2, "unequal", None), (5, "unequal", STORE),
                (16, "equal", None)]


@pytest.mark.parametrize("preset", sorted(ZOO))
@pytest.mark.parametrize("at", range(len(ZOO_OPTIONS)),
                         ids=["-".join(o) or "plain" for o in ZOO_OPTIONS])
def test_kernel_fast_timeline_is_the_simulation_on_the_zoo(preset: str, at: int) -> None:
    """The layer graph phase at a time equals it op by op, at 1 to 16 devices, equal and
    unequal, with and without a store; `uneven`: tied splits leaving devices idle."""
    network = ZOO[preset]
    for p, mix, store in (ZOO_CLUSTERS[at % 4], ZOO_CLUSTERS[(at + 1) % 4]):
        kw = dict(ZOO_OPTIONS[at])
        if kw.pop("uneven", False):
            kw["kernel_counts"] = tied_counts(network, p, (2, 0, 1, 3))
            kw["master"] = p - 1
        kw = _kernel_options(kw, p, network)
        devices = _devices(p, mix)
        fast = predict("kernel", network, 8, devices, LINK, store, **kw)
        reference = predict("kernel", network, 8, devices, LINK, store, timeline="reference",
                            **kw)
        _same(fast, reference)
