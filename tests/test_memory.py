"""Memory per worker: the peak a stretch of work reaches (tasks/memory.py), and what a
real run records of it (record, summary) on the shared cluster and in-process."""

from __future__ import annotations

import gc
import json
import mmap
import os
import subprocess
import sys
import weakref

import numpy as np
import pytest
import torch

from pipeline.cluster.worker_setup import register_setup
from pipeline.cluster.workers import find_workers
from pipeline.records.memory import memory_baseline
from pipeline.records.starts import measured
from pipeline.run import run_training
from tasks import memory
from tasks.conv_shard import ConvShard
from tasks.data_ops import Gradients
from tasks.optim import WorkerSGD, make_sgd, torch_sgd
from tasks.specs import ConvLayerSpec, OptimizerSpec, ShardRange
from tests.helpers import shared_workers, tiny_config

MB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_stretch_peak_counts_what_it_allocated_and_forgets_what_came_before():
    kind = memory.reset_peak()
    # 64 MiB, touched, in a mapping of its own: returned when closed, whatever the heap
    # (freed numpy blocks can stay on glibc's heap after a test tuned its thresholds)
    block = mmap.mmap(-1, 64 * MB)
    for _ in range(64):
        block.write(b"\1" * MB)
    held = memory.read_peak(kind=kind)
    block.close()
    assert kind == memory.PER_STRETCH  # Linux: the high-water mark resets
    assert held.rss >= memory.current_rss() + 60 * MB
    kind = memory.reset_peak()
    small = np.ones(MB // 8)
    after = memory.read_peak(kind=kind)
    del small
    assert after.rss < held.rss - 50 * MB  # the freed block is not counted again
    assert after.gpu_allocated == after.gpu_reserved == 0  # a CPU stretch


def test_without_the_reset_the_peak_is_the_lifetime_peak(monkeypatch, tmp_path):
    monkeypatch.setattr(memory, "_CLEAR_REFS", str(tmp_path / "missing" / "clear_refs"))
    kind = memory.reset_peak()
    block = np.ones(32 * MB // 8)
    peak = memory.read_peak(kind=kind)
    assert kind == memory.LIFETIME and peak.kind == memory.LIFETIME
    assert peak.rss >= memory.current_rss() - MB  # the block included (it is still held)
    del block


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_a_gpu_stretch_reports_torch_allocated_and_reserved_peaks():
    kind = memory.reset_peak("cuda:0")
    block = torch.ones(16 * MB // 4, device="cuda:0")
    peak = memory.read_peak("cuda:0", kind)
    del block
    assert peak.gpu_allocated >= 16 * MB and peak.gpu_reserved >= peak.gpu_allocated


def _first_activations(batch: int) -> int:
    """Bytes of the tiny network's first conv output for `batch` (10 channels, 32x32,
    float32): one of the tensors a step keeps for its backward."""
    return batch * 10 * 32 * 32 * 4


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory, shared_cluster, tiny_dataset_factory):
    """`single` on cpu-0 at batch 16, then at 512 (3 steps each)."""
    client, config = shared_workers(shared_cluster, "FAST")
    register_setup(client, config)
    dataset = tiny_dataset_factory("float32")
    results = {}
    for batch in (16, 512):
        run = tiny_config(tmp_path_factory.mktemp(f"b{batch}"), dataset, strategy="single",
                          **{"train.steps": 3, "train.batch": batch, "train.eval_samples": 0,
                             "cluster.resource": "FAST"})
        run.cluster.workers = config.workers
        results[batch] = run_training(run, client=client,
                                      offered=find_workers(client, run.cluster))
    return results


def test_the_record_and_summary_carry_each_workers_peak(single_runs):
    result = single_runs[16]
    record, summary = result.record, result.summary
    assert record.memory_peak.dims == ("step", "worker")
    assert record.memory_peak.attrs["units"] == "B"
    assert record.client_memory_peak.dims == ("step",)
    held = record.memory_held.values  # at each step's start: a part of its peak
    assert (held > 0).all() and (held <= record.memory_peak.values).all()
    assert "gpu_allocated_peak" not in record  # a CPU worker has no GPU figures
    peaks = record.memory_peak.values
    assert np.isfinite(peaks).all() and (peaks > 0).all()
    base = summary["memory_baseline"]
    assert base == memory_baseline() and 50 * MB < base < 2000 * MB  # torch alone is more
    # the client's bare process imports xarray and pandas too, a worker's does not
    assert summary["client_memory_baseline"] == memory_baseline(memory.CLIENT_IMPORTS) > base
    assert summary["memory_peak"]["cpu-0"] == pytest.approx(float(peaks.max()))
    assert summary["memory_working"]["cpu-0"] == pytest.approx(peaks.max() - base)
    assert summary["client_memory_peak"] > base / 2
    assert summary["memory_peak_kind"] == memory.PER_STRETCH


def test_a_bigger_batch_needs_more_memory_on_its_worker(single_runs):
    small, large = (single_runs[b].summary["memory_peak"]["cpu-0"] for b in (16, 512))
    # the larger batch's activations alone, at least half of what the first layer's
    # output grows by (run after the small one on the same process, it cannot pass
    # on memory the small run left behind)
    assert large - small > 0.5 * (_first_activations(512) - _first_activations(16))


def test_the_reference_in_process_records_its_own_peak(tmp_path, tiny_dataset_factory):
    config = tiny_config(tmp_path, tiny_dataset_factory("float32"), strategy="reference",
                         **{"train.steps": 2, "train.batch": 512, "train.eval_samples": 0})
    summary = run_training(config).summary
    assert list(summary["memory_peak"]) == ["reference"]
    working = summary["memory_working"]["reference"]
    assert working > _first_activations(512)
    # it trains in the client process, so the client's bare process is its baseline
    assert summary["memory_baseline"] == summary["client_memory_baseline"]
    assert working == summary["memory_peak"]["reference"] - summary["client_memory_baseline"]
    # one process: the reference's step is part of the client's
    assert summary["client_memory_peak"] >= summary["memory_peak"]["reference"]


def test_the_models_baselines_are_this_machines_bare_processes(monkeypatch):
    """The memory model starts a prediction from the bare processes, runtimes and conv
    workspace measured here (the baselines a run's working memory is measured
    against); one that cannot be measured (0) leaves the constant's figure."""
    from pipeline.costmodel.memory import DEFAULT_CONSTANTS
    from pipeline.records import memory as records_memory
    measured = {memory.CLIENT_IMPORTS: 301_000_000, memory.WORKER_IMPORTS: 177_000_000}
    runtimes = [41e6, 97e6]
    workspace = [0.9]
    monkeypatch.setattr(records_memory, "memory_baseline", lambda imports: measured[imports])
    monkeypatch.setattr(records_memory, "memory_runtimes", lambda: tuple(runtimes))
    monkeypatch.setattr(records_memory, "memory_conv_workspace", lambda: workspace[0])
    here = records_memory.machine_memory_constants()
    assert (here.baseline, here.worker_baseline) == (301e6, 177e6)
    assert (here.worker_runtime, here.client_runtime) == (41e6, 97e6)
    assert here.conv_workspace == 0.9
    assert here.retention == DEFAULT_CONSTANTS.retention  # the rest as they were
    measured[memory.WORKER_IMPORTS] = 0
    runtimes[0] = 0.0
    workspace[0] = 0.0
    here = records_memory.machine_memory_constants()
    assert (here.baseline, here.worker_baseline) == (301e6, DEFAULT_CONSTANTS.worker_baseline)
    assert (here.worker_runtime, here.client_runtime) == (DEFAULT_CONSTANTS.worker_runtime, 97e6)
    assert here.conv_workspace == DEFAULT_CONSTANTS.conv_workspace


def test_the_runtimes_are_a_tiny_runs_working_memory_measured_once(monkeypatch, tmp_path,
                                                                   capfd):
    """Two real tiny runs (a worker's, the training process's) give this machine's
    runtimes, kept in the cache beside the baselines: read back, not measured again;
    ``$CNN_MEMORY_RUNTIME=fitted`` keeps the fitted constants. With a scheduler named in
    ``$DASK_SCHEDULER_ADDRESS`` (README: a run without `cluster.scheduler` uses it), here
    an unreachable one, they still measure this machine's own embedded worker (they went
    to that scheduler: a worker runtime of 0, the fitted constant, measured again by
    every process)."""
    from pipeline.costmodel.memory import DEFAULT_CONSTANTS
    from pipeline.records import memory as records_memory
    cache = tmp_path / "memory.json"
    kept = records_memory._cache_path()
    if os.path.exists(kept):  # the baselines as measured already: only the runtimes now
        with open(kept, encoding="utf-8") as handle:
            baselines = {key: value for key, value in json.load(handle).items()
                         if "runtimes" not in json.loads(key)}
        cache.write_text(json.dumps(baselines))
    monkeypatch.setenv("CNN_MEMORY_CACHE", str(cache))
    monkeypatch.delenv("CNN_MEMORY_RUNTIME", raising=False)
    monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", "tls://127.0.0.1:9")
    records_memory.memory_runtimes.cache_clear()
    try:
        worker, client = records_memory.memory_runtimes()
        assert "measuring this machine's memory runtimes" in capfd.readouterr().err
        # a Dask worker that ran the tasks holds more than a bare forked worker, and
        # less than a process that trained a real network (about 50 and 100 MB here)
        assert 10 * MB < worker < 400 * MB and 10 * MB < client < 800 * MB
        assert any("runtimes" in json.loads(key) for key in json.loads(cache.read_text()))

        def measure_again() -> tuple[float, float]:
            raise AssertionError("measured again")
        monkeypatch.setattr(records_memory, "measure_runtimes", measure_again)
        records_memory.memory_runtimes.cache_clear()
        assert records_memory.memory_runtimes() == (worker, client)
        here = records_memory.machine_memory_constants()
        assert (here.worker_runtime, here.client_runtime) == (worker, client)

        monkeypatch.setenv("CNN_MEMORY_RUNTIME", "fitted")
        records_memory.memory_runtimes.cache_clear()
        here = records_memory.machine_memory_constants()
        assert (here.worker_runtime, here.client_runtime) == (
            DEFAULT_CONSTANTS.worker_runtime, DEFAULT_CONSTANTS.client_runtime)
    finally:
        records_memory.memory_runtimes.cache_clear()


@pytest.mark.parametrize("pool", [2, 1])
def test_a_shard_keeping_less_still_computes_autograds_bits(pool):
    """The shard keeps where its output is positive (a bool per output element) and the
    pool's indices, not the ReLU's output, and runs autograd's kernels by hand: weights,
    input gradient and kernel gradients equal nn.Conv2d -> ReLU -> MaxPool2d's bit for
    bit, with outputs on both sides of zero."""
    spec = ConvLayerSpec(in_channels=3, kernels=6, pool=pool, in_height=8, in_width=8)
    generator = torch.Generator().manual_seed(1)
    weight = 0.2 * torch.randn(6, 3, 5, 5, generator=generator)
    bias = 0.1 * torch.randn(6, generator=generator)
    x = torch.randn(4, 3, 8, 8, generator=generator)
    grad_y = torch.randn(4, 6, 8 // pool, 8 // pool, generator=generator)
    conv = torch.nn.Conv2d(3, 6, 5, padding=2)
    conv.weight.data, conv.bias.data = weight.clone(), bias.clone()
    leaf = x.clone().requires_grad_(True)
    y = torch.nn.functional.relu(conv(leaf))
    y = torch.nn.functional.max_pool2d(y, pool) if pool > 1 else y
    y.backward(grad_y)
    shard = ConvShard(spec, ShardRange(0, 0, 6), "0",
                      {"weight": weight.numpy().copy(), "bias": bias.numpy().copy()},
                      {"weight": np.zeros((6, 3, 5, 5), np.float32),
                       "bias": np.zeros(6, np.float32)},
                      OptimizerSpec(lr=0.0, weight_decay=0.0), "cpu")
    out = shard.forward(x, input_grad=True)
    assert torch.equal(out, y.detach())
    kept = shard._saved.positive
    assert kept.dtype == torch.bool and kept.shape == out.shape
    assert kept.any() and not kept.all()  # the ReLU's mask matters somewhere
    assert torch.equal(shard.input_gradient(grad_y.clone()), leaf.grad)
    shard.update(0)
    assert shard.weight.grad is None and shard.bias.grad is None  # dropped once used
    momentum = shard.optimizer.state  # a first step's momentum is its gradient as it was
    assert torch.equal(momentum[shard.weight]["momentum_buffer"], conv.weight.grad)
    assert torch.equal(momentum[shard.bias]["momentum_buffer"], conv.bias.grad)


def test_a_first_layer_shard_computes_no_input_gradient_and_autograds_kernel_gradients():
    """The network's first layer asks its one backward call for the kernel and bias
    gradients only (as autograd does for an input that needs no gradient): no input
    gradient comes back, and the kernel gradients are autograd's bit for bit."""
    spec = ConvLayerSpec(in_channels=3, kernels=4, in_height=8, in_width=8)
    generator = torch.Generator().manual_seed(3)
    weight = 0.2 * torch.randn(4, 3, 5, 5, generator=generator)
    x = torch.randn(2, 3, 8, 8, generator=generator)
    grad_y = torch.randn(2, 4, 4, 4, generator=generator)
    conv = torch.nn.Conv2d(3, 4, 5, padding=2)
    conv.weight.data, conv.bias.data = weight.clone(), torch.zeros(4)
    torch.nn.functional.max_pool2d(torch.nn.functional.relu(conv(x)), 2).backward(grad_y)
    shard = ConvShard(spec, ShardRange(0, 0, 4), "0",
                      {"weight": weight.numpy().copy(), "bias": np.zeros(4, np.float32)},
                      {"weight": np.zeros((4, 3, 5, 5), np.float32),
                       "bias": np.zeros(4, np.float32)},
                      OptimizerSpec(lr=0.0, weight_decay=0.0), "cpu")
    shard.forward(x, input_grad=False)
    assert shard.input_gradient(grad_y) is None
    shard.update(0)
    assert shard.weight.grad is None and shard.bias.grad is None  # dropped once used
    momentum = shard.optimizer.state  # a first step's momentum is its gradient as it was
    assert torch.equal(momentum[shard.weight]["momentum_buffer"], conv.weight.grad)
    assert torch.equal(momentum[shard.bias]["momentum_buffer"], conv.bias.grad)


@pytest.mark.parametrize("nesterov", [False, True])
def test_worker_sgd_steps_as_torchs_sgd_bit_for_bit(nesterov):
    """The workers' SGD is torch's step without torch.optim (and the weight decay added
    into the gradient in place): weights and momentum after three steps are torch's."""
    spec = OptimizerSpec(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=nesterov)
    generator = torch.Generator().manual_seed(2)
    start = torch.randn(7, 5, generator=generator)
    grads = [torch.randn(7, 5, generator=generator) for _ in range(3)]
    params = [start.clone().requires_grad_(True) for _ in range(2)]
    plain, worker = torch_sgd([params[0]], spec), make_sgd([params[1]], spec)
    assert isinstance(worker, WorkerSGD)
    for step, grad in enumerate(grads):
        for param in params:
            param.grad = grad.clone()
        plain.step()
        worker.step(step)
    assert torch.equal(params[0], params[1])
    assert torch.equal(plain.state[params[0]]["momentum_buffer"],
                       worker.state[params[1]]["momentum_buffer"])


def test_a_worker_process_never_imports_torch_dynamo():
    """torch.optim's optimizers import torch._dynamo (and sympy) when built, and a backward
    from an explicit gradient imports sympy: 74-76 MB in a process. A worker's training
    (a shard, a replica and a trunk's backward, their SGD steps, a checkpoint's momentum
    in and out) runs in a fresh process without either."""
    script = """
import sys, numpy as np, torch
from tasks.conv_shard import ConvShard
from tasks.optim import make_sgd, momentum_of, restore_momentum
from tasks.specs import ConvLayerSpec, OptimizerSpec, ShardRange
spec = ConvLayerSpec(in_channels=3, kernels=4, in_height=8, in_width=8)
zeros = {"weight": np.zeros((4, 3, 5, 5), np.float32), "bias": np.zeros(4, np.float32)}
shard = ConvShard(spec, ShardRange(0, 0, 4), "0", dict(zeros), dict(zeros), OptimizerSpec(), "cpu")
y = shard.forward(torch.randn(2, 3, 8, 8), input_grad=True)
shard.input_gradient(torch.ones_like(y)); shard.update(0); shard.state()
model = torch.nn.Linear(3, 2)
sgd = make_sgd(model.parameters(), OptimizerSpec())
model(torch.randn(4, 3)).sum().backward(); sgd.step(0); sgd.zero_grad()
restore_momentum(sgd, dict(model.named_parameters()), momentum_of(sgd, dict(model.named_parameters())))
from tasks.hybrid_ops import backward_from
features = model(torch.randn(4, 3))
backward_from(features, torch.ones_like(features))  # hybrid's trunk: an explicit gradient
print(sorted(name for name in sys.modules if name.startswith(("torch._dynamo", "sympy")))[:3])
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_a_trained_shard_is_freed_with_its_last_reference():
    """The conv's backward runs without autograd: run with it, the weight's gradient
    pointed back at the weight through a graph node, a cycle Python's collector
    cannot see, and every calibrated shard stayed in memory for the worker's life."""
    spec = ConvLayerSpec(in_channels=3, kernels=4, in_height=8, in_width=8)
    shard = ConvShard(spec, ShardRange(0, 0, 4), "0",
                      {"weight": np.ones((4, 3, 5, 5), np.float32),
                       "bias": np.zeros(4, np.float32)},
                      {"weight": np.zeros((4, 3, 5, 5), np.float32),
                       "bias": np.zeros(4, np.float32)}, OptimizerSpec(), "cpu")
    shard.forward(torch.ones(2, 3, 8, 8), input_grad=True)
    shard.input_gradient(torch.ones(2, 4, 4, 4))
    assert shard._saved.grads[0].grad_fn is None  # no graph node behind the gradient
    shard.update(0)
    weight = weakref.ref(shard.weight)
    del shard
    gc.collect()
    assert weight() is None


def test_the_record_and_summary_carry_the_clients_cpu_per_step(single_runs):
    """The client's process (client, scheduler) takes CPU from the workers' cores."""
    cpu = single_runs[16].record.client_cpu_time
    assert cpu.dims == ("step",) and cpu.attrs["units"] == "s"
    assert np.isfinite(cpu.values).all() and (cpu.values > 0).all()
    steps = single_runs[16].record.step_time.values
    assert (cpu.values < 4 * steps + 0.05).all()  # a process's CPU over a step's wall time
    for result in (single_runs[16], single_runs[512]):
        summary, tail = result.summary, measured(result.record, 1)  # train.warmup_steps
        assert tail.sizes["step"] == 2
        assert 0 < summary["client_cpu_per_step"] < summary["step_time_median"] * 4
        # the summary's figures are the measured steps' medians (of each step's share,
        # not the ratio of the medians: those part when a loaded machine's steps vary)
        assert summary["client_cpu_per_step"] == pytest.approx(
            float(np.median(tail.client_cpu_time.values)), rel=1e-12)
        assert summary["client_core_share"] == pytest.approx(
            float(np.median(tail.client_cpu_time.values / tail.step_time.values)), rel=1e-12)


def test_a_replicas_gradient_ranges_are_the_flat_gradient_in_pieces():
    """`data` and `hybrid` hand on ranges of the flat gradient copied one at a time out
    of the parameters' gradients (never the whole flat copy beside them): the ranges,
    end to end, are the parameters' gradients end to end, in any cut, with zeros for a
    parameter that has none (a worker given no rows)."""
    generator = torch.Generator().manual_seed(4)
    params = [torch.zeros(shape, requires_grad=True) for shape in ((3, 4), (5,), (2, 2, 2))]
    for param in params[:2]:
        param.grad = torch.randn(param.shape, generator=generator)
    grads = Gradients([(str(i), p) for i, p in enumerate(params)])
    flat = torch.cat([params[0].grad.reshape(-1), params[1].grad, torch.zeros(8)])
    assert grads.size == flat.numel() == 25
    for cuts in ([0, 25], [0, 12, 25], [0, 3, 13, 17, 25], [0, 0, 25]):
        pieces = [grads.range(a, b) for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat(pieces), flat)
        assert all(piece.data_ptr() != params[0].grad.data_ptr() for piece in pieces if
                   piece.numel())  # copies: the parameters' gradients can go
