"""A kernel backward folds its output gradient's parts into one sum as it reads them.

- the engine (`tasks.kernel_ops._output_gradient`, over a real exchange on disk):
  the sum equals the left-to-right sum to the bit, a kept part (a view of a larger
  tensor, or a residual gradient) is never changed, and the own partial's whole input
  gradient is freed before the conv backward runs, not held until the op ends;
- the model (`kernel_memory_fold`): the walk frees each part as the engine does, so a
  device's peak no longer grows with the holders of the layer reading its output.
"""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import numpy as np
import torch

from pipeline.costmodel.kernel_memory import kernel_footprint
from pipeline.costmodel.kernel_memory_fold import Part, fold_parts, fold_positions
from pipeline.costmodel.memory import Live
from pipeline.placement.split import split_even
from pipeline.probe.tables import costmodel_network
from storage.exchange import Exchange, SlotSpec, create_exchange
from tasks.kernel_ops import KernelWork, _output_gradient
from tasks.layout import layout_from_counts
from tasks.moves import Mover
from tasks.receipts import Receipt, TaskClock
from tasks.zoo import build_preset

STEP = 1


def _run(tmp_path, me: int):
    """Worker `me` of two at layer 0 of a quarter-width ResNet-20 (the stem, read by
    the first block's conv and added by its second): its kept parts, and the other
    worker's partial written to a real exchange. Returns (run, parts by name)."""
    network = build_preset("resnet20", (3, 32, 32), 10, "float64", 0.25)
    counts = [[spec.kernels // 2, spec.kernels - spec.kernels // 2] for spec in network.conv]
    layout = layout_from_counts(["a", "b"], counts, 0)
    reader, adder = network.readers(0)[0], network.adders(0)[0]
    other = 1 - me
    own = layout.shards[0][me]
    generator = torch.Generator().manual_seed(me)
    shape = (4, own.stop - own.start, 8, 8)
    whole = torch.randn((4, network.conv[0].kernels, 8, 8), generator=generator,
                        dtype=torch.float64)  # the reader's input gradient, all channels
    read = torch.randn(shape, generator=generator, dtype=torch.float64)
    residual = torch.randn(shape, generator=generator, dtype=torch.float64)
    slot = f"partial/{reader}/{other}/{me}"
    create_exchange(str(tmp_path), [SlotSpec(slot, shape, "float64")])
    exchange = Exchange(str(tmp_path))
    exchange.write(slot, STEP, read.numpy())
    work = KernelWork({}, None, [], {})
    work.keep(f"partial/{reader}", whole[:, own.start:own.stop])
    work.keep(f"residual/{adder}", residual)
    run = SimpleNamespace(work=work, layout=layout, network=network, me=me,
                          mover=Mover(exchange, {}, "cpu", lambda: None, 5.0))
    return run, {"whole": whole, "view": whole[:, own.start:own.stop], "read": read,
                 "residual": residual}


def _clock() -> TaskClock:
    return TaskClock(Receipt("conv-backward", "a", STEP, 0.0))


def test_the_sum_is_the_left_to_right_sum_to_the_bit_and_kept_parts_stay(tmp_path):
    for me in (0, 1):  # the own partial first (a kept view), then second
        run, parts = _run(tmp_path / str(me), me)
        kept = {name: parts[name].clone() for name in ("whole", "residual")}
        order = ["view", "read"] if me == 0 else ["read", "view"]
        expected = parts[order[0]] + parts[order[1]] + parts["residual"]
        clock = _clock()
        with clock.op("conv-backward", 0):
            grad, _ = _output_gradient(run, 0, STEP, clock)
        assert torch.equal(grad, expected)
        for name, before in kept.items():  # nothing kept was added into
            assert torch.equal(parts[name], before)
        assert not run.work.kept  # every part taken


def test_the_own_partials_whole_gradient_is_freed_before_the_conv_backward(tmp_path):
    """The own partial is a view of the reader's whole input gradient (all channels):
    once folded, nothing holds it; before, the op held every part until it ended."""
    for me in (0, 1):
        run, parts = _run(tmp_path / str(me), me)
        whole = weakref.ref(parts["whole"])
        del parts
        clock = _clock()
        with clock.op("conv-backward", 0):
            grad, _ = _output_gradient(run, 0, STEP, clock)
            gc.collect()
            assert whole() is None
            assert grad.shape[1] < run.network.conv[0].kernels


def test_the_walk_frees_each_part_as_the_engine_does():
    """Two reads, the own part (a 40-byte view's base) between them, a residual: at
    most the sum, one read and what is still kept are alive."""
    live = Live()
    live.alloc("partial1", "backward", 40.0)
    live.alloc("residual2", "backward", 10.0)
    parts = [Part("read-a", True, 10.0), Part("partial1"), Part("read-b", True, 10.0),
             Part("residual2")]
    total = fold_parts(live, parts, "sum", 10.0)
    assert total == "read-a" and live.total == 10.0  # the first read became the sum
    assert live.peak == 40 + 10 + 10  # the kept parts and the first read
    live = Live()
    live.alloc("partial1", "backward", 40.0)
    live.alloc("residual2", "backward", 10.0)
    total = fold_parts(live, [Part("partial1"), Part("residual2")], "sum", 10.0)
    assert total == "sum" and live.total == 10.0 and live.peak == 60.0  # a new tensor


def test_devices_differ_only_in_whether_two_reads_come_before_or_after_their_own():
    places = fold_positions([[1, 1, 1, 1, 1, 1], [2, 0, 2, 2, 0, 2]])
    assert places[0] == ((0, 2), (0, 2)) and places[1] == ((1, 2), None)
    assert places[2] == ((2, 2), (1, 2)) and places[3] == ((2, 2), (2, 1))
    assert places[5] == ((2, 0), (2, 0))


def test_a_devices_peak_no_longer_grows_with_the_holders_of_its_reader():
    """VGG-16 at batch 256 on GPUs: the master held 13.66 GB on 64 devices and 14.48 on
    128 while each part read was held until the op ended (conv3's 128 holders send
    conv2's channels 127 slices); folded, each read is dropped once added."""
    network = costmodel_network(build_preset("vgg16", (3, 224, 224), 1000, "float32",
                                             1.0, 0.5))
    peaks = {}
    for devices in (64, 128):
        counts = [split_even(layer.out_channels, devices, 1) for layer in network.conv]
        peaks[devices] = kernel_footprint(network, 256, counts, 4, 0,
                                          gpu=[True] * devices).per_device[0]
    assert peaks[128] <= peaks[64] < 12.1e9
    assert np.isfinite(peaks[128])
