"""The memory count of the zoo's layers (pure): batch norm's saved tensors, residual
terms and their gradients, dropout's masks, every preset under every strategy, and a
`kernel` device's peak that never rises as its share shrinks."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pipeline.costmodel.memory import MemoryConstants, Live, tail_sizes
from pipeline.costmodel.network import ConvLayer, DenseLayer, Network, Pool
from pipeline.costmodel.replica_memory import _graph_replica_walk
from pipeline.placement.split import split_even
from pipeline.strategies import strategy_named
from tests.test_costmodel_zoo import TORCHVISION, zoo_network

#: Tensors only: no process, no runtime, no allocator's retention, no scratch.
TENSORS = MemoryConstants(worker_baseline=0, baseline=0, worker_runtime=0, client_runtime=0,
                          autograd_runtime=0, conv_workspace=0, retention=1.0,
                          load_retained=0)
BATCH, S = 4, 4


def two_layers(batch_norm: bool = False, residual: bool = False) -> Network:
    """A stride-2 conv (off the paper family's path), then a conv that may add the
    first's output, a global average pool and one dense layer."""
    first = ConvLayer(3, 8, (8, 8), kernel=3, stride=2, padding=1, bias=not batch_norm,
                      batch_norm=batch_norm, pools=())
    second = ConvLayer(8, 8, (4, 4), kernel=3, padding=1, bias=not batch_norm,
                       batch_norm=batch_norm, residual=0 if residual else None,
                       pools=(Pool("adaptive_avg", 1, 1, 0),))
    return Network((first, second), (DenseLayer(8, 6), DenseLayer(6, 10)))


def peak(strategy: str, network: Network, split=None, master: int = 0) -> list[float]:
    return strategy_named(strategy).peak_memory(network, BATCH, split, S, master,
                                                constants=TENSORS).per_device


def test_a_batch_norm_keeps_its_input_and_statistics_in_a_replica():
    """Autograd's batch norm saves the conv output (the ReLU's input is not saved
    without it) and a mean and inverse deviation per channel: after the forward, the
    layer with batch norm holds exactly those bytes more."""
    held = {}
    for batch_norm in (False, True):
        live = Live()
        network = two_layers(batch_norm)
        _graph_replica_walk(live, Network(network.conv[:1], ()), BATCH, S, 0.0, False)
        held[batch_norm] = live.peak
    layer = two_layers(True).conv[0]
    conv_bytes = layer.conv_elements(BATCH) * S
    assert held[True] - held[False] == conv_bytes + tail_sizes(layer, BATCH, 8, S)["stats"][0]


def test_every_strategy_counts_more_for_batch_norm_than_its_parameters():
    """A replica holds more than batch norm's scale, shift, their gradients and momentum
    and its running statistics: autograd keeps the conv output for batch norm's
    backward. A shard keeps its conv output anyway (a leaf of its tail's graph): batch
    norm adds its statistics and the normalised output while the ReLU runs."""
    channels = sum(layer.out_channels for layer in two_layers().conv)
    state = 4 * 2 * channels * S  # weights, gradients, momentum, running statistics
    for strategy, split, more in (("reference", None, state), ("data", [[2, 2]], state),
                                  ("hybrid", [[2, 2]], state), ("single", None, 0),
                                  ("kernel", [[4, 4], [4, 4]], 0)):
        plain, normed = (peak(strategy, two_layers(bn), split) for bn in (False, True))
        assert all(b > a + more for a, b in zip(plain, normed)), strategy


def test_without_momentum_no_device_holds_a_momentum_buffer():
    """SGD without momentum keeps no buffer (torch's SGD and the workers' `WorkerSGD`
    alike, checked here): every strategy's peak drops by its devices' parameter bytes
    at most, by the momentum part exactly, and no part is named momentum any more."""
    from tasks.optim import WorkerSGD, torch_sgd
    from tasks.specs import OptimizerSpec
    spec = OptimizerSpec(lr=0.1, momentum=0.0, weight_decay=1e-4, nesterov=False)
    for make in (WorkerSGD, torch_sgd):
        param = torch.nn.Parameter(torch.ones(3))
        param.grad = torch.ones(3)
        optimizer = make([param], spec)
        optimizer.step(0) if make is WorkerSGD else optimizer.step()
        assert not any(optimizer.state.get(param, {}).values()), make
    plain = two_layers(True)
    without = dataclasses.replace(plain, momentum=False)
    for strategy, split in (("reference", None), ("single", None), ("data", [[2, 2]]),
                            ("hybrid", [[2, 2]]), ("kernel", [[4, 4], [4, 4]])):
        model = strategy_named(strategy)
        kept, none = (model.peak_memory(n, BATCH, split, S, 0, constants=TENSORS)
                      for n in (plain, without))
        for device, (a, b) in enumerate(zip(kept.parts, none.parts)):
            assert a.get("momentum", 0) > 0 and b.get("momentum", 0) == 0, strategy
            assert none.per_device[device] == pytest.approx(
                kept.per_device[device] - a["momentum"]), strategy


def test_the_reference_process_keeps_copies_of_its_largest_tensor():
    """`reference` runs torch's SGD, whose weight decay (and Nesterov's look-ahead) makes
    a new tensor where the workers' SGD adds in place (checked here), and completes
    its checkpoints itself, reading each tensor back: copies of the largest weight
    tensor, kept on the heap below glibc's mmap threshold, handed back above it. The
    heap keeps the largest of those and of what the start's checkpoint read left,
    not their sum: each one's freed bytes serve the next."""
    from tasks.optim import WorkerSGD, torch_sgd
    from tasks.specs import OptimizerSpec
    spec = OptimizerSpec(lr=0.1, momentum=0.9, weight_decay=1e-4, nesterov=False)
    for make, in_place in ((WorkerSGD, True), (torch_sgd, False)):
        param = torch.nn.Parameter(torch.ones(3))
        param.grad = torch.ones(3)
        optimizer = make([param], spec)
        optimizer.step(0) if make is WorkerSGD else optimizer.step()
        assert (param.grad[0].item() != 1.0) == in_place, make
    network = two_layers()
    largest = 8 * 8 * 9 * S  # the second conv's kernels
    assert network.largest_tensor() * S == largest

    def kept(varied=network, constants=TENSORS) -> dict[str, float]:
        parts = strategy_named("reference").peak_memory(varied, BATCH,
                                                        constants=constants).parts[0]
        return {name: parts[name] for name in ("load", "update copies", "checksum read")
                if name in parts}

    assert kept() == {"update copies": largest}  # one update copy, one checksum read
    for changes, held in (({"weight_decay": False}, {"checksum read": largest}),
                          ({"nesterov": True}, {"update copies": 2 * largest}),
                          ({"nesterov": True, "momentum": False}, {"update copies": largest})):
        assert kept(dataclasses.replace(network, **changes)) == held, changes
    mapped = dataclasses.replace(TENSORS, mmap_threshold=largest - 1)
    assert kept(constants=mapped) == {"load": 0.0}
    loaded = dataclasses.replace(TENSORS, load_retained=1.0)  # the read left more
    assert kept(constants=loaded) == {"load": pytest.approx(2 * network.params() * S)}
    # a worker's replica makes neither copy
    data = strategy_named("data").peak_memory(network, BATCH, [[2, 2]], S, 0, constants=TENSORS)
    assert not any("copies" in name or "checksum" in name for p in data.parts for name in p)


def test_a_tied_splits_devices_hold_their_residual_channels():
    """The residual term's gradient is kept from the adder's backward to the added
    layer's, on the device holding those channels (the split is tied): with more of
    them a device holds more for the residual, in proportion."""
    extra = []
    for share in (2, 6):
        split = [[share, 8 - share], [share, 8 - share]]
        added, alone = (peak("kernel", two_layers(True, residual), split, master=1)
                        for residual in (True, False))
        extra.append([a - b for a, b in zip(added, alone)])
    assert all(e > 0 for row in extra for e in row)
    assert extra[1][0] > extra[0][0] and extra[1][1] < extra[0][1]


def test_dropout_masks_are_counted_where_the_dense_layers_run():
    """A wide dense head (where the step's peak is) with dropout on both inputs holds
    the masks and the dropped inputs too."""
    conv = two_layers().conv[:1]
    wide = [DenseLayer(conv[0].output_elements(1), 4096), DenseLayer(4096, 10)]
    for strategy in ("reference", "single"):  # (a replica's peak is its reduction's)
        without, with_dropout = (peak(strategy, Network(conv, tuple(wide), dropout=(p, p)))
                                 for p in (0.0, 0.5))
        assert with_dropout[0] >= without[0] + 2 * BATCH * 4096 * S, strategy


@pytest.mark.parametrize("preset", sorted(TORCHVISION))
def test_every_preset_has_a_finite_peak_under_every_strategy(preset):
    network = zoo_network(preset, 0.25)
    kernels = [split_even(layer.out_channels, 2, 1) for layer in network.conv]
    for strategy, split in (("reference", None), ("single", None), ("kernel", kernels),
                            ("data", [[4, 4]]), ("hybrid", [[4, 4]])):
        peaks = strategy_named(strategy).peak_memory(network, 8, split).per_device
        assert peaks and all(math.isfinite(p) and p > 0 for p in peaks), strategy
        # more than the weights it holds: its step's tensors are counted
        weights = network.params() * 4 / (2 if strategy == "kernel" else 1)
        assert max(peaks) > weights


def test_a_zoo_kernel_device_never_holds_more_for_a_smaller_share():
    """Placement moves a tied group's units off a device together, on this promise."""
    network = zoo_network("resnet20", 0.5)
    groups = network.tied_groups()
    for master in (0, 1):
        peaks = []
        for units in range(1, 8):
            counts = [[0, 0] for _ in network.conv]
            for group in groups:
                total = network.conv[group[0]].out_channels
                mine = max(1, round(total * units / 8))
                for l in group:
                    counts[l] = [mine, total - mine]
            peaks.append(strategy_named("kernel").peak_memory(network, 32, counts,
                                                              master=master).per_device[0])
        assert peaks == sorted(peaks), master
