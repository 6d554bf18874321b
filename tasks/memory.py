"""A process's peak memory over a stretch of work: host resident memory and, on a
GPU, what torch's caching allocator handed out and held.

Why the kernel's high-water mark and not a sampling thread: a thread that reads the
resident size every few milliseconds misses a peak that lasts less (an im2col
buffer, a gradient freed at once) and costs the compute a wake-up each time. Linux
keeps the peak itself (``VmHWM`` in ``/proc/self/status``) and lets the process
reset it to the current size by writing ``5`` to ``/proc/self/clear_refs`` (since
Linux 4.0; the file belongs to the process's own user, so no privilege is needed).
So a stretch of work (a task's ops, the reference's step) is bracketed by
`reset_peak` and `read_peak`, and the peak it reports is the most the process held
at any moment in between, everything it held already included.

Where that reset is refused (no /proc, an older kernel, another OS), the peak is the
process's lifetime peak (`resource.getrusage`'s ``ru_maxrss``), and ``kind`` says
so: a peak that never falls, not one per stretch. Every process of a run measures
its own, so workers sharing one process (some tests) share one figure.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
from dataclasses import dataclass

PER_STRETCH, LIFETIME = "per-step", "lifetime"
_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
#: What a bare process imports to stand for each kind of process of a run: a Dask
#: worker imports distributed and the task modules (torch, numpy, zarr; not xarray or
#: pandas, about 45 MB more), the client the whole pipeline. The embedded cluster's
#: workers are forked from a process that imported exactly `WORKER_MODULES`
#: (pipeline/cluster/fork_server.py), so their baseline is a child forked from such a process
#: (`bare_process_rss`).
WORKER_MODULES = ("distributed", "tasks.step_task")
WORKER_IMPORTS = "import " + ", ".join(WORKER_MODULES)
CLIENT_IMPORTS = "import pipeline.run"
#: A `dask worker` you start yourself is not forked from a process that imported torch:
#: it imports Dask's worker command line, then (once a run sets it up) the task modules,
#: all on pages of its own. A bare process of that kind (unforked: `bare_process_rss`
#: forks only for `WORKER_IMPORTS`) is the least such a worker holds.
EXTERNAL_WORKER_IMPORTS = "import distributed.cli.dask_worker, tasks.step_task"


@dataclass(frozen=True)
class MemoryPeak:
    """The most a process held over one stretch of work, in bytes (GPU figures 0 on a
    CPU worker); `kind` is `PER_STRETCH` or `LIFETIME` (see the module)."""

    rss: int
    gpu_allocated: int = 0
    gpu_reserved: int = 0
    kind: str = PER_STRETCH

    def as_dict(self) -> dict[str, int | str]:
        return {"rss": self.rss, "gpu_allocated": self.gpu_allocated,
                "gpu_reserved": self.gpu_reserved, "kind": self.kind}


def _status_kib(field: str) -> int | None:
    """A ``Vm...`` line of /proc/self/status in KiB (None where there is none)."""
    try:
        with open(_STATUS, encoding="ascii") as handle:
            match = re.search(rf"^{field}:\s+(\d+)\s+kB", handle.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def _lifetime_rss() -> int:
    """The process's lifetime peak: ru_maxrss is KiB on Linux, bytes on macOS."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _cuda(device: str) -> bool:
    if not device.startswith("cuda"):
        return False
    import torch  # here, not at the top: a process that only reads these constants
    # (the client of an embedded cluster, pipeline/cluster/fork_server.py) stays torch-free
    return torch.cuda.is_available()


def reset_peak(device: str = "cpu") -> str:
    """Start a stretch: the resident peak back to the current size (and the GPU's peak
    counters on a CUDA device). Returns the kind of peak `read_peak` will give."""
    if _cuda(device):
        import torch
        torch.cuda.reset_peak_memory_stats(torch.device(device))
    try:
        with open(_CLEAR_REFS, "w", encoding="ascii") as handle:
            handle.write("5")
    except OSError:
        return LIFETIME
    return PER_STRETCH if _status_kib("VmHWM") is not None else LIFETIME


def read_peak(device: str = "cpu", kind: str = PER_STRETCH) -> MemoryPeak:
    """The peak since `reset_peak` (whose return value is `kind`)."""
    hwm = _status_kib("VmHWM") if kind == PER_STRETCH else None
    rss = hwm * 1024 if hwm is not None else _lifetime_rss()
    if not _cuda(device):
        return MemoryPeak(rss, kind=kind if hwm is not None else LIFETIME)
    import torch
    where = torch.device(device)
    return MemoryPeak(rss, int(torch.cuda.max_memory_allocated(where)),
                      int(torch.cuda.max_memory_reserved(where)),
                      kind if hwm is not None else LIFETIME)


def current_rss() -> int:
    """The process's resident memory now, in bytes (its lifetime peak without /proc)."""
    rss = _status_kib("VmRSS")
    return rss * 1024 if rss is not None else _lifetime_rss()


def bare_process_rss(imports: str = WORKER_IMPORTS) -> int:
    """The resident memory of a fresh Python process that has run `imports` (the
    import line of `WORKER_IMPORTS` or `CLIENT_IMPORTS`) and done nothing else: what
    no process of that kind can avoid, subtracted from its peak to give its
    "working" memory. Why one per kind: a baseline that imported more than a worker
    does would leave a small network's worker a negative working memory.

    For `WORKER_IMPORTS`, a child forked from that process, as the workers are forked
    from the fork server: a forked child starts without its parent's pages of the
    libraries' files (Linux fills those page tables on the child's first touch), so
    it holds about 75 MB less than its parent (182 against 259 MB on the Intel host),
    and a worker's peak was below the unforked figure. Measured in a subprocess
    (about as long as importing torch); 0 where that fails."""
    report = "print(current_rss(), flush=True)"
    if imports == WORKER_IMPORTS:
        report = (f"child = os.fork()\nif child == 0:\n    {report}\n    os._exit(0)\n"
                  "os.waitpid(child, 0)")
    code = f"{imports}\nimport os\nfrom tasks.memory import current_rss\n{report}\n"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, env=env, check=True)
        return int(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0
