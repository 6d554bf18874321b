"""The small record every task returns instead of data.

A task runs one or more ops (`conv-forward`, `dense-head`, `conv-backward`, ...);
each op is an `OpEvent` made of timed `Phase`s:

- ``compute``: the device's own work (GPU work is synchronised before the clock
  is read); ``emulated``: the sleep that makes an emulated slow device slow;
- ``read`` / ``write``: workspace accesses (bytes recorded);
- ``wait``: blocked until a peer's slot was ready;
- ``dataset``: reading the batch (or its labels) from the dataset store.

Times are the worker's wall clock (``time.time()``), so the client can draw every
worker's ops on one timeline (`pipeline/records/trace.py`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

PHASES = ("compute", "emulated", "read", "write", "wait", "dataset")


@dataclass
class Phase:
    kind: str
    start: float
    end: float
    nbytes: int = 0
    slot: str = ""  # the workspace slot a read, write or wait touched

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class OpEvent:
    name: str
    layer: int
    start: float
    end: float = 0.0
    phases: list[Phase] = field(default_factory=list)


@dataclass
class Receipt:
    """What one task did: its ops with their phases, and the loss if it ran the head."""

    task: str
    worker: str
    step: int
    start: float
    end: float = 0.0
    events: list[OpEvent] = field(default_factory=list)
    loss: float | None = None
    extra: dict = field(default_factory=dict)

    def seconds(self, kind: str, op: str | None = None, layer: int | None = None) -> float:
        """Total seconds of phases of `kind` (optionally of one op name and layer)."""
        return sum(p.seconds for e in self._events(op, layer) for p in e.phases
                   if p.kind == kind)

    def nbytes(self, kind: str, op: str | None = None, layer: int | None = None) -> int:
        return sum(p.nbytes for e in self._events(op, layer) for p in e.phases if p.kind == kind)

    def _events(self, op: str | None, layer: int | None) -> list[OpEvent]:
        return [e for e in self.events
                if (op is None or e.name == op) and (layer is None or e.layer == layer)]


class TaskClock:
    """Builds a receipt while a task runs: ``with clock.op(...)``, ``with clock.phase(...)``.

    `sync` is called before every clock reading that ends a phase, so that work a
    GPU queued asynchronously is counted in the phase that queued it.
    """

    def __init__(self, receipt: Receipt, sync: Callable[[], None] = lambda: None) -> None:
        self.receipt = receipt
        self.sync = sync
        self.current: OpEvent | None = None

    @contextlib.contextmanager
    def op(self, name: str, layer: int = -1) -> Iterator[OpEvent]:
        event = OpEvent(name, layer, time.time())
        self.current = event
        try:
            yield event
        finally:
            event.end = time.time()
            self.receipt.events.append(event)
            self.current = None

    @contextlib.contextmanager
    def phase(self, kind: str, nbytes: int = 0, slot: str = "") -> Iterator[Phase]:
        """Time a phase of the op open now, and add it to that op when it ends.

        The op is the one open at the start, not whichever is open at the end: a stop
        signal raised inside contextlib's ``__exit__``, before it resumes this
        generator, leaves the phase suspended while the op closes; garbage collection
        then ends the phase after its op, and the phase still belongs to that op."""
        op = self.current
        assert op is not None, "a phase belongs to an op"
        phase = Phase(kind, time.time(), 0.0, nbytes, slot)
        try:
            yield phase
        finally:
            if kind == "compute":
                self.sync()
            phase.end = time.time()
            op.phases.append(phase)

    def add(self, kind: str, start: float, end: float, nbytes: int = 0) -> None:
        """Record a phase timed elsewhere (e.g. an emulated sleep)."""
        assert self.current is not None, "a phase belongs to an op"
        self.current.phases.append(Phase(kind, start, end, nbytes))
