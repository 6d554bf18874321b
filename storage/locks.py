"""Ownership of a path on disk: one process writes it at a time.

Sweep stores (`experiments.sweep.results.SweepLock`) and run output directories
(`pipeline.train`) are guarded by the same lock, a file beside or inside what it
guards. An flock on that file, not its mere existence, is the lock: the kernel
drops it when the holder dies (even by SIGKILL), so a lock left by a dead process
is taken over without guessing whether a recorded pid is still alive. The file
holds the holder's pid, host and start time, for the refusal message and for the
note that a stale lock was taken over. Where flock is unavailable (some network
file systems) the recorded pid is checked instead.

The lock file is often in a folder others can write in too (a sweep store's sits
beside it: ``--out /tmp/x.zarr`` puts it in /tmp). It is opened without following a
symbolic link, and one that is a link, not a plain file, another user's, or a
second name of a file (a hard link) is refused with one line, never written:
another user's link planted there would have had the holder's record written over
whatever file it names.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
from collections.abc import Callable
from typing import Any

import psutil

from storage.private import user_name

#: How the lock file is opened: never through a symbolic link.
NO_LINK = os.O_NOFOLLOW | os.O_NONBLOCK


class LockBusy(RuntimeError):
    """Another live process holds the lock."""


def now_text(at: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(at))


def describe_holder(holder: dict[str, Any]) -> str:
    """``pid 12 on host, since 2026-...``: who holds (or held) a lock."""
    who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
    return who + (f", since {holder['started']}" if holder.get("started") else "")


class OwnerLock:
    """An exclusive lock on `lock_path`, held from `acquire` to `release`.

    `what` names the guarded thing in messages ("output directory runs/x"), `who`
    the kind of holder ("another run"). After `acquire`, `stale` holds the record
    of a dead holder whose lock was taken over (None if there was none), so the
    caller can say so.
    """

    busy_error: type[Exception] = LockBusy

    def __init__(self, lock_path: str, what: str, who: str = "another process") -> None:
        self.path = lock_path
        self.what = what
        self.who = who
        self.stale: dict[str, Any] | None = None
        self._fd: int | None = None

    def _holder(self) -> dict[str, Any]:
        try:
            with open(os.open(self.path, os.O_RDONLY | NO_LINK), encoding="utf-8") as handle:
                return json.loads(handle.read() or "{}")
        except (OSError, ValueError):
            return {}

    def _open(self, flags: int) -> int:
        """The lock file's descriptor, opened with `flags` (module doc: never through a
        link). Where it is not a plain file of this user's with one name: the busy error
        naming its holder if one holds it, else naming the problem."""
        while True:
            try:
                fd = os.open(self.path, flags | NO_LINK, 0o644)
            except OSError as error:
                if error.errno != errno.ELOOP:
                    raise
                raise self._unsafe(f"is a symbolic link (to {os.readlink(self.path)})") \
                    from None
            info = os.fstat(fd)
            if info.st_nlink or not stat.S_ISREG(info.st_mode):
                break
            os.close(fd)  # no name left: its holder released it (removed it) since the
            # open; open what is at the path now (none: FileNotFoundError, or made anew)
        problem = ("is not a plain file" if not stat.S_ISREG(info.st_mode)
                   else f"belongs to user {user_name(info.st_uid)}"
                   if info.st_uid != os.geteuid()
                   else "has another name too (a hard link)" if info.st_nlink != 1 else None)
        if problem is None:
            return fd
        try:
            if stat.S_ISREG(info.st_mode):
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self._busy(self._holder()) from None
        except OSError:
            pass
        finally:
            os.close(fd)
        raise self._unsafe(problem)

    def _unsafe(self, problem: str) -> Exception:
        return self.busy_error(f"{self.what}: its lock file {self.path} {problem}, and is not "
                               "used: remove it if nothing of its owner's holds it")

    def _busy(self, holder: dict[str, Any], extra: str = "") -> Exception:
        return self.busy_error(f"{self.what} is in use by {self.who} ({describe_holder(holder)})"
                               f"; wait for it to finish or stop it (lock file {self.path})"
                               + extra)

    def acquire(self, on_wait: Callable[[str], None] | None = None) -> None:
        """Take the lock; held by a live process, refused (the busy error), or with
        `on_wait`, waited for, after one line to `on_wait` naming the holder."""
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        said = False
        while True:
            fd = self._open(os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if on_wait is None:
                    os.close(fd)
                    raise self._busy(self._holder()) from None
                if not said:
                    on_wait(f"waiting for {self.who} to finish with {self.what} "
                            f"({describe_holder(self._holder())})")
                    said = True
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except BaseException:  # a signal that stops the process meanwhile
                    os.close(fd)
                    raise
            except OSError as error:  # no flock here: fall back on the recorded pid
                if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    os.close(fd)
                    raise
                holder = self._holder()
                if holder.get("host") == socket.gethostname() and holder.get("pid") \
                        and psutil.pid_exists(int(holder["pid"])) \
                        and int(holder["pid"]) != os.getpid():
                    os.close(fd)
                    raise self._busy(holder) from None
            # The file may have been removed and recreated by its last holder between
            # our open and our flock: then we locked an orphan inode; start over.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            holder = self._holder()
            if holder.get("host") not in (None, socket.gethostname()) and holder.get("pid"):
                os.close(fd)  # a shared file system without cross-host locks
                raise self._busy(holder, f" (on another host: delete the lock file if that "
                                         f"{self.who.removeprefix('another ')} is gone)")
            # A clean release deletes the file: a record left in it is a dead holder's.
            self.stale = holder if holder.get("pid") else None
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                     "started": now_text()}).encode())
            os.fsync(fd)
            self._fd = fd
            return

    def check_free(self) -> None:
        """Raise the busy error if a live process holds the lock now; takes nothing (what
        a check before the real `acquire` asks)."""
        try:
            fd = self._open(os.O_RDONLY)
        except OSError:
            return  # no lock file (or none readable): nobody holds it
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self._busy(self._holder()) from None
        except OSError:
            return  # no flock here: `acquire` decides
        finally:
            os.close(fd)

    def stale_note(self) -> str | None:
        """One line saying a dead holder's lock was taken over, or None."""
        if self.stale is None:
            return None
        return (f"note: took over the lock on {self.what} left by {describe_holder(self.stale)}"
                ", which is gone")

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "OwnerLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
