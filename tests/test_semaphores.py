"""The named semaphores of an embedded cluster's queues (6 a worker, in /dev/shm) are
gone after its process group is hung up or killed: a real process holding a real
one-worker embedded cluster, as a test session or a script holds one, in a session
of its own, its whole group signalled (pipeline/cluster/semaphores.py says why).
And a child's own semaphore is gone after a second signal stopped its parent at once."""

from __future__ import annotations

import glob
import mmap
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil

from pipeline.cluster.semaphores import (SEMAPHORE_FOLDER, is_resource_tracker, maker_gone,
                                         pid_namespace, remove_stale_semaphores,
                                         semaphore_maker, tag_semaphores_with_pid,
                                         untagged_maker, untagged_maker_gone)
from pipeline.cluster.temp_folders import remove_stale_temp_folders
from tests.helpers import wait_exited

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HOLDER = """
import signal, sys
# a terminal's process takes a hang-up; one started under nohup (as this suite may be)
# inherits it ignored, and so would outlive it
signal.signal(signal.SIGHUP, signal.SIG_DFL)
from pipeline.cluster.embedded import start_embedded_cluster
from pipeline.config.cluster_config import WorkerConfig
cluster = start_embedded_cluster([WorkerConfig(name="w0", resources={"CPU": 1})])
print("ready", flush=True)
sys.stdin.read()  # until the test's end closes it, if no signal came first
"""


def semaphores_of(pid: int) -> list[str]:
    """The semaphore files in /dev/shm that process `pid` made (named after it)."""
    return glob.glob(os.path.join(SEMAPHORE_FOLDER, f"sem.mp-cnn-{pid}-*"))


def temp_folders_of(pid: int, root: str) -> list[str]:
    """The multiprocessing temporary folders in `root` that process `pid` made (named
    after it: pipeline/cluster/temp_folders.py)."""
    return glob.glob(os.path.join(root, f"pymp-cnn-{pid}-*"))


def wait_for_group_to_end(pgid: int, timeout: float = 60) -> None:
    """Return once every process of group `pgid` has exited (its resource tracker
    included); a zombie has (init reaps an orphan up to a second or two later)."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for pid in psutil.pids():
            try:
                if os.getpgid(pid) == pgid and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
            except (OSError, psutil.NoSuchProcess):
                pass
        if not left:
            return
        assert time.monotonic() < deadline, \
            f"process group {pgid} still running: {[survivor(pid) for pid in left]}"
        time.sleep(0.05)


def survivor(pid: int) -> str:
    """What a process that outlived its group's signal is, and what it does with
    signals (blocked, ignored, caught, pending: its own and its threads'), so that a
    failure says why. (It showed a hung-up group that outlived SIGHUP to have it
    ignored: the suite ran under nohup, which `HOLDER` now undoes.)"""
    try:
        command = " ".join(psutil.Process(pid).cmdline())[:80]
        masks = {}
        for task in sorted(os.listdir(f"/proc/{pid}/task")):
            with open(f"/proc/{pid}/task/{task}/status", encoding="utf-8") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
            masks[task] = {key: fields[key].strip() for key in
                           ("State", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
                           if key in fields}
    except (OSError, psutil.Error) as error:
        return f"{pid}: {error}"
    return f"{pid} {command!r} {masks}"


def held_then_group_signalled(signum: int, temp_root: str) -> tuple[int, list[str]]:
    """Start a process holding a one-worker embedded cluster in a session of its own,
    with `temp_root` as its temporary folder (where no other test's cluster sweeps),
    check its 6 semaphores are there, send `signum` to its process group and wait
    until every process of the group has ended; returns the holder's pid and the
    semaphores it left. Those are read before the holder is reaped: until then its
    pid is taken, so the sweep of another test's cluster starting meanwhile
    (`remove_stale_semaphores`, under xdist) cannot judge its maker gone."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": ROOT, "TMPDIR": temp_root},
                              stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "ready", holder.communicate(timeout=60)
        assert len(semaphores_of(holder.pid)) == 6  # two queues of three to its worker
        os.killpg(holder.pid, signum)
        wait_for_group_to_end(holder.pid)
        left = sorted(os.path.basename(path) for path in semaphores_of(holder.pid))
        holder.communicate(timeout=60)
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()
    return holder.pid, left


def test_a_hang_up_of_the_process_group_leaves_no_semaphore():
    """SIGHUP (a closed terminal) ends every process of the group, which unwinds
    nothing; the resource tracker, started with it blocked, outlives them and unlinks
    the semaphores. Unblocked, the hang-up ends the tracker too and all 6 stay."""
    with tempfile.TemporaryDirectory(dir="/tmp") as temp_root:  # short: a socket's path
        pid, left = held_then_group_signalled(signal.SIGHUP, temp_root)
        remove_stale_semaphores()  # whatever the group left: not for later tests to see
        (folder,) = temp_folders_of(pid, temp_root)  # nobody unwound: the next cluster's
        assert remove_stale_temp_folders(temp_root) == [os.path.basename(folder)]
    assert left == []


def test_the_next_cluster_removes_what_a_killed_process_group_left():
    """SIGKILL to the group leaves nobody to unlink the semaphores nor to remove the
    temporary folder of the fork server's socket; the next embedded cluster's sweeps
    (`remove_stale_semaphores`, `remove_stale_temp_folders`) remove them by the dead
    pid in their names, and keep those of a live process (this one's)."""
    with tempfile.TemporaryDirectory(dir="/tmp") as temp_root:  # short: a socket's path
        pid, left = held_then_group_signalled(signal.SIGKILL, temp_root)
        (folder,) = temp_folders_of(pid, temp_root)
        assert remove_stale_temp_folders(temp_root) == [os.path.basename(folder)]
    assert len(left) == 6  # the tracker died with the group
    tag_semaphores_with_pid()
    own = multiprocessing.get_context("forkserver").Lock()  # a named semaphore of a live pid
    try:
        assert len(semaphores_of(os.getpid())) >= 1
        assert set(left) <= set(remove_stale_semaphores())
        assert semaphores_of(pid) == [] and len(semaphores_of(os.getpid())) >= 1
    finally:
        del own


def test_only_a_tagged_name_carries_a_pid_and_its_namespace():
    assert semaphore_maker("sem.mp-cnn-4242-ns4026531836-a1b2_c3d") == (4242, 4026531836)
    for name in ("sem.mp-a1b2c3d4", "sem.mp-cnn--a1b2", "sem.mp-cnn-42", "sem.mp-cnn-42-x/y",
                 "mp-cnn-42-ns7-abcd", "sem.mp-cnn-4x2-ns7-abcd", "sem.mp-cnn-42-ns-abcd",
                 "sem.mp-cnn-42-ns7-x/y", "sem.mp-cnn-4242-a1b2_c3d"):  # the last: pid only
        assert semaphore_maker(name) is None, name


def test_a_maker_is_judged_gone_only_in_its_own_pid_namespace():
    """`maker_gone`: a container sharing /dev/shm but not the pids would see another's
    live maker as gone, and unlinking its semaphore fails its next worker. Only a name
    made in this process's namespace, by a pid none has there now, is gone."""
    alive = {10}.__contains__
    assert maker_gone("sem.mp-cnn-11-ns5-abcd", 5, alive)
    assert not maker_gone("sem.mp-cnn-10-ns5-abcd", 5, alive)  # its maker, or a new holder
    assert not maker_gone("sem.mp-cnn-11-ns6-abcd", 5, alive)  # another namespace's
    assert not maker_gone("sem.mp-cnn-11-ns0-abcd", 5, alive)  # its maker's unknown
    assert not maker_gone("sem.mp-cnn-11-ns5-abcd", None, alive)  # this process's unknown
    assert not maker_gone("sem.mp-cnn-11-abcd", 5, alive)  # no namespace: judged apart
    assert not maker_gone("sem.mp-abcd", 5, alive)


def test_a_name_with_the_pid_alone_is_judged_by_its_pid_and_its_mappings():
    """`untagged_maker_gone`: a name from before the namespace was recorded does not say
    where its maker ran; gone only when its pid is gone here and no process this one
    sees maps the file (a live maker in a container below has another pid here)."""
    assert untagged_maker("sem.mp-cnn-4242-a1b2_c3d") == 4242
    for name in ("sem.mp-cnn-4242-ns7-a1b2", "sem.mp-a1b2c3d4", "sem.mp-cnn--a1b2",
                 "sem.mp-cnn-42", "mp-cnn-42-abcd", "sem.mp-cnn-4x2-abcd"):
        assert untagged_maker(name) is None, name
    alive, file = {10}.__contains__, (27, 1234)
    assert untagged_maker_gone("sem.mp-cnn-11-abcd", file, alive, set())
    assert not untagged_maker_gone("sem.mp-cnn-10-abcd", file, alive, set())  # a live pid
    assert not untagged_maker_gone("sem.mp-cnn-11-abcd", file, alive, {file})  # mapped
    assert untagged_maker_gone("sem.mp-cnn-11-abcd", file, alive, {(27, 99)})  # another's
    assert not untagged_maker_gone("sem.mp-cnn-11-ns5-abcd", file, alive, set())


def test_the_sweep_keeps_another_namespaces_semaphore_of_a_pid_unknown_here(tmp_path):
    """Real files in a folder of their own, of a pid no process has here: the one made
    in this pid namespace is unlinked, the other namespace's kept; of two whose name
    carries the pid alone, the one no process maps is unlinked, and the one this
    process maps (as a live maker in a container below this namespace would) kept;
    one of a live pid stays."""
    with open("/proc/sys/kernel/pid_max", encoding="ascii") as handle:
        unused = int(handle.read()) + 1  # above the largest pid: nobody's here
    here, elsewhere = pid_namespace(), pid_namespace() + 1
    names = [f"sem.mp-cnn-{unused}-ns{here}-abcd1234", f"sem.mp-cnn-{unused}-abcd1234",
             f"sem.mp-cnn-{unused}-ns{elsewhere}-abcd1234", f"sem.mp-cnn-{unused}-mapped12",
             f"sem.mp-cnn-{os.getpid()}-abcd1234"]
    for name in names:
        (tmp_path / name).write_bytes(bytes(32))
    with open(tmp_path / names[3], "r+b") as handle, mmap.mmap(handle.fileno(), 32):
        assert sorted(remove_stale_semaphores(str(tmp_path))) == sorted(names[:2])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])


STOPPED_TWICE = """
import multiprocessing, multiprocessing.util, time
from pipeline.cli import stops_on_signals
from pipeline.cluster.semaphores import start_resource_tracker
from tests.semaphore_child import hold_a_semaphore  # not this module: it imports torch
start_resource_tracker()
with stops_on_signals():
    try:
        multiprocessing.get_context("forkserver").Process(target=hold_a_semaphore).start()
        print(multiprocessing.util.get_temp_dir(), flush=True)  # the fork server's socket's
        time.sleep(120)
    finally:  # a run's cleanup that hangs: the second signal stops it at once
        print("unwinding", flush=True)
        time.sleep(120)
"""


def test_a_second_signal_spares_the_tracker_that_unlinks_a_childs_semaphore():
    """The stop at once (`pipeline.cli.stop_now`) kills the process's children, a
    semaphore of one of them (not the process's own, which it unlinks itself) with
    it; the resource tracker, spared, unlinks that one once they are all gone.
    Killed with them, it left the semaphore in /dev/shm. The process's own temporary
    folder (its fork server's socket's) is removed too, as its exit would have."""
    process = subprocess.Popen([sys.executable, "-c", STOPPED_TWICE], cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    path = ""
    try:
        # the child's semaphore's name and the process's folder, in either order
        said = sorted(process.stdout.readline().strip() for _ in range(2))
        folder, name = said if said[0].startswith("/") else ("", said[0])
        path = os.path.join(SEMAPHORE_FOLDER, f"sem.{name}")
        assert name and os.path.exists(path), (said, process.communicate(timeout=60))
        assert os.path.isdir(folder), said
        (tracker,) = [child for child in psutil.Process(process.pid).children()
                      if is_resource_tracker(child)]
        process.send_signal(signal.SIGHUP)
        assert process.stdout.readline().strip() == "unwinding"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 128 + signal.SIGTERM
        alive = wait_exited([tracker], timeout=30)
        assert not alive
        assert not os.path.exists(path)
        assert not os.path.exists(folder)  # removed before the exit that skips cleanup
    finally:
        if process.poll() is None:
            process.kill()
        if path and os.path.isfile(path):  # a failed check's leftover, for nobody else
            os.unlink(path)
