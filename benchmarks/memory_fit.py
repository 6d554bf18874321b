"""Measured peak memory per process of a run, beside the model's prediction.

``python -m benchmarks.memory_fit CONFIG... [--runs NAME ...] [--steps N] [--set K=V ...]
[--out FILE]``, or ``--compare FILE [--fit]``

Runs `python -m pipeline.train CONFIG` once per case (`CASES`: reference, single,
kernel/2, kernel/3 and kernel/4 even, data/2 and hybrid/2 even; batch 32 unless
`--set train.batch=...`), samples the resident memory of
the training process and of every worker process it spawned (psutil, every 20 ms),
and keeps each process's peak. Beside it: the peak the model predicts (the
strategy's `peak_memory`, pipeline/costmodel/memory.py) for the same split, and the
error against the measured *working* memory (the peak minus the bare process of its kind,
as the run's own summary measures it: a forked worker's or the client's,
`pipeline.records.memory.machine_memory_constants`; each measurement keeps the two it
was taken beside, and an older one without them is read against this machine's).
The worker processes' names cannot be told from outside, so measured and predicted
peaks are compared largest to largest. `--out` appends the
measurements as JSON lines; `--compare FILE...` compares them with the model again, and
with `--fit` searches `FIT_GRID` for the `MemoryConstants` that put the most figures
within 15 % (then the smallest largest error), and compares with those. Repeats of one
case (the same config and arguments, in any of the files) are compared as their
median, rank by rank
(`median_of_repeats`): one process's peak moves by up to 15 % between runs of the
same code (glibc's heap), so a single run can put a figure outside 15 % either way.

Not a timed test: a paper-network case takes a minute or two on two cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

from pipeline.config.run_config import load_run_config
from pipeline.costmodel.memory import MB, MemoryConstants, element_bytes
from pipeline.records.library_pages import evict_library_pages
from pipeline.records.memory import machine_memory_constants
from pipeline.cluster.embedded import is_worker_process
from pipeline.prediction import network_for
from pipeline.probe.tables import model_network
from pipeline.strategies import strategy_named

#: The constants `--fit` tries (MemoryConstants' factors): those of the code and glibc's
#: allocator alone; every other one is measured on the machine at hand
#: (`machine_memory_constants`: the bare processes, the runtimes, the conv workspace).
FIT_GRID = {
    "retention": [1.0 + r / 20 for r in range(0, 17)],
    "load_retained": [0.0, 0.25, 0.5, 0.75, 1.0],
}

#: name -> (strategy, workers, extra overrides)
CASES = {
    "reference": ("reference", 1, []),
    "single": ("single", 1, []),
    "kernel/2": ("kernel", 2, ["placement=even"]),
    "kernel/3": ("kernel", 3, ["placement=even"]),
    "kernel/4": ("kernel", 4, ["placement=even"]),
    "data/2": ("data", 2, ["placement=even"]),
    "hybrid/2": ("hybrid", 2, ["placement=even"]),
}


def sample_tree(process: subprocess.Popen, period: float = 0.02) -> dict[int, dict]:
    """Peak RSS of `process` and each of its descendants until it exits:
    pid -> {"peak": bytes, "cmd": str, "worker": bool, "first_seen": s}."""
    root = psutil.Process(process.pid)
    peaks: dict[int, dict] = {}
    start = time.monotonic()
    while process.poll() is None:
        try:
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            break
        for proc in procs:
            try:
                rss = proc.memory_info().rss
                entry = peaks.get(proc.pid)
                if entry is None:
                    entry = peaks[proc.pid] = {"peak": 0, "cmd": " ".join(proc.cmdline()),
                                               "worker": is_worker_process(proc),
                                               "first_seen": time.monotonic() - start}
                entry["peak"] = max(entry["peak"], rss)
            except psutil.Error:
                continue
        time.sleep(period)
    return peaks


def measure_case(config_path: str, name: str, steps: int, extra: list[str]) -> dict:
    """Run one case (the environment's libraries first dropped from the page cache:
    `pipeline.records.library_pages.evict_library_pages`); the peak RSS (bytes) of the
    training process and of each worker."""
    strategy, workers, overrides = CASES[name]
    evict_library_pages()
    with tempfile.TemporaryDirectory() as tmp:
        args = [f"strategy={strategy}", f"cluster.workers={workers}", f"train.steps={steps}",
                f"output={tmp}/run", "train.eval_samples=0", "train.checkpoint_every=0",
                "progress=false", *overrides, *extra]
        command = [sys.executable, "-m", "pipeline.train", config_path, *args]
        env = {**os.environ, "CNN_PREDICT_PROBE": "never"}
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   env=env, text=True)
        peaks = sample_tree(process)
        output = process.stdout.read() if process.stdout else ""
        if process.wait() != 0:
            raise SystemExit(f"{name}: run failed:\n{output[-2000:]}")
    client = peaks.pop(process.pid)
    here = machine_memory_constants()
    worker_peaks = [v["peak"] for _, v in sorted(peaks.items(),
                                                 key=lambda kv: kv[1]["first_seen"])
                    if v["worker"]]
    return {"config": config_path, "case": name, "args": args, "client": client["peak"],
            "workers": worker_peaks,
            "baselines": {"client": here.baseline, "worker": here.worker_baseline}}


@functools.lru_cache(maxsize=None)
def _case(config_path: str, args: tuple[str, ...], name: str) -> tuple:
    """A measured case's strategy, network, batch, split and element size."""
    strategy, workers, _ = CASES[name]
    config = load_run_config(config_path, list(args))
    spec = network_for(config)
    split, _ = strategy_named(strategy).even_split(config, spec, workers)
    return (strategy, model_network(config, spec), config.train.batch, split,
            element_bytes(spec.dtype))


def median_of_repeats(measurements: list[dict]) -> list[dict]:
    """One measurement per case: repeats of the same config and arguments (the output
    folder apart) merged into their median, the client's and each worker rank's
    (largest to largest, as `compare` matches them); ``repeats`` says how many."""
    groups: dict[tuple, list[dict]] = {}
    for m in measurements:
        args = tuple(a for a in m["args"] if not a.startswith("output="))
        groups.setdefault((m["config"], m["case"], args), []).append(m)
    merged = []
    for runs in groups.values():
        # a run whose sampling missed a short-lived worker has fewer: its ranks still count
        ordered = [sorted(m["workers"], reverse=True) for m in runs]
        ranks = max(len(w) for w in ordered)
        merged.append({**runs[0], "client": statistics.median(m["client"] for m in runs),
                       "workers": [statistics.median(w[r] for w in ordered if len(w) > r)
                                   for r in range(ranks)],
                       "repeats": len(runs)})
    return merged


def beside(measured: dict, constants: MemoryConstants) -> MemoryConstants:
    """`constants` on the bare processes the measurement was taken beside (where it
    kept them; else as they are)."""
    kept = measured.get("baselines") or {}
    return dataclasses.replace(constants, baseline=kept.get("client", constants.baseline),
                               worker_baseline=kept.get("worker", constants.worker_baseline))


def compare(measured: dict, constants: MemoryConstants | None = None) -> dict:
    """The model's peak per device for a measured case, and its error on working memory
    (`constants`: this machine's by default, on the measurement's own baselines)."""
    strategy, network, batch, split, s = _case(measured["config"], tuple(measured["args"]),
                                               measured["case"])
    constants = beside(measured, constants or machine_memory_constants())
    footprint = strategy_named(strategy).peak_memory(network, batch, split, s,
                                                     constants=constants)
    # each device's peak with the bare process the model counted for it (the client's
    # for reference, a worker's otherwise): working memory is the peak less that
    predicted = sorted(zip(footprint.per_device, (p["baseline"] for p in footprint.parts)),
                       reverse=True)
    # the worker processes' names are not known from outside: largest to largest
    # (a worker the nanny restarted shows as one more process: the largest are kept)
    have_all = sorted([measured["client"]] if not strategy_named(strategy).uses_cluster
                      else measured["workers"],
                      reverse=True)[:len(predicted)]
    rows = []
    for d, (have, (want, base)) in enumerate(zip(have_all, predicted)):
        working, model = have - base, want - base
        rows.append({"device": d, "measured_mb": have / MB, "working_mb": working / MB,
                     "predicted_mb": want / MB, "predicted_working_mb": model / MB,
                     "error": (model - working) / working})
    return {"case": measured["case"], "config": measured["config"], "batch": batch,
            "client_mb": measured["client"] / MB, "devices": rows,
            "repeats": measured.get("repeats", 1)}


#: The bound the model aims for on a figure's error: `fit` keeps the most figures within it.
WITHIN = 0.15


def _score(errors: list[float]) -> tuple[int, float]:
    """Higher is better: figures within `WITHIN`, then the smaller largest error."""
    return (sum(e <= WITHIN for e in errors), -max(errors, default=0.0))


def fit(measurements: list[dict]) -> tuple[MemoryConstants, float]:
    """The grid's constants that put the most measured figures within `WITHIN`, of
    those the one with the smallest largest error, with every constant measured on
    this machine as it measures it (`FIT_GRID`); and that largest error.

    Why not the smallest largest error alone: one figure that moves by a quarter
    between repeats (the small network's `single` at batch 128: 140-155 MB working)
    would then pull every other figure its way."""
    here = machine_memory_constants()
    best: tuple[tuple[int, float], MemoryConstants] | None = None
    for values in itertools.product(*FIT_GRID.values()):
        constants = dataclasses.replace(here, **dict(zip(FIT_GRID, values)))
        score = _score([abs(row["error"]) for m in measurements
                        for row in compare(m, constants)["devices"]])
        if best is None or score > best[0]:
            best = (score, constants)
    assert best is not None
    return best[1], -best[0][1]


def show(result: dict) -> None:
    for row in result["devices"]:
        print(f"{result['config']} b{result['batch']} {result['case']:10s} "
              f"(x{result['repeats']}) device {row['device']}: measured "
              f"{row['measured_mb']:7.1f} MB (working {row['working_mb']:6.1f}), model "
              f"{row['predicted_mb']:7.1f} (working {row['predicted_working_mb']:6.1f}), "
              f"error {100 * row['error']:+.1f} %", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", help="run configs (YAML)")
    parser.add_argument("--runs", nargs="*", default=list(CASES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="", help="append the measurements (JSON lines)")
    parser.add_argument("--set", nargs="*", default=["train.batch=32"],
                        help="dotted overrides for every case")
    parser.add_argument("--compare", nargs="*", default=[], help="only compare the "
                        "measurements in these JSON-lines files with the model (repeats "
                        "of a case as their median)")
    parser.add_argument("--fit", action="store_true", help="with --compare: the grid's "
                        "constants (FIT_GRID) with the most figures within 15 %%, and the "
                        "comparison with them")
    args = parser.parse_args(argv)
    if args.compare:
        measurements = []
        for path in args.compare:
            with open(path, encoding="utf-8") as handle:
                measurements += [json.loads(line) for line in handle if line.strip()]
        measurements = median_of_repeats(measurements)
        constants = machine_memory_constants()
        if args.fit:
            constants, worst = fit(measurements)
            print(f"fitted: {constants} (largest error {100 * worst:.1f} %)")
        errors = []
        for measured in measurements:
            result = compare(measured, constants)
            show(result)
            errors += [abs(row["error"]) for row in result["devices"]]
        print(f"{sum(e <= WITHIN for e in errors)} of {len(errors)} figures within 15 %, "
              f"largest error {100 * max(errors):.1f} %")
        return
    for config in args.configs:
        for name in args.runs:
            measured = measure_case(config, name, args.steps, args.set)
            if args.out:
                with open(args.out, "a", encoding="utf-8") as handle:
                    handle.write(json.dumps(measured) + "\n")
            print(json.dumps(measured), flush=True)


if __name__ == "__main__":
    main()
