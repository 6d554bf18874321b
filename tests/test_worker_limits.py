"""Workers that cannot fit: `dask worker --memory-limit` too small for a set-up worker
or for the run's network, a worker lost at its limit, and the setup plugin not
outliving the run.

The arithmetic is checked as pure functions; the rest on one `dask scheduler` with
`dask worker` processes started as a user starts them (tests/test_cli.py's
`CliCluster`), a worker at a time.
"""

from __future__ import annotations

import time

import psutil
import pytest
from distributed import Client

from pipeline.cluster.workers import ClusterWorker, WorkerLost, live_workers
from pipeline.engine.runner import TaskRunner
from pipeline.train import lost_line
from pipeline.cluster.worker_limits import MemoryRule, limit_problem, memory_loss_notes, memory_rule
from tests.helpers import error_lines_of, reliability_rows, run_main
from tests.test_cli import CliCluster, tiny_args

MB = 10 ** 6
#: fault injected -> the test that injects it (docs/reliability.md lists the same).
FAULTS = {
    "`dask worker --memory-limit 250MB` (torch alone is more)":
        "test_a_too_small_limit_is_refused_before_the_setup",
    "a worker of another tag with `--memory-limit 150MB`":
        "test_a_small_worker_outside_the_run_is_left_alone",
    "a run on workers you started ends": "test_the_setup_does_not_outlive_the_run",
    "a run's setup left on the scheduler (its scheduler frozen until the run stopped)":
        "test_a_run_removes_the_setups_of_runs_whose_client_is_gone",
    "a worker's nanny restarts it for memory mid-task":
        "test_a_worker_its_nanny_restarts_for_memory_is_lost_for_memory",
}


def test_what_dask_lets_a_worker_hold():
    """The pause fraction (the worker runs nothing above it), the nanny's restart
    fraction where lower, none without either (False in Dask's config)."""
    assert memory_rule(0.8, 0.95, nanny=True) == MemoryRule(0.8, "Dask pauses a worker")
    assert memory_rule(False, 0.95, nanny=True) == MemoryRule(0.95, "its nanny restarts it")
    assert memory_rule(False, 0.95, nanny=False).fraction == 1.0  # no nanny, no restart
    assert memory_rule(0.9, 0.7, nanny=True).fraction == 0.7


def test_a_limit_below_a_bare_worker_is_named_with_what_it_needs():
    rule = memory_rule(0.8, 0.95, nanny=True)
    workers = {"tcp://a:1": {"name": "a", "memory_limit": 250 * MB},
               "tcp://b:1": {"name": "b", "memory_limit": 0},  # no limit
               "tcp://c:1": {"name": "c", "memory_limit": 2000 * MB}}
    rules = {address: rule for address in workers}
    line = limit_problem(workers, rules, need=270 * MB)
    assert line is not None and "\n" not in line
    # 270 MB held must stay under 80 % of the limit: 337.5 MB
    assert "worker a: 250 MB limit, a worker needs at least 338 MB" in line
    assert "worker b" not in line and "worker c" not in line and "80 %" in line
    assert limit_problem(workers, rules, need=150 * MB) is None  # 250 * 0.8 = 200 MB
    # without a pause fraction, a worker without a nanny may use its whole limit
    assert limit_problem(workers, {a: MemoryRule(1.0, "") for a in workers}, 240 * MB) is None


def test_a_started_worker_s_capacity_is_what_dask_lets_it_hold():
    from pipeline.placement.capacity import capacities_from
    workers = [ClusterWorker("tcp://a:1", "a", "CPU", 1, 1.0, "")]
    reported = {"tcp://a:1": {"memory_limit": 650 * MB}}
    rules = {"tcp://a:1": memory_rule(0.8, 0.95, nanny=False)}
    assert capacities_from(workers, {}, reported, {}, rules) == [520 * MB]


def test_a_worker_lost_near_its_limit_is_said_to_be_lost_for_memory():
    rule = memory_rule(0.8, 0.95, nanny=True)
    seen = {"tcp://a:1": {"memory_limit": 500 * MB, "metrics": {"memory": 395 * MB}},
            "tcp://b:1": {"memory_limit": 500 * MB, "metrics": {"memory": 200 * MB}},
            "tcp://c:1": {"memory_limit": 0, "metrics": {"memory": 900 * MB}},
            "tcp://d:1": {"memory_limit": 500 * MB, "metrics": {"memory": 100 * MB}}}
    restarted = [(1.0, {"worker": "tcp://d:1", "pid": 7, "rss": 480 * MB})]
    rules = {address: rule for address in seen}
    notes = memory_loss_notes(list(seen), restarted, seen, rules)
    assert set(notes) == {"tcp://a:1", "tcp://d:1"}  # b far below, c without a limit
    assert "395 MB held of its 500 MB" in notes["tcp://a:1"]
    assert notes["tcp://d:1"] == ("its nanny restarted it for memory: it held 480 MB of its "
                                  "500 MB limit")


def test_the_line_of_a_worker_lost_for_memory_does_not_suggest_a_resume():
    lost = WorkerLost("calibration: worker d (its nanny restarted it for memory) left the "
                      "cluster", ["tcp://d:1"], ["d"], memory=True)
    assert "train.resume=true" not in lost_line(lost) and "--memory-limit" in lost_line(lost)
    plain = WorkerLost("step 3: worker d left the cluster", ["tcp://d:1"], ["d"])
    assert "train.resume=true" in lost_line(plain)


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory):
    """A `dask scheduler`; each test starts (and kills) the workers it needs."""
    cluster = CliCluster(tmp_path_factory.mktemp("limits"))
    try:
        yield cluster, cluster.start_scheduler()
    finally:
        cluster.stop()


def _stop_workers(cluster: CliCluster, address: str) -> None:
    """Kill the tests' workers (nanny and child) and wait until the scheduler has
    none, so that the next test sees only its own. Each nanny's resource tracker is
    left to end by itself once they are gone: it then removes the semaphores they
    made in /dev/shm, which a SIGKILL of it would leave there for good."""
    for process in cluster.processes[1:]:
        trackers = []
        for child in psutil.Process(process.pid).children(recursive=True):
            if "resource_tracker" in " ".join(child.cmdline()):
                trackers.append(child)
            else:
                child.kill()
        process.kill()
        process.wait()
        psutil.wait_procs(trackers, timeout=10)
    del cluster.processes[1:]
    with Client(address, timeout="10s") as client:
        deadline = time.monotonic() + 30
        while live_workers(client) and time.monotonic() < deadline:
            time.sleep(0.2)


def _wait_for_workers(address: str, count: int) -> dict[str, dict]:
    with Client(address, timeout="10s") as client:
        deadline = time.monotonic() + 60
        while len(workers := live_workers(client)) < count and time.monotonic() < deadline:
            time.sleep(0.2)
        return workers


def test_a_too_small_limit_is_refused_before_the_setup(tmp_path, scheduler,
                                                       tiny_dataset_factory):
    """`dask worker --memory-limit 250MB` (with its nanny): torch alone is more. The
    run says so in one line, exit 2, and never sets the worker up, so its nanny does
    not restart it (before: "Stream is closed", then a restart a second for as long as
    the worker lived)."""
    cluster, address = scheduler
    worker = cluster.start_worker("--memory-limit", "250MB", "--name", "tiny")
    try:
        _wait_for_workers(address, 1)
        child = psutil.Process(worker.pid).children()[-1].pid  # the nanny's worker process
        # the command's main in this process: what is checked is the line and the
        # worker's nanny, a process of its own (one interpreter start less)
        status, said, _out = run_main("train", [
            *tiny_args(tmp_path, tiny_dataset_factory("float32")), "--scheduler", address])
        lines = error_lines_of("\n".join(said))
        assert status == 2, said
        assert len(lines) == 1 and "worker tiny: 250 MB limit, a worker needs at least" \
            in lines[0], lines
        time.sleep(3)  # a setup would have had it restarted by now
        assert psutil.Process(child).is_running()
        assert [c.pid for c in psutil.Process(worker.pid).children()][-1] == child
    finally:
        _stop_workers(cluster, address)


def test_a_small_worker_outside_the_run_is_left_alone(tmp_path, scheduler,
                                                      tiny_dataset_factory):
    """A `dask worker --resources SMALL=1 --memory-limit 150MB` (with its nanny) beside
    the run's CPU worker: the run trains, exit 0 (before: refused, "worker tiny: 150 MB
    limit, a worker needs at least ...", exit 2, though the run never uses it), and
    the run's setup, which Dask registers on every worker, left it as it was: no
    torch imported there, its process not restarted."""
    cluster, address = scheduler
    cluster.start_worker("--name", "plain", "--no-nanny")
    tiny = cluster.start_worker("--memory-limit", "150MB", "--name", "tiny",
                                "--resources", "SMALL=1")
    try:
        workers = _wait_for_workers(address, 2)
        (tiny_address,) = [a for a, info in workers.items() if info["name"] == "tiny"]
        child = psutil.Process(tiny.pid).children()[-1].pid  # the nanny's worker process
        status, said, _out = run_main("train", [
            *tiny_args(tmp_path, tiny_dataset_factory("float32")), "train.steps=2",
            "placement=even", "--scheduler", address])
        assert status == 0, said
        with Client(address, timeout="10s") as client:
            imported = client.run(lambda: "torch" in __import__("sys").modules,
                                  workers=[tiny_address])
        assert imported == {tiny_address: False}
        assert [c.pid for c in psutil.Process(tiny.pid).children()][-1] == child
    finally:
        _stop_workers(cluster, address)


def test_an_external_worker_s_memory_limit_is_read_from_the_scheduler(
        tmp_path, scheduler, tiny_dataset_factory):
    """A `dask worker --memory-limit 650MB` gives the capacity, 80 % of it (Dask pauses
    a worker beyond): the paper network on one worker needs more (806 MB predicted,
    772 MB measured: docs/model.md), so the run is refused in one line before it
    calibrates, exit 2."""
    cluster, address = scheduler
    cluster.start_worker("--memory-limit", "650MB", "--no-nanny", "--resources", "LIMITED=1")
    try:  # the run waits for the worker (cluster.wait_timeout) while it starts
        # the command's main in this process: the limit is the worker's, read from the
        # scheduler (one interpreter start less)
        status, said, _out = run_main("train", [
            *tiny_args(tmp_path, tiny_dataset_factory("float32")),
            "network.conv.0.kernels=500", "network.conv.1.kernels=1500", "train.batch=32",
            "strategy=single", "cluster.resource=LIMITED", "--scheduler", address])
    finally:
        _stop_workers(cluster, address)
    assert status == 2, said
    lines = error_lines_of("\n".join(said))
    assert len(lines) == 1 and "needs" in lines[0] and "has 520 MB" in lines[0], lines
    assert "Dask pauses a worker at 80 % of its limit" in lines[0]
    assert not (tmp_path / "run" / "record.zarr").exists()


def test_the_setup_does_not_outlive_the_run(tmp_path, scheduler, tiny_dataset_factory):
    """After a run on workers the user started, the scheduler holds none of its
    plugins: a worker that joins or restarts later is not set up by a run that
    ended. The command's `main` in this process (its client, the one that registered
    the plugins, gone when it returns; one interpreter start less): what is checked is
    the scheduler's, a process of its own."""
    cluster, address = scheduler
    # no nanny: what is checked is the scheduler's plugin table, and a nanny is one
    # more process to start (the nanny's worker trains in tests/test_cli.py)
    cluster.start_worker("--name", "plain", "--no-nanny")
    try:
        _wait_for_workers(address, 1)
        status, lines, _out = run_main("train", [
            *tiny_args(tmp_path, tiny_dataset_factory("float32")), "placement=even",
            "--scheduler", address])
        assert status == 0, lines
        with Client(address, timeout="10s") as client:
            plugins = client.run_on_scheduler(
                lambda dask_scheduler: sorted(dask_scheduler.worker_plugins))
        assert not [name for name in plugins if name.startswith("cnn-worker-setup")], plugins
    finally:
        _stop_workers(cluster, address)


def test_a_run_removes_the_setups_of_runs_whose_client_is_gone(tmp_path, scheduler,
                                                              tiny_dataset_factory):
    """A setup left on the scheduler by a run that could not remove it (its scheduler
    frozen until the run stopped): the scheduler installed it on every worker that
    joined later. A run that starts removes it, in one line, and leaves the setup of
    a client still connected (another run's) where it is."""
    from distributed.diagnostics.plugin import WorkerPlugin

    from pipeline.cluster.worker_setup import setup_name

    cluster, address = scheduler
    cluster.start_worker("--name", "plain", "--no-nanny")
    try:
        _wait_for_workers(address, 1)
        with Client(address, timeout="10s") as gone:  # a run's client, gone when it ends
            orphaned = setup_name(gone)
            gone.register_plugin(WorkerPlugin(), name=orphaned)
        with Client(address, timeout="10s") as other:  # another run's, connected
            other.register_plugin(WorkerPlugin(), name=setup_name(other))
            status, lines, _out = run_main("train", [
                *tiny_args(tmp_path, tiny_dataset_factory("float32")), "train.steps=2",
                "placement=even", "--scheduler", address])
            plugins = other.run_on_scheduler(
                lambda dask_scheduler: sorted(dask_scheduler.worker_plugins))
        assert status == 0, lines
        assert [line for line in lines if "removed the setup" in line] == [
            f"note: setting up the workers: removed the setup of an earlier run whose client has "
            f"left the scheduler ({orphaned}), which set up every worker that joined since"]
        assert orphaned not in plugins and setup_name(other) in plugins, plugins
    finally:
        _stop_workers(cluster, address)


def test_a_worker_its_nanny_restarts_for_memory_is_lost_for_memory(scheduler):
    """A task that fills a `--memory-limit 300MB` worker: its nanny restarts it; the
    run's runner reports the worker lost for memory (`WorkerLost.memory`), naming
    what it held of its limit."""
    cluster, address = scheduler
    cluster.start_worker("--memory-limit", "300MB", "--name", "full")
    try:
        workers = _wait_for_workers(address, 1)
        [(worker_address, info)] = workers.items()
        with Client(address, timeout="10s") as client:
            worker = ClusterWorker(worker_address, "full", "CPU", 1, 1.0, "cpu")
            runner = TaskRunner(client, [worker], "limits")

            def hog_memory(megabytes: int) -> int:  # nested: sent by value (no tests/ there)
                import time as worker_time
                data = b"x" * (megabytes * 10 ** 6)
                worker_time.sleep(60)
                return len(data)

            future = runner.submit(hog_memory, 0, 400, name="hog")
            with pytest.raises(WorkerLost) as lost:
                runner.gather([future], "filling")
        assert lost.value.memory, str(lost.value)
        assert "worker full (its nanny restarted it for memory: it held" in str(lost.value)
        assert "of its 300 MB limit" in str(lost.value)
    finally:
        _stop_workers(cluster, address)


def test_reliability_page_lists_these_faults():
    rows = reliability_rows("## Workers that cannot fit")
    assert {row[0]: row[-1].strip("`") for row in rows} == FAULTS
    assert all(callable(globals().get(test)) for test in FAULTS.values())
