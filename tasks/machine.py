"""What machine a process runs on, read where it runs: the client's for the record and
the probe cache, each worker's by a call on the worker (`worker_machine`).

A probe's figures are a machine's arithmetic and memory speeds. Cloud machines are
often all named alike ("vm", "localhost", an image's default), and a machine of one
name can come back on another CPU: this project's own ran on an AMD EPYC until
2026-11-25 and on an Intel Xeon on 2026-11-27, named "vm" both times, with the probe
cache kept in the home directory between them. So a machine is named by its host
name, CPU model, the cores the process may use (its CPU affinity: a worker started
under `taskset -c 0` has one), the instruction set torch's kernels use, and the NVIDIA
GPUs' models. On a cluster the workers' machines are not the client's (a Slurm login
node, another partition's nodes): each worker says its own.

Read from /proc without starting CUDA. Here in `tasks` because the workers run it:
they import this layer and nothing of `pipeline`.
"""

from __future__ import annotations

import functools
import glob
import os
import platform
import socket
from typing import Any

import torch

from tasks.worker_state import set_up_threads

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


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.cache
def machine_identity() -> str:
    """This process's machine as a probe's cache key and a record name it, e.g. "vm:
    Intel(R) Xeon(R) Processor, 2 cores, AVX512" (read once per process: every cache
    lookup asks)."""
    parts = [cpu_model(), f"{usable_cores()} cores", torch.backends.cpu.get_cpu_capability(),
             *gpu_models()]
    return f"{socket.gethostname()}: {', '.join(parts)}"


def worker_machine(dask_worker: Any = None) -> dict[str, Any]:
    """What a worker says of its machine (run on it by `Client.run`, which passes
    `dask_worker`): `machine_identity` and ``torch_threads``, the threads its run's
    setup gave torch (tasks/worker_state.py), or torch's own count before any setup."""
    threads = set_up_threads(dask_worker.address) if dask_worker is not None else None
    return {"machine": machine_identity(),
            "torch_threads": threads if threads is not None else torch.get_num_threads()}
