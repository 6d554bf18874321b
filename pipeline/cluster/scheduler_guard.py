"""A limit on a run's wait for a silent scheduler outside the step loop.

The step loop asks its scheduler with a limit (`SchedulerWatch` in `live_workers`),
but a run also asks it elsewhere: to find its workers, to probe and place its work,
at a checkpoint whether workers joined, and to recover from a lost worker. Those
questions go through Dask's client (`Client.sync`, futures' results), which never
times out a question on an open connection, so a stopped scheduler held the run there
silently for as long as it was stopped.

`guarded` bounds a whole block instead of each question: a thread asks the scheduler
for its identity every second, said and limited by the run's `SchedulerWatch` rules
(a warning after half the limit, `cluster.scheduler_timeout` in all). At the limit
it closes the client: what the block waits on then fails at once (a closed client
cancels its futures and its connections), and the block ends in `SchedulerLost`,
naming what the run was doing, as the step loop's loss does.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from distributed import Client

from pipeline.cluster.workers import (SchedulerLost, SchedulerSilent, SchedulerWatch,
                                      abandon_client)

__all__ = ["guarded", "SchedulerGuard", "SchedulerSilentThen"]

#: Seconds between two questions to a scheduler that answers.
ASK_EVERY_S = 1.0


class SchedulerGuard:
    """A thread that asks `client`'s scheduler for its identity until stopped, and
    closes the client once the scheduler has been silent for the watch's limit."""

    def __init__(self, client: Client, watch: SchedulerWatch) -> None:
        self.client, self.watch = client, watch
        self.silenced: SchedulerSilent | None = None  # set once the limit passed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._ask, name="scheduler-guard",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _ask(self) -> None:
        while not self._stop.is_set():
            try:
                self.client.sync(self.client.scheduler.identity, n_workers=0,
                                 callback_timeout=self.watch.ask_s())
            except TimeoutError:  # no answer within the question's slice
                if self._stop.is_set():
                    return
                try:
                    self.watch.unanswered()
                except SchedulerSilent as silent:
                    self.silenced = silent
                    abandon_client(self.client)  # what the block waits on fails now
                    return
                continue
            except Exception:  # noqa: BLE001 - a closed client or a dead scheduler: the
                return  # block's own calls fail and say so
            self.watch.answered()
            self._stop.wait(ASK_EVERY_S)


@contextlib.contextmanager
def guarded(client: Client | None, limit: float | None, doing: str) -> Iterator[None]:
    """Run the block with its scheduler watched (`SchedulerGuard`); a scheduler
    silent for `limit` seconds (`cluster.scheduler_timeout`; None: wait for ever,
    with the warning) ends it in `SchedulerLost` naming `doing`. Without a client
    (work in this process: `reference`) there is nothing to watch."""
    if client is None:
        yield
        return
    address = getattr(client.scheduler, "address", None) or "?"
    guard = SchedulerGuard(client, SchedulerWatch(limit, address))
    guard.start()
    try:
        yield
    except Exception as error:
        # `silenced` is set before the client closes, so before anything fails of it
        if guard.silenced is not None:
            raise SchedulerSilentThen(doing, address, guard.silenced) from error
        raise
    finally:
        guard.stop()
    if guard.silenced is not None:  # the block swallowed what the closed client raised
        raise SchedulerSilentThen(doing, address, guard.silenced)


class SchedulerSilentThen(SchedulerLost):
    """A guarded block's scheduler went silent past its limit: what the run was doing,
    and the silence (a caller that can go on without the block says so its own way)."""

    def __init__(self, doing: str, address: str, silent: SchedulerSilent) -> None:
        self.doing, self.address, self.silent = doing, address, silent
        super().__init__(f"{doing}: lost the Dask scheduler at {address} ({silent}); the "
                         "run stopped (its checkpoints are kept)")
