"""Preloaded by the workers' fork server only (pipeline/cluster/fork_server.py): it gives the
server's ``__main__`` the name and file of the main module of the process that
started it, so that no worker forked from it runs that module again.

multiprocessing prepares every child it starts, forked from a server too, as a
spawned one: it imports the parent's main module under the name ``__mp_main__``
unless the child's own ``__main__`` already carries that module's name (``python
-m``) or file (a script). For ``python -m pipeline.train`` that was the whole
pipeline with xarray and pandas in every worker: a second of CPU and tens of MB each,
which a worker never uses. Dask sends what a worker runs with cloudpickle, which
carries functions and classes of ``__main__`` by value, so a worker needs nothing
of the parent's main module.

The parent hands the name and file over in `PARENT_MAIN` (its environment when the
server starts); the server takes it out of its environment again, so that the workers
forked from it do not carry it on.
"""

from __future__ import annotations

import json
import os
import sys
from importlib.machinery import ModuleSpec

#: The environment variable that carries [module name or None, file or None].
PARENT_MAIN = "HETCNN_PARENT_MAIN"


def parent_main() -> str:
    """This process's main module as `PARENT_MAIN` carries it to the server."""
    main = sys.modules["__main__"]
    path = getattr(main, "__file__", None)  # normalised as multiprocessing hands it on
    return json.dumps([getattr(getattr(main, "__spec__", None), "name", None),
                       None if path is None else os.path.normpath(os.path.abspath(path))])


def adopt_parent_main(carried: str) -> None:
    """Make this process's ``__main__`` look like the parent's to multiprocessing."""
    name, path = json.loads(carried)
    main = sys.modules["__main__"]
    if name is not None:
        main.__spec__ = ModuleSpec(name, None)
    if path is not None:
        main.__file__ = path


if PARENT_MAIN in os.environ:
    adopt_parent_main(os.environ.pop(PARENT_MAIN))
