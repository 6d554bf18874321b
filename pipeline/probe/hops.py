"""Dask's own latencies: a client round trip and a dependency hop between workers.

The engine's default (`workspace.sync: markers`) keeps the scheduler out of a
step; these figures predict the other mode (`sync: scheduler`), where every
exchange is a Dask dependency, and show what the markers save. A chain of
trivial tasks alternating between workers is submitted whole behind a gate (a
short sleep), so the scheduler holds every task before the first runs; the
tasks' own clocks time each link (the workers share a clock on one host).
Trivial tasks hop faster than tasks that hold the GIL, so this is a lower bound.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Sequence

import numpy as np

from pipeline.cluster.workers import ClusterWorker
from pipeline.engine.runner import TaskRunner


def clock_task(*args: Any, deps: Sequence[Any] = ()) -> float:
    """A trivial task that reports when it ran (wall clock)."""
    return time.time()


def sleep_task(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def probe_hops(client: Any, offered: Sequence[ClusterWorker], round_trips: int = 20,
               links: int = 12) -> tuple[float, float]:
    """``(client round trip, hop)`` medians in seconds."""
    runner = TaskRunner(client, offered, f"hops-{uuid.uuid4().hex[:8]}")
    n = len(offered)
    trips = []
    for i in range(round_trips + 3):
        t0 = time.perf_counter()
        runner.gather([runner.submit(clock_task, i % n, name=f"trip-{i}")], "probe round trip")
        trips.append(time.perf_counter() - t0)
    gate = runner.submit(sleep_task, 0, 0.05 + 0.002 * links, name="gate")
    chain, previous = [], gate
    for i in range(links):
        previous = runner.submit(clock_task, i % n, deps=[previous], name=f"link-{i}")
        chain.append(previous)
    stamps = runner.gather(chain, "probe hops")
    return float(np.median(trips[3:])), float(np.median(np.diff(stamps)))
