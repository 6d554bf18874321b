"""Training strategies, found by name: `STRATEGIES`, `register`, `strategy_of`.

Each strategy is one `Strategy` object (pipeline/strategies/base.py says what it
answers); the project's own are `reference`, `single`, `kernel`, `data`,
`hybrid` and `auto` (the model's choice among the others, made when a run
starts). Everything else asks the object: no other module branches on a
strategy's name.
"""

from __future__ import annotations

from pipeline.config.run_config import RunConfig
from pipeline.config.schema import ConfigError
from pipeline.strategies.auto import AutoStrategy
from pipeline.strategies.base import PLACEMENTS, Strategy
from pipeline.strategies.kernel import KernelStrategy, SingleStrategy
from pipeline.strategies.reference import ReferenceStrategy
from pipeline.strategies.replicas import DataStrategy, HybridStrategy

__all__ = ["PLACEMENTS", "STRATEGIES", "Strategy", "register", "strategy_named", "strategy_of",
           "arithmetic_settings"]

#: Every strategy a config may name, by name.
STRATEGIES: dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    """Make `strategy` available to configs by its name (a later one replaces it)."""
    if not strategy.name:
        raise ValueError("a strategy needs a name")
    STRATEGIES[strategy.name] = strategy
    return strategy


def strategy_named(name: str) -> Strategy:
    """The strategy called `name`; a ConfigError naming the field if there is none."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ConfigError(f"strategy: {name!r} is not a strategy; expected one of "
                          f"{', '.join(repr(n) for n in STRATEGIES)}") from None


def arithmetic_settings(name: str) -> tuple[str, ...] | None:
    """The settings beyond plain SGD the strategy called `name` uses
    (`Strategy.arithmetic_settings`; None for a name not registered here)."""
    strategy = STRATEGIES.get(name)
    return None if strategy is None else strategy.arithmetic_settings


def strategy_of(config: RunConfig) -> Strategy:
    """The run's strategy, after it has checked the config."""
    strategy = strategy_named(config.strategy)
    strategy.check(config)
    return strategy


for _builtin in (KernelStrategy(), SingleStrategy(), ReferenceStrategy(), DataStrategy(),
                 HybridStrategy(), AutoStrategy(STRATEGIES)):
    register(_builtin)
