"""The in-process reference's constants: plain PyTorch in this process.

`strategy: reference` trains the whole network in the client's process with
`reference.threads` threads; its prediction needs each conv layer's forward and
backward as they run inside whole steps, the rest of a step (dense head, loss,
SGD), and a batch read.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from pipeline.probe.results import MasterProbe
from pipeline.probe.timings import ShardTiming
from pipeline.probe.robust import estimate
from pipeline.placement.split import rough_seconds
from storage.datasets.store import open_dataset_info
from storage.datasets.reader import read_batch
from tasks.network import build_network
from tasks.specs import NetworkSpec
from tasks.worker_state import configure_process


def probe_master(network: NetworkSpec, batch: int, threads: int = 1,
                 dataset: str | None = None) -> MasterProbe:
    """Time whole training steps of the plain network in this process with ``threads``
    torch threads (what ``strategy: reference`` runs), split by layer
    (:func:`time_network`). The process's torch thread count is restored afterwards.
    """
    before = torch.get_num_threads()
    configure_process(threads)
    try:
        rows = time_network(network, batch, dataset, threads)
        timings = []
        for i, layer in enumerate(network.conv):
            f, b = (estimate([[row[n][i] for row in rows]]) for n in (0, 1))
            total = estimate([[row[0][i] + row[1][i] for row in rows]])
            both = f.value + b.value
            timings.append(ShardTiming(i, layer.kernels, 1, f.value, b.value, 0.0, 1,
                                       total.samples, min(total.low, both),
                                       max(total.high, both)))
        rest = estimate([[row[2] for row in rows]])
        read_s = time_dataset(dataset, batch, 5) if dataset else None
    finally:
        torch.set_num_threads(before)
    return MasterProbe(threads, batch, rest.value, timings, read_s, created=time.time(),
                       dense_low_s=rest.low, dense_high_s=rest.high)


def time_dataset(path: str, batch: int, repeats: int) -> float:
    """Median seconds of one random batch through ``read_batch`` (warm cache, as in training)."""
    samples = open_dataset_info(path).train_samples
    rng = np.random.default_rng(1)
    times = []
    for _ in range(repeats + 1):
        indices = rng.choice(samples, size=min(batch, samples), replace=batch > samples)
        t0 = time.perf_counter()
        read_batch(path, "train", indices)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:]))


def repeats_for(seconds: float) -> tuple[int, bool]:
    """Repeats and whether to warm up, for a measurement of about ``seconds``."""
    if seconds < 0.05:
        return 5, True
    if seconds < 0.5:
        return 3, True
    if seconds < 3.0:
        return 2, True
    return 1, False


def time_network(network: NetworkSpec, batch: int, dataset: str | None = None,
                 threads: int = 1) -> list[tuple[list[float], list[float], float]]:
    """Per step timed: per-layer forward and backward seconds inside it, and the rest.

    Timed per conv layer within real steps of the plain ``nn.Sequential``
    (as ``strategy: reference`` trains it), so that each layer meets the
    memory state a real step leaves it (timing layers alone in a loop reads
    10-15 % fast).  Hooks stamp the clock where each conv block's forward
    starts and ends and where the gradient reaches each block's output and
    input.  The rest (dense head, loss, both passes, and the SGD step over all
    parameters) is the third value.  One row per step after a warm-up.
    """
    if not network.plain:
        raise ValueError("the probe times the paper family's layers only")
    torch.manual_seed(0)
    model = _sequential(network)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, weight_decay=5e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    blocks, index = [], 0
    for layer in network.conv:
        size = 3 if layer.pool > 1 else 2
        blocks.append((model[index], model[index + size - 1]))
        index += size
    if dataset:
        samples = open_dataset_info(dataset).train_samples
        images, labels = read_batch(dataset, "train", np.arange(batch) % samples)
        x, y = torch.from_numpy(images), torch.from_numpy(labels)
    else:
        first = network.conv[0]
        x = torch.randn(batch, first.in_channels, first.in_height, first.in_width,
                        dtype=getattr(torch, network.dtype))
        y = torch.randint(0, network.classes, (batch,))
    stamps: dict[str, float] = {}
    outputs: list[torch.Tensor] = []

    def stamp(name: str) -> Any:
        def hook(*_: Any) -> None:
            stamps[name] = time.perf_counter()
        return hook

    handles = []
    for i, (first_module, last_module) in enumerate(blocks):
        handles.append(first_module.register_forward_pre_hook(stamp(f"f{i}")))

        def keep(module: Any, inputs: Any, output: torch.Tensor, i: int = i) -> None:
            stamps[f"F{i}"] = time.perf_counter()
            outputs.append(output)
            if output.requires_grad:
                output.register_hook(stamp(f"g{i}"))  # the gradient reached block i's output
        handles.append(last_module.register_forward_hook(keep))
    seconds = rough_seconds(network.conv[-1], batch, network.conv[-1].kernels) / threads
    repeats, warmup = repeats_for(seconds)
    rows = []
    try:
        for attempt in range(repeats + (1 if warmup else 0)):
            outputs.clear()
            stamps.clear()
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            optimizer.step()
            t3 = time.perf_counter()
            if warmup and not attempt:
                continue
            L = len(blocks)
            fwd = [stamps[f"F{i}"] - stamps[f"f{i}"] for i in range(L)]
            # block i's backward: from the gradient at its output to the gradient at its
            # input (the output of block i - 1), the first block until backward returns
            ends = [stamps[f"g{i - 1}"] if i else t2 for i in range(L)]
            bwd = [ends[i] - stamps[f"g{i}"] for i in range(L)]
            rest = (t3 - t0) - sum(fwd) - sum(bwd)
            rows.append((fwd, bwd, rest, t1))
    finally:
        for handle in handles:
            handle.remove()
    return [(fwd, bwd, rest) for fwd, bwd, rest, _ in rows]


def _sequential(network: NetworkSpec) -> torch.nn.Sequential:
    """The paper family's network as an nn.Sequential (conv, ReLU, max-pool per layer,
    flatten, dense): its blocks are module ranges that hooks can time. The weights are
    `build_network`'s (the same modules made in the same order)."""
    model = build_network(network)
    modules: list[torch.nn.Module] = []
    for layer, conv in zip(network.conv, model.convs):
        modules += [conv, torch.nn.ReLU()]
        if layer.pool > 1:
            modules.append(torch.nn.MaxPool2d(layer.pool))
    modules.append(torch.nn.Flatten())
    for j, linear in enumerate(model.linears):
        modules.append(linear)
        if j < len(model.linears) - 1:
            modules.append(torch.nn.ReLU())
    return torch.nn.Sequential(*modules)
