"""Folders only the run's user can reach: the default workspace root in shared memory.

A run's exchange workspace holds the activations and gradients its workers hand each
other, and each worker reads them back as trusted input. /dev/shm is shared by every
user of the machine (mode 1777), so the folder the workspaces go in by default,
``/dev/shm/dask-cnn-<uid>``, is made by the run with mode 0700, and one found there is
used only if it is a real directory of the run's user that nobody else can write in:
otherwise another local user who made it first (mode 0777) could move a run's
workspace aside mid-run, read its activations, or feed forged ones in. Such a folder
is refused with one line (`UnsafeFolder`), never repaired: it is not ours to change.
A folder of ours that others can read (made by an older version, mode 0755) is
narrowed to 0700.

Each run's own workspace folder is made 0700 too, wherever it goes (its files are
not readable by others even in a `workspace.path` shared with other users).
"""

from __future__ import annotations

import os
import pwd
import stat

PRIVATE_MODE = 0o700


class UnsafeFolder(OSError):
    """A folder the run would trust belongs to another user or others can write in it."""


def default_workspace_root() -> str:
    """Where exchange workspaces go on this host by default (shared memory, per user)."""
    return os.path.join("/dev/shm", f"dask-cnn-{os.getuid()}")


def user_name(uid: int) -> str:
    """A user's name, or their number where the system knows no name."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def folder_problem(path: str) -> str | None:
    """What makes the existing `path` unsafe as a private folder of this process's user,
    as one line; None if it is safe (or does not exist: it will be made private)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link (to {os.readlink(path)}), not a folder of this user's"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a folder"
    if info.st_uid != os.getuid():
        return (f"{path} belongs to user {user_name(info.st_uid)}, not to this run's user "
                f"{user_name(os.getuid())}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def owner_problem(path: str) -> str | None:
    """`path` (not what a link there names) belongs to another user: that as one line
    naming both users; None if it is this process's user's or does not exist. A run's
    output directory or a sweep's store of another user's could hand the run files of
    theirs (checkpoints a resume trusts, links its writes follow) and change its
    results after it wrote them."""
    try:
        owner = os.lstat(path).st_uid
    except FileNotFoundError:
        return None
    if owner == os.getuid():
        return None
    return (f"{path} belongs to user {user_name(owner)}, not to this run's user "
            f"{user_name(os.getuid())}")


def parent_problem(path: str) -> str | None:
    """What lets another user move aside what the run makes in the existing folder
    `path` (a `workspace.path`: the run's own 0700 folder in it keeps them out of it, not
    from renaming it and putting one of theirs in its place): the folder belongs to a
    user other than this one and root, or every user may write in it without the
    sticky bit (as /tmp has) keeping them to their own entries. One line, or None."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    if info.st_uid not in (os.getuid(), 0):
        return f"{path} belongs to user {user_name(info.st_uid)}"
    if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        return (f"{path} is writable by every user (mode {stat.S_IMODE(info.st_mode):o}) "
                "without the sticky bit")
    return None


def make_private_folder(path: str) -> None:
    """Make `path` (its parent must exist) with mode 0700, or check that the existing
    one is safe (`folder_problem`) and narrow it to 0700; UnsafeFolder otherwise."""
    try:
        os.mkdir(path, PRIVATE_MODE)
        os.chmod(path, PRIVATE_MODE)  # whatever the umask left
        return
    except FileExistsError:
        pass
    problem = folder_problem(path)
    if problem:
        raise UnsafeFolder(f"the workspace folder {problem}: remove it, or set "
                           "workspace.path to a folder of your own")
    if stat.S_IMODE(os.lstat(path).st_mode) != PRIVATE_MODE:
        os.chmod(path, PRIVATE_MODE)
