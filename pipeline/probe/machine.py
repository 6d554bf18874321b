"""What identifies this machine for a cached probe: its name is not enough.

A probe's figures are this machine's arithmetic and memory speeds. Cloud machines
are often all named alike ("vm", "localhost", an image's default), and a machine of
one name can come back on another CPU: this project's own ran on an AMD EPYC until
2026-11-25 and on an Intel Xeon on 2026-11-27, named "vm" both times, with the probe
cache kept in the home directory between them, so a probe cached on one would have
been taken for the other's. So the cache key holds the host name, the CPU model, the
cores this process may use, the instruction set torch's kernels use, and the NVIDIA
GPUs' models: a probe is reused only on a machine that matches it in all of them.

Read from /proc without starting CUDA. The key covers the client's machine; an
external cluster's workers on other machines are known to it only by name and
threads (docs/model.md, "Calibration on a real cluster").
"""

from __future__ import annotations

import functools
import glob
import platform
import socket

import torch

from pipeline.cluster.startup import usable_cores

CPUINFO = "/proc/cpuinfo"
NVIDIA_GPUS = "/proc/driver/nvidia/gpus/*/information"


def cpu_model(cpuinfo: str = CPUINFO) -> str:
    """The CPU's model name (the first "model name" line of /proc/cpuinfo), else what
    `platform` knows."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def gpu_models(pattern: str = NVIDIA_GPUS) -> list[str]:
    """The NVIDIA driver's model of each GPU, in its order (none without the driver)."""
    models = []
    for path in sorted(glob.glob(pattern)):
        try:
            with open(path, encoding="utf-8", errors="replace") as handle:
                for line in handle:
                    key, _, value = line.partition(":")
                    if key.strip() == "Model":
                        models.append(value.strip())
        except OSError:
            continue
    return models


@functools.cache
def machine_identity() -> str:
    """This machine as a probe's cache key and record name it, e.g. "vm: Intel(R)
    Xeon(R) Processor, 2 cores, AVX512" (read once per process: every cache lookup
    asks)."""
    parts = [cpu_model(), f"{usable_cores()} cores", torch.backends.cpu.get_cpu_capability(),
             *gpu_models()]
    return f"{socket.gethostname()}: {', '.join(parts)}"
