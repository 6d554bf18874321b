"""Benchmark: the cost model's predicted step time against measured runs.

For each point (strategy, workers, batch) it trains for a few steps, takes
the median step time (warm-up excluded), and asks the model
(:func:`pipeline.prediction.predict_point`, calibrated by a probe of the
same cluster made just before) for its prediction of the split the run used.
It prints every point and the median absolute prediction error per
strategy.  Not a test: this machine has 2 cores shared with other work, so
figures move from one invocation to the next.

    python -m benchmarks.prediction_error small             # quick-sweep-like points
    python -m benchmarks.prediction_error paper             # the 500/1500 network, batch 32
    python -m benchmarks.prediction_error small --repeats 3 --json out.json

``small``: the 32/64 network at batch 64 and 128: ``reference`` (1 thread),
``single`` and ``kernel`` on embedded clusters of 1 and 2 workers, ``data`` and
``hybrid`` on 2.
``paper``: 500/1500 at batch 32: ``reference`` (1 thread), ``single``, and
``kernel`` on 2 workers (about 11 s per single-thread step, so few steps).
``placement``: the small network at batch 128 on a fast and an emulated
slow worker (speed 0.5, ``--slow``): even, calibrated and model placement,
measured and predicted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import tempfile
import time
from statistics import median

from benchmarks.nets import net_path
from pipeline.cluster.connect import open_client
from pipeline.cluster.worker_setup import register_setup
from pipeline.cluster.workers import find_workers
from pipeline.config.run_config import RunConfig, load_run_config
from pipeline.run import run_training
from pipeline.prediction import network_for, predict_point
from pipeline.probe import cached_master_probe, cached_probe
from pipeline.strategies import strategy_named


PROBE_EACH_RUN = False
SLOW_SPEED = 0.5


def config_for(net: str, batch: int, steps: int, warmup: int, workdir: str,
               overrides: list[str]) -> RunConfig:
    return load_run_config(net_path(net), [
        f"train.batch={batch}", f"train.steps={steps}", f"train.warmup_steps={warmup}",
        "train.eval_samples=0", "progress=false", "train.checkpoint_every=0",
        f"output={tempfile.mkdtemp(dir=workdir)}", *overrides])


def points(case: str) -> list[dict]:
    """The measured points of a case: cluster workers, batch, overrides, label."""
    if case == "small":
        out = []
        for batch in (64, 128):
            out.append(dict(workers=None, batch=batch, strategy="reference",
                            overrides=["strategy=reference", "reference.threads=1"]))
            for workers in (1, 2):
                out.append(dict(workers=workers, batch=batch, strategy="single",
                                overrides=["strategy=single", f"cluster.workers={workers}"]))
                out.append(dict(workers=workers, batch=batch, strategy="kernel",
                                overrides=["strategy=kernel", f"cluster.workers={workers}"]))
            for strategy in ("data", "hybrid"):
                out.append(dict(workers=2, batch=batch, strategy=strategy,
                                overrides=[f"strategy={strategy}", "cluster.workers=2"]))
        return out
    if case == "paper":
        return [dict(workers=None, batch=32, strategy="reference",
                     overrides=["strategy=reference", "reference.threads=1"]),
                dict(workers=2, batch=32, strategy="single",
                     overrides=["strategy=single", "cluster.workers=2"]),
                dict(workers=2, batch=32, strategy="kernel",
                     overrides=["strategy=kernel", "cluster.workers=2"])]
    pair = f"[{{name: fast, speed: 1.0}}, {{name: slow, speed: {SLOW_SPEED}}}]"
    return [dict(workers=pair, batch=128, strategy=f"kernel-{placement}",
                 overrides=["strategy=kernel", f"placement={placement}",
                            f"cluster.workers={pair}"])
            for placement in ("even", "calibrated", "model")]


def run_case(case: str, repeats: int, steps: int, warmup: int, workdir: str) -> list[dict]:
    """Measure and predict every point of ``case``, clusters reused per worker set."""
    net = "paper" if case == "paper" else "small"
    rows = []
    by_cluster: dict[str, list[dict]] = {}
    for point in points(case):
        by_cluster.setdefault(str(point["workers"]), []).append(point)
    for key, group in by_cluster.items():
        if key == "None":
            for point in group:
                rows += measure(net, point, None, None, repeats, steps, warmup, workdir)
            continue
        probe_config = config_for(net, group[0]["batch"], steps, warmup, workdir,
                                  group[0]["overrides"])
        with open_client(probe_config.cluster) as client:
            register_setup(client, probe_config.cluster)
            offered = find_workers(client, probe_config.cluster)
            for point in group:
                rows += measure(net, point, client, offered, repeats, steps, warmup, workdir)
    return rows


def measure(net: str, point: dict, client, offered, repeats: int, steps: int, warmup: int,
            workdir: str) -> list[dict]:
    rows = []
    for repeat in range(repeats):
        config = config_for(net, point["batch"], steps, warmup, workdir, point["overrides"])
        result = run_training(config, client=client, offered=offered)
        # the probe right after the run (the dataset exists now), so that both see about
        # the same load on this shared machine; cached across repeats unless asked not to
        spec = network_for(config)
        fresh = PROBE_EACH_RUN and repeat > 0
        if client is None:
            probe = cached_master_probe(spec, config.train.batch, config.reference.threads,
                                        config.dataset_path, refresh=fresh,
                                        optimizer=config.optimizer_spec())
        else:
            probe = cached_probe(client, offered, spec, config.train.batch,
                                 config.channel_quanta(spec), None, config.dataset_path,
                                 refresh=fresh, batch_norm=config.train.batch_norm)
        summary = result.summary
        prediction = predict_point(config, summary, probe)
        # what the model gave before it took replicas' conv trunks from the probe's
        # replica plan (their layer tables instead): same run, same probe
        tables = None
        if getattr(probe, "workers", None) and any(w.trunk for w in probe.workers):
            bare = dataclasses.replace(probe, workers=[dataclasses.replace(w, trunk=None)
                                                       for w in probe.workers])
            tables = predict_point(config, summary, bare)["predicted_step_time"]
        row = {"strategy": point["strategy"], "batch": point["batch"],
               "workers": len(summary.get("split_workers", [])),  # 0: in this process
               "repeat": repeat, "measured": summary["step_time_median"],
               "predicted": prediction["predicted_step_time"],
               "low": prediction["predicted_low"], "high": prediction["predicted_high"],
               "predicted_from_tables": tables,
               "error": prediction["prediction_error"],
               "split": summary.get("kernel_split"), "load": os.getloadavg()[0],
               "probe_key": probe.key, "probe_s": getattr(probe, "seconds", 0.0),
               "breakdown": {k: v for k, v in prediction["breakdown"].items()
                             if k != "compute"},
               "measured_breakdown": {k: summary[k] for k in (
                   "compute_time_median", "storage_time_median", "master_time_median",
                   "wait_time_median")}}
        rows.append(row)
        print(f"{row['strategy']:18s} workers {row['workers']} batch {row['batch']:4d} "
              f"measured {row['measured']:.4f} s  predicted {row['predicted']:.4f} s "
              f"[{row['low']:.4f}-{row['high']:.4f}]  error {row['error']:+6.1%}  "
              f"load {row['load']:.1f}  split {row['split']}", flush=True)
    return rows


def report(rows: list[dict]) -> dict[str, float]:
    """Median absolute prediction error per strategy."""
    out = {}
    for strategy in sorted({r["strategy"] for r in rows}):
        mine = [r for r in rows if r["strategy"] == strategy]
        errors = [abs(r["error"]) for r in mine]
        out[strategy] = median(errors)
        inside = sum(r["low"] <= r["measured"] <= r["high"] for r in mine)
        measured = strategy_named(strategy.split("/")[0])  # replicas on a cluster: trunks
        replicas = measured.uses_cluster and measured.split_unit == "sample"
        if replicas and all(r["predicted_from_tables"] for r in mine):
            tables = median(abs(r["predicted_from_tables"] / r["measured"] - 1) for r in mine)
            print(f"  {strategy:18s} from layer tables instead of replica trunks: median "
                  f"|error| {tables:6.1%}")
        print(f"  {strategy:18s} median |error| {median(errors):6.1%} over {len(errors)} "
              f"runs (max {max(errors):.1%}); step time median measured "
              f"{median(r['measured'] for r in mine):.4f} s, predicted "
              f"{median(r['predicted'] for r in mine):.4f} s; measured within the band "
              f"{inside}/{len(mine)}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("case", choices=["small", "paper", "placement"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per run (default: 10 small, 4 paper)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="warm-up steps excluded (default: 2 small, 1 paper)")
    parser.add_argument("--slow", type=float, default=0.5,
                        help="placement: the emulated slow worker's speed")
    parser.add_argument("--json", help="also write every point here")
    parser.add_argument("--probe-each-run", action="store_true",
                        help="probe again after every run (default: once per cluster, network "
                        "and batch)")
    parser.add_argument("--reuse-probes", action="store_true",
                        help="use the probe cache (default: probe afresh in a temporary cache, "
                        "so the constants are this invocation's)")
    args = parser.parse_args()
    global PROBE_EACH_RUN, SLOW_SPEED
    PROBE_EACH_RUN, SLOW_SPEED = args.probe_each_run, args.slow
    steps = args.steps or (4 if args.case == "paper" else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.case == "paper" else 2)
    started = time.time()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as workdir:
        if not args.reuse_probes:
            os.environ["CNN_PROBE_CACHE"] = os.path.join(workdir, "probes")
        rows = run_case(args.case, args.repeats, steps, warmup, workdir)
    command = shlex.join(["python", "-m", "benchmarks.prediction_error", *sys.argv[1:]])
    load = ", ".join(f"{a:.1f}" for a in load_before + os.getloadavg())
    print(f"\n{command}\n{args.case}: {steps} steps per run ({warmup} warm-up), "
          f"{args.repeats} repeat(s), {time.time() - started:.0f} s; load average "
          f"(1/5/15 min) before, after: {load}")
    errors = report(rows)
    probes = {r["probe_key"]: r["probe_s"] for r in rows if r["probe_s"]}
    if probes:
        print("  cluster probes: " + ", ".join(f"{s:.1f} s" for s in probes.values()))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"command": command, "rows": rows, "median_abs_error": errors}, handle,
                      indent=1, default=str)


if __name__ == "__main__":
    main()
