"""Each worker says its own machine: the probe cache and the record keep the workers',
not only the client's (tasks/machine.py, pipeline/probe/machine.py).

On a cluster the client runs on one machine (a Slurm login node) and the workers on
others; a probe cached under the client's machine and the workers' names alone was
handed to another partition's nodes under the same names. One machine here has one
CPU, but a `dask worker` started under `taskset -c 0` may use one core of two: a real
difference in the machine the worker trains on, which the probe's figures follow.

Real processes: `dask scheduler` and `dask worker`s started by hand (tests/test_cli.py's
`CliCluster`), one of them pinned to a core; a real probe (cut to one round) in a
private cache; a real run on them.
"""

from __future__ import annotations

import functools
import json
import os
import shutil

import pytest
import xarray as xr
from distributed import Client

from pipeline.cluster.worker_setup import register_setup
from pipeline.cluster.workers import find_workers
from pipeline.config.cluster_config import ClusterConfig
import pipeline.probe.cluster as cluster_probe
import pipeline.probe.hops as hops
from pipeline.probe import cached_probe, find_cached_probe
from pipeline.probe.keys import worker_identity
from pipeline.probe.machine import machine_identity, worker_machines
from tasks.specs import ConvLayerSpec, NetworkSpec
from tests.helpers import cut_probe_to_one_round, run_main
from tests.test_cli import CliCluster, tiny_args
from tests.test_faults import quiet_servers

NETWORK = NetworkSpec((ConvLayerSpec(3, 8, 5, 2, 2, 32, 32),), (), 10, "float32")
PINNED = ["taskset", "-c", "0"]  # one core of those this process may use

pytestmark = pytest.mark.skipif(
    shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2,
    reason="needs taskset and two usable cores (a worker pinned to one is another machine)")


@pytest.fixture(scope="module")
def partitions(tmp_path_factory):
    """Two clusters as two partitions of a batch system give them: each a `dask
    scheduler` and one worker named w0, tagged CPU; one's w0 may use every core of this
    process, the other's is pinned to one. Yields a client of each: (whole, pinned)."""
    made = [CliCluster(tmp_path_factory.mktemp(name), dashboards=False)
            for name in ("whole", "pinned")]
    clients: list[Client] = []
    try:
        # the servers quiet, as the project's own (tests/test_faults.py's `QUIET_SERVERS`:
        # no profiler sampling the probe's tasks, slower ticks); not this process's runs
        with pytest.MonkeyPatch.context() as patch:
            quiet_servers(patch)
            for cluster, prefix in zip(made, [(), PINNED]):
                cluster.start_scheduler()
                # no nanny: its process would cost a start (distributed's imports) and
                # watch nothing these tests ask of a worker; the pinned worker is then
                # the process `taskset` runs as
                cluster.start_worker("--name", "w0", "--no-nanny", prefix=prefix)
        for cluster in made:
            address = json.loads(cluster.scheduler_file.read_text())["address"]
            clients.append(Client(address, set_as_default=False, timeout="30s"))
            clients[-1].wait_for_workers(1, timeout=60)
            register_setup(clients[-1], _cluster_config(clients[-1]))
        yield tuple(clients)
    finally:
        for client in clients:
            client.close()
        for cluster in made:
            cluster.stop()


def _cluster_config(client: Client) -> ClusterConfig:
    return ClusterConfig(scheduler=client.scheduler.address)


@pytest.fixture
def quick_probe(monkeypatch, tmp_path):
    """A probe of one round in a private cache: the key is what is tested, not the
    figures (tests/test_probe_zoo.py cuts its probes the same way)."""
    monkeypatch.setenv("CNN_PROBE_CACHE", str(tmp_path / "probes"))
    cut_probe_to_one_round(monkeypatch)
    # Dask's latencies from one round trip and one hop, not 23 and 12 (a second of CPU
    # a probe): their figures are not what is tested here either
    monkeypatch.setattr(cluster_probe, "probe_hops",
                        functools.partial(hops.probe_hops, round_trips=1, links=2))


def _probe(client: Client):
    offered = find_workers(client, _cluster_config(client))
    return offered, cached_probe(client, offered, NETWORK, 16, [4])


def test_a_probe_is_not_handed_to_another_machine_under_the_same_worker_name(partitions,
                                                                              quick_probe):
    """w0 on every core is probed and the probe reused; the other partition's w0,
    pinned to one core, is probed anew: the key holds the machine each worker said, not
    its name alone."""
    whole_client, pinned_client = partitions
    offered, whole = _probe(whole_client)
    assert whole.workers[0].machine == machine_identity()  # the client's machine
    # a worker on the client's machine keeps the key it had before workers said theirs
    assert worker_identity(offered) == worker_identity(offered, {"w0": machine_identity()})
    assert _probe(whole_client)[1] == whole  # the same machine: the cache, no second probe
    pinned = _probe(pinned_client)[1]
    assert pinned.key != whole.key and pinned.created > whole.created, \
        "a worker pinned to one core was handed the probe of one on every core"
    assert ", 1 cores, " in pinned.workers[0].machine, pinned.workers[0]
    assert _probe(pinned_client)[1] == pinned
    assert find_cached_probe(whole.key) == whole  # both kept, each for its machine


def test_the_record_and_summary_say_each_workers_machine(partitions, tmp_path, monkeypatch,
                                                         tiny_dataset_factory):
    """A run on the pinned worker keeps its machine (one core, not the client's) and
    torch threads in its record, its start and its summary, and prints them."""
    pinned_client = partitions[1]
    said = worker_machines(pinned_client, find_workers(pinned_client,
                                                       _cluster_config(pinned_client)))
    assert said["w0"]["torch_threads"] == 1 and ", 1 cores, " in said["w0"]["machine"], said
    monkeypatch.setenv("CNN_PREDICT_PROBE", "never")
    status, lines, out = run_main("train", [
        *tiny_args(tmp_path, tiny_dataset_factory("float32")), "placement=even",
        "train.steps=2", "train.eval_samples=0", "--scheduler",
        pinned_client.scheduler.address])
    assert status == 0, lines
    expected = {"w0": said["w0"]}
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["worker_machines"] == expected
    record = xr.open_zarr(tmp_path / "run" / "record.zarr")
    assert record.attrs["machine"] == machine_identity()  # the client's, apart
    assert json.loads(record.attrs["worker_machines"]) == expected
    assert json.loads(record.attrs["starts"])[-1]["worker_machines"] == expected
    assert f"  machine     w0: {said['w0']['machine']}; 1 torch thread\n" in out, out


def test_a_worker_says_its_machine_once_to_a_client(partitions, monkeypatch):
    """A probe's cache key asks each worker (by address) once per client: the model's
    probe after training does not wait `ASK_S` on a worker the run stopped or fenced
    off since (it did, 30 s, in every recovery test), and a worker not yet heard from
    is asked."""
    import pipeline.probe.machine as machine
    whole, pinned = partitions
    asked: list[list[str]] = []

    def asking(client, offered):
        asked.append([w.address for w in offered])
        return worker_machines(client, offered)

    monkeypatch.setattr(machine, "worker_machines", asking)
    monkeypatch.setattr(machine, "_SAID", type(machine._SAID)())  # this test's own memo
    offered = find_workers(whole, _cluster_config(whole))
    first = machine.worker_identities(whole, offered)
    assert first == {"w0": machine_identity()} and len(asked) == 1
    assert machine.worker_identities(whole, offered) == first and len(asked) == 1
    other = find_workers(pinned, _cluster_config(pinned))
    assert machine.worker_identities(pinned, other)["w0"] != first["w0"]  # another client
    assert len(asked) == 2 and asked[1] == [other[0].address]
