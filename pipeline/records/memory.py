"""A run's memory figures as its summary gives them: each worker's and the client's
peak, and the "working" memory, that peak less a bare process's of the same kind.

The bare processes (`tasks.memory.bare_process_rss`: a fresh Python that has imported
what a worker imports, forked once as the workers are, or what the client imports,
xarray and pandas included) cost a subprocess and an import of torch each, about 3 s
of CPU; every run's summary needs them, and the CLI runs once per process, so the
figures are kept in ``~/.cache/dask-cnn/memory-baseline.json`` (or
``$CNN_MEMORY_CACHE``), keyed by the interpreter, the libraries' versions, the import
line and `BASELINE_METHOD`, and measured again when any changes. `reference` trains
in the client process, so its peak is set against the client's baseline.

The memory model's prediction starts from the same two figures
(`machine_memory_constants`): the machine at hand's bare processes, not the ones
measured where the model was written, so that a predicted and a measured peak stand on
one baseline; and beyond them from the project's runtimes on this machine, a tiny
run's working memory (`memory_runtimes`, pipeline/records/memory_runtime.py), and the
convolution library's scratch (`memory_conv_workspace`,
pipeline/records/conv_workspace.py), kept in the same cache (keys `RUNTIME_METHOD`,
`WORKSPACE_METHOD` and the CPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import sys
from typing import Callable, Iterator

import dask
import distributed
import numpy as np
import torch
import xarray as xr
import zarr

from pipeline.costmodel.memory import DEFAULT_CONSTANTS, MemoryConstants
from pipeline.records.conv_workspace import cpu_signature, measure_conv_workspace
from pipeline.records.library_pages import evict_library_pages
from pipeline.records.memory_runtime import measure_runtimes, runtimes_wanted
from storage.locks import LockBusy, OwnerLock
from storage.space import replace_file
from tasks.memory import CLIENT_IMPORTS, WORKER_IMPORTS, bare_process_rss


#: Part of the cache's key: bumped when `bare_process_rss` measures differently
#: (2: the worker's baseline a forked child; 3: the libraries first dropped from the
#: page cache).
BASELINE_METHOD = 3
#: The same for `measure_runtimes` (1: a tiny run's own record; 2: the libraries
#: first dropped from the page cache).
RUNTIME_METHOD = 2
#: The same for `measure_conv_workspace` (1: each pass's scratch in a trimmed heap).
WORKSPACE_METHOD = 1


def _cache_path() -> str:
    return os.environ.get("CNN_MEMORY_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "dask-cnn", "memory-baseline.json")


def _kept(path: str, key: str) -> tuple[list[float] | None, dict]:
    """The figures the cache at `path` keeps under `key` (None: none, or not all
    positive), and everything it keeps."""
    try:
        with open(path, encoding="utf-8") as handle:
            cached = json.load(handle)
        kept = cached.get(key)
    except (OSError, ValueError, TypeError, AttributeError):
        return None, {}
    kept = [kept] if isinstance(kept, (int, float)) else kept
    if isinstance(kept, list) and kept and all(
            isinstance(v, (int, float)) and v > 0 for v in kept):
        return [float(v) for v in kept], cached
    return None, cached


@contextlib.contextmanager
def _held(lock_path: str) -> Iterator[None]:
    """`lock_path` held (`storage.locks.OwnerLock`, waiting for another holder), or
    nothing held where it cannot be taken: the cache is an optimisation."""
    lock = OwnerLock(lock_path, f"the memory cache's {os.path.basename(lock_path)}")
    try:
        lock.acquire(on_wait=lambda line: None)
    except (OSError, LockBusy):
        yield
        return
    try:
        yield
    finally:
        lock.release()


def _cached(what: list, measure: Callable[[], list[float]]) -> list[float]:
    """`measure()`'s figures, kept in the cache under the interpreter, the libraries'
    versions and `what`; measured again where none are kept, and kept only where all
    are measured (positive). The environment's libraries are dropped from the page cache
    first (`evict_library_pages`), so that a figure measured right after an install,
    when pip's files sit in the cache as large folios, is not kept for every run after
    it (a tiny run's working memory read 133 MB then against 93 MB after).

    A figure is measured by one process at a time (a lock per key): processes that
    start together (the test suite's three) would each measure and keep their own,
    and one that read the cache twice could get two figures (a run's summary held a
    baseline 12 KB off the one its process read after). Another process's wait ends
    with the figure it kept; the cache file is rewritten under a lock of its own, so
    that no process drops a figure another kept meanwhile."""
    key = json.dumps([sys.executable, torch.__version__, np.__version__, dask.__version__,
                      distributed.__version__, zarr.__version__, xr.__version__, *what])
    path = _cache_path()
    kept, _ = _kept(path, key)
    if kept is not None:
        return kept
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    except OSError:
        pass
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    with _held(f"{path}.{digest}.lock"):
        kept, _ = _kept(path, key)  # kept by the process that held the lock before
        if kept is not None:
            return kept
        evict_library_pages()
        measured = measure()
        if measured and all(v > 0 for v in measured):
            with _held(f"{path}.lock"):
                _, cached = _kept(path, key)
                try:
                    kept_all = {k: v for k, v in cached.items() if k.startswith("[")}
                    replace_file(path, json.dumps({**kept_all, key: measured}))
                except OSError:
                    pass  # a cache that cannot be written: measured again next time
        return measured


@functools.cache
def memory_baseline(imports: str = WORKER_IMPORTS) -> int:
    """`tasks.memory.bare_process_rss(imports)`, measured once per interpreter,
    library versions and import line (cached on disk, see the module); 0 where it
    cannot be measured."""
    return int(_cached([imports, BASELINE_METHOD], lambda: [bare_process_rss(imports)])[0])


@functools.cache
def memory_runtimes() -> tuple[float, float]:
    """This machine's (worker, client) runtimes, `measure_runtimes` measured once per
    interpreter and library versions (cached with the baselines); (0, 0) where they
    cannot be measured or ``$CNN_MEMORY_RUNTIME=fitted``."""
    if not runtimes_wanted():
        return 0.0, 0.0

    def measure() -> list[float]:
        print(f"measuring this machine's memory runtimes for the memory model (two tiny "
              f"runs, once; kept in {_cache_path()})", file=sys.stderr, flush=True)
        return list(measure_runtimes())
    worker, client = _cached(["runtimes", RUNTIME_METHOD], measure)
    return worker, client


@functools.cache
def memory_conv_workspace() -> float:
    """This machine's `conv_workspace` (`measure_conv_workspace`,
    pipeline/records/conv_workspace.py), measured once per interpreter, library
    versions and CPU (`cpu_signature`: oneDNN picks its kernels by the instruction set;
    cached with the baselines); 0 where it cannot be measured or
    ``$CNN_MEMORY_RUNTIME=fitted``."""
    if not runtimes_wanted():
        return 0.0
    return _cached(["conv_workspace", WORKSPACE_METHOD, cpu_signature()],
                   lambda: [measure_conv_workspace()])[0]


def machine_memory_constants(constants: MemoryConstants = DEFAULT_CONSTANTS
                             ) -> MemoryConstants:
    """`constants` with this machine's own figures: the bare processes as the model's
    baselines, the client's (`CLIENT_IMPORTS`) for a process that trains in itself, a
    forked worker's (`WORKER_IMPORTS`) for a worker, each `memory_baseline` (measured
    once, cached); and the runtimes beyond them, a tiny run's working memory
    (`memory_runtimes`, pipeline/records/memory_runtime.py); and the convolution
    library's scratch (`memory_conv_workspace`, pipeline/records/conv_workspace.py).

    Why: a bare process's resident size is the machine's and its environment's, not
    the model's (the libraries' pages a process maps follow how the page cache holds
    their files: 50-90 MB a process apart between a fresh install and files read back
    from disk, docs/benchmarks.md; each is measured in the second state,
    pipeline/records/library_pages.py), and a run's working memory is its peak less these
    same figures; what the project's processes hold beyond them follows the machine as
    much, and the scratch with the kernels oneDNN picks for the CPU. Where one cannot
    be measured, `constants`' own stays."""
    client, worker = memory_baseline(CLIENT_IMPORTS), memory_baseline(WORKER_IMPORTS)
    worker_runtime, client_runtime = memory_runtimes()
    return dataclasses.replace(
        constants, baseline=float(client or constants.baseline),
        worker_baseline=float(worker or constants.worker_baseline),
        worker_runtime=worker_runtime or constants.worker_runtime,
        client_runtime=client_runtime or constants.client_runtime,
        conv_workspace=memory_conv_workspace() or constants.conv_workspace)


def memory_summary(ds: xr.Dataset, in_client: bool = False) -> dict:
    """Each worker's and the client's peak resident memory over the whole run (warm-up
    steps included: a peak anywhere is what a device must hold), and the same less the
    bare-process baseline of the same kind (`memory_baseline`): the memory the run's
    work needs. `in_client`: the run trained in the client's process (a strategy that
    uses no cluster), whose baseline its peak is then set against."""
    if "memory_peak" not in ds or not ds.sizes["step"]:
        return {}
    client_base = float(memory_baseline(CLIENT_IMPORTS))
    base = client_base if in_client else float(memory_baseline(WORKER_IMPORTS))

    def peak(values: xr.DataArray) -> float | None:
        top = float(values.max(skipna=True))
        return top if np.isfinite(top) else None

    workers = {str(w): peak(ds.memory_peak.sel(worker=w)) for w in ds.worker.values}
    client = peak(ds.client_memory_peak) if "client_memory_peak" in ds else None
    summary = {"memory_peak": workers, "client_memory_peak": client,
               "memory_baseline": base, "client_memory_baseline": client_base,
               "memory_working": {w: None if v is None else v - base
                                  for w, v in workers.items()},
               "client_memory_working": None if client is None else client - client_base,
               "memory_peak_kind": str(ds.memory_peak.attrs.get("peak_kind", ""))}
    if "memory_held" in ds:
        summary["memory_held"] = {str(w): peak(ds.memory_held.sel(worker=w))
                                  for w in ds.worker.values}
    for name in ("gpu_allocated_peak", "gpu_reserved_peak"):
        if name in ds:
            summary[name] = {str(w): peak(ds[name].sel(worker=w)) for w in ds.worker.values}
    return summary


def memory_lines(summary: dict) -> list[str]:
    """The summary's memory line: each worker's peak (working), and the client's."""
    peaks = summary.get("memory_peak")
    if not peaks:
        return []

    def mb(value: float | None) -> str:
        return "?" if value is None else f"{value / 1e6:.0f}"

    working = summary["memory_working"]
    each = ", ".join(f"{name} {mb(peak)} ({mb(working[name])})" for name, peak in peaks.items())
    return [f"  memory      peak MB (working) {each}; client {mb(summary['client_memory_peak'])}"
            f" ({mb(summary['client_memory_working'])}); bare process "
            f"{mb(summary['memory_baseline'])} MB, client's "
            f"{mb(summary.get('client_memory_baseline'))} MB"]
