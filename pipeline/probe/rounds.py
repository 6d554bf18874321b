"""Rounds of calibration runs, and timing again what the rounds did not settle.

Every plan runs `runs.plan_rounds` rounds, one round of all plans after the other;
then the plans holding a size whose rounds disagree, or one that breaks "time grows
with kernels" (pipeline/probe/robust.py), run `runs.RETIMES` more.
"""

from __future__ import annotations

from typing import Any, Sequence

from pipeline.cluster.workers import ClusterWorker
from pipeline.probe.client_share import measure_share
from pipeline.probe.readings import Cell, shard_timings, trunk_timings
from pipeline.probe.timings import ShardTiming, TrunkTiming
from pipeline.probe.runs import (RETIMES, Plan, PlanEngines, PlanRun, ReplicaPlan, plan_rounds,
                                 plan_seconds)
from tasks.specs import NetworkSpec


def suspects(timings: dict[str, list[ShardTiming]],
             trunks: dict[str, TrunkTiming] | None = None) -> set[Cell]:
    """The cells to time again: not settled by their rounds, or inconsistent (a
    replica's trunk as layer -1, its rows as kernels)."""
    cells = {(worker, t.layer, t.kernels, t.active) for worker, mine in timings.items()
             for t in mine if not t.settled or t.outlier}
    return cells | {(worker, -1, t.rows, t.active) for worker, t in (trunks or {}).items()
                    if not t.settled}


def plans_holding(plans: Sequence[Plan], cells: set[Cell], names: Sequence[str]
                  ) -> list[Plan]:
    """The plans that time any of ``cells`` (``names``: the offered workers in order)."""
    out = []
    for plan in plans:
        for worker, layer, k, active in cells:
            column = names.index(worker) if worker in names else plan.workers
            if active != plan.workers or column >= plan.workers \
                    or (layer < 0) != isinstance(plan, ReplicaPlan):
                continue
            held = plan.shares[column] if isinstance(plan, ReplicaPlan) \
                else plan.counts[layer][column]
            if held == k:
                out.append(plan)
                break
    return out


def calibrate(client: Any, offered: Sequence[ClusterWorker], network: NetworkSpec, batch: int,
              dataset: str, plans: Sequence[Plan], workspace_dir: str | None = None,
              output_root: str | None = None, share_plans: Sequence[Plan] = (),
              batch_norm: str = "sync") -> tuple[list[PlanRun], int, list[float | None]]:
    """Every plan in rounds (`plan_rounds`, one round after the other), then up to
    `RETIMES` more rounds of the plans holding an unsettled or inconsistent size, then
    the client's share of the cores measured on `share_plans` (pipeline/probe/
    client_share.py; their rounds are not the runs'). Returns the runs, how many plan
    rounds were timing again, and each measured pair's share."""
    names = [w.name for w in offered]
    rounds = [plan_rounds(plan_seconds(network, batch, plan), isinstance(plan, ReplicaPlan))
              for plan in plans]
    runs: list[PlanRun] = []
    again_runs = 0
    with PlanEngines(client, offered, network, batch, dataset, plans, workspace_dir,
                     output_root, batch_norm) as engines:
        for r in range(max(rounds, default=0)):
            runs += [engines.run(plan, r) for plan, n in zip(plans, rounds) if n > r]
        for extra in range(RETIMES):
            again = plans_holding(plans, suspects(shard_timings(runs), trunk_timings(runs)),
                                  names)
            if not again:
                break
            runs += [engines.run(plan, max(rounds) + extra) for plan in again]
            again_runs += len(again)
        shares = measure_share(engines, share_plans, max(rounds, default=0) + RETIMES)
    return runs, again_runs, shares
