"""Per-process state on a Dask worker: its settings and the runs it takes part in.

Shard weights, optimizer state, the dense head and the tensors a worker keeps
between the ops of a step must stay on that worker across steps (weights never
travel in kernel-parallel training). Dask keeps no such state for us, so it lives
here, keyed by the worker's address (several workers may share one process in
tests) and the run id. `WorkerSetup`, registered by the client with
`Client.register_plugin`, prepares every worker, including ones that join later.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from distributed import get_worker
from distributed.diagnostics.plugin import WorkerPlugin

from tasks.code_identity import code_identity


#: Where this worker imported the project from and its code's digest, taken as it loads
#: the project (a run compares it with its own: pipeline/cluster/shared_paths.py).
LOADED_CODE = code_identity()


@dataclass
class WorkerProfile:
    """What a task needs to know about the worker it runs on."""

    name: str
    threads: int
    speed: float  # 1.0 = real speed; < 1 = emulated slower device
    device: str  # "cpu" or "cuda:N"

    @property
    def emulated(self) -> bool:
        return self.speed < 1.0

    def synchronize(self) -> None:
        """Wait for the device's queued work (a no-op on CPUs)."""
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def emulate(self, compute_s: float) -> float:
        """Sleep so the device appears `speed` times as fast; return the added time."""
        if not self.emulated:
            return 0.0
        extra = compute_s * (1.0 / self.speed - 1.0)
        time.sleep(extra)
        return extra

    def time_rounds(self, one_round: Callable[[], object], repeats: int,
                    spread: float = 0.10) -> list[float]:
        """Seconds of `repeats` stable rounds of `one_round`: how calibration times
        what training will do.

        One warm-up round first (allocator, cuDNN's autotuning), each round
        synchronised before the clock is read, emulated slowness included; rounds go
        on (up to 3x `repeats`) until the last `repeats` lie within `spread` of their
        median, and those are returned.
        """
        times: list[float] = []
        for attempt in range(3 * repeats + 1):
            start = time.perf_counter()
            one_round()
            self.synchronize()
            elapsed = time.perf_counter() - start
            elapsed += self.emulate(elapsed)
            if attempt:
                times.append(elapsed)
            last = sorted(times[-repeats:])
            if len(last) == repeats and last[-1] - last[0] <= spread * last[len(last) // 2]:
                break
        return times[-repeats:]


_PROFILES: dict[str, WorkerProfile] = {}
_RUNS: dict[tuple[str, str], Any] = {}


def tune_allocator() -> None:
    """Undo the Dask nanny's MALLOC_TRIM_THRESHOLD_=65536.

    With that setting glibc returns freed memory at once, so every large tensor is
    built on fresh pages: torch ran 1.6x slower inside a worker (docs/benchmarks.md). Raising
    the trim and mmap thresholds restores the heap reuse an ordinary process gets.
    One arena: a Dask worker computes in a thread of its own, and glibc gives such a
    thread its own arena of 64 MB heaps, where tensors of tens of MB fragment and
    freed ones are not reused by the main arena's allocations (a thread running the
    paper network's kernel/2 half peaked 78 MB, 16 %, above the same in one arena).
    The embedded cluster sets ``MALLOC_ARENA_MAX=1`` before its workers start
    (pipeline/cluster/embedded.py); this reaches only threads that have no arena yet.
    """
    libc = _libc()
    if libc is None:
        return
    try:
        m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
        libc.mallopt(m_trim_threshold, 1 << 30)
        libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum for 64-bit
        libc.mallopt(m_arena_max, 1)
    except (OSError, AttributeError):
        pass


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``).

    `tune_allocator` keeps freed memory in the process so that a step reuses the
    last step's pages; after a stretch that allocated much and will not repeat
    (calibration's shards at other sizes, loading a checkpoint), those pages would
    stay resident for the whole run and lift every step's peak above what the run
    itself needs. Called once at each such stretch's end, never per step.
    """
    libc = _libc()
    if libc is None:
        return
    try:
        libc.malloc_trim(0)
    except AttributeError:  # not glibc
        pass


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, found once: `ctypes.util.find_library` runs ldconfig each call."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def configure_process(threads: int) -> None:
    """Thread count, denormal flushing and allocator, as every compute process needs."""
    torch.set_num_threads(threads)
    # Small initial weights make denormal floats, which ran 3x slower (docs/benchmarks.md).
    torch.set_flush_denormal(True)
    tune_allocator()


_THREAD = threading.local()


def prepare_thread() -> None:
    """Flush denormals in the calling thread, once.

    The CPU's flush-to-zero flags are per thread, and Dask runs tasks in an
    executor thread, not the one `WorkerSetup.setup` runs in: every task that
    computes calls this first.
    """
    if not getattr(_THREAD, "ready", False):
        torch.set_flush_denormal(True)
        _THREAD.ready = True


def worker_device(resources: dict[str, float]) -> str:
    """The device of a worker the config does not describe (one started by `dask
    worker`): its first CUDA device if it is tagged GPU and has one, else the CPU."""
    return "cuda:0" if "GPU" in resources and torch.cuda.is_available() else "cpu"


class _DropStopQueueError(logging.Filter):
    """Hide the traceback a nanny-started worker logs when it is closed after being
    stopped (SIGSTOP) and removed from the cluster ("Worker process died
    unexpectedly": its stop queue's pipe read fails): the run reports the worker
    itself, in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and
                    record.getMessage().startswith("Worker process died unexpectedly"))


class _DropEndedRunFailures(logging.Filter):
    """Hide Dask's "Compute Failed" log of a task that failed because the client
    ended its run: a wait aborted by the client (`ExchangeError`, other than a
    timeout or a broken step order, which are the run's own faults) or a save
    refused by a woken worker (`RunEnded`); and of a write refused for a full disk
    (`NoSpace`) or a read of a dataset store rebuilt under the run (`DatasetChanged`),
    which reach the client whole. The client reports why the run
    ended, in one line; these would add a dozen lines per worker to its stderr."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Compute Failed") or len(record.args or ()) < 4:
            return True
        text = str(record.args[3])
        if text.startswith(("RunEnded(", "NoSpace(", "DatasetChanged(")):
            return False
        return not (text.startswith("ExchangeError(") and "wait_timeout" not in text
                    and "order was broken" not in text)


class _DropClosingHeartbeats(logging.Filter):
    """Hide "Failed to communicate with scheduler during heartbeat" (with its
    traceback) in an embedded cluster's worker: its scheduler lives in the run's
    process and is gone only once the run closes the cluster, while the last of
    many workers on few cores are still being closed (64 workers on 2 cores logged
    a dozen at the end of a run that went well)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to communicate with scheduler during "
                                              "heartbeat")


class _DropSetupNeverInstalled(logging.Filter):
    """Hide "Worker plugin cnn-worker-setup-... failed to teardown" where the worker
    never had that setup (a KeyError): a worker that joined while a run removed its
    setup, as a sweep's freshly restarted workers do when a signal stops the sweep
    mid-restart (pipeline/cluster/embedded.restart_workers). There was nothing to
    take down; the run says in one line why it stopped. Added when this module is
    imported, as the fork server does before any worker exists: a setup's own
    filters come only with the setup."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith("Worker plugin %s failed to teardown")
                    and record.args and str(record.args[0]).startswith(WorkerSetup.name)
                    and record.exc_info and record.exc_info[0] is KeyError)


def _add_filter(logger: str, kind: type[logging.Filter]) -> None:
    """Add a filter of `kind` to `logger` once (setup runs again for each run)."""
    log = logging.getLogger(logger)
    if not any(isinstance(f, kind) for f in log.filters):
        log.addFilter(kind())


class WorkerSetup(WorkerPlugin):
    """Configures each worker: torch threads, emulated speed, the compute device (run
    by the plugin a run registers, `tasks.setup_gate.RunSetup`, on the run's workers)."""

    name = "cnn-worker-setup"  # as `setup_gate.SETUP_NAME`, which is imported apart: no torch

    def __init__(self, threads_by_name: dict[str, int] | None = None,
                 speed_by_name: dict[str, float] | None = None,
                 device_by_name: dict[str, str] | None = None, embedded: bool = False) -> None:
        self.threads_by_name = threads_by_name or {}
        self.speed_by_name = speed_by_name or {}
        self.device_by_name = device_by_name or {}
        self.embedded = embedded  # workers of the run's own cluster (not `dask worker`s)

    def setup(self, worker: Any) -> None:
        _add_filter("distributed.nanny", _DropStopQueueError)
        _add_filter("distributed.worker", _DropEndedRunFailures)
        if self.embedded:
            _add_filter("distributed.worker", _DropClosingHeartbeats)
        name = str(worker.name)
        threads = int(self.threads_by_name.get(name, worker.state.nthreads))
        configure_process(threads)
        device = self.device_by_name.get(name) or worker_device(
            worker.state.total_resources or {})
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
            # Shard shapes are fixed for a run: let cuDNN pick its fastest algorithms
            # (the calibration's warm-up round pays for the search).
            torch.backends.cudnn.benchmark = True
        _PROFILES[worker.address] = WorkerProfile(
            name=name, threads=threads, speed=float(self.speed_by_name.get(name, 1.0)),
            device=device,
        )
        freeze_heap()


_add_filter("distributed.worker", _DropSetupNeverInstalled)


def freeze_heap() -> None:
    """Move every object alive now (mostly torch's and Dask's, from their imports)
    out of the garbage collector's view (`gc.freeze`, after a collection), so that
    no later collection walks them again.

    The collections that matter are the interpreter's own at exit: a worker fenced
    off while stopped (SIGSTOP) closes when woken, and on a loaded machine its exit
    spent most of its time in them (docs/reliability.md: median exit after the wake
    9.9 s, 5.3 s frozen, alternating in one run). Objects frozen here are
    never collected as cycles; only import-time state and the worker's own are
    alive when a run registers its setup (the previous run's state is released).
    The young generations are collected first (cheap); a full collection would cost
    each worker 0.2 s per run here, which 64 workers on 2 cores would feel."""
    gc.collect(1)
    gc.freeze()


def current_profile() -> WorkerProfile:
    """The profile of the worker running this task (plain defaults outside Dask).

    Also readies the calling thread (`prepare_thread`): every task asks for it.
    """
    prepare_thread()
    try:
        address = get_worker().address
    except ValueError:
        return WorkerProfile("local", torch.get_num_threads(), 1.0, "cpu")
    profile = _PROFILES.get(address)
    if profile is None:
        raise RuntimeError(f"worker {address} was not set up: register WorkerSetup first")
    return profile


def _address() -> str:
    try:
        return get_worker().address
    except ValueError:
        return "local"


def put_run(run_id: str, state: Any) -> None:
    """Keep a run's worker-side state (tasks/step_task.RunState) on this worker."""
    _RUNS[(_address(), run_id)] = state


def get_run(run_id: str) -> Any:
    try:
        return _RUNS[(_address(), run_id)]
    except KeyError:
        raise RuntimeError(
            f"run {run_id}: this worker holds none of its state (was the worker restarted?)"
        ) from None


def drop_run(run_id: str) -> bool:
    """Forget a run's state on this worker; whether it held any."""
    return _RUNS.pop((_address(), run_id), None) is not None


def set_up_threads(address: str) -> int | None:
    """The torch threads the run's setup gave the worker at `address` (None: not set up)."""
    profile = _PROFILES.get(address)
    return None if profile is None else profile.threads
