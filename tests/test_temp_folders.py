"""multiprocessing's temporary folder of a process that starts a fork server is named
for its pid and removed by the next embedded cluster once that process is gone, and a
stop at once removes its own (pipeline/cluster/temp_folders.py). The process-level
cases, a killed or hung-up process group and a second signal, are in
tests/test_semaphores.py beside the semaphores the same processes leave."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from pipeline.cluster.semaphores import pid_namespace
from pipeline.cluster.temp_folders import folder_maker, remove_stale_temp_folders

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TAGGED_THEN_EXITED = """
import multiprocessing.util, os
from pipeline.cluster.temp_folders import tag_temp_folder
tag_temp_folder()
folder = multiprocessing.util.get_temp_dir()
print(folder, os.path.isdir(folder), flush=True)
"""


def tagged_then_exited(root: str) -> tuple[str, bool]:
    """The temporary folder a process with `root` as its TMPDIR had after
    `tag_temp_folder`, and whether it existed then."""
    done = subprocess.run([sys.executable, "-c", TAGGED_THEN_EXITED], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT, "TMPDIR": root},
                          capture_output=True, text=True, timeout=60, check=True)
    folder, exists = done.stdout.split()
    return folder, exists == "True"


def test_a_tagged_folder_is_the_process_own_and_goes_with_its_exit():
    """The tagged folder is the one multiprocessing then uses (its listeners' sockets
    go there), named for the process, and an exit that unwinds removes it."""
    with tempfile.TemporaryDirectory(dir="/tmp") as root:  # a short path (see below)
        folder, existed = tagged_then_exited(root)
        assert os.path.dirname(folder) == root and existed
        assert folder_maker(os.path.basename(folder))[1] == (pid_namespace() or 0)
        assert os.listdir(root) == []


def test_a_root_too_long_for_the_socket_path_keeps_multiprocessing_own_folder():
    """Where the tagged name would push the fork server's socket past a socket path's
    107 bytes, multiprocessing names the folder itself (shorter, and removed at exit as before)."""
    with tempfile.TemporaryDirectory(dir="/tmp") as short:
        root = os.path.join(short, "r" * (70 - len(short)))  # 70 + 30 + 8 > 89; 70 + 13 not
        os.mkdir(root)
        folder, existed = tagged_then_exited(root)
        assert os.path.dirname(folder) == root and existed
        assert os.path.basename(folder).startswith("pymp-")
        assert folder_maker(os.path.basename(folder)) is None
        assert os.listdir(root) == []


def test_only_a_tagged_folder_name_carries_a_pid_and_its_namespace():
    assert folder_maker("pymp-cnn-4242-ns4026531836-a1b2_c3d") == (4242, 4026531836)
    for name in ("pymp-a1b2c3d4", "pymp-cnn--ns7-a1b2", "pymp-cnn-42-a1b2", "pymp-cnn-42-ns7",
                 "sem.mp-cnn-42-ns7-abcd", "pymp-cnn-4x2-ns7-abcd", "pymp-cnn-42-ns7-x/y"):
        assert folder_maker(name) is None, name


def test_the_sweep_removes_only_a_gone_makers_folders_of_this_namespace(tmp_path):
    """Of folders in a root of their own: the one a pid nobody has made in this pid
    namespace is removed with its contents; another namespace's, a live pid's and an
    untagged one stay, as do a link and a file under a gone maker's name (and the
    folder the link points to)."""
    with open("/proc/sys/kernel/pid_max", encoding="ascii") as handle:
        unused = int(handle.read()) + 1  # above the largest pid: nobody's here
    here, elsewhere = pid_namespace(), pid_namespace() + 1
    gone = f"pymp-cnn-{unused}-ns{here}-abcd1234"
    kept = [f"pymp-cnn-{unused}-ns{elsewhere}-abcd1234", f"pymp-cnn-{os.getpid()}-ns{here}-ab",
            "pymp-abcd1234"]
    for name in [gone, *kept]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "listener-abcd").write_text("")
    target = tmp_path / kept[0]
    (tmp_path / f"pymp-cnn-{unused}-ns{here}-link").symlink_to(target)
    (tmp_path / f"pymp-cnn-{unused}-ns{here}-file").write_text("")
    assert remove_stale_temp_folders(str(tmp_path)) == [gone]
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        [*kept, f"pymp-cnn-{unused}-ns{here}-link", f"pymp-cnn-{unused}-ns{here}-file"])
    assert (target / "listener-abcd").exists()
