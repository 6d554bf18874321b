"""The shard path's compute against plain autograd's, in one process, on one thread.

What `single` (and every `kernel` worker) computes a step, the network's conv layers
as `ConvShard`s holding all their kernels and the `DenseHead`, against the same step
as plain PyTorch runs it (`nn.Sequential`, autograd, torch's SGD): no Dask, no
workspace, no dataset. Also autograd with the workers' max-pool (tasks/pooling.py),
as `data` and `hybrid` replicas compute. Rounds are interleaved and timed in the thread's CPU time
(`time.thread_time`), so that other processes on a shared machine disturb the
comparison little; the ratio is taken per round and its median printed, with the
shard path's time per piece. `--channels-last` adds autograd on channels-last
tensors (faster here, but not plain PyTorch's bits: docs/benchmarks.md).

    python -m benchmarks.shard_compute --net small --batch 128
    python -m benchmarks.shard_compute --net paper --batch 32 --rounds 3
"""

from __future__ import annotations

import argparse
import copy
import time
from statistics import median
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.nets import NETS, net_path
from pipeline.config.run_config import load_run_config
from tasks.conv_shard import ConvShard
from tasks.dense_head import DenseHead
from tasks.network import build_network
from tasks.optim import make_sgd
from tasks.specs import NetworkSpec, ShardRange
from tasks.worker_state import configure_process




def autograd_step(network: NetworkSpec, optimizer, x: torch.Tensor, y: torch.Tensor,
                  channels_last: bool = False, fast_pool: bool = False) -> Callable[[], None]:
    """One plain PyTorch step (the reference's arithmetic) as a closure; ``fast_pool``:
    with the workers' pool (tasks/pooling.py), as `data` and `hybrid` replicas run it."""
    model = build_network(network, fast_pool)
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(
            memory_format=torch.channels_last)
    sgd = make_sgd(model.parameters(), optimizer)

    def step() -> None:
        sgd.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        sgd.step(0)
    return step


def shard_step(network: NetworkSpec, optimizer, x: torch.Tensor, y: torch.Tensor,
               pieces: dict[str, float]) -> Callable[[], None]:
    """One step as `single` runs it (tasks/kernel_ops.py), less its I/O; adds each
    piece's thread seconds into `pieces`."""
    weights = {k: v.detach().numpy().copy() for k, v in build_network(network)
               .state_dict().items()}
    shards = []
    for layer, spec in enumerate(network.conv):
        key = network.conv_keys()[layer]
        mine = {name: weights[f"{key}.{name}"] for name in ("weight", "bias")}
        shards.append(ConvShard(spec, ShardRange(layer, 0, spec.kernels), key, mine,
                                {k: np.zeros_like(v) for k, v in mine.items()}, optimizer,
                                "cpu"))
    head = DenseHead(network, optimizer, weights,
                     {k: np.zeros_like(v) for k, v in weights.items()}, "cpu")

    def timed(name: str, work: Callable[[], object]) -> object:
        start = time.thread_time()
        out = work()
        pieces[name] = pieces.get(name, 0.0) + time.thread_time() - start
        return out

    def step() -> None:
        a = x
        for layer, shard in enumerate(shards):
            a = timed(f"forward {layer}", lambda s=shard, a=a, l=layer: s.forward(a, l > 0))
        _, grad = timed("dense head", lambda: head.step(a, y))
        for layer in reversed(range(len(shards))):
            grad = timed(f"backward {layer}",
                         lambda s=shards[layer], g=grad: s.input_gradient(g))
            timed(f"update {layer}", shards[layer].update)
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--net", choices=sorted(NETS), default="small")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--channels-last", action="store_true")
    args = parser.parse_args()
    configure_process(1)
    config = load_run_config(net_path(args.net), [f"train.batch={args.batch}"])
    network = config.network_spec((3, 32, 32))
    optimizer = config.optimizer_spec()
    generator = torch.Generator().manual_seed(0)
    dtype = getattr(torch, network.dtype)
    x = torch.randn(args.batch, 3, 32, 32, generator=generator, dtype=dtype)
    y = torch.randint(0, network.classes, (args.batch,), generator=generator)
    pieces: dict[str, float] = {}
    steps = {"autograd": autograd_step(network, optimizer, x, y),
             "autograd, workers' pool": autograd_step(network, optimizer, x, y, fast_pool=True),
             "shard path": shard_step(network, optimizer, copy.deepcopy(x), y, pieces)}
    if args.channels_last:
        steps["autograd channels-last"] = autograd_step(network, optimizer, x, y, True)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for name, step in steps.items():
            start = time.thread_time()
            step()
            if round_:
                times[name].append(time.thread_time() - start)
        if not round_:
            pieces.clear()
    print(f"{args.net} network, batch {args.batch}, one thread, {args.rounds} interleaved "
          "rounds, thread CPU seconds (median):")
    for name, values in times.items():
        ratio = median(v / a for v, a in zip(values, times["autograd"]))
        print(f"  {name:24s} {median(values):.4f} s   {ratio:.3f}x autograd")
    print("  shard path by piece (mean): " + ", ".join(
        f"{name} {seconds / args.rounds:.4f}" for name, seconds in pieces.items()))


if __name__ == "__main__":
    main()
