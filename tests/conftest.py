"""Shared fixtures: a small synthetic dataset and a real Dask cluster.

The cluster is a real scheduler with three nanny-managed worker processes (the same
SpecCluster the runs start), started once and shared by every test module that asks
for it: starting, warming up and closing a cluster costs several seconds, more than
most of the runs on it. Each run registers its own worker setup (`register_setup`:
torch threads, emulated speeds) and keeps its worker-side state under its own run
id, so a run meets the workers as a fresh cluster gives them; a module that sets
the workers up otherwise (an emulated slow worker) sets them back when it is done.

Its workers, by name and resource tags (a run uses the workers offering its tags):

* cpu-0, cpu-1, cpu-2: CPU=1, the workers of most runs (`three_worker_cluster`);
  also tagged FAST, MID, SLOW one each (tests/test_devices.py's device mix) and,
  cpu-0 and cpu-1, PROBE (the pair tests/test_prediction.py probes and predicts);
* gpu-0 (GPU=1, no CUDA device here) is started beside them only for
  tests/test_cluster.py's master by tag (`tests.helpers.worker_beside`), not kept for
  the session: an idle worker costs its cluster about 9 ms of CPU a second.

`slurm` is a real one-node Slurm per module that asks for it (tests/slurm_cluster.py;
tests/test_jobqueue.py, tests/test_jobqueue_stops.py and tests/test_jobqueue_jobs.py),
skipped with the reason where it cannot start.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


from pipeline.cluster.shared_use import FIRE_AND_FORGET  # noqa: E402
from pipeline.config.cluster_config import WorkerConfig  # noqa: E402
from storage.datasets import create_synthetic_dataset  # noqa: E402
from tests.helpers import embedded_client, shared_workers  # noqa: E402
from tests.slurm_cluster import LocalSlurm, slurm_missing  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dataset_factory(tmp_path_factory):
    """Build (once per dtype) a 512/128-sample synthetic dataset: with `tiny_config`'s
    data (seed 0, the config's default), so a run given it opens it and never rebuilds
    it in place (which made tests that copy it depend on which test ran first)."""
    made = {}

    def make(dtype: str = "float32") -> str:
        if dtype not in made:
            path = str(tmp_path_factory.mktemp("data") / f"tiny-{dtype}.zarr")
            create_synthetic_dataset(path, train_samples=512, test_samples=128, seed=0,
                                     dtype=dtype)
            made[dtype] = path
        return made[dtype]

    return make


SHARED_WORKERS = [
    WorkerConfig(name="cpu-0", resources={"CPU": 1, "FAST": 1, "PROBE": 1}),
    WorkerConfig(name="cpu-1", resources={"CPU": 1, "MID": 1, "PROBE": 1}),
    WorkerConfig(name="cpu-2", resources={"CPU": 1, "SLOW": 1}),
]


@pytest.fixture(scope="session")
def shared_cluster():
    """The session's cluster (module doc); yields (client, config of its three workers)."""
    with embedded_client(SHARED_WORKERS) as made:
        yield made


@pytest.fixture(autouse=True)
def shared_cluster_quiet(request):
    """Before a test on the session's cluster, wait (up to 10 s) until no client of it
    holds tasks: futures an earlier test dropped are released by a message the client
    sends in the background, and a run started meanwhile saw them as another client's
    work and said so (pipeline/cluster/shared_use.py), one line too many for a test
    that counts its lines. What is still held after the wait (futures kept alive by
    an earlier test, or a client it left open) is released on the scheduler, with a
    warning naming the clients and keys, so that one test's leftovers fail no other.
    Tests that do not use the cluster do not wait."""
    if "shared_cluster" not in request.fixturenames:
        return
    client, _ = request.getfixturevalue("shared_cluster")
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        if not client.run_on_scheduler(_clients_holding_tasks):
            return
        gc.collect()  # futures in reference cycles
        time.sleep(0.05)
    held = client.run_on_scheduler(_release_held_tasks)
    warnings.warn(f"clients of the shared cluster still held tasks after 10 s, released "
                  f"now (this process's own client: {client.id}): {held}")


def _clients_holding_tasks(dask_scheduler) -> dict[str, list[str]]:
    """The clients of the scheduler holding tasks (a few of each one's keys), less
    fire-and-forget's own."""
    return {key: sorted(str(task.key) for task in state.wants_what)[:5]
            for key, state in dask_scheduler.clients.items()
            if key != FIRE_AND_FORGET and state.wants_what}


def _release_held_tasks(dask_scheduler) -> dict[str, list[str]]:
    """Release, for every client (less fire-and-forget's) still holding tasks, what it
    holds, as its own release message would; return `_clients_holding_tasks` as it
    was. A test starts with nothing of its own on the cluster: all it finds held is
    an earlier test's."""
    held = _clients_holding_tasks(dask_scheduler)
    for key in held:
        dask_scheduler.client_releases_keys(
            [task.key for task in dask_scheduler.clients[key].wants_what], key,
            stimulus_id=f"tests-release-leftovers-{time.time()}")
    return held


@pytest.fixture
def three_worker_cluster(shared_cluster):
    """The shared cluster's three CPU workers (cpu-0, cpu-1, cpu-2); yields (client, config)."""
    return shared_workers(shared_cluster, "CPU")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node Slurm for the module (tests/slurm_cluster.py), the batch commands of
    this process and its children pointed at it; every job cancelled and every daemon
    stopped after, whatever happened."""
    reason = slurm_missing()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("dask_jobqueue", reason="needs dask-jobqueue (pip install -e '.[slurm]')")
    local = LocalSlurm(str(tmp_path_factory.mktemp("slurm")))
    with pytest.MonkeyPatch.context() as patch:
        for key, value in local.environment.items():
            patch.setenv(key, value)
        try:
            local.start()
            yield local
        finally:
            local.stop(str(tmp_path_factory.getbasetemp()))
