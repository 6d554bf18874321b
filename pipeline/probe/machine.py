"""What identifies a machine for a cached probe and a record: the client's, and each
worker's as it says it (tasks/machine.py reads them; its doc says why a host name is
not enough).

The probe cache's key holds the client's machine and, for each worker whose machine
is not the client's (an external scheduler's workers elsewhere, Slurm jobs on another
partition's nodes, a `dask worker` pinned to fewer cores), that worker's: a probe is
reused only where every machine matches (keys.py, `worker_identity`).
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

from distributed import Client

from pipeline.cluster.workers import ClusterWorker
from tasks.machine import cpu_model, gpu_models, machine_identity, usable_cores, worker_machine

__all__ = ["cpu_model", "gpu_models", "machine_identity", "usable_cores", "worker_machines",
           "worker_identities"]

#: Seconds the workers have to say their machines: a call on each worker's event loop,
#: which a busy worker answers at once; a frozen one is the run's to find.
ASK_S = 30.0


def worker_machines(client: Client | None, offered: Sequence[ClusterWorker]
                    ) -> dict[str, dict[str, Any]]:
    """Each worker's machine and torch threads by name (`tasks.machine.worker_machine`,
    run on the worker), in the order of `offered`; {} without a client. A worker that
    does not answer in `ASK_S` (or left) is left out: its machine is unknown."""
    if client is None or not offered:
        return {}
    addresses = [w.address for w in offered]
    try:
        said = client.sync(client._run, worker_machine, workers=addresses, on_error="return",
                           callback_timeout=ASK_S)
    except (OSError, TimeoutError):
        return {}
    answers = {w.name: said[w.address] for w in offered
               if isinstance(said.get(w.address), dict)}
    known = _SAID.setdefault(client, {})
    for worker in offered:
        if worker.name in answers:
            known[worker.address] = str(answers[worker.name]["machine"])
    return answers


#: Each client's workers' machine identities by address, as they said them: a worker
#: process's machine does not change while it lives (tasks/machine.py reads it once),
#: so a probe's cache key asks each worker once, and a worker that stopped answering
#: since (stopped, fenced off by the run) costs no `ASK_S` wait when the run's model
#: probes after training.
_SAID: "weakref.WeakKeyDictionary[Client, dict[str, str]]" = weakref.WeakKeyDictionary()


def worker_identities(client: Client | None, offered: Sequence[ClusterWorker]
                      ) -> dict[str, str]:
    """Each worker's machine identity by name (what a probe's cache key holds of it),
    asking only the workers (by address) this client has not heard from yet."""
    if client is None:
        return {}
    said = _SAID.setdefault(client, {})
    unheard = [w for w in offered if w.address not in said]
    if unheard:
        worker_machines(client, unheard)  # keeps what each says in `_SAID`
    return {w.name: said[w.address] for w in offered if w.address in said}
