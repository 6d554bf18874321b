"""How long a run with default settings takes to notice a stopped worker, and what
it costs: every strategy (kernel, data, hybrid) on 2 and 3 workers.

Each case trains `configs/small.yaml` (`placement: even`, no evaluation) on an
embedded cluster of its own, started here as a run starts its own (so that the
stopped worker's process is known by name), with `cluster.stall_timeout` left at
its default (`auto`). One worker is SIGSTOPped just after checkpoint `--stop-after`
(a non-master for `kernel` and `hybrid`, the first worker for `data`, which writes
the checkpoints), and SIGCONTed as soon as the run has removed it. Printed per
case: the run's median step, the stall limit that gave (max(30 s, 10x the median)),
seconds from the stop to the worker's removal, steps replayed, seconds from
noticing to the new engine's first step, the ended attempt's late writes, seconds
until the woken worker's process had exited, and whether the run finished by
itself. A JSON line per case goes to `--json`.

    python -m benchmarks.stall_notice                     # all six cases, ~10 min
    python -m benchmarks.stall_notice --cases kernel:2 data:3 --steps 300
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
import time

import psutil
from distributed import Client

from pipeline.cluster.embedded import start_embedded_cluster
from pipeline.cluster.worker_setup import register_setup
from pipeline.cluster.workers import live_workers
from pipeline.config.run_config import load_run_config
from pipeline.run import run_training
from pipeline.engine.stalls import STALL_FLOOR_S, STALL_STEPS
from storage import checkpoints

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = ["kernel:2", "kernel:3", "data:2", "data:3", "hybrid:2", "hybrid:3"]
ROLE = {"kernel": 1, "data": 0, "hybrid": 1}  # which of the run's workers is stopped


def _names(client: Client) -> dict[str, str]:
    """By name, asked of the scheduler (`Client.scheduler_info()` may answer from a
    cache without workers, which would read as the stopped worker removed)."""
    return {i["name"]: a for a, i in live_workers(client).items()}


def _wait(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def measure(strategy: str, count: int, steps: int, stop_after: int, data: str) -> dict:
    """One case (module doc); returns its figures."""
    out = tempfile.mkdtemp(prefix=f"stall-{strategy}-{count}-")
    config = load_run_config(os.path.join(ROOT, "configs/small.yaml"), [
        f"strategy={strategy}", f"cluster.workers={count}", "placement=even",
        f"train.steps={steps}", f"train.checkpoint_every={stop_after}", "train.eval_samples=0",
        "progress=false", f"output={out}/run", f"data.path={data}"])
    cluster = start_embedded_cluster(config.cluster.worker_list())
    client = Client(cluster, set_as_default=False)
    try:
        register_setup(client, config.cluster)
        names = _names(client)
        victim = sorted(names)[ROLE[strategy]]
        pid = client.run(os.getpid, workers=[names[victim]])[names[victim]]
        outcome: dict = {}

        def train() -> None:
            try:
                outcome["result"] = run_training(config, client=client)
            except BaseException as error:  # noqa: BLE001 - reported in the figures
                outcome["error"] = f"{type(error).__name__}: {error}"

        runner = threading.Thread(target=train, daemon=True)
        runner.start()
        _wait(lambda: (checkpoints.latest_complete_step(config.checkpoint_path) or 0)
              >= stop_after or not runner.is_alive(), 600)
        time.sleep(0.2)  # a few steps past the checkpoint
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            _wait(lambda: victim not in _names(client) or not runner.is_alive(), 300)
            noticed = time.monotonic() - stopped
        finally:
            os.kill(pid, signal.SIGCONT)
        woken = time.monotonic()
        _wait(lambda: not psutil.pid_exists(pid), 300)
        exited = time.monotonic() - woken
        runner.join(1800)
        figures = {"strategy": strategy, "workers": count, "victim": victim,
                   "noticed_s": round(noticed, 1), "woken_exit_s": round(exited, 1),
                   "finished": "result" in outcome, "error": outcome.get("error")}
        if "result" in outcome:
            summary = outcome["result"].summary
            median = summary["step_time_median"]
            figures.update(median_step_s=round(median, 3),
                           limit_s=max(STALL_FLOOR_S, STALL_STEPS * median),
                           recoveries=summary["recoveries"])
        return figures
    finally:
        client.close()
        cluster.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=CASES, help="strategy:workers")
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--stop-after", type=int, default=20, help="checkpoint to stop after")
    parser.add_argument("--data", default=os.path.join(tempfile.gettempdir(),
                                                       "stall-notice-small.zarr"))
    parser.add_argument("--json", default=None, help="append one JSON line per case here")
    args = parser.parse_args()
    os.environ.setdefault("CNN_PREDICT_PROBE", "cached")  # the run's prediction: no probe
    for case in args.cases:
        strategy, count = case.split(":")
        figures = measure(strategy, int(count), args.steps, args.stop_after, args.data)
        recovery = (figures.get("recoveries") or [{}])[0]
        print(f"{strategy:6} {count} workers: median step {figures.get('median_step_s')} s, "
              f"limit {figures.get('limit_s')} s; noticed {figures['noticed_s']} s after the "
              f"stop ({figures['victim']}); replayed {recovery.get('replayed_steps')} step(s), "
              f"new engine {recovery.get('seconds', 0):.2f} s later; late writes "
              f"{recovery.get('late_writes')}; woken worker gone {figures['woken_exit_s']} s "
              f"after; finished: {figures['finished']} {figures['error'] or ''}", flush=True)
        if args.json:
            with open(args.json, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(figures) + "\n")


if __name__ == "__main__":
    main()
