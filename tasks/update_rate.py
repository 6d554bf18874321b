"""How fast a worker streams memory, timed on the op that streams the most: a replica's
update.

A replica's ``grad-update`` (tasks/data_ops.py) concatenates the summed ranges of the
flat gradient and steps SGD with momentum over every parameter: element-wise passes
over the whole parameter count, each bound by memory, not arithmetic. Its time per
parameter, measured on every worker at once (as the replicas run it, sharing the
memory bus), is the probe's figure of a worker's memory rate (pipeline/probe/
replica_rates.py); the cost model prices every element-wise pass by it.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np
import torch

from tasks.optim import make_sgd
from tasks.specs import OptimizerSpec
from tasks.worker_state import WorkerProfile, current_profile, release_freed_memory

#: The shortest round timed: smaller parameter counts repeat the update within one.
ROUND_S = 0.002


def time_update(elements: int, pieces: int, dtype: str, start_at: float,
                repeats: int = 5) -> dict:
    """Seconds per parameter of a replica's update over `elements` parameters: the
    concatenation of `pieces` summed ranges and an SGD step with momentum (as
    ``grad-update`` runs them), on this worker's device, emulated slowness included.

    The update starts at wall-clock time `start_at` (every worker of the probe is
    given the same), so that the workers stream at once as replicas do."""
    profile = current_profile()
    round_s, loops = _timed_rounds(profile, elements, pieces, getattr(torch, dtype),
                                   start_at, repeats)
    release_freed_memory()  # a run's peak is its own, not the probe's
    return {"worker": profile.name, "seconds_per_element": round_s / (loops * elements),
            "elements": elements, "loops": loops}


def _timed_rounds(profile: WorkerProfile, elements: int, pieces: int, dtype: torch.dtype,
                  start_at: float, repeats: int) -> tuple[float, int]:
    """The median round's seconds, and the updates in a round."""
    param = torch.zeros(elements, dtype=dtype, device=profile.device)
    ranges = [piece.clone() for piece in torch.ones(elements, dtype=dtype,
                                                    device=profile.device).chunk(pieces)]
    optimizer = make_sgd([param], OptimizerSpec(lr=1e-6, momentum=0.9))

    def update() -> None:
        param.grad = torch.cat(ranges)
        optimizer.step(0)

    update()  # the momentum buffer's first step clones the gradient
    loops = _loops_per_round(update, profile)
    time.sleep(max(0.0, start_at - time.time()))
    seconds = profile.time_rounds(lambda: [update() for _ in range(loops)], repeats)
    return float(np.median(seconds)), loops


def _loops_per_round(update: Callable[[], None], profile: WorkerProfile) -> int:
    """Updates per timed round, so that a round lasts at least `ROUND_S`."""
    start = time.perf_counter()
    update()
    profile.synchronize()
    once = max(time.perf_counter() - start, 1e-7)
    return max(1, math.ceil(ROUND_S / once))
