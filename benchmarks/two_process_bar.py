"""The bar for kernel parallelism on this machine: a layer whole, and halved in two processes.

Times the largest conv layer's forward, backward and SGD update in plain processes
with one torch thread each: all its kernels in one process, then half of them in
each of two processes at once, the way two workers hold them. No Dask, no
workspace: the best two single-thread devices can do here on that layer. Repeats
are interleaved and the ratio taken per repeat (the machine's speed drifts).

    python -m benchmarks.two_process_bar --net paper --batch 32
    python -m benchmarks.two_process_bar --net small --batch 128 --rounds 7
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from statistics import median

import numpy as np
import torch

from benchmarks.nets import NETS, net_path
from pipeline.config.run_config import load_run_config
from tasks.conv_shard import ConvShard
from tasks.specs import ConvLayerSpec, OptimizerSpec, ShardRange
from tasks.worker_state import configure_process




def time_shard(spec: ConvLayerSpec, batch: int, kernels: int, rounds: int) -> list[float]:
    """Seconds of `rounds` forward + backward + update rounds after one warm-up."""
    configure_process(1)
    rng = np.random.default_rng(0)
    weights = {"weight": (0.05 * rng.standard_normal(
        (kernels, spec.in_channels, spec.kernel_size, spec.kernel_size))).astype("float32"),
               "bias": np.zeros(kernels, "float32")}
    momentum = {k: np.zeros_like(v) for k, v in weights.items()}
    shard = ConvShard(spec, ShardRange(0, 0, kernels), "bar", weights, momentum,
                      OptimizerSpec(), "cpu")
    x = torch.from_numpy(rng.standard_normal(
        (batch, spec.in_channels, spec.in_height, spec.in_width)).astype("float32"))
    grad = torch.ones(batch, kernels, spec.out_height, spec.out_width)
    times = []
    for attempt in range(rounds + 1):
        start = time.perf_counter()
        shard.forward(x, input_grad=True)
        shard.input_gradient(grad)
        shard.update(0)
        if attempt:
            times.append(time.perf_counter() - start)
    return times


def _worker(args: tuple) -> list[float]:
    return time_shard(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--net", choices=sorted(NETS), default="paper")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = load_run_config(net_path(args.net), [f"train.batch={args.batch}"])
    network = config.network_spec((3, 32, 32))
    layer = max(network.conv, key=lambda spec: spec.macs(args.batch, spec.kernels))
    half = layer.kernels // 2
    whole, pairs, ratios = [], [], []
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        for repeat in range(args.repeats):
            alone = median(pool.apply(_worker, ((layer, args.batch, layer.kernels,
                                                 args.rounds),)))
            both = pool.map(_worker, [(layer, args.batch, half, args.rounds)] * 2)
            pair = max(median(times) for times in both)  # the slower of the two
            whole.append(alone)
            pairs.append(pair)
            ratios.append(alone / pair)
            print(f"repeat {repeat}: whole layer {alone:.4f} s, halves in two processes "
                  f"{pair:.4f} s, ratio {alone / pair:.3f}", flush=True)
    print(f"\n{args.net} network, batch {args.batch}: layer {layer.in_channels}->{layer.kernels}"
          f" (forward + backward + update), {args.rounds} rounds, {args.repeats} repeats")
    print(f"  whole layer, one process:        median {median(whole):.4f} s")
    print(f"  half each, two processes at once: median {median(pairs):.4f} s (the slower)")
    print(f"  best speedup of this layer on two processes: {median(ratios):.3f} "
          f"(spread {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
