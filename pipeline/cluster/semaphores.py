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
that starts an embedded cluster makes carries its pid and pid namespace in its
name (`tag_semaphores_with_pid`: ``sem.mp-cnn-<pid>-ns<namespace>-<random>``), so that the next embedded cluster on
the machine removes those whose process is gone (`remove_stale_semaphores`), as it
removes a killed run's scratch folder. A pid means something only in its own pid
namespace: a container that shares /dev/shm but not the pids sees another's live
maker as gone, so a semaphore made in another namespace is never removed
(`maker_gone`). A name that carries the pid alone (``sem.mp-cnn-<pid>-<random>``,
as made before the namespace was recorded) does not say where it was made: it is
removed only when, besides its pid being gone here, no process this one can see
has it mapped (a live semaphore is mapped by every process using it, and a
container's processes are visible from the namespaces above it:
`untagged_maker_gone`). What this cannot see is a live maker in a namespace beside
or above this one that still runs the code before the namespace was recorded.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import signal
import stat
from multiprocessing import resource_tracker
from typing import Callable

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


def pid_namespace() -> int | None:
    """This process's pid namespace: the inode of /proc/self/ns/pid, which no other
    namespace on the host has while this one lives; None where /proc does not say."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def tag_semaphores_with_pid() -> None:
    """Name every semaphore this process makes from now on
    ``mp-cnn-<pid>-ns<namespace>-<random>`` (``ns0``: namespace unknown; multiprocessing's
    ``/mp-<random>`` otherwise), through multiprocessing's process-wide prefix (a
    private setting: nothing changes where it is missing)."""
    config = getattr(multiprocessing.current_process(), "_config", None)
    if isinstance(config, dict) and "semprefix" in config:
        config["semprefix"] = f"/{TAG}{os.getpid()}-ns{pid_namespace() or 0}"


def semaphore_maker(name: str) -> tuple[int, int] | None:
    """The pid and pid namespace a tagged semaphore's file name
    (``sem.mp-cnn-<pid>-ns<namespace>-<random>``) carries; None for any other name
    (one tagged with its pid only, as before namespaces were recorded, too:
    `untagged_maker`)."""
    match = re.fullmatch(rf"sem\.{TAG}(\d+)-ns(\d+)-[A-Za-z0-9_]+", name)
    return (int(match[1]), int(match[2])) if match else None


def untagged_maker(name: str) -> int | None:
    """The pid a semaphore file name tagged with its maker's pid alone carries
    (``sem.mp-cnn-<pid>-<random>``, as made before the namespace was recorded); None
    for any other name."""
    match = re.fullmatch(rf"sem\.{TAG}(\d+)-[A-Za-z0-9_]+", name)
    return int(match[1]) if match else None


def maker_gone(name: str, namespace: int | None, pid_exists: Callable[[int], bool]) -> bool:
    """Whether semaphore file `name` was made by a process now gone, as a process in
    pid namespace `namespace` can tell by `pid_exists`: only a tagged name made in
    that same namespace, whose pid no process there has. One made in another
    namespace (a container sharing /dev/shm but not the pids) or in an unknown one
    (``ns0``, or this process's unknown) may have a live maker this process cannot
    see, and unlinking it would fail that maker's next worker, which opens the
    semaphore by name: it is never judged gone."""
    return tagged_maker_gone(semaphore_maker(name), namespace, pid_exists)


def tagged_maker_gone(maker: tuple[int, int] | None, namespace: int | None,
                      pid_exists: Callable[[int], bool]) -> bool:
    """`maker_gone` for the pid and namespace a tagged name carries (`maker`; None: an
    untagged name), whatever the thing named (a temporary folder too:
    pipeline/cluster/temp_folders.py)."""
    if maker is None or not namespace or maker[1] != namespace:
        return False
    return not pid_exists(maker[0])


def untagged_maker_gone(name: str, file: tuple[int, int], pid_exists: Callable[[int], bool],
                        mapped: set[tuple[int, int]]) -> bool:
    """Whether semaphore file `name`, tagged with its maker's pid alone, was made by a
    process now gone: no process here has that pid and none this process can see maps
    the file (`file`: its device and inode, as in `mapped`). The name does not say
    its namespace, so the pid alone cannot tell: a live maker in a container below
    this namespace has another pid here, but its mapping shows (module doc)."""
    pid = untagged_maker(name)
    return pid is not None and not pid_exists(pid) and file not in mapped


def mapped_files(folder: str) -> set[tuple[int, int]]:
    """The files in `folder` (device, inode) that some process this one can read the
    memory map of has mapped: a named semaphore is mapped by each process using it,
    under the temporary name it was made as (glibc's sem_open: made, mapped, then
    linked to its name), hence by inode, not by name."""
    found = set()
    prefix = folder.rstrip(os.sep) + os.sep
    for process in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            with open(f"/proc/{process.pid}/maps", encoding="utf-8",
                      errors="replace") as handle:
                for line in handle:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith(prefix):
                        major, minor = (int(part, 16) for part in fields[3].split(":"))
                        found.add((os.makedev(major, minor), int(fields[4])))
    return found


def remove_stale_semaphores(folder: str = SEMAPHORE_FOLDER) -> list[str]:
    """Unlink the tagged semaphores in `folder` that this user's processes made in this
    process's pid namespace and that no process of that pid holds now (killed with
    its resource tracker: `maker_gone`), and those tagged with a pid alone whose pid
    is gone here and which no process this one sees has mapped
    (`untagged_maker_gone`); returns their file names. Another user's, a live pid's
    (its maker, or a later process given its pid), another namespace's, a mapped
    one and every untagged one stay. Unlinking only removes the name: a process
    still holding one goes on using it."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    namespace = pid_namespace()
    mapped: set[tuple[int, int]] | None = None  # read once, if any name needs it
    removed = []
    for entry in entries:
        tagged_gone = maker_gone(entry.name, namespace, psutil.pid_exists)
        if not tagged_gone and untagged_maker(entry.name) is None:
            continue
        with contextlib.suppress(OSError):
            status = entry.stat(follow_symlinks=False)
            if not (stat.S_ISREG(status.st_mode) and status.st_uid == os.getuid()):
                continue
            if not tagged_gone:
                if psutil.pid_exists(untagged_maker(entry.name) or 0):
                    continue  # its maker, or a later process given its pid: no scan
                mapped = mapped_files(folder) if mapped is None else mapped
                if not untagged_maker_gone(entry.name, (status.st_dev, status.st_ino),
                                           psutil.pid_exists, mapped):
                    continue
            os.unlink(entry.path)
            removed.append(entry.name)
    return removed
