"""Timing functions of the probe: what runs on a worker, in this process, or as tasks.

Pure measurements returning plain numbers (:mod:`pipeline.probe` turns them into
the probe's records and the cost model's objects): a conv shard's forward and
backward in a loop (:func:`time_shard`), each conv layer inside whole steps of the
plain network (:func:`time_network`), Zarr accesses (:func:`time_store`), a batch
read (:func:`time_dataset`), the engine's step graph with sleeping tasks
(:func:`skeleton_step`), and the non-negative least-squares fits used on them.
Worker-side functions import nothing from ``pipeline`` but this module.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, Sequence

import numpy as np
import torch

from tasks.conv_shard import conv_relu_pool
from tasks.specs import ConvLayerSpec, NetworkSpec

#: Rough single-thread conv rate, used only to budget how long a measurement takes.
BUDGET_FLOPS = 100e9


def time_shard(spec: ConvLayerSpec, batch: int, kernels: int, dtype: str, input_grad: bool,
               repeats: int, warmup: bool = True, deps: Sequence[Any] = ()) -> dict:
    """Median forward and backward seconds of a shard, as `conv_shard` computes them.

    Forward: conv + ReLU + pool on an input that requires grad (layers > 0).
    Backward: ``autograd.grad`` from a gradient array, then an SGD-with-momentum
    step, like ``conv_backward``.  The worker's emulated slowness is added,
    as the real tasks add it.
    """
    from tasks.worker_state import current_profile

    profile = current_profile()
    torch_dtype = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, spec.in_channels, spec.in_height, spec.in_width,
                    generator=generator, dtype=torch_dtype).to(profile.device)
    weight = (0.05 * torch.randn(kernels, spec.in_channels, spec.kernel_size,
                                 spec.kernel_size, generator=generator, dtype=torch_dtype)
              ).to(profile.device).requires_grad_(True)
    bias = torch.zeros(kernels, dtype=torch_dtype, device=profile.device, requires_grad=True)
    optimizer = torch.optim.SGD([weight, bias], lr=1e-3, momentum=0.9, weight_decay=5e-4)
    grad = np.ones((batch, kernels, spec.out_height, spec.out_width), dtype=dtype)
    forward, backward = [], []
    for attempt in range(repeats + (1 if warmup else 0)):
        sync = torch.cuda.synchronize if profile.device == "cuda" else (lambda: None)
        t0 = time.perf_counter()
        xi = x.detach().requires_grad_(input_grad)
        with torch.enable_grad():
            y = conv_relu_pool(xi, weight, bias, spec)
        sync()
        t1 = time.perf_counter()
        fwd = t1 - t0
        fwd += profile.emulate(fwd)
        t1 = time.perf_counter()
        g = torch.from_numpy(grad).to(profile.device)
        grads = torch.autograd.grad(y, [weight, bias] + ([xi] if input_grad else []),
                                    grad_outputs=g)
        weight.grad, bias.grad = grads[0], grads[1]
        optimizer.step()
        sync()
        bwd = time.perf_counter() - t1
        bwd += profile.emulate(bwd)
        if attempt or not warmup:
            forward.append(fwd)
            backward.append(bwd)
    return {"forward_s": float(np.median(forward)), "backward_s": float(np.median(backward))}


def time_store(path: str, arrays: Sequence[str], repeats: int, which: str = "all",
               deps: Sequence[Any] = ()) -> list[list[float]]:
    """Time reads and writes of Zarr arrays the master created: ``[dir, chunks, bytes, s]``.

    Accesses, per array: the whole array, its first half of channel chunks,
    one chunk (writes are chunk-aligned, as the engine's are).  ``which``:
    ``"all"``, or ``"full"`` (whole-array accesses only: the concurrency probe).
    ``dir`` is 0 for reads, 1 for writes.
    """
    from storage.arrays import open_cached

    rows: list[list[float]] = []
    for name in arrays:
        array = open_cached(path, name)
        shape, chunk = array.shape, array.chunks
        n_chunks = math.ceil(shape[1] / chunk[1])
        spans = [n_chunks] if which == "full" else sorted({n_chunks, max(1, n_chunks // 2), 1})
        for span in spans:
            stop = min(shape[1], span * chunk[1])
            selection = (slice(None), slice(0, stop))
            data = np.random.default_rng(0).standard_normal(
                (shape[0], stop, *shape[2:])).astype(array.dtype)
            for direction in (1, 0):
                times = []
                for _ in range(repeats + 1):
                    t0 = time.perf_counter()
                    if direction:
                        array[selection] = data
                    else:
                        array[selection]
                    times.append(time.perf_counter() - t0)
                rows.append([direction, span, data.nbytes, float(np.median(times[1:]))])
    return rows


def time_dataset(path: str, batch: int, repeats: int, deps: Sequence[Any] = ()) -> float:
    """Median seconds of one random batch through ``read_batch`` (warm cache, as in training)."""
    from storage.datasets import open_dataset_info, read_batch

    samples = open_dataset_info(path).train_samples
    rng = np.random.default_rng(1)
    times = []
    for _ in range(repeats + 1):
        indices = rng.choice(samples, size=min(batch, samples), replace=batch > samples)
        t0 = time.perf_counter()
        read_batch(path, "train", indices)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:]))


def noop(*args: Any, deps: Sequence[Any] = ()) -> int:
    """A trivial task (its deps arrive as arguments, as the engine's receipts do)."""
    return 0


def repeats_for(seconds: float) -> tuple[int, bool]:
    """Repeats and whether to warm up, for a measurement of about ``seconds``."""
    if seconds < 0.05:
        return 5, True
    if seconds < 0.5:
        return 3, True
    if seconds < 3.0:
        return 2, True
    return 1, False


def estimate_s(spec: ConvLayerSpec, batch: int, kernels: int) -> float:
    out_px = spec.conv_height * spec.conv_width
    macs = batch * out_px * kernels * spec.in_channels * spec.kernel_size ** 2
    return 3 * 2 * macs / BUDGET_FLOPS


def time_network(network: NetworkSpec, batch: int, dataset: str | None = None,
                 threads: int = 1) -> tuple[list[float], list[float], float]:
    """Per-layer forward and backward seconds inside whole training steps, and the rest.

    Timed per conv layer within real steps of the plain ``nn.Sequential``
    (as ``strategy: reference`` trains it), so that each layer meets the
    memory state a real step leaves it (timing layers alone in a loop reads
    10-15 % fast).  Hooks stamp the clock where each conv block's forward
    starts and ends and where the gradient reaches each block's output and
    input.  The rest (dense head, loss, both passes, and the SGD step over all
    parameters) is the third value.  Medians over steps after a warm-up.
    """
    from pipeline.network import build_sequential

    torch.manual_seed(0)
    model = build_sequential(network)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, weight_decay=5e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    blocks, index = [], 0
    for layer in network.conv:
        size = 3 if layer.pool > 1 else 2
        blocks.append((model[index], model[index + size - 1]))
        index += size
    if dataset:
        from storage.datasets import open_dataset_info, read_batch

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
    seconds = estimate_s(network.conv[-1], batch, network.conv[-1].kernels) / threads
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
    forward = [float(np.median([r[0][i] for r in rows])) for i in range(len(blocks))]
    backward = [float(np.median([r[1][i] for r in rows])) for i in range(len(blocks))]
    return forward, backward, float(np.median([r[2] for r in rows]))


def time_dense(head: torch.nn.Module, network: NetworkSpec, batch: int,
                repeats: int = 7) -> float:
    """Median seconds of the dense head's forward, backward and SGD step (DenseHead.step)."""
    dtype = getattr(torch, network.dtype)
    features = torch.randn(batch, network.flat_features, dtype=dtype)
    labels = torch.randint(0, network.classes, (batch,))
    optimizer = torch.optim.SGD(head.parameters(), lr=1e-3, momentum=0.9, weight_decay=5e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        x = features.detach().clone().requires_grad_(True)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(head(x), labels)
        loss.backward()
        optimizer.step()
        x.grad.numpy()
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:]))


class Submitter:
    """Pinned, impure submissions with unique keys (as the engine submits)."""

    def __init__(self, client: Any, slots: Sequence[Any]) -> None:
        self.client, self.slots = client, list(slots)
        self.tag = uuid.uuid4().hex[:8]
        self.count = 0

    def __call__(self, function: Any, index: int, *args: Any, **kwargs: Any) -> Any:
        slot = self.slots[index]
        self.count += 1
        return self.client.submit(function, *args, workers=[slot.address],
                                  resources={slot.resource: 1}, allow_other_workers=False,
                                  pure=False, key=f"probe-{function.__name__}-{self.tag}-"
                                  f"{self.count}", **kwargs)


def nonneg_fit(rows: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (dropping negative ones, refitting)."""
    keep = list(range(rows.shape[1]))
    coef = np.zeros(rows.shape[1])
    while keep:
        solution, *_ = np.linalg.lstsq(rows[:, keep], t, rcond=None)
        if (solution >= 0).all():
            coef[keep] = solution
            return coef
        keep.pop(int(np.argmin(solution)))
    return coef


def fit_store(rows: Sequence[Sequence[float]], direction: int) -> tuple[float, float, float]:
    """``(latency, per-chunk s, bandwidth B/s)`` from ``time_store`` rows of one direction."""
    data = np.array([r for r in rows if int(r[0]) == direction], dtype=float)
    design = np.stack([np.ones(len(data)), data[:, 1], data[:, 2]], axis=1)
    latency, chunk, per_byte = nonneg_fit(design, data[:, 3])
    if per_byte <= 0:  # degenerate fit: charge the bytes instead of the chunks
        per_byte = float(np.median(data[:, 3] / data[:, 2]))
    return float(latency), float(chunk), float(1.0 / per_byte)


def fit_overhead(skeleton: Sequence[Sequence[float]], round_trip: float, layers: int
                 ) -> tuple[float, float]:
    """``(hop, task)`` so that the model's Dask overhead reproduces the measured steps.

    The cost model charges a step ``round_trip + (2L - 1) hop + 2 L P task``
    (:mod:`pipeline.costmodel.kernel`); this fits it (non-negative least
    squares) to the orchestration time of engine steps with ``P = 1..n``
    workers (:func:`skeleton_step`), with the round trip measured alone.
    With one worker there is one equation: it all goes to ``hop``.
    """
    ps = np.array([p for p, _ in skeleton], float)
    rest = np.maximum(np.array([t for _, t in skeleton], float) - round_trip, 0.0)
    hops = max(2 * layers - 1, 1)
    if len(ps) < 2:
        return float(rest[0]) / hops, 0.0
    hop, task = nonneg_fit(np.stack([np.full_like(ps, hops), 2 * layers * ps], axis=1), rest)
    return float(hop), float(task)


def clock_task(*args: Any, deps: Sequence[Any] = ()) -> tuple[float, float]:
    """A trivial task that reports when it started and ended (wall clock)."""
    start = time.time()
    return start, time.time()


def sleep_task(seconds: float, deps: Sequence[Any] = ()) -> float:
    """Sleep: a gate for a chain, or a stand-in task that takes time but no CPU."""
    time.sleep(seconds)
    return seconds


def skeleton_step(client: Any, slots: Sequence[Any], layers: int, steps: int = 8,
                  task_s: float = 0.01) -> float:
    """Orchestration seconds of one engine step: its task graph with sleeping tasks.

    Mirrors ``KernelParallelEngine.step``: submit the forward levels (each
    task on the level below and its own previous backward), gather them with
    the pending backward, then submit the backward levels top-down and
    return.  Every task sleeps ``task_s`` (no CPU taken), so that, as in
    training, the next submissions overlap running tasks; the ``2 L``
    sleeps on the critical path are subtracted from the median step.
    """
    submit = Submitter(client, slots)
    previous_backward: dict[tuple[int, int], Any] = {}
    pending: list[Any] = []
    ends = []
    last = time.perf_counter()
    for _ in range(steps + 1):
        forward: list[list[Any]] = []
        for layer in range(layers):
            below = forward[layer - 1] if layer else []
            own = [previous_backward[(layer, i)] if (layer, i) in previous_backward else None
                   for i in range(len(slots))]
            forward.append([submit(sleep_task, i, task_s,
                                   deps=below + ([own[i]] if own[i] is not None else []))
                            for i in range(len(slots))])
        client.gather(pending + [f for level in forward for f in level])
        above: list[Any] = []
        pending = []
        for layer in reversed(range(layers)):
            current = [submit(sleep_task, i, task_s, deps=above) for i in range(len(slots))]
            for i, future in enumerate(current):
                previous_backward[(layer, i)] = future
            pending += current
            above = current
        now = time.perf_counter()
        ends.append(now - last)
        last = now
    client.gather(pending)
    return max(float(np.median(ends[1:])) - 2 * layers * task_s, 0.0)
