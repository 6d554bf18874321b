"""What a worker's first autograd backward adds to its resident memory.

A `kernel` shard computes its gradients with direct `convolution_backward` calls
(tasks/conv_shard.py); only the dense head (on the master) and a replica (`data`,
`hybrid`) run autograd's engine. Its first backward allocates what the engine keeps
for the process's life, so the master holds a little more than a worker with the
same shards: `MemoryConstants.autograd_runtime` (pipeline/costmodel/memory.py).

Runs, in a fresh process that imported what a worker imports (torch, dask,
distributed, zarr, xarray; one thread), a network's conv layers as full `ConvShard`s
for a few steps, then its `DenseHead` for a few steps, and prints the resident memory
after each; the head's figure less the shards' is the engine's (the head's own
tensors, a few KB on the small network, included). `--repeats` fresh processes.

    python -m benchmarks.autograd_memory --net small --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from benchmarks.nets import NETS, net_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(config_path: str, batch: int, steps: int) -> dict[str, float]:
    """In this process: resident MB at the start, after the shards' steps, after the
    head's."""
    import gc

    import dask  # noqa: F401  (what a worker has imported)
    import distributed  # noqa: F401
    import numpy as np
    import psutil
    import torch
    import xarray  # noqa: F401
    import zarr  # noqa: F401

    from pipeline.config.run_config import load_run_config
    from pipeline.prediction import network_for
    from tasks.conv_shard import ConvShard
    from tasks.dense_head import DenseHead
    from tasks.network import build_network
    from tasks.specs import ShardRange

    torch.set_num_threads(1)

    def rss() -> float:
        gc.collect()
        return psutil.Process().memory_info().rss / 1e6

    config = load_run_config(config_path, [f"train.batch={batch}"])
    spec, optimizer = network_for(config), config.optimizer_spec()
    weights = {k: v.detach().numpy().copy() for k, v in build_network(spec).state_dict().items()}
    figures = {"start": rss()}
    shards = []
    for l, layer in enumerate(spec.conv):
        key = spec.conv_keys()[l]
        own = {name: weights[f"{key}.{name}"] for name in ("weight", "bias")}
        shards.append(ConvShard(layer, ShardRange(l, 0, layer.kernels), key, own,
                                {k: np.zeros_like(v) for k, v in own.items()}, optimizer, "cpu"))
    first = spec.conv[0]
    x0 = torch.randn(batch, first.in_channels, first.in_height, first.in_width)
    for _ in range(steps):
        x = x0
        for l, shard in enumerate(shards):
            x = shard.forward(x, input_grad=l > 0)
        grad = torch.ones_like(x)
        for l in reversed(range(len(shards))):
            grad = shards[l].input_gradient(grad)
            shards[l].update(0)
    figures["shards"] = rss()
    dense = {f"{n}.{name}" for n in spec.dense_names for name in ("weight", "bias")}
    head = DenseHead(spec, optimizer, {k: weights[k] for k in dense},
                     {k: np.zeros_like(weights[k]) for k in dense}, "cpu")
    labels = torch.zeros(batch, dtype=torch.long)
    for _ in range(steps):
        head.step(x.detach(), labels)
    figures["head"] = rss()
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--net", choices=sorted(NETS), default="small")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    config = net_path(args.net)
    if args.child:
        print(json.dumps(measure(config, args.batch, args.steps)))
        return
    added = []
    for _ in range(args.repeats):
        child = [sys.executable, "-m", "benchmarks.autograd_memory", "--child", "--net",
                 args.net, "--batch", str(args.batch), "--steps", str(args.steps)]
        out = subprocess.run(child, cwd=ROOT, check=True, capture_output=True, text=True).stdout
        figures = json.loads(out.strip().splitlines()[-1])
        added.append(figures["head"] - figures["shards"])
        print(f"start {figures['start']:.1f} MB, after the shards {figures['shards']:.1f}, "
              f"after the head {figures['head']:.1f}: the head added {added[-1]:.1f} MB",
              flush=True)
    added.sort()
    print(f"median the head added: {added[len(added) // 2]:.1f} MB ({args.net}, batch "
          f"{args.batch}, {args.repeats} fresh processes)")


if __name__ == "__main__":
    main()
