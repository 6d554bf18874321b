"""The one-device step a scaling point's speedup is measured against: `single`
(`BASELINE`) on one device of the point's fastest kind, at its network and batch;
and a mix's devices in the order the model takes them, fastest kind first.

Why the fastest kind: a mix written `{cpu: 4, gpu: 4}` and one written
`{gpu: 4, cpu: 4}` are the same hardware. Against "the first kind written", the same
8 devices read 76x (against a CPU) or 1.3x (against a GPU) in one grid, and `single`
on the mix ran on whichever came first. Against the fastest, a speedup says how much
the mix gains over the best one device in it, whatever the order.

Apart from run.py because the baseline is a rule of its own (which device, cached
across the grid's points), and the figures and report name it too.
"""

from __future__ import annotations

from experiments.scaling import hardware as hw
from experiments.scaling.config import ScalingPoint, network_of
from pipeline.costmodel import DeviceSpec, predict

__all__ = ["BASELINE", "UNFIT_BASELINE", "UNFIT_NOTE", "single_time", "devices_fastest_first"]

#: The strategy every scaling point's speedup is measured against, on one device.
BASELINE = "single"

#: Marks a speedup whose baseline (`single` on one device) does not fit that device,
#: in the report's tables and the sweep's closing lines alike.
UNFIT_BASELINE = "*"
UNFIT_NOTE = (f"{UNFIT_BASELINE}: `single` does not fit one device's memory at this network "
              "and batch; the speedup is against its predicted step as if it did")

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


def devices_fastest_first(point: ScalingPoint) -> tuple[list[DeviceSpec], list[str]]:
    """The point's devices and their kinds' names, the fastest kind (`single_time`)
    first, a tie in the order written: so the speedup's baseline, the device `single`
    runs on and `kernel`'s master (device 0) are the mix's fastest, however it is
    written."""
    return hw.device_list(point.hardware, rank=lambda kind: single_time(point, kind))
