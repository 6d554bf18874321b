"""A run's exchange workspace as a folder: made private, marked with its owner
process, removed at the run's end, and swept when its owner died.

Apart from the slots and markers (storage/exchange.py) because the folders'
lifetime (which run owns a workspace, when one is stale, the shared root in
/dev/shm) is a job of its own that the run's client does, while the slots are what
the workers read and write each step.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import uuid
from typing import Callable, Iterator

import fsspec
import psutil

from storage.private import PRIVATE_MODE, default_workspace_root, make_private_folder

OWNER = "owner.json"


def is_local(path: str) -> bool:
    """Whether `path` is on this host's file system (a plain path or file://)."""
    return "://" not in path or path.startswith("file://")


def local_path(path: str) -> str:
    """A local `path` without its file:// prefix."""
    return path[len("file://"):] if path.startswith("file://") else path


def make_folder(folder: str, then: Callable[[], None] = lambda: None,
                attempts: int = 50) -> None:
    """`os.makedirs` (a new `folder` private to this user, and the default root, when
    it is or holds `folder`, made or checked private: storage/private.py), then `then`
    (a file to make in it), again when a concurrent run removed an empty parent or
    `folder` itself meanwhile (`remove_root_if_empty`)."""
    root = default_workspace_root()
    for attempt in range(attempts):
        try:
            if root in (folder.rstrip(os.sep), os.path.dirname(folder.rstrip(os.sep))):
                make_private_folder(root)
            os.makedirs(folder, PRIVATE_MODE, exist_ok=True)
            then()
            return
        except FileNotFoundError:
            if attempt == attempts - 1:
                raise


def remove_root_if_empty(root: str) -> None:
    """Remove the workspaces' root folder if nothing is left in it: one rmdir, which
    fails (and is ignored) while anything is there, so a concurrent run's workspace or
    a linked run's pin (pipeline/cluster/links.py, `LinkedHosts.pin`) keeps it."""
    try:
        os.rmdir(root)
    except OSError:
        pass


def write_owner(folder: str) -> None:
    """Write the owner record (this process, its host and start time) into `folder`,
    made if need be: what tells a later run whether the workspace is stale."""
    make_folder(folder)
    me = psutil.Process()
    record = {"kind": "hetcnn-workspace", "pid": me.pid, "host": socket.gethostname(),
              "process_started": me.create_time()}
    temporary = os.path.join(folder, f"{OWNER}.{uuid.uuid4().hex[:8]}")
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(record, handle)
    os.replace(temporary, os.path.join(folder, OWNER))  # readers never see half a record


def _owner_gone(record: dict) -> bool:
    """True if the record names a process of this host that no longer runs (a pid
    reused by another process counts as gone: its start time differs)."""
    if record.get("kind") != "hetcnn-workspace" or record.get("host") != socket.gethostname():
        return False
    try:
        started = psutil.Process(int(record["pid"])).create_time()
    except psutil.NoSuchProcess:
        return True
    except (KeyError, TypeError, ValueError, psutil.Error):
        return False
    return abs(started - float(record.get("process_started", started))) > 1.0


def _owned_workspaces(parent: str) -> Iterator[tuple[str, dict]]:
    """The workspaces in local folder `parent` with an owner record: (path, record)."""
    if not is_local(parent) or not os.path.isdir(local_path(parent)):
        return
    for entry in sorted(os.scandir(local_path(parent)), key=lambda e: e.name):
        if not (entry.name.endswith(".zarr") and entry.is_dir(follow_symlinks=False)):
            continue
        try:
            with open(os.path.join(entry.path, OWNER), encoding="utf-8") as handle:
                record = json.load(handle)
        except (OSError, ValueError):
            continue  # no owner record: not ours, older, or being created
        if isinstance(record, dict):
            yield entry.path, record


def remove_stale_exchanges(parent: str) -> list[str]:
    """Remove the workspaces in local folder `parent` left by dead runs of this host;
    one line per workspace removed, saying whose it was."""
    removed = []
    for path, record in _owned_workspaces(parent):
        if _owner_gone(record):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(f"note: removed the stale workspace {path} of a dead run "
                           f"(pid {record.get('pid')} on {record.get('host')})")
    return removed


def remove_own_exchanges(parent: str) -> None:
    """Remove the workspaces in local folder `parent` that this process made, and
    `parent` itself if nothing else is left in it (as a run's own end does): what an
    exit without unwinding (a second stop signal) would leave behind."""
    for path, record in _owned_workspaces(parent):
        if record.get("pid") == os.getpid() and record.get("host") == socket.gethostname():
            shutil.rmtree(path, ignore_errors=True)
    if is_local(parent):
        remove_root_if_empty(local_path(parent))


def remove_exchange(path: str) -> None:
    """Delete a workspace (it holds only the last step's scratch data).

    A local one is first renamed aside, then removed: a worker fenced off but still
    running (woken, or its link back) may go on marking slots ready, and a marker it
    made inside the folder while `shutil.rmtree` worked through it kept that folder,
    without its owner record, for good. After the rename its paths lead nowhere; the
    new name ends in ``.zarr`` so that, were this process killed before the removal
    ends, the next start's `remove_stale_exchanges` finds it by its dead owner."""
    if is_local(path):
        folder = local_path(path).rstrip(os.sep)
        aside = f"{folder.removesuffix('.zarr')}.removing-{uuid.uuid4().hex[:8]}.zarr"
        try:
            os.rename(folder, aside)
        except FileNotFoundError:
            return
        except OSError:  # not renamable (a mount point): remove it where it is
            aside = folder
        shutil.rmtree(aside, ignore_errors=True)
    else:
        fs, root = fsspec.core.url_to_fs(path)
        try:
            fs.rm(root, recursive=True)
        except FileNotFoundError:
            pass
