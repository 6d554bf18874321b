"""Whether a scaling point fits its devices' memory: each device's predicted peak
(the strategy's `peak_memory`, under the split the model used) against its kind's
``memory`` (`experiments.scaling.hardware`).

Why it decides feasibility: a point whose shares do not fit would not run at all,
so a step time for it would answer a question nobody can ask; the scaling run
records such a point as infeasible, with the line this module writes, and keeps
the peak so the store says how much memory it would need.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

from experiments.scaling import hardware as hw
from experiments.scaling.config import ScalingPoint, network_of, point_strategy
from pipeline.strategies import strategy_named
from pipeline.costmodel import Network, Prediction
from pipeline.costmodel.memory import Footprint

__all__ = ["MemoryVerdict", "memory_verdict", "baseline_fits", "size_text"]


@dataclass(frozen=True)
class MemoryVerdict:
    """The largest predicted peak per device, whether every device's fits its kind's
    memory (NaN: the strategy's memory model gave no figure), and if not, the one
    line saying which kind falls short by how much."""

    largest: float
    fits: float
    shortfall: str = ""


@functools.lru_cache(maxsize=16)
def _footprint(peak_memory: Callable[..., Footprint], network: Network, batch: int,
               split: tuple[tuple[int, ...], ...] | None, master: int,
               gpu: tuple[bool, ...]) -> Footprint:
    """A strategy's `peak_memory`, kept for the next points: a sweep's points that
    differ only in link bandwidth or in the rate of equal devices (its innermost axes,
    here) share the split and so the footprint, which at thousands of devices costs
    more than the step."""
    return peak_memory(network, batch, None if split is None else [list(row) for row in split],
                       master=master, gpu=list(gpu))


def memory_verdict(point: ScalingPoint, prediction: Prediction, kinds: list[str]
                   ) -> MemoryVerdict:
    """Each used device's predicted peak under the split the model used, against its
    kind's memory. A peak the memory model cannot give (NaN) leaves the point
    predicted, its fit unknown."""
    strategy = point_strategy(point)
    if not strategy.memory_model:  # a strategy the memory count does not know
        return MemoryVerdict(math.nan, math.nan)
    network = network_of(point.network)
    presets = {kind: hw.resolve_kind(point.hardware, kind) for kind in set(kinds)}
    kinds = kinds[:strategy.devices_used(len(kinds))]
    split = strategy.split_of_prediction(prediction)
    footprint = _footprint(strategy.peak_memory, network, point.train.batch,
                           None if split is None else tuple(map(tuple, split)),
                           int(prediction.details.get("master", 0)),
                           tuple(presets[k].accelerator for k in kinds))
    peaks = [float(peak) for peak in footprint.per_device]
    if not peaks or any(math.isnan(peak) for peak in peaks):
        return MemoryVerdict(math.nan, math.nan)
    over = [(peak - presets[k].memory, peak, k) for peak, k in zip(peaks, kinds)
            if peak > presets[k].memory]
    if not over:
        return MemoryVerdict(max(peaks), 1.0)
    _, peak, kind = max(over)
    return MemoryVerdict(max(peaks), 0.0, f"out of memory: a device needs {size_text(peak)}, "
                         f"more than the {size_text(presets[kind].memory)} of one `{kind}` "
                         f"(hardware.kinds.{kind}.memory)")


def size_text(size: float) -> str:
    """Bytes in GB, or TB from 1000 GB (a 4096-sample step needs 12.2 TB, not 1.22e+04 GB)."""
    return f"{size / 1e12:.3g} TB" if size >= 1e12 else f"{size / 1e9:.3g} GB"


def baseline_fits(point: ScalingPoint, kind: str) -> float:
    """1 where the speedups' baseline, `single` on one device of ``kind`` at the
    point's network and batch, fits that device's memory, 0 where it does not, NaN
    where the memory model gives no figure. A speedup over a baseline that could not
    run compares with a step no one could measure: the report marks it."""
    single = strategy_named("single")
    preset = hw.resolve_kind(point.hardware, kind)
    footprint = _footprint(single.peak_memory, network_of(point.network), point.train.batch,
                           None, 0, (preset.accelerator,))
    peaks = [float(peak) for peak in footprint.per_device]
    if not peaks or math.isnan(peaks[0]):
        return math.nan
    return float(peaks[0] <= preset.memory)
