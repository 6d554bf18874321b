"""What the command-line entry points share: bad input as one line on stderr.

A user who mistypes an option, a field or a path gets one line naming it and an
exit status that says whose fault it was (2: the input, 1: the run), never a usage
block or a traceback. argparse's own complaints go the same way. Ctrl-C, SIGTERM
and SIGHUP stop either entry point the same way (`stops_on_signals`): cleanup, one
line, exit 128 + the signal's number.
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import gc
import logging
import multiprocessing.synchronize
import multiprocessing.util
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator, NoReturn, TypeVar

import psutil

from pipeline.cluster.semaphores import is_resource_tracker
from pipeline.cluster.temp_folders import remove_own_temp_folder
from storage.exchange_folders import remove_own_exchanges
from storage.private import default_workspace_root

T = TypeVar("T")

CONFIG_ERROR = 2  # the input is wrong: config, option, path
RUNTIME_ERROR = 1  # the input was fine, the run failed (cluster, worker, disk)
IN_USE = 3  # the output directory (or sweep store) is held by another run


class UsageError(ValueError):
    """The command line itself is wrong (unknown option, missing argument)."""


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser that raises UsageError instead of printing a usage block and
    exiting, so that `main(argv)` reports it like every other bad input (and tests
    can call `main` in-process)."""

    def error(self, message: str) -> NoReturn:
        required = "the following arguments are required: "
        if message.startswith(required):  # argparse lists optional positionals (`nargs="*"`)
            optional = {action.dest for action in self._actions  # too, as if required
                        if not action.option_strings and action.nargs in ("*", "?")}
            names = [name for name in message[len(required):].split(", ")
                     if name not in optional]
            message = required + ", ".join(names)
        raise UsageError(f"{message} (see {self.prog} --help)")


def quiet_dask(level: int = logging.ERROR) -> None:
    """Keep only Dask's errors on stderr: its client logs its own view of a failure
    (closed comms, reconnect attempts, at INFO and WARNING), and the run reports every
    failure itself, in one line. Dask's config gives some of its loggers a level of
    their own (`distributed.client`: WARNING, whose "Couldn't gather keys" once broke
    a lost worker's one-line message), so each of them is raised too. A stop signal
    raises them past CRITICAL: the in-process scheduler's "Closed comm" (CRITICAL)
    when the client closes before the workers' last results is then noise."""
    names = ["distributed"] + [name for name in logging.root.manager.loggerDict
                               if name.startswith("distributed.")]
    for name in names:
        logger = logging.getLogger(name)
        if logger.level < level:
            logger.setLevel(level)


def error_line(error: BaseException | str) -> str:
    """``error: <message>`` on one line, whatever newlines the message carried."""
    text = " ".join(str(error).split()) or type(error).__name__
    return f"error: {text}"


def fail(error: BaseException | str, status: int) -> int:
    """Print the one line for `error` and hand back the exit status."""
    print(error_line(error), file=sys.stderr)
    return status


class Interrupted(KeyboardInterrupt):
    """A stop asked for by a signal (Ctrl-C, SIGTERM, SIGHUP): the work unwinds as
    from Ctrl-C (the embedded cluster and the workspace are removed on the way out)
    and the entry point exits 128 + the signal's number, as a shell reports it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        # set where the stop came after the run's last step and its results were
        # written first (`ResultsFirst`): nothing is left to continue
        self.after_last_step = False

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def status(self) -> int:
        return 128 + self.signum


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: A signal of the first one's number this soon after it is the same stop delivered
#: twice, not a second one: coreutils' `timeout` sends its signal to the command and
#: then to the command's process group, and the two, microseconds apart, reached the
#: handler one by one at times, which stopped the run at once.
SAME_STOP_S = 0.25


class ResultsFirst:
    """Once a run's last step is done, a stop must not lose it: from `hold()` on, a
    first stop signal is noted instead of raised, the run writes its results, and the
    stop is raised when the block ends (`Interrupted.after_last_step` set). Work that
    may be cut short (the model's probe) runs through `unless_stopped`, where a stop
    still raises and ends only that work. A second signal still stops at once
    (`stops_on_signals`). Without `stops_on_signals` (a run started from a thread, or
    with Python's own Ctrl-C handling) a KeyboardInterrupt in `unless_stopped` is
    noted the same way; elsewhere it propagates as it would."""

    def __init__(self) -> None:
        self.holding = False
        self.stop: KeyboardInterrupt | None = None

    def hold(self) -> None:
        self.holding = True

    def note(self, stop: KeyboardInterrupt) -> None:
        if self.stop is None:
            self.stop = stop

    def unless_stopped(self, work: Callable[[], T], stopped: Callable[[str], T]) -> T:
        """`work()`, or `stopped(name of the stop)` when a stop came before or during it."""
        if self.stop is None:
            self.holding = False
            try:
                return work()
            except KeyboardInterrupt as stop:
                self.note(stop)
            finally:
                self.holding = True
        name = self.stop.name if isinstance(self.stop, Interrupted) else "KeyboardInterrupt"
        return stopped(name)

    def __enter__(self) -> "ResultsFirst":
        _HOLDS.append(self)
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, trace: Any) -> None:
        _HOLDS.remove(self)
        if error is None and self.stop is not None:
            if isinstance(self.stop, Interrupted):
                self.stop.after_last_step = True
            raise self.stop


#: The `ResultsFirst` blocks open in this process, innermost last.
_HOLDS: list[ResultsFirst] = []


@contextlib.contextmanager
def stops_on_signals() -> Iterator[None]:
    """While the body runs, SIGINT, SIGTERM and SIGHUP raise `Interrupted`, so a
    batch system's stop or a closed terminal ends a run as cleanly as Ctrl-C; a
    second one, while the first unwinds, stops at once (`stop_now`), unless it is the
    first one's signal within `SAME_STOP_S` of it, also once the body has ended (the
    process is then ending). Only the main
    thread can take signals: elsewhere (a run started from a thread) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    first: list[tuple[int, float]] = []  # the first stop's signal and when it came
    swallowed: list[int] = []  # a stop raised where Python ignores exceptions

    def deliver(signum: int) -> None:
        if _HOLDS and _HOLDS[-1].holding:  # the run's results come first (`ResultsFirst`)
            _HOLDS[-1].note(Interrupted(signum))
            return
        raise Interrupted(signum)

    def handle(signum: int, frame: object) -> None:
        if swallowed:  # the stop again, after it was swallowed (`raised_again_if_swallowed`)
            deliver(swallowed.pop())
            return
        now = time.monotonic()
        if first:
            if first[0][0] == signum and now - first[0][1] < SAME_STOP_S:
                return  # the first stop again (`SAME_STOP_S`)
            stop_now(signum)
        first.append((signum, now))
        # Interrupting Dask's `sync` mid-call makes its cancel callback fail on the
        # event loop (distributed 2026.8: "cannot access free variable 'future'"),
        # which tornado logs as a traceback: noise once the user has asked to stop.
        logging.getLogger("tornado.application").setLevel(logging.CRITICAL)
        quiet_dask(logging.CRITICAL + 1)  # the run's own cleanup, said in its one line
        deliver(signum)

    previous = {number: signal.signal(number, handle) for number in STOP_SIGNALS}
    try:
        with raised_again_if_swallowed(Interrupted, swallowed):
            yield
    finally:
        for number, handler in previous.items():  # after a stop, a second one still
            signal.signal(number, handle if first else handler)  # stops at once: the
        # process is ending, and Python's own Ctrl-C would raise a KeyboardInterrupt
        # into whatever its exit runs (a traceback, "Exception ignored in ...")


@contextlib.contextmanager
def quiet_start() -> Iterator[None]:
    """A command's imports (torch, Dask, xarray: a second or two) under a Ctrl-C that
    ends it with one line and 130, not a traceback of whichever import it cut: nothing
    has run or been written yet. Python's own Ctrl-C handling is back after the block
    (the command's `stops_on_signals` takes over)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    swallowed: list[int] = []

    def handle(signum: int, frame: object) -> None:
        if not swallowed:  # said once, also where it has to be raised again
            print(f"interrupted ({signal.Signals(signum).name}) while starting: nothing was "
                  "run or written", file=sys.stderr)
        raise StoppedWhileStarting(signum)

    previous = signal.signal(signal.SIGINT, handle)
    try:
        with raised_again_if_swallowed(StoppedWhileStarting, swallowed):
            yield
    finally:
        signal.signal(signal.SIGINT, previous)


class StoppedWhileStarting(SystemExit):
    """`quiet_start`'s stop: exit 128 + the signal's number."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


@contextlib.contextmanager
def raised_again_if_swallowed(kind: type[Interrupted] | type[StoppedWhileStarting],
                              swallowed: list[int]) -> Iterator[None]:
    """A signal handler's exception is raised wherever the main thread is, and where
    that is a garbage collector's callback (distributed's GC diagnosis), a `__del__`
    or a weakref's callback, Python prints "Exception ignored in ..." and goes on: a
    Ctrl-C lost, the run finishing as if never asked to stop. While the body runs,
    such a swallowed `kind` is delivered again (`_deliver_soon`), its number put in
    `swallowed` so that the handler raises it again (not a second stop, nor the same
    stop delivered twice)."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        stop = unraisable.exc_value
        if not isinstance(stop, kind):
            previous(unraisable)
            return
        try:
            _thread.start_new_thread(_deliver_soon, (stop.signum,))
        except RuntimeError:  # no new threads (the interpreter is ending): said as before
            previous(unraisable)
            return
        swallowed.append(stop.signum)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


def _deliver_soon(signum: int) -> None:
    """Run `signum`'s handler in the main thread once it is out of what swallowed the
    stop: from another thread, after a millisecond (the rest of a garbage collection),
    as `_thread.interrupt_main`, which only marks it pending. Raised or marked from
    the main thread itself, the handler would run at once, still inside."""
    time.sleep(0.001)
    _thread.interrupt_main(signum)


def stop_now(signum: int) -> NoReturn:
    """Kill this process's children (an embedded cluster's workers) and exit
    128 + `signum` without unwinding: what a second signal asks for. The semaphores
    of the workers' queues are unlinked first (`unlink_semaphores`) and
    multiprocessing's temporary folder removed (`remove_own_temp_folder`); the
    workspaces this process made in the default root are removed once its workers
    are gone (one in `workspace.path` is left to the next run's sweep of stale ones).
    The resource tracker is spared: it ends by itself once this process and the
    killed ones are gone, and unlinks what they made that this process could not
    (a worker's own semaphores, or one made while this stop ran)."""
    print(f"stopped at once by a second signal ({signal.Signals(signum).name})",
          file=sys.stderr)
    unlink_semaphores()
    remove_own_temp_folder()
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if not is_resource_tracker(child):
                child.kill()
    with contextlib.suppress(OSError):  # its workspaces (the model's probe's too)
        remove_own_exchanges(default_workspace_root())
    os._exit(128 + signum)


def unlink_semaphores() -> None:
    """Unlink this process's multiprocessing semaphores now, as its exit would.

    Every worker of an embedded cluster talks to its nanny (in this process) through
    queues whose named semaphores live in /dev/shm until unlinked; an exit without
    unwinding (`os._exit`) skips that. Left to the resource tracker, they are unlinked
    with a warning ("There appear to be 384 leaked semaphore objects": 6 a worker).
    Uses multiprocessing's own finalizers (a private registry: nothing happens where
    it is missing); pipeline/cluster/semaphores.py says who unlinks them otherwise."""
    registry = getattr(multiprocessing.util, "_finalizer_registry", {})
    cleanup = getattr(multiprocessing.synchronize.SemLock, "_cleanup", None)
    for finalizer in list(registry.values()):
        if cleanup is not None and getattr(finalizer, "_callback", None) is cleanup:
            with contextlib.suppress(Exception):
                finalizer()


def exit_with(status: int) -> NoReturn:
    """Exit an entry point with `status`, skipping the garbage collector's passes over
    every object of torch, xarray and Dask while the interpreter shuts down: garbage
    is collected now (its finalizers run as usual), then everything still alive is
    frozen out of later collections (`gc.freeze`). Shutdown went from 1.08 s to
    0.35 s here (plus 0.16 s for this collection); a test suite that starts ~60 runs
    and sweeps as processes pays it each time."""
    gc.collect()
    gc.freeze()
    sys.exit(status)
