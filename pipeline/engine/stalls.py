"""When a run waiting on its workers has stalled, and on whom or what.

A worker that stops answering while the run waits on it (SIGSTOP, a frozen host, a
cut link: its Dask process cannot answer across it) is a stall. `StallWatch` says
how long a run may go without a task finishing; past that, the runner
(pipeline/engine/runner.py) asks the workers holding unfinished tasks for their
identity, and `stall_verdict` judges what it heard: one that does not answer is
fenced off and reported as lost, so the run recovers as from a dead worker. When
every worker answers, each is asked to list the run's stores (`stores_silent_on`,
storage/liveness.py): a store that none of them can list stopped answering (a
frozen file server), which no recovery gets past (the survivors would wait on it
too), so the run stops with `StoreStalled`; a store only some workers cannot reach
makes those workers stalled. Before the limit, a long wait is named on the progress
bar (`waiting_note`).
"""

from __future__ import annotations

import asyncio
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from distributed import Client

from pipeline.cluster.workers import ClusterError
from storage.liveness import silent_stores

#: `cluster.stall_timeout: auto`: the limit is this many median steps, at least
#: STALL_FLOOR_S; before any step is measured (loading the shards, the first step),
#: FIRST_STALL_S.
STALL_STEPS, STALL_FLOOR_S, FIRST_STALL_S = 10.0, 30.0, 120.0
#: Seconds a probed worker has to answer before it counts as stalled (at most the
#: limit itself), and to list the run's stores.
PROBE_S = 5.0
#: Seconds without a task finishing after which the progress bar names the workers
#: waited for (at most half the stall limit).
WAIT_NOTE_S = 5.0


class StoreStalled(ClusterError):
    """The run's stores stopped answering every worker: the run cannot go on."""

    def __init__(self, message: str, paths: list[str]) -> None:
        super().__init__(message)
        self.paths = paths  # the stores (directories or URLs) that did not answer


@dataclass
class Verdict:
    """What a stall probe found: workers to fence off, or stores that stopped answering
    (neither: the run is busy, or waits for data, which workspace.wait_timeout ends)."""

    workers: list[str] = field(default_factory=list)  # addresses
    stores: list[str] = field(default_factory=list)  # paths; with workers: what they missed


def stall_verdict(silent: list[str], holders: list[str], store_silence: dict[str, list[str]],
                  before: dict[str, list[str]]) -> Verdict:
    """Judge a stall probe: `silent`, the holders of unfinished tasks that did not
    answer a call; `store_silence`, for every worker that answered the store probe,
    the stores it could not list (`before`: the same from the previous probe of this
    stall, {} if none). Workers that do not answer are stalled (the store is not
    asked). A store no replying worker could list has stopped (the stores every one
    of them missed; their union if none is common). Holders that could not reach a
    store on two probes in a row are stalled (their own mount or link fails them; one
    slow listing on a loaded host is not enough)."""
    if silent:
        return Verdict(workers=list(silent))
    if store_silence and all(store_silence.values()):
        common = set.intersection(*(set(paths) for paths in store_silence.values()))
        missed = common or set().union(*store_silence.values())
        order = [p for paths in store_silence.values() for p in paths]
        return Verdict(stores=sorted(missed, key=order.index))
    cut_off = [a for a in holders if store_silence.get(a) and before.get(a)]
    if cut_off:
        missed = {p for a in cut_off for p in store_silence[a]}
        return Verdict(workers=cut_off, stores=sorted(missed))
    return Verdict()


def waiting_note(quiet_s: float, limit: float | None, holding: dict[str, list[str]]) -> str:
    """What the progress bar says while the run waits on workers before the stall
    limit: for how long, on whom (`holding`: each worker's label and what it holds),
    and the limit; "" when it is not waiting long enough to say
    (`WAIT_NOTE_S`, or half the limit if shorter). A frozen worker is seen
    here well before the limit declares it stalled."""
    if not holding or quiet_s < (WAIT_NOTE_S if limit is None else min(WAIT_NOTE_S, limit / 2)):
        return ""
    whom = "; ".join(f"{label} ({', '.join(doing)})" for label, doing in holding.items())
    after = "never" if limit is None else f"at {limit:g} s"
    return f"waiting {quiet_s:.0f} s on {whom}; stall declared {after}"


def stores_silent_on(client: Client, addresses: list[str], paths: list[str],
                     timeout: float) -> dict[str, list[str]]:
    """Each worker's stores (of `paths`) it could not list within `timeout` seconds,
    for the workers that replied (a worker that did not is left out: no evidence)."""

    async def ask(address: str) -> Any:
        try:
            replies = await asyncio.wait_for(
                client._run(silent_stores, paths, timeout, workers=[address], on_error="return"),
                timeout + PROBE_S)
        except (asyncio.TimeoutError, OSError):
            return None
        return replies.get(address)

    async def probe() -> list[Any]:
        return await asyncio.gather(*(ask(a) for a in addresses))

    replies = client.sync(probe)
    return {a: list(r) for a, r in zip(addresses, replies) if isinstance(r, list)}


def store_names(paths: list[str]) -> str:
    """How a stall's line names `paths`: "the store P" or "the stores P, Q"."""
    return f"the store {paths[0]}" if len(paths) == 1 else f"the stores {', '.join(paths)}"



class StallWatch:
    """How long a run may go without progress before its busy workers are probed.

    A fixed number of seconds, None (never), or "auto": `STALL_STEPS` times the median
    of the last 101 collected tasks (each of one or more steps: progress is seen when
    one finishes), at least `STALL_FLOOR_S` (a step's time varies with the machine's
    load; a stall is a worker gone silent, not a slow step).
    """

    def __init__(self, setting: float | None | Literal["auto"]) -> None:
        self.setting = setting
        self.tasks: deque[float] = deque(maxlen=101)

    def task_took(self, seconds: float) -> None:
        self.tasks.append(seconds)

    def limit(self) -> float | None:
        if self.setting != "auto":
            return None if self.setting is None else float(self.setting)
        if not self.tasks:
            return FIRST_STALL_S
        return max(STALL_FLOOR_S, STALL_STEPS * statistics.median(self.tasks))

    def wait_s(self, quiet_s: float) -> float:
        """How long a run that has seen no progress for `quiet_s` seconds waits for
        some before it looks again: 2 s, or until the limit if that comes first (a
        stall is judged at its limit, not up to 2 s after it)."""
        limit = self.limit()
        return 2.0 if limit is None else min(2.0, max(0.05, limit - quiet_s))
