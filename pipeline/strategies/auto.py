"""``strategy: auto``: the performance model picks the strategy, split and master.

`AutoStrategy` stands in the registry so that configs, preflight and sweeps take
``auto`` like any strategy name; it checks that at least one distributed strategy
accepts the config. It never runs: the run resolves it at the start, once its
cluster is up, to the candidate the model predicts fastest on a probe of that
cluster (pipeline/placement/strategy_choice.py), and then runs that strategy as if it had
been named.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from pipeline.config.run_config import RunConfig
from pipeline.config.schema import ConfigError
from pipeline.strategies.base import Strategy


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
