"""Benchmark: seconds per `predict` call by strategy and device count.

Scaling sweeps predict clusters of up to thousands of devices, so a point must cost
about as much at 4096 devices as at 8. For each strategy and device count this
prints the median of a few calls on equal `gpu`-preset devices (an A100-class GPU,
experiments/scaling/hardware.py) over 10 Gb/s links, at the scaling sweep's options
(experiments/configs/scaling.yaml) and batch 8192 (so data and hybrid are feasible
at 4096 devices): the default path, and for ``kernel`` the op-by-op reference
simulation (``Options(timeline="reference")``) up to ``--reference-max`` devices
(it grows with the square of the device count: minutes at 1024).

    python -m benchmarks.predict_speed
    python -m benchmarks.predict_speed --network alexnet --store --reference-max 64
    python -m benchmarks.predict_speed --network resnet50 --strategies kernel --devices 1024 4096

``--network``: the cost model's own ``marques`` (500/1500) or ``alexnet``, or any other
zoo preset (tasks/zoo.py) at 3x224x224, 1000 classes (a layer graph for the ResNets).

To time an older pipeline/costmodel (one without ``Options.timeline``: it then times
that one's only path), copy this file into that tree's benchmarks/ and run it there
the same way. Not a test: this machine has 2 cores shared with other work.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from statistics import median
from typing import Callable

from pipeline.costmodel import (DeviceSpec, LinkSpec, Network, Options, StoreSpec,
                                alexnet, marques_cifar, predict)
from pipeline.probe.tables import costmodel_network
from pipeline.strategies import strategy_named
from tasks.zoo import PRESETS, build_preset

STRATEGIES = ("single", "kernel", "data", "hybrid")
DEVICES = (8, 64, 512, 1024, 4096)
#: The `gpu` preset of experiments/scaling/hardware.py (not imported: the model alone is timed).
GPU = DeviceSpec(flops=1.95e13, mem_bw=1.555e12, conv_efficiency=0.6, dense_efficiency=0.8,
                 mem_efficiency=0.8, name="gpu")
LINK = LinkSpec.from_bandwidth(10e9 / 8, latency=5e-6)
STORE = StoreSpec(write_bw=5e9, read_bw=5e9, latency=1e-4)
SCALING = dict(split="proportional", allreduce="ring", overlap=True, scheme="b",
               dense_batch="worker")
HAS_REFERENCE = "timeline" in {f.name for f in dataclasses.fields(Options)}


def seconds_per_call(call: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of `repeats` calls (one where a call is slow)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
        if times[-1] > 2.0:
            break
    return median(times)


def network_named(name: str) -> Network:
    """The cost model's network `name`: its own marques or alexnet, else the zoo preset's
    at ImageNet size."""
    if name in ("marques", "alexnet"):
        return alexnet() if name == "alexnet" else marques_cifar()
    return costmodel_network(build_preset(name, (3, 224, 224), 1000, "float32"))


def _row(strategy: str, p: int, args: argparse.Namespace) -> list[str]:
    network = network_named(args.network)
    store = STORE if args.store else None
    devices = [GPU] * p

    def run(**extra: str) -> float:
        options = Options(**SCALING, **extra)
        return seconds_per_call(
            lambda: predict(strategy, network, args.batch, devices, LINK, store, options),
            args.repeats)

    fast = run()
    reference = "-"
    # the reference timeline is the kernel split's over several devices
    kernel_split = strategy_named(strategy)
    if kernel_split.split_unit == "kernel" and not kernel_split.one_worker \
            and HAS_REFERENCE and p <= args.reference_max:
        reference = f"{run(timeline='reference'):.4f}"
    return [strategy, str(p), f"{fast:.4f}", reference]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--network", choices=PRESETS, default="marques")
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--store", action="store_true",
                        help="through a shared store (data and hybrid then follow the "
                             "engine's ops; slow beyond a few dozen devices)")
    parser.add_argument("--devices", type=int, nargs="+", default=list(DEVICES))
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--reference-max", type=int, default=512,
                        help="largest device count to time kernel's reference simulation at")
    args = parser.parse_args(argv)
    print(f"# predict() seconds per call, median of {args.repeats}: {args.network}, batch "
          f"{args.batch}, gpu preset, 10 Gb/s links, {'store' if args.store else 'no store'}")
    print("| strategy | devices | seconds | kernel reference (s) |")
    print("|---|---:|---:|---:|")
    for strategy in args.strategies:
        for p in args.devices:
            print("| " + " | ".join(_row(strategy, p, args)) + " |", flush=True)


if __name__ == "__main__":
    main()
