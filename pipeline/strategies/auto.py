"""``strategy: auto``: the performance model picks the strategy, split and master.

`AutoStrategy` stands in the registry so that configs, preflight and sweeps take
``auto`` like any strategy name; it checks that at least one distributed strategy
accepts the config. It never runs: when a run with ``strategy: auto`` has its
cluster, `choose_strategy` predicts, on a probe of that cluster (cached, else
measured once: pipeline/prediction.py), every distributed strategy that accepts the
config (`AutoStrategy.candidates`: kernel with the model's own split, single, data,
hybrid, and any registered strategy with a model) and fits the workers' memory (the
memory check a run of it would meet first: `pipeline.preflight_memory.memory_refusal`) with
each worker as master, and the run goes on with the config of the fastest as if it
had been named. The choice is recorded: the chosen and the runner-up (another
strategy) with their predictions, every alternative's, and why each other strategy
was none (its check, or the memory it needs). `pick` is that choice on plain numbers.
Where no candidate fits the workers' memory, `auto` is refused as a named strategy
would be (`MemoryRefused`, one line naming what each needs), before the cluster
starts where the workers' limits are in the config (`AutoStrategy.check_memory`).

Why at the start of the run and not in the config: which strategy wins depends on
the cluster's measured speeds and store (and links), which only the probe knows.
The model itself (`pipeline.prediction.predict_config`) is handed in: it asks the
registry's strategies, so this module cannot import it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from pipeline.cluster.workers import ClusterError
from pipeline.config.run_config import RunConfig
from pipeline.config.schema import ConfigError
from pipeline.costmodel import Prediction
from pipeline.placement.memory_fit import MemoryRefused
from pipeline.probe import ClusterProbe
from pipeline.strategies.base import Strategy

#: The model's step of a run config on a probe (`pipeline.prediction.predict_config`).
Predict = Callable[[RunConfig, ClusterProbe], Prediction]
#: Why a candidate config does not fit the run's workers' memory, "" where it does
#: (`pipeline.preflight_memory.memory_refusal` on the workers' capacities).
Refusal = Callable[[RunConfig], str]


class AutoStrategy(Strategy):
    """A placeholder the run replaces by the model's choice (module doc)."""

    name = "auto"
    chosen_by_model = True

    def __init__(self, registry: Mapping[str, Strategy]) -> None:
        self.registry = registry

    @staticmethod
    def candidate_config(config: RunConfig, strategy: Strategy) -> RunConfig:
        """`config` as `strategy` would run it for the choice: with ``placement:
        model`` where it takes it (the model picks the split too), else the config's
        placement where it takes that, else ``calibrated``."""
        if "model" in strategy.placements:
            placement = "model"
        elif config.placement in strategy.placements:
            placement = config.placement
        else:
            placement = "calibrated"
        split_from = config.split_from if placement == "recorded" else None
        return dataclasses.replace(config, strategy=strategy.name, placement=placement,
                                   split_from=split_from)

    def candidates(self, config: RunConfig) -> dict[str, RunConfig | str]:
        """Every distributed strategy by name: its candidate config where it accepts
        it (as its own `check` says), else why not."""
        out: dict[str, RunConfig | str] = {}
        for name, strategy in self.registry.items():
            if not strategy.uses_cluster or strategy.chosen_by_model:
                continue
            candidate = self.candidate_config(config, strategy)
            try:
                strategy.check(candidate)
            except ConfigError as error:
                out[name] = str(error)
            else:
                out[name] = candidate
        return out

    def check(self, config: RunConfig) -> None:
        candidates = self.candidates(config)
        if not any(isinstance(c, RunConfig) for c in candidates.values()):
            reasons = "; ".join(f"{name}: {why}" for name, why in candidates.items())
            raise ConfigError(f"strategy: 'auto' found no strategy that takes this config "
                              f"({reasons})")

    def fitting(self, config: RunConfig, refusal: Refusal | None, masters: Sequence[str] = ()
                ) -> tuple[dict[str, RunConfig], dict[str, str]]:
        """The candidate configs that fit the workers' memory (`refusal`; None: every
        one) with their own master or one of `masters`, and why each other
        distributed strategy is no candidate. Raises `MemoryRefused` where the config
        suits some strategy but none fits."""
        fitting: dict[str, RunConfig] = {}
        skipped: dict[str, str] = {}
        for name, candidate in self.candidates(config).items():
            if isinstance(candidate, str):
                skipped[name] = candidate
                continue
            why = refusal(candidate) if refusal else ""
            others = [m for m in masters if m != candidate.cluster.master]
            if why and any(not refusal(with_master(candidate, m)) for m in others):
                why = ""  # it fits with another master (which choose_strategy tries)
            if why:
                skipped[name] = why
            else:
                fitting[name] = candidate
        if not fitting:
            refuse_for_memory(skipped)
        return fitting, skipped

    def check_memory(self, config: RunConfig, refusal: Refusal, masters: Sequence[str] = ()
                     ) -> None:
        """Refuse (`MemoryRefused`) a config no candidate of which fits the workers'
        memory with any of `masters`, before a cluster starts and a probe runs for a
        choice that cannot run."""
        self.fitting(config, refusal, masters)


def with_master(config: RunConfig, master: str) -> RunConfig:
    """`config` with `master` as its cluster's master."""
    return dataclasses.replace(config, cluster=dataclasses.replace(config.cluster, master=master))


def refuse_for_memory(skipped: dict[str, str]) -> None:
    """Raise `MemoryRefused`, one line naming what each needs, where some of the
    strategies `auto` left out (`skipped`: name -> why) were left out for memory."""
    memory = {n: why for n, why in skipped.items() if why.startswith("memory: ")}
    if memory:
        needs = "; ".join(f"{n}: {why.removeprefix('memory: ').split('; ')[0]}"
                          for n, why in memory.items())
        raise MemoryRefused(f"memory: strategy 'auto' found no strategy that fits the "
                            f"workers' memory ({needs}): add workers or memory, or lower "
                            "train.batch")


def pick(times: dict[tuple[str, str], float]) -> tuple[tuple[str, str], tuple[str, str] | None]:
    """The fastest ``(strategy, master)`` and the fastest of another strategy (the
    runner-up; None if there is no other). Ties go to the first listed."""
    ranked = sorted(times, key=lambda key: times[key])  # stable: ties keep their order
    best = ranked[0]
    runner_up = next((key for key in ranked if key[0] != best[0]), None)
    return best, runner_up


def choice_words(choice: dict[str, Any]) -> str:
    """How a start says `auto`'s pick, with the steps per task its figure prices: a
    short run's tasks may hold fewer, and its closing prediction (at the run's own)
    then differs."""
    steps = choice.get("task_steps")
    at = f" at {steps} step{'s' if steps != 1 else ''} per task" if steps else ""
    return (f"the model picks {choice['chosen']} (master {choice['master']}), predicted "
            f"{choice['predicted_step_time']:.4f} s/step{at}")


def choose_strategy(config: RunConfig, auto: Strategy, probe: ClusterProbe | None,
                    predict: Predict, refusal: Refusal | None = None
                    ) -> tuple[RunConfig, Strategy, dict[str, Any]]:
    """The config of the strategy `predict` finds fastest on `probe` (the run's
    cluster; None if none could be made) among those that fit the workers' memory
    (`refusal`; None: no limit known), that strategy, and the record of the choice
    (module doc)."""
    assert isinstance(auto, AutoStrategy)
    if probe is None:
        why = ("the probe does not time a workspace over s3 (cluster.workspace.transport)"
               if config.cluster.workspace_transport() == "s3" else
               "its calibration runs failed; the warning above says how")
        raise ClusterError("strategy: 'auto' needs the model's probe of this cluster, and "
                           f"none could be made: {why}")
    masters = [w.name for w in probe.workers]
    configs: dict[tuple[str, str], RunConfig] = {}
    times: dict[tuple[str, str], float] = {}
    task_steps: dict[tuple[str, str], int | None] = {}  # what each time prices (per task)
    fitting, skipped = auto.fitting(config, refusal, masters)
    for name, candidate in fitting.items():
        for master in masters[:auto.registry[name].workers_used(candidate, probe)]:
            trial = with_master(candidate, master)
            why = refusal(trial) if refusal else ""
            if why:  # its master holds more (the dense head), or has less memory
                skipped[f"{name}@{master}"] = why
                continue
            try:
                prediction = predict(trial, probe)
            except (NotImplementedError, ValueError) as error:
                skipped[name] = f"no prediction: {error}"
                break
            times[name, master] = prediction.step_time
            task_steps[name, master] = prediction.details.get("task_steps")
            configs[name, master] = trial
    if not times:
        refuse_for_memory(skipped)
        raise ClusterError("strategy: 'auto' has no strategy the model can predict here: "
                           + "; ".join(f"{n}: {why}" for n, why in skipped.items()))
    best, runner_up = pick(times)
    chosen = configs[best]
    record = {
        "requested": "auto", "chosen": best[0], "master": best[1],
        "placement": chosen.placement, "predicted_step_time": times[best],
        "task_steps": task_steps[best],
        "runner_up": None if runner_up is None else {
            "strategy": runner_up[0], "master": runner_up[1],
            "predicted_step_time": times[runner_up]},
        "alternatives": {f"{s}@{m}": t for (s, m), t in times.items()},
        "not_candidates": skipped, "probe_key": probe.key}
    return chosen, auto.registry[best[0]], record
