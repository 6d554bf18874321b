"""Other users of an external cluster: clients of the same scheduler with work on it.

A run's step times are its workers' times. On a cluster the user started (`dask
scheduler`, `dask worker`), another client (a second run or sweep, a notebook) may
hold tasks on the same workers at the same time: their work then slows this run's
steps, and its figures (and the model's errors against them) include it, with
nothing in the record to say so. So a run on an external scheduler asks how many
other clients hold tasks there once its work is placed, at each checkpoint (a run
started after this one and done before its end is seen there) and when its steps are
done, and says so in a warning that its record's notes keep (`SharedUseWatch`). A
client that is only connected (a dashboard's, an idle notebook's) holds none and is
not counted.
"""

from __future__ import annotations

from typing import Any, Callable

from distributed import Client

from pipeline.cluster.workers import scheduler_address
from pipeline.config.cluster_config import ClusterConfig

__all__ = ["SharedUseWatch", "other_clients_with_work", "shared_use_warning"]

#: The scheduler's own client of `fire_and_forget` tasks.
FIRE_AND_FORGET = "fire-and-forget"


def other_clients_with_work(client: Client) -> int:
    """How many clients of `client`'s scheduler, other than `client`, hold tasks
    there now. Nested so that cloudpickle sends it by value: the scheduler's Python
    need not have this project."""
    me = client.id

    def count(dask_scheduler: Any) -> int:
        return sum(1 for key, state in dask_scheduler.clients.items()
                   if key not in (me, FIRE_AND_FORGET) and state.wants_what)

    return int(client.run_on_scheduler(count))


def shared_use_warning(client: Client, when: str) -> str | None:
    """A warning line if other clients hold tasks on `client`'s scheduler (`when`:
    the moment asked, as the line says it), else None; None too where the scheduler
    cannot be asked (one that refuses to run code sent to it): the run goes on."""
    try:
        others = other_clients_with_work(client)
    except Exception:  # noqa: BLE001 - a question for the record's sake only
        return None
    if not others:
        return None
    address = getattr(client.scheduler, "address", None) or "?"
    holds = "client holds" if others == 1 else "clients hold"
    return (f"warning: {when}, {others} other {holds} tasks on the Dask scheduler at "
            f"{address} (another run or sweep?): their work shares this run's workers, so "
            "its step times include it")


class SharedUseWatch:
    """A run's questions about other clients, on a cluster the user started (`config`
    names its scheduler; elsewhere nothing is asked). `check` says the warning where
    other clients hold tasks, through the run's `say` (which keeps it in the record's
    notes); at a checkpoint (`only_new`) only where the last question found none, so
    a long run shared throughout is not warned at every checkpoint."""

    def __init__(self, client: Client, config: ClusterConfig,
                 say: Callable[[str], None]) -> None:
        self.client, self.say = client, say
        self.asks = scheduler_address(config) is not None
        self.others_before = 0

    def check(self, when: str, only_new: bool = False) -> None:
        if not self.asks or self.client.status != "running":
            return
        line = shared_use_warning(self.client, when)
        others_before, self.others_before = self.others_before, int(line is not None)
        if line and not (only_new and others_before):
            self.say(line)
