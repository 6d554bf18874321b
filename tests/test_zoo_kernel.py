"""`kernel` trains every zoo network exactly as plain PyTorch does.

The general shard (`GraphShard`: stride, no bias, batch norm, residual sums, any
pooling) against autograd on the plain-PyTorch modules; the tied-split check; and
whole float64 runs of every preset at a test size on three workers with uneven tied
splits, against a plain single-process replay (weights, momentum, batch norm's
running statistics and counter, losses), with checkpoints under the plain model's
keys.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.cluster.worker_setup import register_setup
from pipeline.cluster.workers import find_workers
from pipeline.config.run_config import build_run_config
import pipeline.run
from pipeline.run import run_training
from pipeline.strategies import STRATEGIES
from storage import checkpoints
from storage.datasets import create_synthetic_dataset, open_dataset_info
from tasks.conv_shard import make_shard, time_layer
from tasks.graph_shard import COUNTER, GraphShard, parameter_names
from tasks.layout import check_tied, exchange_slots, layout_from_counts, workspace_bytes
from tasks.network import pool, to_arrays
from tasks.specs import ConvLayerSpec, OptimizerSpec, PoolSpec, ShardRange
from tasks.zoo import build_preset
from tests.helpers import max_relative_error, replay_model, tiny_config

TOLERANCE = 1e-10
POOLS = (PoolSpec("max", 3, 2, 1), PoolSpec("avg", 2, 1, 0), PoolSpec("adaptive_avg", 2))


def _plain_layer(spec: ConvLayerSpec, x, residual, grad_y):
    """The layer as plain PyTorch modules under autograd: outputs and gradients."""
    torch.manual_seed(5)
    conv = torch.nn.Conv2d(spec.in_channels, spec.kernels, spec.kernel_size, spec.stride,
                           spec.padding, bias=spec.bias).double()
    norm = torch.nn.BatchNorm2d(spec.kernels).double() if spec.batch_norm else None
    if norm is not None:
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    leaf, shortcut = x.clone().requires_grad_(True), residual.clone().requires_grad_(True)
    out = conv(leaf)
    out.retain_grad()
    z = out
    start = {"weight": conv.weight.detach().clone(),
             **({"bias": conv.bias.detach().clone()} if spec.bias else {})}
    if norm is not None:
        start.update({"bn.weight": norm.weight.detach().clone(),
                      "bn.bias": norm.bias.detach().clone()})
        out = norm(out)
    if spec.residual is not None:
        out = out + shortcut
    if spec.relu:
        out = F.relu(out)
    for pooling in spec.pooling:
        out = pool(out, pooling)
    out.backward(grad_y)
    grads = {"weight": conv.weight.grad, **({"bias": conv.bias.grad} if spec.bias else {})}
    if norm is not None:
        grads.update({"bn.weight": norm.weight.grad, "bn.bias": norm.bias.grad})
    return start, out.detach(), z.grad, shortcut.grad, grads, norm


@pytest.mark.parametrize("spec", [
    ConvLayerSpec(4, 6, 3, 1, 1, 9, 9, stride=2, bias=False, batch_norm=True, pools=POOLS,
                  residual=0, bn_name="bn"),
    ConvLayerSpec(3, 6, 5, 2, 1, 11, 11, stride=3, relu=True, pools=(PoolSpec("max", 3, 2),)),
    ConvLayerSpec(4, 6, 1, 0, 1, 8, 8, stride=2, bias=False, batch_norm=True, relu=False,
                  pools=(), bn_name="bn"),
], ids=["bn-residual-pools", "strided-bias-overlapping-pool", "projection"])
def test_a_graph_shard_computes_its_channels_as_autograd_does(spec):
    """Channels [2, 5) of a layer: output, input gradient (its part), residual
    gradient, the parameters' gradients (the first momentum), running statistics and
    counter equal plain PyTorch's on the whole layer, sliced, to float64's rounding: a
    convolution of a subset of the output channels may take another of oneDNN's code
    paths than the whole layer's (on the AMD EPYC's AVX-512 the forward differed by up to
    4 ulps; on the Intel Xeon it was bit for bit)."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(5, spec.in_channels, spec.in_height, spec.in_width, generator=generator,
                    dtype=torch.float64)
    residual = torch.randn(5, spec.kernels, spec.conv_height, spec.conv_width,
                           generator=generator, dtype=torch.float64)
    grad_y = torch.randn(5, spec.kernels, spec.out_height, spec.out_width,
                         generator=generator, dtype=torch.float64)
    start, out, grad_z, grad_residual, grads, norm = _plain_layer(spec, x, residual, grad_y)
    lo, hi = 2, 5
    weights = {name: value[lo:hi].numpy().copy() for name, value in start.items()}
    if spec.batch_norm:
        weights.update({"bn.running_mean": np.zeros(3), "bn.running_var": np.ones(3),
                        COUNTER: np.zeros(1)})
    momentum = {name: np.zeros_like(weights[name]) for name in parameter_names(spec)}
    shard = make_shard(spec, ShardRange(0, lo, hi), "conv", weights, momentum,
                       OptimizerSpec(lr=0.0, weight_decay=0.0), "cpu")
    assert isinstance(shard, GraphShard)
    given = residual[:, lo:hi] if spec.residual is not None else None
    rounding = {"rtol": 1e-12, "atol": 1e-14}
    torch.testing.assert_close(shard.forward(x, True, given), out[:, lo:hi], **rounding)
    partial = shard.input_gradient(grad_y[:, lo:hi].contiguous())
    if spec.residual is not None:
        torch.testing.assert_close(shard.residual_gradient(), grad_residual[:, lo:hi],
                                   **rounding)
    else:
        assert shard.residual_gradient() is None
    shard.update(0)
    state = shard.state()
    for name, grad in grads.items():  # a first step's momentum is its gradient
        torch.testing.assert_close(torch.from_numpy(state["momentum"][name]), grad[lo:hi],
                                   rtol=1e-12, atol=0)
    if norm is not None:
        for stat in ("running_mean", "running_var"):
            np.testing.assert_allclose(state["weights"][f"bn.{stat}"],
                                       getattr(norm, stat)[lo:hi].numpy(), rtol=1e-12,
                                       atol=1e-14)
        assert state["weights"][COUNTER].tolist() == [1.0]
    # the input gradient through kernels [lo, hi) alone (a partial sum)
    expected = torch.nn.grad.conv2d_input(x.shape, start["weight"][lo:hi],
                                          grad_z[:, lo:hi], spec.stride, spec.padding)
    torch.testing.assert_close(partial, expected, rtol=1e-12, atol=1e-14)


def _tiny_resnet():
    return build_preset("resnet20", (3, 32, 32), 10, "float64", width=0.25)


def test_a_layout_whose_tied_layers_differ_is_refused_naming_them():
    """layer1.0.conv2 adds conv1's output (the stem) channel by channel: a split giving
    them different ranges is refused, naming both."""
    network = _tiny_resnet()
    counts = [[2, 1, 1] for _ in network.conv]
    stem_group = next(g for g in network.tied_groups() if 0 in g)
    counts[stem_group[-1]] = [1, 2, 1]
    layout = layout_from_counts(["a", "b", "c"], counts, 0)
    with pytest.raises(ValueError, match=rf"conv layers conv1 and "
                       rf"{network.conv[stem_group[-1]].name} .*\[2, 1, 1\] and \[1, 2, 1\]"):
        check_tied(layout, network)
    with pytest.raises(ValueError, match="must share one kernel split"):
        exchange_slots(layout, network, 8)


@pytest.mark.parametrize("preset", ["resnet20", "resnet18", "resnet50", "vgg11_bn"])
@pytest.mark.parametrize("quantum", ["auto", 1, 3])
def test_even_placement_ties_every_residual_group(tmp_path, preset, quantum):
    """`placement: even` gives tied layers the same kernels (they have the same
    channels and quantum): the layout check passes on three workers."""
    config = build_run_config({"output": str(tmp_path), "network": {"preset": preset,
                                                                    "width": 0.25}},
                              [f"workspace.channel_quantum={quantum}"])
    network = config.network_spec((3, 32, 32))
    counts, _ = STRATEGIES["kernel"].even_split(config, network, 3)
    check_tied(layout_from_counts(["a", "b", "c"], counts, 0), network)


def test_a_block_input_read_by_two_layers_is_read_at_each_readers_first_op():
    """The input of a projection block is read by its first conv and its shortcut;
    a worker holding only the shortcut reads it at the shortcut's forward."""
    network = _tiny_resnet()
    shortcut = next(l for l, spec in enumerate(network.conv) if spec.source is not None
                    and spec.residual is None)
    block_input, first = network.source(shortcut), network.source(shortcut) + 1
    assert network.readers(block_input) == [first, shortcut]
    counts = [[spec.kernels, 0, 0] for spec in network.conv]
    counts[first] = [0, network.conv[first].kernels, 0]
    for layer in next(g for g in network.tied_groups() if shortcut in g):
        counts[layer] = [0, 0, network.conv[layer].kernels]
    slots = {s.name: s for s in exchange_slots(layout_from_counts(["a", "b", "c"], counts, 0),
                                               network, 8)}
    reads = dict(slots[f"act/{block_input}/0"].reads())
    assert reads[1].layer == first and reads[2].layer == shortcut


def uneven(kernels: int, quantum: int) -> list[int]:
    """An uneven split of a layer's kernels over three workers in whole quanta (the
    last holder's may be short), every worker holding some where there are units."""
    units = -(-kernels // quantum)
    first = min(kernels, max(1, units // 5) * quantum)
    second = min(kernels - first, max(1, (units - first // quantum) * 2 // 3) * quantum)
    return [first, second, kernels - first - second]


#: A tensor this small is zero but for rounding: a conv's bias before batch norm, whose
#: gradient batch norm cancels (its mean is subtracted), holds ~1e-19 after training.
ROUNDING_ZERO = 1e-12


def assert_equal_within_rounding(state: dict[str, np.ndarray], expected: dict[str, np.ndarray]
                                 ) -> None:
    """Every tensor within `TOLERANCE` relative; one that is zero but for rounding
    (`ROUNDING_ZERO`) within `TOLERANCE` absolute."""
    assert set(state) == set(expected)
    for key, want in expected.items():
        scale = float(np.linalg.norm(want))
        error = float(np.linalg.norm(state[key] - want))
        bound = TOLERANCE * (scale if scale > ROUNDING_ZERO else 1.0)
        assert error <= bound, f"{key}: |a - b| = {error:.3g}, |b| = {scale:.3g}"


PRESETS = {  # preset -> (width, image side, channel quantum)
    "resnet20": (0.25, 32, 2), "vgg11_bn": (1 / 16, 32, 2), "vgg16": (1 / 16, 32, 4),
    "alexnet": (1 / 16, 64, 2), "resnet18": (1 / 16, 32, 4), "resnet50": (1 / 16, 32, 8),
    "marques": (0.02, 32, 2),
}


@pytest.fixture(scope="module")
def side_64_dataset(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("data") / "side64.zarr")
    create_synthetic_dataset(path, train_samples=64, test_samples=16,
                             image_shape=(3, 64, 64), dtype="float64")
    return path


@pytest.mark.parametrize("preset", list(PRESETS))
def test_kernel_trains_every_preset_as_plain_pytorch(tmp_path, three_worker_cluster,
                                                     tiny_dataset_factory, side_64_dataset,
                                                     monkeypatch, preset):
    """Three workers, uneven tied splits (recorded), float64: plain PyTorch's numbers."""
    width, side, quantum = PRESETS[preset]
    dataset = side_64_dataset if side == 64 else tiny_dataset_factory("float64")
    if side == 64:  # the run takes the store as it is (a config's images are 32 wide)
        monkeypatch.setattr(pipeline.run, "prepare_dataset",
                            lambda config, *_: open_dataset_info(dataset))
    network = build_preset(preset, (3, side, side), 10, "float64", width)
    split = [uneven(spec.kernels, quantum) for spec in network.conv]
    assert any(len(set(row)) > 1 for row in split)
    assert all(any(row[d] for row in split) for d in range(3))  # no worker left out
    result = _train_and_compare(tmp_path, three_worker_cluster, dataset, preset, width,
                                quantum, placement="recorded", split_from=json.dumps(split))
    assert result.summary["kernel_split"] == split
    record = result.record  # every worker's workspace bytes are the formula's
    workers = list(record.worker.values)
    layout = layout_from_counts(workers, split, workers.index(result.summary["master"]))
    for w, (read, written) in enumerate(workspace_bytes(layout, network, 8, 8)):
        np.testing.assert_array_equal(record.read_bytes.isel(worker=w), read)
        np.testing.assert_array_equal(record.write_bytes.isel(worker=w), written)


def test_single_trains_resnet20_as_plain_pytorch(tmp_path, three_worker_cluster,
                                                 tiny_dataset_factory):
    """`single`: one worker holds every layer (a block's input gathered once for
    both its readers), no slots. (A run restored from a checkpoint mid-way, batch
    norm's running statistics, counters and momentum included, is
    tests/test_faults.py's killed worker on resnet20.)"""
    result = _train_and_compare(tmp_path, three_worker_cluster, tiny_dataset_factory("float64"),
                                "resnet20", *PRESETS["resnet20"][::2], strategy="single")
    assert all(len(row) == 1 for row in result.summary["kernel_split"])


def _train_and_compare(tmp_path, cluster, dataset: str, preset: str, width: float,
                       quantum: int, **overrides):
    """Train `preset` 2 steps of 8 in float64 (the second already steps the momentum
    and batch norm's running statistics again, from the first's); check the last
    checkpoint (its keys the plain model's; weights, running statistics, counters,
    momentum) and the losses against `replay_model`. The run's result."""
    client, cluster_config = cluster
    settings = {
        "network.preset": preset, "network.width": width, "network.dtype": "float64",
        "data.train_samples": 64, "data.test_samples": 16, "train.eval_samples": 16,
        "train.steps": 2, "train.batch": 8, "workspace.channel_quantum": quantum,
        **overrides}
    config = tiny_config(tmp_path, dataset, **settings)
    config.cluster.workers = cluster_config.workers
    register_setup(client, config.cluster)
    result = run_training(config, client=client, offered=find_workers(client, config.cluster))
    model, optimizer, losses = replay_model(config, dataset)
    steps = config.train.steps
    trained = checkpoints.read_tensors(config.checkpoint_path, steps)
    assert set(trained) == set(model.state_dict())
    expected = to_arrays(model.state_dict(), config.network.dtype)
    assert_equal_within_rounding(trained, expected)
    momentum = checkpoints.read_tensors(config.checkpoint_path, steps, "momentum")
    named = dict(model.named_parameters())
    assert_equal_within_rounding({k: momentum[k] for k in named},
                                 {k: optimizer.state[p]["momentum_buffer"].numpy()
                                  for k, p in named.items()})
    np.testing.assert_allclose(result.record.loss.values, losses, rtol=TOLERANCE, atol=0)
    initial = checkpoints.read_tensors(config.checkpoint_path, 0)
    assert max_relative_error(initial, expected) > 1e-6  # training moved the weights
    return result


def test_calibration_times_a_layer_with_batch_norm_and_a_residual_sum():
    """Calibration runs a non-plain layer as training does (a residual term of the
    conv output's shape): two sizes, a positive time each."""
    network = _tiny_resnet()
    layer = next(l for l, spec in enumerate(network.conv) if spec.residual is not None
                 and network.conv[spec.residual].kernels == spec.kernels)
    timed = time_layer(network.conv[layer], 2, [2, 4], "float64", True, repeats=1)
    assert [k for k, _ in timed["points"]] == [2, 4]
    assert all(seconds > 0 for _, seconds in timed["points"])
