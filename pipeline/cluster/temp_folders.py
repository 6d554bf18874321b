"""multiprocessing's temporary folder in a process that starts embedded clusters, and who
removes it.

The fork server the workers are forked from (pipeline/cluster/fork_server.py) listens on
a socket in a folder multiprocessing makes for the process that starts it
(``<tmp>/pymp-<random>``) and removes as that process exits. A process that ends
without unwinding leaves it behind for good: a hang-up or SIGKILL of its process group,
or a second signal's stop at once (`pipeline.cli.stop_now`, which skips the exit's
cleanup). The test suite alone left three a run.

So, as with the queues' semaphores (pipeline/cluster/semaphores.py), the folder of a
process that starts a fork server carries its pid and pid namespace in its name
(`tag_temp_folder`: ``pymp-cnn-<pid>-ns<namespace>-<random>``), the next embedded cluster
on the machine removes those whose maker is gone (`remove_stale_temp_folders`, judged
as a semaphore's maker is), and a stop at once removes its own first (`remove_own_temp_folder`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.util
import os
import re
import shutil
import stat
import tempfile

import psutil

from pipeline.cluster.semaphores import pid_namespace, tagged_maker_gone

#: The name prefix of a tagged folder, before its maker's pid.
TAG = "pymp-cnn-"

#: The longest folder whose listener socket (``<folder>/listener-<8 random>``) still
#: fits a socket's path (107 bytes on Linux).
_LONGEST_FOLDER = 107 - len("/listener-12345678")


def _config() -> dict | None:
    """multiprocessing's per-process settings (a private dict; None where it is missing)."""
    config = getattr(multiprocessing.current_process(), "_config", None)
    return config if isinstance(config, dict) else None


def tag_temp_folder() -> None:
    """Make this process's multiprocessing temporary folder now, named
    ``pymp-cnn-<pid>-ns<namespace>-<random>`` (``ns0``: namespace unknown), and have it
    removed at exit as multiprocessing removes its own; nothing changes where the
    process has one already, where the private setting is missing, or where the name
    would make the fork server's socket path too long for the system."""
    config = _config()
    if config is None or config.get("tempdir") is not None:
        return
    prefix = f"{TAG}{os.getpid()}-ns{pid_namespace() or 0}-"
    if len(os.path.join(tempfile.gettempdir(), prefix)) + len("12345678") > _LONGEST_FOLDER:
        return
    folder = tempfile.mkdtemp(prefix=prefix)  # private to this user, as multiprocessing's
    multiprocessing.util.Finalize(None, _remove, args=(folder,), exitpriority=-100)
    config["tempdir"] = folder


def _remove(folder: str) -> None:
    """Remove `folder` and forget it as this process's temporary folder."""
    shutil.rmtree(folder, ignore_errors=True)
    config = _config()
    if config is not None and config.get("tempdir") == folder:
        config["tempdir"] = None


def remove_own_temp_folder() -> None:
    """Remove this process's multiprocessing temporary folder now, tagged or not, as its
    exit would: for an exit that skips the exit's cleanup (`os._exit`)."""
    config = _config()
    folder = config.get("tempdir") if config is not None else None
    if folder:
        _remove(folder)


def folder_maker(name: str) -> tuple[int, int] | None:
    """The pid and pid namespace a tagged temporary folder's name
    (``pymp-cnn-<pid>-ns<namespace>-<random>``) carries; None for any other name."""
    match = re.fullmatch(rf"{TAG}(\d+)-ns(\d+)-[A-Za-z0-9_]+", name)
    return (int(match[1]), int(match[2])) if match else None


def remove_stale_temp_folders(root: str | None = None) -> list[str]:
    """Remove the tagged temporary folders in `root` (the system's temporary folder by
    default) that this user's processes made in this process's pid namespace and whose
    maker no process has now (`tagged_maker_gone`); returns their names. Another user's, a
    live pid's, another namespace's, a link and every untagged folder stay."""
    root = root or tempfile.gettempdir()
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    namespace = pid_namespace()
    removed = []
    for entry in entries:
        if not tagged_maker_gone(folder_maker(entry.name), namespace, psutil.pid_exists):
            continue
        with contextlib.suppress(OSError):
            status = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(status.st_mode) and status.st_uid == os.getuid():
                shutil.rmtree(entry.path)
                removed.append(entry.name)
    return removed
