"""The in-process reference's constants: plain PyTorch in this process.

`strategy: reference` trains the whole network in the client's process with
`reference.threads` threads; its prediction needs each conv layer's forward and
backward as they run inside whole steps, the rest of a step (dense head, loss,
SGD), and a batch read.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch

from pipeline.probe.results import MasterProbe
from pipeline.probe.timings import ShardTiming
from pipeline.probe.robust import estimate
from pipeline.placement.split import rough_seconds
from pipeline.engine.heap import heap_frozen
from storage.datasets.store import open_dataset_info
from storage.datasets.reader import read_batch
from tasks.network import SpecNetwork, build_network, set_dropout
from tasks.optim import torch_sgd
from tasks.specs import NetworkSpec, OptimizerSpec
from tasks.worker_state import configure_process


#: The SGD the reference probe steps with where it is not told the run's: the
#: config's defaults (the learning rate changes no time).
DEFAULT_OPTIMIZER = OptimizerSpec(lr=1e-3)

#: A burst of load on the machine (a page-cache flush, another process) lasts tens to
#: hundreds of milliseconds and can cover every step of a short round: a 2-thread probe
#: of the small network once read 38 % slow with all five of its 22 ms steps inside one.
#: So a round shorter than SHORT_ROUND_S is one of REFERENCE_ROUNDS, ROUND_GAP_S apart,
#: and each figure is the median of the rounds' medians, as in the cluster's probe
#: (pipeline/probe/robust.py).
SHORT_ROUND_S, REFERENCE_ROUNDS, ROUND_GAP_S = 0.5, 3, 0.2


def probe_master(network: NetworkSpec, batch: int, threads: int = 1,
                 dataset: str | None = None,
                 optimizer: OptimizerSpec = DEFAULT_OPTIMIZER) -> MasterProbe:
    """Time whole training steps of the plain network in this process with ``threads``
    torch threads and the run's ``optimizer`` (what ``strategy: reference`` runs), split
    by layer (:func:`time_network`), each figure the median of its rounds' medians
    (`estimate`). The process's torch thread count is restored afterwards.
    """
    before = torch.get_num_threads()
    configure_process(threads)
    try:
        rounds = time_network(network, batch, dataset, threads, optimizer)
        timings = []
        for i, layer in enumerate(network.conv):
            f, b = (estimate([[row[n][i] for row in rows] for rows in rounds]) for n in (0, 1))
            total = estimate([[row[0][i] + row[1][i] for row in rows] for rows in rounds])
            both = f.value + b.value
            timings.append(ShardTiming(i, layer.kernels, 1, f.value, b.value, 0.0, len(rounds),
                                       total.samples, min(total.low, both),
                                       max(total.high, both)))
        rest = estimate([[row[2] for row in rows] for rows in rounds])
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


def rounds_for(seconds: float, repeats: int) -> int:
    """Rounds of `repeats` steps of about ``seconds`` each: `REFERENCE_ROUNDS` where a
    round lasts under `SHORT_ROUND_S` (one burst of load can cover all its steps), else
    one (a burst then covers one step of a round, which its median absorbs)."""
    return REFERENCE_ROUNDS if seconds * repeats < SHORT_ROUND_S else 1


def time_network(network: NetworkSpec, batch: int, dataset: str | None = None,
                 threads: int = 1, optimizer: OptimizerSpec = DEFAULT_OPTIMIZER
                 ) -> list[list[tuple[list[float], list[float], float]]]:
    """Rounds (`rounds_for`) of steps timed: per step, per-layer forward and backward
    seconds inside it, and the rest.

    Timed per conv layer within real steps of the network as ``strategy: reference``
    trains it (the paper family as a plain ``nn.Sequential``, any other network as
    `build_network`'s), so that each layer meets the memory state a real step leaves
    it (timing layers alone in a loop reads 10-15 % fast). Hooks stamp the clock
    where each layer's forward starts and ends and where its backward starts and ends
    (`_chain_hooks`, `_graph_hooks`). The rest (dense head, loss, both passes, and the
    SGD step over all parameters) is the third value. One row per step after a
    warm-up (before the first round only).
    """
    torch.manual_seed(0)
    model = _sequential(network) if network.plain else build_network(network)
    sgd = torch_sgd(model.parameters(), optimizer)
    loss_fn = torch.nn.CrossEntropyLoss()
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
    hooks = _chain_hooks if network.plain else _graph_hooks
    handles, layer_times = hooks(network, model, stamps)
    seconds = rough_seconds(network.conv[-1], batch, network.conv[-1].kernels) / threads
    repeats, warmup = repeats_for(seconds)
    rounds: list[list[tuple[list[float], list[float], float]]] = []
    step = 0
    try:
        with heap_frozen():  # as the training loop's steps run
            for round_index in range(rounds_for(seconds, repeats)):
                if round_index:
                    time.sleep(ROUND_GAP_S)
                rows = []
                for attempt in range(repeats + (1 if warmup and not round_index else 0)):
                    stamps.clear()
                    set_dropout(model, 0, step)  # each step its masks, as in training
                    step += 1
                    t0 = time.perf_counter()
                    sgd.zero_grad(set_to_none=True)
                    loss = loss_fn(model(x), y)
                    loss.backward()
                    t2 = time.perf_counter()
                    sgd.step()
                    t3 = time.perf_counter()
                    if warmup and not round_index and not attempt:
                        continue
                    fwd, bwd = layer_times(t2)
                    rows.append((fwd, bwd, (t3 - t0) - sum(fwd) - sum(bwd)))
                rounds.append(rows)
    finally:
        for handle in handles:
            handle.remove()
    return rounds


#: Per conv layer, its forward and backward seconds in the step just run, given the
#: moment backward returned.
LayerTimes = Callable[[float], tuple[list[float], list[float]]]


def _stamp(stamps: dict[str, float], name: str) -> Callable[..., None]:
    def hook(*_: Any) -> None:
        stamps[name] = time.perf_counter()
    return hook


def _chain_hooks(network: NetworkSpec, model: torch.nn.Sequential, stamps: dict[str, float]
                 ) -> tuple[list[Any], LayerTimes]:
    """The paper family's blocks (conv, ReLU, max-pool) as module ranges: a block's
    forward from its first module's start to its last's end; its backward from the
    gradient at its output to the gradient at its input (the output of the block
    before; the first block's until backward returns)."""
    blocks, index = [], 0
    for layer in network.conv:
        size = 3 if layer.pool > 1 else 2
        blocks.append((model[index], model[index + size - 1]))
        index += size
    handles, outputs = [], []  # the step's block outputs, held until the next step's
    for i, (first_module, last_module) in enumerate(blocks):
        handles.append(first_module.register_forward_pre_hook(_stamp(stamps, f"f{i}")))

        def keep(module: Any, inputs: Any, output: torch.Tensor, i: int = i) -> None:
            stamps[f"F{i}"] = time.perf_counter()
            if not i:
                outputs.clear()
            outputs.append(output)
            if output.requires_grad:
                output.register_hook(_stamp(stamps, f"g{i}"))  # grad at block i's output
        handles.append(last_module.register_forward_hook(keep))

    def layer_times(backward_end: float) -> tuple[list[float], list[float]]:
        count = len(blocks)
        fwd = [stamps[f"F{i}"] - stamps[f"f{i}"] for i in range(count)]
        ends = [stamps[f"g{i - 1}"] if i else backward_end for i in range(count)]
        return fwd, [ends[i] - stamps[f"g{i}"] for i in range(count)]

    return handles, layer_times


def _graph_hooks(network: NetworkSpec, model: SpecNetwork, stamps: dict[str, float]
                 ) -> tuple[list[Any], LayerTimes]:
    """Any network's layers (`SpecNetwork.layer_output`: conv, batch norm, residual sum,
    ReLU, poolings): a layer's forward is its `layer_output` call; its backward runs
    from the gradient at its output to its conv's weight gradient, which autograd makes
    in the same node as the input gradient and hands to the weight's hook at once.
    Autograd runs a layer's nodes one after another (a later layer's are never ready
    in between), so the stamps bound that layer's backward alone."""
    handles = [conv.weight.register_hook(_stamp(stamps, f"w{l}"))
               for l, conv in enumerate(model.convs)]
    layer_output = model.layer_output

    def timed(layer: int, x: torch.Tensor, outputs: list[torch.Tensor | None]) -> torch.Tensor:
        stamps[f"f{layer}"] = time.perf_counter()
        z = layer_output(layer, x, outputs)
        stamps[f"F{layer}"] = time.perf_counter()
        if z.requires_grad:
            z.register_hook(_stamp(stamps, f"g{layer}"))
        return z

    model.layer_output = timed  # type: ignore[method-assign]  # this model's only

    def layer_times(backward_end: float) -> tuple[list[float], list[float]]:
        count = len(network.conv)
        return ([stamps[f"F{l}"] - stamps[f"f{l}"] for l in range(count)],
                [stamps[f"w{l}"] - stamps[f"g{l}"] for l in range(count)])

    return handles, layer_times


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
