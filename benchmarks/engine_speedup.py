"""Benchmark: the engine's step time against plain PyTorch, and calibrated vs even.

Prints figures; it is not a test (this machine is shared and noisy). Every ratio is
measured within one invocation, the runs of each repeat interleaved (in the listed
order in even repeats and reversed in odd ones, so that a drift of the machine over
a pair of repeats favours no run), and reported as the median over repeats with the
spread (min-max) of the per-repeat ratios and an interval for the median
(`median_interval`; with under 6 repeats, the spread). `strategies` ends with
its targets: each ratio's median against its bound, and whether its interval crosses
it. benchmarks/side_by_side.py times the same contenders kept warm, in bursts.

    python -m benchmarks.engine_speedup speedup --net small --batch 128
    python -m benchmarks.engine_speedup speedup --net paper --batch 32 --no-single
    python -m benchmarks.engine_speedup emulated --net small --batch 128

`speedup`: `reference` (plain PyTorch in one process) with 1 and 2 threads, `single`
on one single-thread worker, `kernel` on 2 single-thread workers (tasks waiting for
each other through ready markers, the default), and the same through Dask
dependencies (`workspace.sync=scheduler`, unless `--no-scheduler`).
`emulated`: 2 workers, one emulated at half speed: calibrated split vs even split.
`mixed`: a fast worker alone against it beside a worker emulated 20x slower (what a
CPU beside a GPU looks like to the placement), calibrated and even: the mix must
not be slower than its best single device (docs/benchmarks.md, "CPUs and GPUs in one run").
`strategies`: every strategy side by side on 2 workers (`reference` with 1 and 2
threads, `single`, `kernel`, `data`, `hybrid`) and the peer users compare against,
PyTorch DDP over gloo with 2 processes (benchmarks/ddp_peer.py). With
`--task-per-step`, `single`, `kernel`, `data` and `hybrid` run a second time with
`train.steps_per_task=1` (a Dask task per step, as before tasks held several steps):
what sharing Dask's per-task costs over a task's steps gains, in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from statistics import median

from benchmarks.nets import NETS, net_path
from benchmarks.ddp_peer import measure_ddp
from pipeline.config.run_config import load_run_config
from pipeline.run import run_training




def measure(net: str, batch: int, steps: int, overrides: list[str], workdir: str) -> float:
    """Median step time (warm-up step excluded) of one run."""
    config = load_run_config(net_path(net), [
        f"train.batch={batch}", f"train.steps={steps}", "train.warmup_steps=1",
        "train.eval_samples=0", "progress=false", "train.checkpoint_every=0",
        f"output={tempfile.mkdtemp(dir=workdir)}", *overrides])
    return run_training(config).summary["step_time_median"]


#: The confidence of `median_interval`.
CONFIDENCE = 0.95


def median_interval(values: list[float], confidence: float = CONFIDENCE
                    ) -> tuple[float, float]:
    """A distribution-free interval for the median of what `values` sample: the
    order statistics ``x(k)`` and ``x(n+1-k)`` for the largest ``k`` whose chance
    that the median lies outside, ``2 * P(Binomial(n, 1/2) < k)``, is at most
    ``1 - confidence``. Too few values for any such ``k`` (fewer than 6 at 95 %):
    their whole range."""
    ordered, n = sorted(values), len(values)
    k, below = 0, 0.0  # below: P(Binomial(n, 1/2) < k + 1)
    while k < n // 2:
        below += math.comb(n, k) / 2 ** n
        if 2 * below > 1 - confidence:
            break
        k += 1
    if k == 0:
        return ordered[0], ordered[-1]
    return ordered[k - 1], ordered[n - k]


def ratio_report(name: str, baseline: list[float], candidate: list[float]) -> dict:
    """Per-repeat ratios ``baseline / candidate``: their median, range and the
    median's `median_interval`."""
    ratios = [b / c for b, c in zip(baseline, candidate)]
    low, high = median_interval(ratios)
    return {"ratio": name, "median": median(ratios), "min": min(ratios), "max": max(ratios),
            "low": low, "high": high}


def run_order(names: list[str], repeat: int) -> list[str]:
    """The runs of one repeat: as listed in even repeats, reversed in odd ones."""
    return list(names) if repeat % 2 == 0 else list(reversed(names))


#: The targets for `strategies`, per network: (ratio name, "<=" or ">=", bound).
TARGETS: dict[str, list[tuple[str, str, float]]] = {
    "small": [("single step time / reference 1 thread", "<=", 1.05),
              ("kernel speedup over reference 1 thread", ">=", 1.6),
              ("kernel vs reference 2 threads", ">=", 0.95),
              ("data step time / DDP-gloo's", "<=", 1.0),
              ("hybrid step time / DDP-gloo's", "<=", 1.0)],
    "paper": [("kernel step time / DDP-gloo's", "<=", 1.0),
              ("data step time / DDP-gloo's", "<=", 0.95)],
    "resnet20": [("kernel step time / DDP-gloo's", "<=", 1.0),
                 ("data step time / DDP-gloo's", "<=", 1.0),
                 ("hybrid step time / DDP-gloo's", "<=", 1.0)],
    "vgg11": [("kernel speedup over reference 1 thread", ">=", 1.6),
              ("kernel vs reference 2 threads", ">=", 0.95),
              ("kernel step time / DDP-gloo's", "<=", 1.0),
              ("data step time / DDP-gloo's", "<=", 1.0),
              ("hybrid step time / DDP-gloo's", "<=", 1.0)],
}


Target = tuple[str, str, float]


def target_lines(targets: list[Target], reports: list[dict]) -> list[str]:
    """Each target (e.g. ``TARGETS[net]``): the median against the bound, and the
    verdict: it holds (the median's 95 % interval too: `median_interval`), holds at
    the median while the interval crosses the bound, or misses."""
    by_name = {r["ratio"]: r for r in reports}
    lines = []
    for name, sense, bound in targets:
        r = by_name.get(name)
        if r is None:
            continue
        good = (lambda v: v <= bound) if sense == "<=" else (lambda v: v >= bound)
        verdict = ("holds, and so does the median's interval" if good(r["low"]) and
                   good(r["high"]) else
                   "holds at the median; its interval crosses the bound" if good(r["median"])
                   else "misses")
        lines.append(f"  target {name} {sense} {bound}: {r['median']:.3f} "
                     f"(interval {r['low']:.3f}-{r['high']:.3f}): {verdict}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("case", choices=["speedup", "emulated", "strategies", "mixed"])
    parser.add_argument("--net", choices=sorted(NETS), default="small")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per run, the first excluded (default: 4 paper, 12 small)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--no-single", action="store_true", help="leave out `single`")
    parser.add_argument("--no-scheduler", action="store_true",
                        help="leave out `kernel` through the scheduler")
    parser.add_argument("--task-per-step", action="store_true",
                        help="strategies: also each strategy at train.steps_per_task=1")
    args = parser.parse_args()
    steps = args.steps or (4 if args.net == "paper" else 12)
    if args.case == "speedup":
        runs = {"reference-1-thread": ["strategy=reference", "reference.threads=1"],
                "reference-2-threads": ["strategy=reference", "reference.threads=2"],
                "single-1-worker": ["strategy=single", "cluster.workers=1"],
                "kernel-2-workers": ["strategy=kernel", "cluster.workers=2"],
                "kernel-2-scheduler": ["strategy=kernel", "cluster.workers=2",
                                       "workspace.sync=scheduler"]}
        if args.no_single:
            del runs["single-1-worker"]
        if args.no_scheduler:
            del runs["kernel-2-scheduler"]
    elif args.case == "strategies":
        runs = {"reference-1-thread": ["strategy=reference", "reference.threads=1"],
                "reference-2-threads": ["strategy=reference", "reference.threads=2"],
                "single": ["strategy=single", "cluster.workers=1"],
                **{name: [f"strategy={name}", "cluster.workers=2"]
                   for name in ("kernel", "data", "hybrid")},
                "ddp-gloo-2": None}
        if args.no_single:
            del runs["single"]
        if args.task_per_step:
            runs.update({f"{name}-task-per-step": [*runs[name], "train.steps_per_task=1"]
                         for name in ("single", "kernel", "data", "hybrid") if name in runs})
    elif args.case == "mixed":
        pair = '[{name: fast, speed: 1.0}, {name: slow-emulated, speed: 0.05}]'
        runs = {"fast-alone": ["strategy=kernel", "cluster.workers=[{name: fast}]"],
                "mix-calibrated": ["strategy=kernel", "placement=calibrated",
                                   f"cluster.workers={pair}"],
                "mix-even": ["strategy=kernel", "placement=even", f"cluster.workers={pair}"]}
    else:
        pair = '[{name: fast, speed: 1.0}, {name: slow-emulated, speed: 0.5}]'
        runs = {"even": ["strategy=kernel", "placement=even", f"cluster.workers={pair}"],
                "calibrated": ["strategy=kernel", "placement=calibrated",
                               f"cluster.workers={pair}"]}
    times: dict[str, list[float]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as workdir:
        for repeat in range(args.repeats):
            for name in run_order(list(runs), repeat):
                overrides = runs[name]
                seconds = (measure_ddp(args.net, args.batch, steps) if overrides is None
                           else measure(args.net, args.batch, steps, overrides, workdir))
                times[name].append(seconds)
                print(f"repeat {repeat}: {name:22s} median step {seconds:.4f} s", flush=True)
    print(f"\n{args.case}: {args.net} network, batch {args.batch}, {steps} steps per run "
          f"(1 warm-up), {args.repeats} repeats")
    for name, values in times.items():
        print(f"  {name:22s} median {median(values):.4f} s  (runs: "
              + ", ".join(f"{v:.4f}" for v in values) + ")")
    if args.case == "speedup":
        one, two = times["reference-1-thread"], times["reference-2-threads"]
        reports = [ratio_report("kernel vs reference 1 thread (speedup)", one,
                                times["kernel-2-workers"]),
                   ratio_report("kernel vs reference 2 threads", two, times["kernel-2-workers"])]
        if "single-1-worker" in times:
            reports.append(ratio_report("single step time / reference 1 thread",
                                        times["single-1-worker"], one))
        if "kernel-2-scheduler" in times:
            reports.append(ratio_report("kernel through the scheduler / with ready markers",
                                        times["kernel-2-scheduler"], times["kernel-2-workers"]))
    elif args.case == "strategies":
        one, ddp = times["reference-1-thread"], times["ddp-gloo-2"]
        reports = [ratio_report(f"{name} speedup over reference 1 thread", one, times[name])
                   for name in runs if name != "reference-1-thread"]
        reports.append(ratio_report("kernel vs reference 2 threads",
                                    times["reference-2-threads"], times["kernel"]))
        if "single" in times:
            reports.append(ratio_report("single step time / reference 1 thread",
                                        times["single"], one))
        reports += [ratio_report(f"{name} step time / DDP-gloo's", times[name], ddp)
                    for name in ("data", "hybrid", "kernel")]
        reports += [ratio_report(f"{name} step time, auto / a task per step", times[name],
                                 times[f"{name}-task-per-step"])
                    for name in ("single", "kernel", "data", "hybrid")
                    if f"{name}-task-per-step" in times]
    elif args.case == "mixed":
        reports = [ratio_report("mix, calibrated / fast alone step time",
                                times["mix-calibrated"], times["fast-alone"]),
                   ratio_report("mix, even / fast alone step time", times["mix-even"],
                                times["fast-alone"])]
    else:
        reports = [ratio_report("calibrated / even step time", times["calibrated"],
                                times["even"])]
    for r in reports:
        print(f"  {r['ratio']}: {r['median']:.3f} (spread {r['min']:.3f}-{r['max']:.3f}, "
              f"interval {r['low']:.3f}-{r['high']:.3f})")
    if args.case == "strategies":
        print("\n".join(target_lines(TARGETS.get(args.net, []), reports)))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"args": vars(args), "times": times, "ratios": reports}, handle, indent=2)


if __name__ == "__main__":
    main()
