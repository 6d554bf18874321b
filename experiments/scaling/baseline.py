"""The one-device step a scaling point's speedup is measured against: `single`
(`BASELINE`) on one device of a kind, at the point's network and batch.

Apart from run.py because the baseline is a rule of its own (which device, cached
across the grid's points), and the figures and report name it too.
"""

from __future__ import annotations

from experiments.scaling import hardware as hw
from experiments.scaling.config import ScalingPoint, network_of
from pipeline.costmodel import predict

__all__ = ["BASELINE", "single_time"]

#: The strategy every scaling point's speedup is measured against, on one device.
BASELINE = "single"

_SINGLE: dict[tuple, float] = {}


def single_time(point: ScalingPoint, kind: str) -> float:
    """`single` (`BASELINE`) on one device of ``kind`` at the point's network and
    batch (cached: a grid asks it for every point, of a few networks and kinds)."""
    preset = hw.resolve_kind(point.hardware, kind)
    network = network_of(point.network)
    key = (network, point.train.batch, preset)
    if key not in _SINGLE:
        device = hw.device_spec(point.hardware, kind)
        _SINGLE[key] = predict(BASELINE, network, point.train.batch, device).step_time
    return _SINGLE[key]
