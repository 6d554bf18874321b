"""Where a sweep ran and with which code, as a store records it in its attrs.

Why: timings mean little without the machine (cores, memory, GPUs) and the code
revision that produced them; measured and scaling sweeps stamp both into the
store, and the measured report prints them.
"""

from __future__ import annotations

import os
import platform
import socket
from typing import Any

import psutil

from pipeline.probe.machine import cpu_model
from pipeline.records.record import code_revision

__all__ = ["code_revision", "machine_info"]


def machine_info() -> dict[str, Any]:
    """Where the sweep ran: the figures mean little without it."""
    gpus: list[str] = []
    try:
        import torch

        if torch.cuda.is_available():
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - a broken CUDA setup must not stop a CPU sweep
        pass
    return {"host": socket.gethostname(), "platform": platform.platform(),
            "cpu": cpu_model(), "cores": os.cpu_count(),
            "physical_cores": psutil.cpu_count(logical=False),
            "memory_bytes": psutil.virtual_memory().total, "gpus": gpus}
