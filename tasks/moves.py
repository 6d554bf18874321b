"""Moving a run's tensors between a worker's device and the exchange workspace.

Every op reads and writes slots through a `Mover`: a read waits for the slot's
ready marker (the step graph's data edge), times the wait and the read apart, and
lands on the worker's device; a write copies to the host (through a pinned buffer
per slot on a GPU) and marks the slot ready. Writing a slot the layout does not
have (nobody else reads it) is a no-op, so an op can hand on its outputs without
knowing who reads them.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from distributed import get_worker

from storage.exchange import Exchange
from tasks.layout import Slot
from tasks.receipts import TaskClock


class Mover:
    """One run's slots as one worker reads and writes them."""

    def __init__(self, exchange: Exchange, slots: dict[str, Slot], device: str,
                 synchronize: Callable[[], None], wait_timeout: float) -> None:
        self.exchange = exchange
        self.slots = slots
        self.device = device
        self.synchronize = synchronize
        self.wait_timeout = wait_timeout
        self.staging: dict[str, torch.Tensor] = {}  # pinned host buffers, per slot

    def read(self, slot: str, step: int, clock: TaskClock) -> torch.Tensor:
        """Wait for `slot` of `step`, read it onto the device."""
        self.wait(slot, step, clock)
        return self.read_ready(slot, clock)

    def wait(self, slot: str, step: int, clock: TaskClock) -> None:
        """Wait for `slot` of `step` (timed as a wait), reading nothing yet."""
        with clock.phase("wait", slot=slot):
            self.exchange.wait(slot, step, self.wait_timeout, task_cancelled)

    def read_ready(self, slot: str, clock: TaskClock) -> torch.Tensor:
        """Read `slot`, already waited for, onto the device: a tensor of its own (a
        fresh array, moved), which the reader may change in place."""
        with clock.phase("read", slot=slot) as phase:
            data = self.exchange.read(slot)
            phase.nbytes = data.nbytes
            tensor = torch.from_numpy(data).to(self.device)
        return tensor

    def write(self, slot: str, step: int, tensor: torch.Tensor, clock: TaskClock) -> None:
        """Write `tensor` to `slot` for `step` (if the layout has that slot)."""
        if slot not in self.slots:
            return
        with clock.phase("write", slot=slot) as phase:
            data = self._to_host(slot, tensor)
            phase.nbytes = data.nbytes
            self.exchange.write(slot, step, data)

    def _to_host(self, slot: str, tensor: torch.Tensor) -> np.ndarray:
        """A contiguous host copy; from a GPU through a pinned buffer kept per slot."""
        if tensor.device.type == "cpu":
            return np.ascontiguousarray(tensor.detach().numpy())
        buffer = self.staging.get(slot)
        if buffer is None or buffer.shape != tensor.shape:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.staging[slot] = buffer
        buffer.copy_(tensor.detach(), non_blocking=True)
        self.synchronize()
        return buffer.numpy()


def task_cancelled() -> bool:
    """Whether Dask released the task this thread runs (e.g. its client went away)."""
    try:
        worker = get_worker()
        task = worker.state.tasks.get(worker.get_current_task())
    except (ValueError, AttributeError, KeyError):
        return False
    return task is None or task.state in ("cancelled", "released", "forgotten")
