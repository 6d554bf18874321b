"""Checks that a run fits its workers' memory, made before anything starts.

`check_embedded_memory` refuses a run its own embedded cluster cannot hold (the
workers' `memory_limit`s are in the config); `fit_even_split` is the check itself,
on any list of workers and capacities; `memory_refusal` says it as a line, which is
what `auto` asks of each strategy it may choose, and `memory_refusal_on` asks it of a
started cluster's workers. The split choice (pipeline/placement/split_choice.py)
refuses the same runs after the start: these checks name them first.
"""

from __future__ import annotations

import math
from typing import Callable

from distributed import Client

from pipeline.cluster.workers import ClusterWorker, started_elsewhere, tagged_workers
from pipeline.cluster.worker_limits import worker_constants
from pipeline.config.run_config import RunConfig
from pipeline.costmodel.memory import DEFAULT_CONSTANTS, MemoryConstants, element_bytes
from pipeline.records.memory import machine_memory_constants
from pipeline.placement.capacity import capacities_explained, worker_capacities
from pipeline.placement.memory_fit import MemoryRefused, move_to_fit, split_peaks
from pipeline.probe.tables import model_network
from pipeline.strategies import strategy_of
from pipeline.strategies.base import network_for


def check_embedded_memory(config: RunConfig) -> None:
    """A run on its own embedded cluster whose workers have a `memory_limit` and that
    fits in none of its splits is refused before the cluster starts: the split choice
    (pipeline/placement/split_choice.py) would refuse it anyway, after the start. Checked from
    the even split moved to fit (`pipeline.placement.memory_fit.move_to_fit`); a master outside
    the run's workers, or a device whose capacity only the worker knows (a GPU's
    total), is left to the split choice."""
    cluster = config.cluster
    if started_elsewhere(cluster):
        return
    workers = cluster.worker_list()
    if (not strategy_of(config).uses_cluster
            or all(w.memory_limit is None for w in workers)):
        return
    by_name = {w.name: w for w in workers}
    offering = tagged_workers({w.name: {"name": w.name, "resources": w.resources}
                               for w in workers}, cluster.tags())
    chosen = [by_name[address] for address, _, _ in offering][:cluster.use_workers or None]
    fit_even_split(config, [(w.name, w.resources or {}, w.device) for w in chosen],
                   [w.memory_bytes() or float("inf") for w in chosen],
                   machine_memory_constants())


def fit_even_split(config: RunConfig, workers: list[tuple[str, dict, str]],
                   capacities: list[float], constants: MemoryConstants = DEFAULT_CONSTANTS
                   ) -> None:
    """Raise `MemoryRefused` (one line) if the even split of the run over `workers`
    (name, tags, device of each), moved to fit (`move_to_fit`), overflows some
    worker's capacity under the memory model (`constants`). The master is the first
    worker or the one `cluster.master` names; one outside `workers` is left to the
    split choice, as is a strategy the model does not count and a network it does not
    price (the split choice records that it was not checked). For `auto`, the
    strategies it may choose: refused only where none fits (`AutoStrategy.check_memory`)."""
    strategy = strategy_of(config)
    if strategy.chosen_by_model:
        strategy.check_memory(config, lambda candidate: memory_refusal(
            candidate, workers, capacities, constants), [name for name, _, _ in workers])
        return
    master_wanted = config.cluster.master
    master = next((d for d, (name, tags, _) in enumerate(workers)
                   if master_wanted in (name, *tags)), None) if master_wanted else 0
    if master is None or not workers or not strategy.memory_model:
        return
    if strategy.one_worker:
        workers, capacities, master = [workers[master]], [capacities[master]], 0
    network = network_for(config)
    counts, quanta = strategy.even_split(config, network, len(workers))
    peaks = split_peaks(strategy, model_network(config, network), config.train.batch,
                        element_bytes(network.dtype), strategy.split_master(master),
                        [device.startswith("cuda") for _, _, device in workers], constants)
    move_to_fit(counts, quanta, capacities, peaks, [name for name, _, _ in workers],
                strategy.tied_rows(network), config.cluster.memory_margin)


def memory_refusal(config: RunConfig, workers: list[tuple[str, dict, str]],
                   capacities: list[float], constants: MemoryConstants = DEFAULT_CONSTANTS
                   ) -> str:
    """`fit_even_split`'s refusal of `config` on `workers` as a line, "" where it fits:
    what `auto` asks of each strategy it may choose."""
    try:
        with capacities_explained(config.cluster):
            fit_even_split(config, workers, capacities, constants)
    except MemoryRefused as refused:
        return str(refused)
    return ""


def memory_refusal_on(client: Client, config: RunConfig, offered: list[ClusterWorker]
                      ) -> Callable[[RunConfig], str] | None:
    """`memory_refusal` on the run's workers (their capacities and baseline, as
    `pipeline.run.check_memory_before_placing` takes them), for `auto`'s choice; None
    where no worker has a limit."""
    capacities = worker_capacities(client, config.cluster, offered)
    if all(capacity == math.inf for capacity in capacities):
        return None
    constants = worker_constants(client, config.cluster, offered)
    workers = [(w.name, {w.resource: 1}, w.device) for w in offered]
    return lambda candidate: memory_refusal(candidate, workers, capacities, constants)
