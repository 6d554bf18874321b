"""The plugin a run registers on its cluster (`RunSetup`), and which workers it sets up.

Dask installs a worker plugin on every worker of the scheduler, those of other tags
too, and on every worker that joins later. Only the run's workers (those offering one
of its tags, and its master) need its setup (`worker_state.WorkerSetup`), which imports
torch: a worker outside the run (another tag, started with a memory limit too small
for torch) is left as it is. This module imports no torch, so that unpickling the
plugin on such a worker costs it nothing.
"""

from __future__ import annotations

import pickle
from typing import Any, Mapping, Sequence

from distributed.diagnostics.plugin import WorkerPlugin

#: The prefix of the plugin's name on the scheduler (one plugin per client).
SETUP_NAME = "cnn-worker-setup"


def serves_run(name: str, resources: Mapping[str, float], tags: Sequence[str] | None,
               master: str | None) -> bool:
    """Whether a worker (its `name` and the resources it offers) may be one of a run's:
    it offers one of `tags` (any amount above 0), or `master` names it or a tag it
    offers. `tags` None: every worker (an embedded cluster, all of it the run's)."""
    if tags is None:
        return True
    offered = {tag for tag, amount in resources.items() if amount > 0}
    return bool(offered.intersection(tags)) or (master is not None and (
        name == master or master in offered))


class RunSetup(WorkerPlugin):
    """A `worker_state.WorkerSetup`, pickled, run on the workers `serves_run` names; on
    the others nothing (not even torch's import, which unpickling it would make)."""

    name = SETUP_NAME

    def __init__(self, setup: bytes, tags: Sequence[str] | None, master: str | None) -> None:
        self.setup_pickled = setup  # unpickled (torch imported) on the run's workers only
        self.tags = list(tags) if tags is not None else None
        self.master = master

    def setup(self, worker: Any) -> None:
        if not serves_run(str(worker.name), worker.state.total_resources or {}, self.tags,
                          self.master):
            return
        pickle.loads(self.setup_pickled).setup(worker)
