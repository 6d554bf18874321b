"""The client process's CPU per training step: what an embedded run's client (which
also hosts the Dask scheduler) takes from the workers' cores.

Runs each strategy on the embedded cluster and reads the client process's CPU
seconds (every thread: the loop's, and the event loop's that runs the scheduler,
the client and the nannies) at the record of step 4 and of the last step, through a
wrapper around `RunRecorder.add_step`; start-up, calibration and the closing
checkpoint fall outside. Prints CPU milliseconds per step, per step task (the Dask
tasks a step submits: one per worker), and the fraction of a core; and the worker
processes' CPU per step (theirs, all together: the step's compute plus Dask's
machinery there). CPU time, so a loaded machine inflates it less than wall time
(but still some). `--set KEY=VALUE` changes a Dask setting of the embedded
cluster (`pipeline.cluster.embedded.QUIET`), to compare settings.

    python -m benchmarks.client_cpu --net small --batch 64 --steps 40
    python -m benchmarks.client_cpu --set distributed.admin.tick.interval=20ms
"""

from __future__ import annotations

import argparse
import tempfile
import time

import psutil

from benchmarks.nets import NETS, net_path
from benchmarks.idle_cpu import workers_cpu_seconds
from pipeline.records import record as records
from pipeline.cluster.embedded import QUIET
from pipeline.config.run_config import load_run_config
from pipeline.run import run_training


FIRST = 4  # steps before this one (start-up, warm-up) are left out
CASES = {"single": ["strategy=single", "cluster.workers=1"],
         **{name: [f"strategy={name}", "cluster.workers=2"]
            for name in ("kernel", "data", "hybrid")}}


def client_cpu_per_step(net: str, batch: int, steps: int, overrides: list[str]) -> dict:
    """CPU seconds of this process between the records of step FIRST and the last."""
    marks: dict[int, tuple[float, float, float]] = {}
    original = records.RunRecorder.add_step

    def add_step(self, result, *args, **kwargs):  # noqa: ANN001, ANN202 - a wrapper
        if result.step in (FIRST, steps - 1):
            times = psutil.Process().cpu_times()
            marks[result.step] = (times.user + times.system, time.perf_counter(),
                                  workers_cpu_seconds())
        return original(self, result, *args, **kwargs)

    records.RunRecorder.add_step = add_step
    try:
        with tempfile.TemporaryDirectory() as output:
            config = load_run_config(net_path(net), [
                f"train.batch={batch}", f"train.steps={steps}", "train.warmup_steps=1",
                "train.eval_samples=0", "progress=false", "train.checkpoint_every=0",
                f"output={output}", *overrides])
            summary = run_training(config).summary
    finally:
        records.RunRecorder.add_step = original
    (cpu0, wall0, work0), (cpu1, wall1, work1) = marks[FIRST], marks[steps - 1]
    count = steps - 1 - FIRST
    return {"cpu_per_step": (cpu1 - cpu0) / count, "worker_cpu_per_step": (work1 - work0) / count,
            "core_fraction": (cpu1 - cpu0) / (wall1 - wall0),
            "tasks_per_step": len(summary["workers"]), "step_time": summary["step_time_median"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--net", choices=sorted(NETS), default="small")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="a Dask setting of the embedded cluster, e.g. "
                             "distributed.admin.tick.interval=20ms")
    args = parser.parse_args()
    for setting in args.set:
        key, _, value = setting.partition("=")
        QUIET[key] = {"true": True, "false": False}.get(value.lower(), value)
    if args.steps < FIRST + 3:
        parser.error(f"--steps must be at least {FIRST + 3}")
    print(f"{args.net} network, batch {args.batch}, steps {FIRST}-{args.steps - 1} counted")
    for name in args.cases:
        got = client_cpu_per_step(args.net, args.batch, args.steps, CASES[name])
        per_task = got["cpu_per_step"] / got["tasks_per_step"]
        print(f"  {name:8s} client CPU {1e3 * got['cpu_per_step']:6.2f} ms a step "
              f"({1e3 * per_task:.2f} ms per step task), {got['core_fraction']:.2f} of a core; "
              f"workers {1e3 * got['worker_cpu_per_step']:6.1f} ms; "
              f"step {got['step_time']:.4f} s", flush=True)


if __name__ == "__main__":
    main()
