"""Benchmark: memory per worker against plain PyTorch, and where it goes.

Prints figures; it is not a test. Each case is one `python -m pipeline.train` in a
fresh process with its own embedded cluster (fresh worker processes: nothing an
earlier case allocated is still held), the paper network by default, and reads the
run's summary: each worker's peak resident memory over the steps and its working
memory (the peak less a bare process that has imported torch, numpy, dask, zarr
and xarray: pipeline/records/memory.py), against `reference` (plain PyTorch in one process).

    python -m benchmarks.memory                        # paper, batch 32, 3 steps
    python -m benchmarks.memory --cases reference single kernel/2 --keep runs/mem
    python -m benchmarks.memory --from runs/mem        # print again, no runs

Measured beside the peak: "held", the working memory the worker held when it
started its step task (after its freed pages were handed back: what it keeps
between steps, weights and momentum among it), and "step's own", the peak less
that (what a step allocates on top: activations, gradients, exchange copies,
library buffers). The breakdown after them is a count, not a measurement: what its share of
the work must hold at its fullest moment, from the network's shapes and the run's
split (weights, their gradients, SGD momentum; the tensors a forward keeps for its
backward; the exchange's copies: a layer input gathered from the other shards and
the full-size partial input gradient). What the measured working memory holds
beyond the count ("rest") is the library's workspace (oneDNN's buffers, the
allocator's pools and fragmentation), Python objects, and whatever the
implementation holds that the method does not need.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from pipeline.config.run_config import load_run_config
from pipeline.strategies import strategy_named
from pipeline.strategies.base import network_for
from tasks.specs import NetworkSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MB = 1e6
DEFAULT_CASES = ["reference", "single", "kernel/2", "kernel/4", "data/2"]
TARGETS = {"kernel/2": 0.6, "kernel/4": 0.4, "single": 1.1, "data/2": 0.8}


def case_overrides(case: str) -> list[str]:
    """`strategy[/workers][:placement]` as config overrides."""
    name, _, placement = case.partition(":")
    strategy, _, workers = name.partition("/")
    overrides = [f"strategy={strategy}"]
    if workers:
        overrides.append(f"cluster.workers={int(workers)}")
    if placement:
        overrides.append(f"placement={placement}")
    return overrides


def run_case(config: str, case: str, batch: int, steps: int, out: str) -> dict:
    """One run in a fresh process; its summary."""
    overrides = [*case_overrides(case), f"train.batch={batch}", f"train.steps={steps}",
                 "train.eval_samples=0", "train.checkpoint_every=0", "progress=false",
                 "prediction=never", f"output={out}"]
    done = subprocess.run([sys.executable, "-m", "pipeline.train", config, *overrides],
                          cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT})
    if done.returncode != 0:
        raise SystemExit(f"{case}: the run failed:\n{done.stderr[-2000:]}")
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as handle:
        return json.load(handle)


def conv_params(spec, kernels: int) -> int:
    return kernels * (spec.in_channels * spec.kernel_size ** 2 + 1)


def dense_params(network: NetworkSpec) -> int:
    widths = [network.flat_features, *network.hidden, network.classes]
    return sum((a + 1) * b for a, b in zip(widths, widths[1:]))


def kept_for_backward(spec, batch: int, kernels: int, itemsize: int) -> int:
    """A conv shard's forward keeps what plain PyTorch's autograd keeps: its input,
    the ReLU's output (the conv output's, in place), the pool's indices (int64), and
    the pooled output (the next layer's input)."""
    conv = batch * kernels * spec.conv_height * spec.conv_width
    pooled = batch * kernels * spec.out_height * spec.out_width
    layer_input = batch * spec.in_channels * spec.in_height * spec.in_width
    return itemsize * (layer_input + conv + pooled) + 8 * pooled


def count(network: NetworkSpec, batch: int, kernels: list[int], head: bool,
          exchanged: bool, itemsize: int = 4) -> dict[str, float]:
    """What a worker holding `kernels` of each conv layer (and the head, if `head`) on
    `batch` samples must hold, in bytes (module doc)."""
    params = sum(conv_params(spec, k) for spec, k in zip(network.conv, kernels))
    params += dense_params(network) if head else 0
    activations = sum(kept_for_backward(spec, batch, k, itemsize)
                      for spec, k in zip(network.conv, kernels) if k)
    exchange = 0
    if exchanged:  # the gathered input of each upper layer; the partial input gradient
        exchange = sum(itemsize * batch * spec.in_channels * spec.in_height * spec.in_width
                       for spec, k in zip(network.conv[1:], kernels[1:]) if k)
    return {"weights": 2 * itemsize * params, "momentum": itemsize * params,
            "activations": activations, "exchange": exchange}


def breakdowns(config: str, case: str, batch: int, summary: dict) -> dict[str, dict]:
    """The count of each worker of a case's run (weights here include gradients)."""
    run = load_run_config(os.path.join(ROOT, config), case_overrides(case))
    network = network_for(run)
    layers = [spec.kernels for spec in network.conv]
    strategy = strategy_named(case.split("/")[0].split(":")[0])
    workers = list(summary["memory_peak"])
    if not strategy.uses_cluster or strategy.one_worker:  # the whole network in one place
        return {w: count(network, batch, layers, True, False) for w in workers}
    if strategy.split_unit == "kernel":
        split = summary[strategy.split_key]  # per layer, kernels per worker
        names = summary.get("split_workers", workers)
        return {w: count(network, batch, [row[i] for row in split], w == summary["master"],
                         True) for i, w in enumerate(names)}
    shares = summary.get("batch_split") or [batch // len(workers)] * len(workers)
    names = summary.get("split_workers", workers)
    out = {}
    for i, w in enumerate(names):
        held = count(network, shares[i], layers, True, False)
        params = sum(conv_params(s, k) for s, k in zip(network.conv, layers)) + \
            dense_params(network)
        held["exchange"] = 2 * 4 * params / len(names) + 4 * params  # flat grad + sums
        out[w] = held
    return out


def report(config: str, batch: int, results: dict[str, dict]) -> str:
    """The table: per case and worker, peak and working MB, the ratio to reference's
    working memory, the count and the rest."""
    base = results.get("reference", {}).get("memory_working", {}).get("reference")
    lines = [f"memory per worker, {config}, batch {batch} (MB; working = peak less a bare "
             f"process of {next(iter(results.values()))['memory_baseline'] / MB:.0f} MB)",
             "| case | worker | peak | working | vs reference | held | step's own | "
             "weights+grads | momentum | activations | exchange | rest |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for case, summary in results.items():
        counts = breakdowns(config, case, batch, summary)
        for worker, peak in summary["memory_peak"].items():
            working = summary["memory_working"][worker]
            held = counts.get(worker, {})
            rest = working - sum(held.values()) if held else float("nan")
            ratio = f"{working / base:.2f}x" if base else "-"
            target = TARGETS.get(case.split(":")[0])
            if target is not None and base:
                ratio += " ok" if working / base <= target else f" (target {target}x)"
            held_at = summary.get("memory_held", {}).get(worker)
            held_cells = ("- | - | " if held_at is None else
                          f"{(held_at - summary['memory_baseline']) / MB:.0f} | "
                          f"{(peak - held_at) / MB:.0f} | ")
            lines.append(
                f"| {case} | {worker} | {peak / MB:.0f} | {working / MB:.0f} | {ratio} | "
                + held_cells
                + " | ".join(f"{held.get(k, 0) / MB:.0f}" for k in
                             ("weights", "momentum", "activations", "exchange"))
                + f" | {rest / MB:.0f} |")
        if summary.get("client_memory_peak") and case != "reference":
            lines.append(f"| {case} | client | {summary['client_memory_peak'] / MB:.0f} | "
                         f"{summary['client_memory_working'] / MB:.0f} | | | | | | | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/paper.yaml")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES,
                        help="strategy[/workers][:placement], e.g. kernel/2:even")
    parser.add_argument("--keep", help="keep the runs (and their summaries) here")
    parser.add_argument("--from", dest="source", help="print the runs kept in this folder")
    args = parser.parse_args()
    results = {}
    folder = args.source or args.keep or tempfile.mkdtemp(prefix="memory-bench-")
    for case in args.cases:
        out = os.path.join(folder, case.replace("/", "-").replace(":", "-"))
        if args.source:
            with open(os.path.join(out, "summary.json"), encoding="utf-8") as handle:
                results[case] = json.load(handle)
        else:
            results[case] = run_case(args.config, case, args.batch, args.steps, out)
            print(f"{case}: done", file=sys.stderr, flush=True)
    print(report(args.config, args.batch, results))


if __name__ == "__main__":
    main()
