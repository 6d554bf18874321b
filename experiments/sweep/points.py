"""The points of a measured sweep's grid, and what each means on its workers.

A `Point` is one run: a position along every axis (:mod:`experiments.sweep.axes`)
and a repeat number, with its validated run config. The rules here make the
grid mean what the strategies can do: `fit_point_to_strategy` gives an in-process
strategy (`reference`) as many threads as the point has workers and skips the
points of a one-worker strategy (`single`) that would repeat one another; `cluster_key` names the worker set a point needs; and
`run_order` orders the points so that one embedded cluster serves a whole block.

Why apart from the sweep file's schema: these are the grid's rules, which the
store (speedup baselines, worker-count coordinates) and the run loop share,
while the schema is only about reading the file.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from experiments.sweep.axes import Axis
from pipeline.cluster.workers import scheduler_address
from pipeline.config.run_config import RunConfig
from pipeline.config.schema import set_dotted, to_dict
from pipeline.strategies import Strategy


@dataclass
class Point:
    """One run of the grid: a position along every axis and a repeat number."""

    position: tuple[int, ...]
    repeat: int
    labels: dict[str, str]
    config: RunConfig
    strategy: Strategy  # the config's strategy
    order: int  # position in grid order (for stable directory names)
    cluster_key: str | None  # the worker set it needs; None: no cluster (reference)
    skip: str = ""  # why the point is not run (it would repeat another point), if so
    #: Why the point cannot run (its predicted peak memory exceeds a worker's limit:
    #: `experiments.sweep.cli.check_sweep_paths`), if so, and that predicted peak.
    infeasible: str = ""
    needed: float = float("nan")

    @property
    def region(self) -> tuple[int, ...]:
        """Its cell in the store: axis positions, then the repeat."""
        return (*self.position, self.repeat)

    @property
    def id(self) -> str:
        parts = [f"{dim}={label}" for dim, label in self.labels.items()]
        slug = re.sub(r"[^A-Za-z0-9._=+-]", "_", ",".join(parts + [f"repeat={self.repeat}"]))
        return f"{self.order:04d}_{slug}"[:180]

    def describe(self) -> str:
        return " ".join([f"{dim}={label}" for dim, label in self.labels.items()]
                        + [f"repeat={self.repeat}"])


def worker_count(value: Any) -> int:
    """Workers a `cluster.workers` value stands for (a count, or a list of workers)."""
    return value if isinstance(value, int) else len(value)


def fewest_workers(axis: Axis) -> int:
    """Position along a `cluster.workers` axis of its smallest worker count (the first
    such)."""
    counts = [worker_count(axis.value_of(i, "cluster.workers")) for i in range(len(axis))]
    return counts.index(min(counts))


def fit_point_to_strategy(data: dict, axes: list[Axis], position: tuple[int, ...],
                          strategy: Strategy) -> str:
    """Make a point of the grid mean what its strategy can do on its workers.

    Along a workers axis, a strategy that trains in this process (`reference`, plain
    PyTorch) runs with as many threads as the point has workers, unless
    `reference.threads` is swept itself; one that uses one worker whatever the
    cluster (`single`) is run at the axis's smallest worker count only. Returns why
    the point is skipped ("" to run it).
    """
    axis = next((a for a in axes if "cluster.workers" in a.fields), None)
    if axis is None:
        return ""
    index = position[axes.index(axis)]
    count = worker_count(axis.value_of(index, "cluster.workers"))
    if not strategy.uses_cluster:
        if not any("reference.threads" in a.fields for a in axes):
            set_dotted(data, "reference.threads", count)
    elif strategy.one_worker:
        first = fewest_workers(axis)
        if index != first:
            return (f"{strategy.name} runs on one worker: measured at {axis.dim}="
                    f"{axis.labels[first]}")
    return ""


def cluster_key(config: RunConfig, strategy: Strategy) -> str | None:
    """The worker set a point's run needs (`Point.cluster_key`), see `run_order`."""
    if not strategy.uses_cluster:
        return None
    if scheduler_address(config.cluster):
        return "external"
    return json.dumps({"workers": to_dict(config.cluster.worker_list()),
                       "links": config.cluster.link_rates(),
                       "jobqueue": to_dict(config.cluster.jobqueue)}, sort_keys=True)


def run_order(points: list[Point]) -> list[Point]:
    """Points that need no cluster first (`reference`, before any nanny has touched
    this process's environment), then one block per worker set in order of first
    appearance, so one embedded cluster serves a whole block; within a block all
    points of repeat 0, then of repeat 1, ... so repeats are spread in time."""
    blocks: dict[str | None, list[Point]] = {None: []}
    for point in sorted(points, key=lambda p: p.order):
        blocks.setdefault(point.cluster_key, []).append(point)
    ordered: list[Point] = []
    for block in blocks.values():
        ordered.extend(sorted(block, key=lambda p: (p.repeat, p.order)))
    return ordered
