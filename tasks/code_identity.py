"""Which code of this project a process runs: a digest of the four packages' source
files, taken once, when the process first imports this module.

A `dask worker` keeps the modules it imported for as long as it lives, and imports
them from its own Python's path, so a worker started before the code changed (a
`git pull`, an edit), or from another copy of the project, runs other code than the
run that hands it tasks; the first sign was a task's AttributeError, or no sign at
all where the difference was in the arithmetic. Every worker imports this module
with `tasks.worker_state` when a run first sets it up, so its digest is of the files
as they were when it loaded the project; the run compares each worker's with its
own (pipeline/cluster/shared_paths.py, `check_workers_code`). The same files at
another path (another host's copy) give the same digest.
"""

from __future__ import annotations

import hashlib
import os

#: The project's packages, whose `.py` files the digest covers.
PACKAGES = ("storage", "tasks", "pipeline", "experiments")
#: The folder this process imported the project from.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_digest(root: str) -> str:
    """A digest of every `.py` file of `PACKAGES` under `root`: their paths relative
    to `root` and their bytes, in a fixed order."""
    digest = hashlib.sha256()
    for package in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(root, package)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                with open(path, "rb") as source:
                    data = source.read()
                digest.update(os.path.relpath(path, root).encode() + b"\0"
                              + len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()[:16]


#: This process's code, as it was when the process imported the project.
DIGEST = source_digest(ROOT)


def code_identity() -> tuple[str, str]:
    """Where this process imported the project from, and the digest of its code then."""
    return ROOT, DIGEST
