"""What Dask's own machinery costs while nothing runs: the CPU per second of an idle
embedded cluster's client process (client, scheduler, nannies) and of its worker
processes (event-loop tick monitors, system monitors, heartbeats, work stealing).

During training this background rate comes on top of each step's own work, on the
same cores as the workers' compute. No task runs here, so the figure does not depend
on a step's time and is steady on a loaded machine (CPU seconds, not wall time).
`--set KEY=VALUE` changes a Dask setting of the embedded cluster
(`pipeline.cluster.embedded.QUIET`), to compare settings.

    python -m benchmarks.idle_cpu --workers 2 --seconds 10
    python -m benchmarks.idle_cpu --set distributed.admin.tick.interval=20ms
"""

from __future__ import annotations

import argparse
import time

import psutil
from distributed import Client

from pipeline.config.cluster_config import WorkerConfig
from pipeline.cluster.embedded import QUIET, is_worker_process, start_embedded_cluster


def workers_cpu_seconds() -> float:
    """CPU seconds so far of this process's worker processes (forked from its fork
    server: the nannies' workers), together."""
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            if is_worker_process(child):
                times = child.cpu_times()
                total += times.user + times.system
        except psutil.Error:
            pass
    return total


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds so far of this process and of its worker processes (together)."""
    own = psutil.Process().cpu_times()
    return own.user + own.system, workers_cpu_seconds()


def idle_rates(workers: int, seconds: float, settle: float = 2.0) -> tuple[float, float]:
    """CPU seconds per second of the client's process and of all workers together,
    over `seconds` of an idle embedded cluster of `workers` workers with a client."""
    cluster = start_embedded_cluster([WorkerConfig(name=f"w{i}") for i in range(workers)])
    try:
        with Client(cluster, set_as_default=False):
            time.sleep(settle)
            (own0, work0), wall0 = cpu_seconds(), time.perf_counter()
            time.sleep(seconds)
            (own1, work1), wall1 = cpu_seconds(), time.perf_counter()
    finally:
        cluster.close()
    wall = wall1 - wall0
    return (own1 - own0) / wall, (work1 - work0) / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="a Dask setting of the embedded cluster")
    args = parser.parse_args()
    for setting in args.set:
        key, _, value = setting.partition("=")
        QUIET[key] = {"true": True, "false": False}.get(value.lower(), value)
    client, workers = idle_rates(args.workers, args.seconds)
    print(f"idle, {args.workers} workers: client process {1e3 * client:.1f} ms CPU/s, "
          f"workers {1e3 * workers:.1f} ms CPU/s ({1e3 * workers / args.workers:.1f} each)"
          f"{' with ' + ' '.join(args.set) if args.set else ''}", flush=True)


if __name__ == "__main__":
    main()
