"""What the embedded cluster's mutual TLS costs a Dask task: round trips over tls:// and tcp://.

Every cluster a run starts speaks mutual TLS (pipeline/cluster/security.py), which
encrypts every message between the client, the scheduler and the workers. A run's
tensors cross the workspace, not Dask's comms, so what TLS can cost is in the
messages of each task: its submission, its start, its small result. This starts the
embedded cluster (`start_embedded_cluster`, TLS) and the same spec without
security (tcp), two workers each, and times `--tasks` sequential round trips of a
trivial task pinned to one worker, in `--rounds` alternating rounds; it prints the
median round trip of each protocol per round and their ratio, pair by pair.

    python -m benchmarks.embedded_tls [--tasks 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import logging
import time
from statistics import median

import dask
from distributed import Client, Nanny, Scheduler, SpecCluster

from pipeline.cluster.embedded import LOOPBACK, QUIET, start_embedded_cluster
from pipeline.config.cluster_config import WorkerConfig

WORKERS = [WorkerConfig(name="w0"), WorkerConfig(name="w1")]


def plain_tcp_cluster() -> SpecCluster:
    """The embedded cluster's spec as it was before TLS: loopback, tcp, no security."""
    spec = {worker.name: {"cls": Nanny, "options": {
        "host": LOOPBACK, "nthreads": 1, "silence_logs": logging.ERROR,
        "resources": dict(worker.resources or {"CPU": 1}), "memory_limit": 0}}
        for worker in WORKERS}
    with dask.config.set(QUIET):
        return SpecCluster(workers=spec, silence_logs=logging.ERROR, scheduler={
            "cls": Scheduler, "options": {"host": LOOPBACK, "dashboard_address": f"{LOOPBACK}:0"}})


def nothing() -> None:
    """The task: no work, so that its time is Dask's messages alone."""


def round_trips(client: Client, tasks: int) -> float:
    """Median seconds of `tasks` sequential submit-and-wait round trips to one worker."""
    worker = sorted(client.scheduler_info()["workers"])[0]
    times = []
    for index in range(tasks):
        started = time.perf_counter()
        client.submit(nothing, key=f"nothing-{index}-{time.monotonic_ns()}",
                      workers=[worker], pure=False).result()
        times.append(time.perf_counter() - started)
    return median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=200, help="round trips per round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    args = parser.parse_args(argv)
    with start_embedded_cluster(WORKERS) as tls_cluster, plain_tcp_cluster() as tcp_cluster, \
            Client(tls_cluster, set_as_default=False) as tls, \
            Client(tcp_cluster, set_as_default=False) as tcp:
        tls.wait_for_workers(len(WORKERS))
        tcp.wait_for_workers(len(WORKERS))
        print(f"scheduler addresses: {tls.scheduler.address} (TLS), {tcp.scheduler.address}")
        round_trips(tls, 20), round_trips(tcp, 20)  # warm-up
        ratios = []
        for number in range(args.rounds):
            tls_s, tcp_s = round_trips(tls, args.tasks), round_trips(tcp, args.tasks)
            ratios.append(tls_s / tcp_s)
            print(f"round {number}: tls {tls_s * 1e3:.2f} ms, tcp {tcp_s * 1e3:.2f} ms, "
                  f"tls/tcp {ratios[-1]:.3f}")
        print(f"tls/tcp median {median(ratios):.3f} (min {min(ratios):.3f}, "
              f"max {max(ratios):.3f}) over {args.rounds} rounds of {args.tasks} round trips")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
