"""The named POSIX semaphores of an embedded cluster, and who removes them.

Every worker of an embedded cluster talks to its nanny (in the run's process)
through two multiprocessing queues, whose three semaphores each live in /dev/shm
(``sem.mp-...``, 32 bytes) until unlinked: 6 a worker. The process that made
them unlinks them as it exits; one that exits without unwinding leaves that to
multiprocessing's resource tracker, a child process that unlinks what its
clients registered once all of them are gone. The tracker ignores SIGINT and
SIGTERM but not a hang-up (SIGHUP: a closed terminal, which reaches the whole
process group) nor SIGQUIT (Ctrl-\\), and nothing survives SIGKILL: a test
session, script or run holding an embedded cluster whose process group took one
of these would leave every semaphore of its cluster in /dev/shm for good
(`tests/test_semaphores.py`).

So the tracker is started with those two signals blocked (`start_resource_tracker`:
it then outlives the hang-up and unlinks them), and every semaphore a process
that starts an embedded cluster makes carries its pid in its name
(`tag_semaphores_with_pid`: ``sem.mp-cnn-<pid>-<random>``), so that the next
embedded cluster on the machine removes those whose process is gone
(`remove_stale_semaphores`), as it removes a killed run's scratch folder.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import signal
import stat
from multiprocessing import resource_tracker

import psutil

#: Where Linux keeps named semaphores, as ``sem.<name>`` (none elsewhere: nothing swept).
SEMAPHORE_FOLDER = "/dev/shm"

#: The name prefix of a tagged semaphore, before its creator's pid.
TAG = "mp-cnn-"

#: Signals of a process group that kill the tracker unless blocked (module doc).
_TRACKER_BLOCKS = {signal.SIGHUP, signal.SIGQUIT}


def start_resource_tracker() -> None:
    """Start this process's resource tracker, if it has none running, with SIGHUP and
    SIGQUIT blocked, which it keeps: a hang-up or quit of the process group then
    ends the others, and the tracker unlinks the semaphores they left (module doc).
    A signal mask is per thread and inherited by the tracker across exec, so this
    changes nothing for the caller after it returns."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _TRACKER_BLOCKS)
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def is_resource_tracker(process: psutil.Process) -> bool:
    """Whether `process` is a multiprocessing resource tracker (by its command line)."""
    return "resource_tracker" in " ".join(process.cmdline())


def tag_semaphores_with_pid() -> None:
    """Name every semaphore this process makes from now on ``mp-cnn-<pid>-<random>``
    (multiprocessing's ``/mp-<random>`` otherwise), through multiprocessing's
    process-wide prefix (a private setting: nothing changes where it is missing)."""
    config = getattr(multiprocessing.current_process(), "_config", None)
    if isinstance(config, dict) and "semprefix" in config:
        config["semprefix"] = f"/{TAG}{os.getpid()}"


def semaphore_maker_pid(name: str) -> int | None:
    """The pid a tagged semaphore's file name (``sem.mp-cnn-<pid>-<random>``) carries;
    None for any other name."""
    match = re.fullmatch(rf"sem\.{TAG}(\d+)-[A-Za-z0-9_]+", name)
    return int(match[1]) if match else None


def remove_stale_semaphores(folder: str = SEMAPHORE_FOLDER) -> list[str]:
    """Unlink the tagged semaphores in `folder` that this user's processes made and
    that no process of that pid holds now (killed with its resource tracker);
    returns their file names. Another user's, a live pid's (its maker, or a later
    process given its pid) and every untagged one stay. A pid is judged in this
    process's pid namespace, which a container sharing /dev/shm may not share.
    Unlinking only removes the name: a process still holding one goes on using it."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    removed = []
    for entry in entries:
        pid = semaphore_maker_pid(entry.name)
        if pid is None or psutil.pid_exists(pid):
            continue
        with contextlib.suppress(OSError):
            status = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(status.st_mode) and status.st_uid == os.getuid():
                os.unlink(entry.path)
                removed.append(entry.name)
    return removed
