"""Memory limits of `dask worker`s the user started, against what a run needs of them.

Why apart from placement's capacities (pipeline/placement/capacity.py): a worker started with
`--memory-limit` is policed by Dask itself. The worker pauses (runs no task) above
`distributed.worker.memory.pause` of its limit (80 % by default) and its nanny
restarts it above `...terminate` (95 %). A limit below what a bare worker process
holds once it has imported torch is killed by the run's own setup, and, with the
setup plugin still registered, again on every restart. So, before the setup:

- `limit_problem`: every worker's limit, times the fraction Dask lets it use, against
  the resident memory of a bare process of that kind (`EXTERNAL_WORKER_IMPORTS`,
  measured once on this machine and cached: pipeline/records/memory.py), in one line;
- `worker_constants`: once set up, the model's per-worker baseline is what the
  workers hold then (an unforked worker holds more than the embedded cluster's
  forked ones, whose bare process the model measures), so predicted peaks are theirs;
- `memory_loss_notes`: a worker lost while it was near its limit (its nanny's
  ``worker-restart-memory`` event, or its last reported memory) is said to be lost
  for memory, which resuming cannot help.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Sequence

import dask
from distributed import Client

from pipeline.cluster.workers import ClusterWorker, scheduler_address
from pipeline.config.cluster_config import ClusterConfig
from pipeline.costmodel.memory import MemoryConstants, fmt_bytes
from pipeline.records.memory import machine_memory_constants, memory_baseline
from pipeline.placement.memory_fit import MemoryRefused
from tasks.setup_gate import serves_run
from tasks.memory import EXTERNAL_WORKER_IMPORTS, current_rss

#: The nanny's event when it restarts a worker for memory (distributed/worker_memory.py).
RESTART_EVENT = "worker-restart-memory"
#: A lost worker whose last reported memory was at least this share of its usable
#: memory is taken to have been lost for memory (no nanny event: `--no-nanny`, the
#: kernel's OOM killer).
NEAR_LIMIT = 0.9
#: Seconds the workers have to answer this module's questions (a frozen one never
#: does: its answer is then taken as unknown, and the run's stall watch finds it).
ASK_WORKERS_S = 10.0


@dataclass(frozen=True)
class MemoryRule:
    """The share of its limit a worker may hold before Dask acts, and what Dask does."""

    fraction: float
    action: str  # "" where Dask does nothing

    def describe(self) -> str:
        return f"{self.action} at {self.fraction * 100:.0f} % of its limit" if self.action else ""


def memory_rule(pause: float | bool, terminate: float | bool, nanny: bool) -> MemoryRule:
    """What Dask lets a worker hold (pure): its pause fraction, or its nanny's restart
    fraction where that is lower (a worker without a nanny is never restarted), or
    all of the limit where neither is set (``False`` in Dask's config)."""
    rules = []
    if pause is not False and pause is not None:
        rules.append(MemoryRule(float(pause), "Dask pauses a worker"))
    if nanny and terminate is not False and terminate is not None:
        rules.append(MemoryRule(float(terminate), "its nanny restarts it"))
    return min(rules, key=lambda rule: rule.fraction, default=MemoryRule(1.0, ""))


def memory_rules(client: Client, workers: dict[str, dict]) -> dict[str, MemoryRule]:
    """Each worker's `MemoryRule`, by address, from its own Dask config (this process's
    where a worker does not answer). The question is sent by value, so a worker
    that has not imported this project answers it without importing torch."""

    def fractions() -> tuple[Any, Any]:
        import dask as worker_dask  # the worker's own config
        return (worker_dask.config.get("distributed.worker.memory.pause", False),
                worker_dask.config.get("distributed.worker.memory.terminate", False))

    here = (dask.config.get("distributed.worker.memory.pause", False),
            dask.config.get("distributed.worker.memory.terminate", False))
    try:
        answered = client.run(fractions, workers=list(workers), on_error="return",
                              callback_timeout=ASK_WORKERS_S)
    except (OSError, TimeoutError):
        answered = {}
    rules = {}
    for address, info in workers.items():
        value = answered.get(address)
        pause, terminate = value if isinstance(value, (tuple, list)) else here
        rules[address] = memory_rule(pause, terminate, bool(info.get("nanny")))
    return rules


def limit_problem(workers: dict[str, dict], rules: dict[str, MemoryRule],
                  need: float) -> str | None:
    """One line naming every worker (of the scheduler's table, `workers`) whose
    memory limit lets it hold less than `need`, a bare worker process (pure); None
    when all can."""
    short, why = [], ""
    for address, info in sorted(workers.items(), key=lambda item: str(item[1].get("name"))):
        limit = float(info.get("memory_limit") or 0)
        rule = rules.get(address, MemoryRule(1.0, ""))
        if limit and limit * rule.fraction < need:
            short.append(f"worker {info.get('name')}: {fmt_bytes(limit)} limit, a worker "
                         f"needs at least {fmt_bytes(need / rule.fraction)}")
            why = why or rule.describe()
    if not short:
        return None
    return (f"memory: {'; '.join(short)} (a bare dask worker holds {fmt_bytes(need)} once "
            f"it has imported torch and this project, measured on this machine"
            f"{'; ' + why if why else ''}); start it with a larger --memory-limit, or 0 "
            "for none")


def check_worker_limits(client: Client, config: ClusterConfig,
                        workers: dict[str, dict]) -> None:
    """Refuse (`MemoryRefused`, one line) a cluster the user started whose workers'
    memory limits cannot hold a set-up worker, before the setup would kill them.
    The workers of `workers` (the scheduler's table) that the setup reaches are
    checked: those that may be the run's (`serves_run`: offering one of its tags, or its
    master); on the others the setup does nothing. Embedded and linked clusters start
    their workers without a limit."""
    if scheduler_address(config) is None:
        return
    limited = {a: info for a, info in workers.items() if info.get("memory_limit")
               and serves_run(str(info.get("name")), info.get("resources") or {},
                              config.tags(), config.master)}
    if not limited:
        return
    problem = limit_problem(limited, memory_rules(client, limited),
                            float(memory_baseline(EXTERNAL_WORKER_IMPORTS)))
    if problem:
        raise MemoryRefused(problem)


def worker_constants(client: Client, config: ClusterConfig,
                     workers: Sequence[ClusterWorker]) -> MemoryConstants:
    """The memory model's constants for this run's workers: on an embedded or linked
    cluster (forked workers, which the constants describe), this machine's
    (`machine_memory_constants`: its bare processes measured); on a cluster the user
    started, the baseline is the most any of its workers holds now, once set up
    (measured on each: an unforked `dask worker` holds Dask's worker and everything it
    imported, over 100 MB more than a forked one)."""
    constants = machine_memory_constants()
    if scheduler_address(config) is None or not workers:
        return constants
    try:
        held = client.run(current_rss, workers=[w.address for w in workers],
                          callback_timeout=ASK_WORKERS_S)
    except (OSError, TimeoutError):
        return constants
    most = max((float(v) for v in held.values() if isinstance(v, int)), default=0.0)
    if most <= constants.worker_baseline:
        return constants
    return dataclasses.replace(constants, worker_baseline=most)


def memory_loss_notes(addresses: Sequence[str], events: Sequence[tuple[float, dict]],
                      last_seen: dict[str, dict],
                      rules: dict[str, MemoryRule]) -> dict[str, str]:
    """Why each of `addresses` (lost workers) was lost, where memory explains it
    (pure): its nanny restarted it for memory (`events`: the scheduler's
    ``worker-restart-memory`` events), or its last reported memory (`last_seen`: the
    scheduler's table as the run last saw it) was within `NEAR_LIMIT` of what Dask
    lets it hold. Workers memory does not explain are left out."""
    notes = {}
    restarted = {msg.get("worker"): msg for _, msg in events if isinstance(msg, dict)}
    for address in addresses:
        info = last_seen.get(address, {})
        limit = float(info.get("memory_limit") or 0)
        rule = rules.get(address, MemoryRule(1.0, ""))
        if address in restarted:
            held = float(restarted[address].get("rss") or 0)
            notes[address] = (f"its nanny restarted it for memory: it held {fmt_bytes(held)}"
                              + (f" of its {fmt_bytes(limit)} limit" if limit else ""))
            continue
        held = float(info.get("metrics", {}).get("memory") or 0)
        if limit and held >= NEAR_LIMIT * rule.fraction * limit:
            notes[address] = (f"it last reported {fmt_bytes(held)} held of its "
                              f"{fmt_bytes(limit)} memory limit"
                              + (f" ({rule.describe()})" if rule.action else ""))
    return notes


def _share_held(info: dict) -> float:
    """The share of its memory limit a worker last reported holding (0: no limit)."""
    limit = float(info.get("memory_limit") or 0)
    return float(info.get("metrics", {}).get("memory") or 0) / limit if limit else 0.0


def lost_for_memory(client: Client, addresses: Sequence[str], last_seen: dict[str, dict],
                    patience: float = 1.0) -> dict[str, str]:
    """`memory_loss_notes` for workers just lost, from the scheduler's events and the
    table the run last saw (`last_seen`). A nanny's event may reach the scheduler
    after the worker's removal, so while a lost worker that last held over half its
    limit is not explained, the events are asked again for `patience` seconds;
    others (no limit, or far from it: a recovery should not wait) are looked up once."""
    rules = {a: memory_rule(dask.config.get("distributed.worker.memory.pause", False),
                            dask.config.get("distributed.worker.memory.terminate", False),
                            bool(last_seen.get(a, {}).get("nanny"))) for a in addresses}
    limited = {a for a in addresses if _share_held(last_seen.get(a, {})) > 0.5}
    deadline = time.monotonic() + patience
    while True:
        try:
            events = client.get_events(RESTART_EVENT)
        except (OSError, TimeoutError):
            events = ()
        notes = memory_loss_notes(addresses, events, last_seen, rules)
        if limited <= set(notes) or time.monotonic() > deadline:
            return notes
        time.sleep(0.2)
