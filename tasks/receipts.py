"""The small record every task returns instead of data."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Receipt:
    """Timings and bytes of one task, for the run's record.

    `compute_s` includes `emulated_s`, the sleep that makes an emulated slow device
    slow; the two are kept apart so that a report can label emulation.
    """

    phase: str
    layer: int
    shard: int
    step: int
    worker: str = ""
    compute_s: float = 0.0
    emulated_s: float = 0.0
    read_s: float = 0.0
    write_s: float = 0.0
    read_bytes: int = 0
    write_bytes: int = 0
    start: float = field(default_factory=time.time)
    end: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def busy_s(self) -> float:
        return self.compute_s + self.read_s + self.write_s
