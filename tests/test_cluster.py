"""The embedded cluster and the choice of workers: loopback only, the master by name or tag."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import types
from importlib.machinery import ModuleSpec
from multiprocessing import spawn

import psutil
import pytest

from pipeline.cluster.workers import ClusterError, add_master, find_workers, too_few_workers
from pipeline.cluster.embedded import is_worker_process
from pipeline.cluster.forked_main import adopt_parent_main, parent_main
from pipeline.config.cluster_config import WorkerConfig
from tests.conftest import ROOT
from tests.helpers import worker_beside


@pytest.fixture(scope="module")
def with_gpu_worker(shared_cluster):
    """The shared cluster (tests/conftest.py) with a GPU-tagged worker (its torch device
    is the CPU here) started beside its three CPU workers for this module."""
    with worker_beside(shared_cluster, WorkerConfig(name="gpu-0",
                                                    resources={"GPU": 1})) as made:
        yield made


@pytest.fixture
def mixed_cluster(with_gpu_worker):
    """Three CPU workers and one tagged GPU, with a config of its own to change."""
    client, config = with_gpu_worker
    return client, dataclasses.replace(config)


def test_too_few_workers_says_none_or_how_many_offer_the_tag():
    """"no worker offers" only where none does (an external CPU and GPU worker, two
    CPU workers wanted, said "no worker offers resource 'CPU'")."""
    table = {"a": {"resources": {"CPU": 1}}, "b": {"resources": {"GPU": 1}}}
    assert too_few_workers(["CPU"], 1, 2, 10, table) == (
        "only 1 of the 2 workers needed offer resource 'CPU' after 10 s (2 connected, "
        "offering: CPU, GPU)")
    assert too_few_workers(["TPU"], 0, 1, 10, table) == (
        "no worker offers resource 'TPU' after 10 s (1 needed; 2 connected, offering: "
        "CPU, GPU)")
    assert too_few_workers(["CPU"], 0, 1, 2.5, {}).endswith("(1 needed; 0 connected, "
                                                           "offering: none)")


def test_embedded_cluster_listens_on_loopback_only_in_tls(mixed_cluster):
    """Loopback only, and TLS on every Dask address (tests/test_local_users.py tries
    other users against it)."""
    client, _ = mixed_cluster
    processes = {os.getpid()} | {p.pid for p in psutil.Process().children(recursive=True)}
    listening = {c.laddr.ip for c in psutil.net_connections("inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in processes}
    assert listening == {"127.0.0.1"}
    info = client.scheduler_info(n_workers=-1)
    assert info["address"].startswith("tls://127.0.0.1:")
    assert all(address.startswith("tls://127.0.0.1:") for address in info["workers"])


def test_master_by_default_name_tag_or_outside_the_kernel_workers(mixed_cluster):
    client, config = mixed_cluster
    offered = find_workers(client, config)  # the CPU-tagged workers
    assert [s.name for s in offered] == ["cpu-0", "cpu-1", "cpu-2"]
    assert add_master(client, config, offered) == (offered, 0)
    config.master = "cpu-1"
    assert add_master(client, config, offered) == (offered, 1)
    config.master = "GPU"  # a tag: its first worker, which joins holding no kernels
    workers, master = add_master(client, config, offered)
    assert [w.name for w in workers] == ["cpu-0", "cpu-1", "cpu-2", "gpu-0"] and master == 3
    assert workers[3].resource == "GPU"
    config.master = "tpu-7"
    with pytest.raises(ClusterError, match="no worker is named or tagged 'tpu-7'.*gpu-0"):
        add_master(client, config, offered)
    config.master = None


def test_embedded_dask_runs_quietly(mixed_cluster):
    """The scheduler and every worker check their event loop every 0.5 s and sample
    their process every 2 s (not Dask's 20 ms and 0.5 s): their periodic work shares
    the workers' cores (pipeline/cluster/embedded.py's QUIET)."""
    client, _ = mixed_cluster

    def timings(dask_worker=None, dask_scheduler=None):  # noqa: ANN001, ANN202
        server = dask_worker or dask_scheduler
        return (server.periodic_callbacks["tick"].callback_time,
                server.periodic_callbacks["monitor"].callback_time)

    assert client.run_on_scheduler(timings) == (500, 2000)
    assert set(client.run(timings).values()) == {(500, 2000)}


def test_embedded_workers_are_forked_from_one_server_with_the_worker_modules(mixed_cluster):
    """Every worker process is a child of one fork server, not of this process
    (pipeline/cluster/fork_server.py), and starts with the environment a spawned worker would
    get (one malloc arena). The server holds torch, as the memory baseline's
    `WORKER_MODULES` do, and not the client's pandas (its compiled modules are not
    mapped), so a new worker starts with what the baseline holds."""
    client, _ = mixed_cluster

    def process_facts():  # noqa: ANN202
        import sys  # noqa: PLC0415 - runs on the worker

        import psutil as ps  # noqa: PLC0415
        parent = ps.Process().parent()
        return (parent.pid, " ".join(parent.cmdline()), os.environ.get("MALLOC_ARENA_MAX"),
                "tasks.step_task" in sys.modules)

    facts = list(client.run(process_facts).values())
    servers = {pid for pid, *_ in facts}
    assert len(servers) == 1 and os.getpid() not in servers  # one server for all four
    for _pid, command, arenas, task_modules in facts:
        assert "multiprocessing.forkserver" in command, command
        assert arenas == "1" and task_modules
    server = servers.pop()
    with open(f"/proc/{server}/maps", encoding="utf-8") as handle:
        mapped = handle.read()
    assert "libtorch_cpu" in mapped and "pandas/_libs" not in mapped
    # how a start that fails tells the workers to kill from the server and this process
    workers = [psutil.Process(pid) for pid in client.run(os.getpid).values()]
    assert all(is_worker_process(p) for p in workers)
    assert not is_worker_process(psutil.Process(server))
    assert not is_worker_process(psutil.Process())


MAIN_MODULE = """
import json, sys
import pandas  # what the CLIs' record writing imports; a worker has no use for it
MAIN_OF_TEST = True  # what a worker's __main__ has if this module ran there again
from distributed import Client
from pipeline.config.run_config import WorkerConfig
from pipeline.cluster.embedded import start_embedded_cluster

if __name__ == "__main__":
    with start_embedded_cluster([WorkerConfig(name="w", resources={"CPU": 1})]) as cluster:
        with Client(cluster) as client:  # a function of __main__, carried by value
            found = client.run(lambda: ("pandas" in sys.modules,
                                        hasattr(sys.modules["__main__"], "MAIN_OF_TEST")))
    print(json.dumps(list(found.values())))
"""


def test_workers_do_not_run_the_parents_main_module_again(tmp_path):
    """A command run as `python -m NAME`, as the CLIs are: its workers, forked from the
    server, do not import it again as `__mp_main__` (pipeline/cluster/forked_main.py), so hold
    none of what it imported; a function of its `__main__` still runs there."""
    (tmp_path / "main_of_test.py").write_text(MAIN_MODULE)
    result = subprocess.run([sys.executable, "-m", "main_of_test"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": f"{ROOT}:{tmp_path}"})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == [[False, False]], result.stdout


@pytest.mark.parametrize("how", ["module", "script"])
def test_a_main_adopted_from_the_parent_is_not_run_again(tmp_path, monkeypatch, how):
    """What multiprocessing runs in each forked child to set up the parent's main
    module, for a command run with `-m` and for a script: once the server adopted the
    parent's main (`adopt_parent_main`), it finds it in place and runs nothing."""
    script = tmp_path / "parent_of_test.py"
    script.write_text("raise AssertionError('the parent main ran again')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    parent = types.ModuleType("__main__")
    parent.__spec__ = ModuleSpec("parent_of_test", None) if how == "module" else None
    parent.__file__ = str(script)
    monkeypatch.setitem(sys.modules, "__main__", parent)
    monkeypatch.setitem(sys.modules, "__mp_main__", parent)
    carried = parent_main()
    server = types.ModuleType("__main__")  # a `python -c` process: no spec, no file
    server.__spec__ = None
    monkeypatch.setitem(sys.modules, "__main__", server)
    adopt_parent_main(carried)
    if how == "module":
        spawn._fixup_main_from_name("parent_of_test")
    else:
        spawn._fixup_main_from_path(str(script))
    assert sys.modules["__main__"] is server


class SetupOnce:
    """A client whose first install of the workers' setup breaks on a connection (a
    worker's process ended, its nanny already restarting it under its name), and
    whose second succeeds; it counts the installs."""

    status, id = "running", "fake"

    def __init__(self, error: Exception) -> None:
        self.error, self.installs = error, 0

    def _register_worker_plugin(self, **kwargs: object) -> None:
        raise AssertionError("called through sync")

    def sync(self, function: object, **kwargs: object) -> None:
        self.installs += 1
        if self.installs == 1:
            raise self.error


@pytest.mark.parametrize("error, retried", [(OSError("Stream is closed"), True),
                                            (ModuleNotFoundError("No module named 'x'"), False)])
def test_a_setup_broken_by_a_connection_is_installed_again(monkeypatch, capsys, error,
                                                           retried):
    """The worker named again at once (its nanny's restart): no worker is missing, and
    the setup used to fail with the connection's error; a broken connection is now
    tried again, saying so; the setup's own error (a worker lacking a module) is not."""
    from pipeline.cluster import worker_setup
    from pipeline.config.cluster_config import ClusterConfig

    monkeypatch.setattr(worker_setup, "_worker_names", lambda client: {"cpu-0", "cpu-1"})
    monkeypatch.setattr(worker_setup, "unregister_setup", lambda client: None)
    monkeypatch.setattr(worker_setup, "_without_the_project", lambda client: ["cpu-1"])
    monkeypatch.setattr(worker_setup, "LEFT_WAIT_S", 0.0)
    client = SetupOnce(error)
    if retried:
        worker_setup.register_setup(client, ClusterConfig(workers=2))
        assert client.installs == 2
        assert ("warning: setting up the workers: a connection to a worker broke (OSError); "
                "setting the workers up again") in capsys.readouterr().err
    else:
        with pytest.raises(ClusterError, match="it lacks it on cpu-1"):
            worker_setup.register_setup(client, ClusterConfig(workers=2))
        assert client.installs == 1


def test_the_quiet_wait_sees_a_held_future_and_its_release(shared_cluster):
    """The wait before each test on the shared cluster (tests/conftest.py) asks the
    scheduler which clients hold tasks: a held future's client is listed, and no
    longer once the future is released (else the wait would never wait, or never end);
    a future still held after the wait is released on the scheduler, its key said."""
    from tests.conftest import _clients_holding_tasks, _release_held_tasks
    client, _ = shared_cluster
    kept = client.submit(sum, [4, 5], pure=False)
    assert kept.result() == 9
    assert client.run_on_scheduler(_release_held_tasks) == {client.id: [str(kept.key)]}
    assert client.run_on_scheduler(_clients_holding_tasks) == {}
    held = client.submit(sum, [1, 2], pure=False)
    assert held.result() == 3
    assert client.id in client.run_on_scheduler(_clients_holding_tasks)
    held.release()
    del held
    deadline = time.monotonic() + 10.0
    while client.run_on_scheduler(_clients_holding_tasks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.run_on_scheduler(_clients_holding_tasks) == {}
