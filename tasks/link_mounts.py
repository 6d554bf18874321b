"""A linked worker's check that its directories are still mounted over its link.

A worker behind `cluster.link` (pipeline/cluster/links.py) reaches the run's directories
through sshfs mounts in its own mount namespace, and the worker shares the file
system with the client. When a mounted directory is removed on the client's side
(any process that deletes /dev/shm/dask-cnn-<uid> while it holds no workspace),
Linux detaches the mount in the worker's namespace too; once the directory is made
again, the worker reads and writes the client's own folder directly, its bytes no
longer crossing its link: fast and wrong. Seen in two link sweeps (a `data` step
behind 20mbit and one behind 100mbit read and wrote 40 MB slots at 3 GB/s), and
reproduced by removing a mounted folder. `check_link_mounts` turns that into a
failed step naming the folder.

Why here: the tasks run on the worker, and this is a plain file system check; the
folders come in the environment the linked host set (`LINK_MOUNTS`).
"""

from __future__ import annotations

import os
import time

#: The environment variable holding a linked worker's mounted folders (os.pathsep)
LINK_MOUNTS = "HETCNN_LINK_MOUNTS"
#: At most one check a second: each is a round trip over the link per folder
EVERY_S = 1.0

_last = [float("-inf")]


class LinkMountLost(RuntimeError):
    """A folder this worker reaches over its link is no longer mounted."""


def check_link_mounts(now: float | None = None) -> None:
    """Raise `LinkMountLost` if a folder of `LINK_MOUNTS` is no longer a mount point
    (checked at most every `EVERY_S` seconds; nothing to do without the variable)."""
    folders = [f for f in os.environ.get(LINK_MOUNTS, "").split(os.pathsep) if f]
    now = time.monotonic() if now is None else now
    if not folders or now - _last[0] < EVERY_S:
        return
    _last[0] = now
    for folder in folders:
        if not os.path.ismount(folder):
            raise LinkMountLost(
                f"{folder} is no longer mounted over this worker's link (the folder was "
                "removed on the client's side, or its sshfs ended): its reads and writes "
                "would bypass the link, so the step stops here")
