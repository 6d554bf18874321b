"""``strategy: auto`` resolved: the candidate the model predicts fastest on this cluster.

When a run with ``strategy: auto`` has its cluster, `choose_strategy` takes a probe
of it (cached, else measured once: pipeline/prediction.py), predicts every
distributed strategy that accepts the config (`AutoStrategy.candidates`: kernel
with the model's own split, single, data, hybrid, and any registered strategy with
a model) with each worker as master, and returns the config of the fastest, plus
a record of the choice: the chosen and the runner-up (another strategy) with their
predictions, and every alternative's. `pick` is that choice on plain numbers.

Why at the start of the run and not in the config: which strategy wins depends on
the cluster's measured speeds and store (and links), which only the probe knows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from distributed import Client

from pipeline.cluster.workers import ClusterError, ClusterWorker
from pipeline.config.run_config import RunConfig
from pipeline.prediction import predict_config, probe_for_config
from pipeline.strategies import Strategy, strategy_named
from pipeline.strategies.auto import AutoStrategy


def pick(times: dict[tuple[str, str], float]) -> tuple[tuple[str, str], tuple[str, str] | None]:
    """The fastest ``(strategy, master)`` and the fastest of another strategy (the
    runner-up; None if there is no other). Ties go to the first listed."""
    ranked = sorted(times, key=lambda key: times[key])  # stable: ties keep their order
    best = ranked[0]
    runner_up = next((key for key in ranked if key[0] != best[0]), None)
    return best, runner_up


def choose_strategy(config: RunConfig, auto: Strategy, client: Client,
                    offered: list[ClusterWorker]) -> tuple[RunConfig, Strategy, dict[str, Any]]:
    """The config of the strategy the model predicts fastest on `offered`, that
    strategy, and the record of the choice (module doc)."""
    assert isinstance(auto, AutoStrategy)
    probe = probe_for_config(config, client, offered, policy="auto")
    if probe is None:
        raise ClusterError("strategy: 'auto' needs the model's probe of this cluster, and "
                           "none could be made (is CNN_PREDICT_PROBE=never or cached set?)")
    masters = [w.name for w in probe.workers]
    configs: dict[tuple[str, str], RunConfig] = {}
    times: dict[tuple[str, str], float] = {}
    skipped: dict[str, str] = {}
    for name, candidate in auto.candidates(config).items():
        if isinstance(candidate, str):
            skipped[name] = candidate
            continue
        for master in masters[:strategy_named(name).workers_used(candidate, probe)]:
            trial = dataclasses.replace(
                candidate, cluster=dataclasses.replace(candidate.cluster, master=master))
            try:
                times[name, master] = predict_config(trial, probe).step_time
            except (NotImplementedError, ValueError) as error:
                skipped[name] = f"no prediction: {error}"
                break
            configs[name, master] = trial
    if not times:
        raise ClusterError("strategy: 'auto' has no strategy the model can predict here: "
                           + "; ".join(f"{n}: {why}" for n, why in skipped.items()))
    best, runner_up = pick(times)
    chosen = configs[best]
    record = {
        "requested": "auto", "chosen": best[0], "master": best[1],
        "placement": chosen.placement, "predicted_step_time": times[best],
        "runner_up": None if runner_up is None else {
            "strategy": runner_up[0], "master": runner_up[1],
            "predicted_step_time": times[runner_up]},
        "alternatives": {f"{s}@{m}": t for (s, m), t in times.items()},
        "not_candidates": skipped, "probe_key": probe.key}
    return chosen, strategy_named(best[0]), record
