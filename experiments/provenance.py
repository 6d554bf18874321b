"""Where a sweep ran and with which code, as a store records it in its attrs.

Why: timings mean little without the machine (cores, memory, GPUs) and the code
revision that produced them; measured and scaling sweeps stamp both into the
store, and the measured report prints them.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from typing import Any

import psutil

def code_revision() -> str:
    """The git revision of this code, '-dirty' if tracked files have changed."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here,
                                  capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return revision + ("-dirty" if dirty.strip() else "")


def machine_info() -> dict[str, Any]:
    """Where the sweep ran: the figures mean little without it."""
    model = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            model = next((line.split(":", 1)[1].strip() for line in handle
                          if line.startswith("model name")), model)
    except OSError:
        pass
    gpus: list[str] = []
    try:
        import torch

        if torch.cuda.is_available():
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - a broken CUDA setup must not stop a CPU sweep
        pass
    return {"host": socket.gethostname(), "platform": platform.platform(),
            "cpu": model, "cores": os.cpu_count(),
            "physical_cores": psutil.cpu_count(logical=False),
            "memory_bytes": psutil.virtual_memory().total, "gpus": gpus}
