"""Results and data survive faults: owned output directories, stale workspaces,
damaged dataset stores and checkpoints.

Processes matter here (a lock holder or a workspace owner that dies), so those
holders are real subprocesses killed with SIGKILL; the runs that meet them are the
real CLI or `run_training`. Runs use the in-process `reference` strategy where the
cluster is beside the point, which keeps this module to seconds.

`FAULTS` names every fault this module injects and the test that does; the
reliability page (docs/reliability.md, "Results and data") lists the same, and
`test_reliability_page_lists_these_faults` keeps the two in step.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
import xarray as xr
import yaml
import zarr

from experiments.sweep.results import ResultStore
from experiments.sweep.store_layout import DONE
from experiments.sweep.run import run_sweep
from experiments.sweep.config import load_sweep
from pipeline import run as pipeline_run, train
from pipeline.cli import Interrupted
from pipeline.engine import step_engine as engine
from pipeline.cluster import links
from pipeline.cluster.worker_setup import register_setup
from pipeline.training.outputs import ASIDE, LOCK_NAME, OutputBusy, OutputLock, set_aside
from pipeline.config.schema import ConfigError, to_dict
from pipeline.run import run_training
from storage import checkpoints
from storage.checksums import crc32c, file_crc32c
from storage.datasets import (DatasetDamaged, DatasetError, ensure_dataset, read_batch,
                              verify_dataset)
from storage.datasets.writer import write_store
from storage.exchange import SlotSpec, create_exchange
from storage.exchange_folders import make_folder, remove_stale_exchanges
from storage.private import default_workspace_root
from tests.helpers import max_relative_error, tiny_config
from tests.test_cli import run_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "reliability.md")
SECTION = "## Results and data"

#: fault injected -> the test that injects it (the reliability page lists the same).
FAULTS = {
    "second run into a locked output directory": "test_second_run_into_a_locked_dir_is_refused",
    "lock left by a SIGKILLed run": "test_second_run_into_a_locked_dir_is_refused",
    "rerun over earlier results without resume": "test_rerun_over_results_is_refused_or_fresh",
    "fresh rerun refused after its start":
        "test_a_fresh_run_refused_before_its_first_step_keeps_the_old_results",
    "fresh rerun killed before or after its first step":
        "test_files_a_killed_fresh_run_set_aside_are_settled_by_the_next_run",
    "a config.yaml or trace.json of the user's in the output directory":
        "test_a_run_refuses_a_config_or_trace_it_did_not_write",
    "sweep retrying a failed point into its old directory":
        "test_sweep_reruns_a_point_over_its_old_results",
    "workspace left by a SIGKILLed run": "test_run_removes_stale_workspaces_only",
    "flipped byte in a dataset chunk": "test_flipped_dataset_chunk_is_detected",
    "missing dataset chunk file": "test_flipped_dataset_chunk_is_detected",
    "out-of-range labels in a store": "test_out_of_range_labels_are_refused",
    "out-of-range labels at import": "test_out_of_range_labels_are_refused",
    "dataset store without checksums (format 1)": "test_old_store_is_rebuilt_or_refused",
    "truncated latest checkpoint": "test_resume_falls_back_past_damaged_checkpoints",
    "bit-flipped checkpoint": "test_resume_falls_back_past_damaged_checkpoints",
    "every checkpoint damaged": "test_resume_falls_back_past_damaged_checkpoints",
    "unreadable record at a resume": "test_resume_refuses_an_unreadable_record",
}


def reference_config(tmp_path, dataset: str, **overrides):
    """A tiny in-process run (no cluster): the directory and data are what matter."""
    return tiny_config(tmp_path, dataset, strategy="reference", **overrides)


def write_config(tmp_path, config) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    return str(path)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)


def main_lines(capsys, argv: list[str]) -> tuple[int, list[str]]:
    """`python -m pipeline.train` in this process: exit status and stderr lines."""
    code = train.main(argv)
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def holder(code: str) -> subprocess.Popen:
    """A python process that runs `code`, prints 'ready' and waits to be killed."""
    process = subprocess.Popen(
        [sys.executable, "-c", f"{code}\nprint('ready', flush=True)\nimport time\n"
                               "time.sleep(600)"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    return process


def flip_bit(path: str, offset: int, mask: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ mask]))


def kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)


# Owned output directories -------------------------------------------------------------


def test_second_run_into_a_locked_dir_is_refused(tmp_path, tiny_dataset_factory, capsys):
    config = reference_config(tmp_path, tiny_dataset_factory("float32"))
    path = write_config(tmp_path, config)
    # another process holding the lock a run takes (`OutputLock`'s file, subject and
    # kind of holder), without importing the run's code (torch: seconds of CPU)
    lock = OutputLock(config.output_dir)
    other = holder(f"from storage.locks import OwnerLock\n"
                   f"OwnerLock({lock.path!r}, {lock.what!r}, {lock.who!r}).acquire()")
    try:
        # the command's main in this process: the lock is another process's (the
        # holder); `python -m pipeline.train` exits with what main returns (tests/test_cli.py)
        code, lines = main_lines(capsys, [path])
        assert code == 3, lines
        assert len(lines) == 1, lines
        assert f"pid {other.pid} on {socket.gethostname()}, since " in lines[0]
        assert "another run" in lines[0] and config.output_dir in lines[0]
        assert not os.path.exists(config.checkpoint_path)  # refused before writing anything
        assert main_lines(capsys, [path, "--check"]) == (3, lines)  # as the run says
    finally:
        kill(other)
    code, lines = main_lines(capsys, [path])  # the holder died: its lock is stale
    assert code == 0, lines
    assert lines == [f"note: took over the lock on output directory {config.output_dir} "
                     f"left by pid {other.pid} on {socket.gethostname()}, since "
                     f"{lines[0].split(', since ')[-1]}"], lines
    notes = xr.open_zarr(os.path.join(config.output_dir, "record.zarr")).attrs["notes"]
    assert json.loads(notes) == lines
    assert not os.path.exists(os.path.join(config.output_dir, LOCK_NAME))  # released


def test_a_run_into_a_zarr_store_is_refused(tmp_path, tiny_dataset_factory, capsys):
    """A sweep's results store given as `output` (or a folder in it): the run's files
    there would be damage to every later report and resume of that store."""
    store = tmp_path / "results.zarr"
    store.mkdir()
    # as a sweep's store holds it: its attributes (the sweep's config, its sessions)
    # make the metadata file 75 KB and more
    (store / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group",
                                                 "attributes": {"config": "x" * 100_000}}))
    (tmp_path / "zarr.json").write_text("{}")  # a file of that name, not a store
    config = reference_config(tmp_path, tiny_dataset_factory("float32"))
    path = write_config(tmp_path, config)
    for output, where in ((store, "is"), (store / "run", "is inside")):
        for check in ([], ["--check"]):
            code, lines = main_lines(capsys, [path, f"output={output}", *check])
            assert code == 2 and lines == [
                f"error: output: {output} {where} the Zarr store {store}, not a run "
                "directory; choose another output"], lines
    assert sorted(os.listdir(store)) == ["zarr.json"]
    assert main_lines(capsys, [path, "--check"]) == (0, [])  # beside a stray zarr.json


def test_a_run_into_the_filesystem_root_is_refused(tmp_path, tiny_dataset_factory, capsys):
    """`output=/` (a slip for `output=/some/where`): as root the folder is writable, and
    the run would spread its files over the root; --check refuses it as the run does,
    and nothing is written there."""
    config = reference_config(tmp_path, tiny_dataset_factory("float32"))
    path = write_config(tmp_path, config)
    before = sorted(os.listdir("/"))
    expected = ["error: output: / is the filesystem root; a run writes its files (run.lock, "
                "record.zarr, checkpoints.zarr, workspace-*.zarr) straight into its output "
                "directory: give it a folder of its own"]
    for check in (["--check"], []):
        assert main_lines(capsys, [path, "output=/", *check]) == (2, expected)
    assert sorted(os.listdir("/")) == before


def test_rerun_over_results_is_refused_or_fresh(tmp_path, tiny_dataset_factory, capsys):
    config = reference_config(tmp_path, tiny_dataset_factory("float32"))
    path = write_config(tmp_path, config)
    assert main_lines(capsys, [path])[0] == 0
    # a step only the first run's store has: a fresh run must not leave it beside its own
    checkpoints.create_checkpoint(config.checkpoint_path, 99, {"w": (2,)}, {}, "float32")
    first = os.path.getmtime(os.path.join(config.output_dir, "summary.json"))

    code, lines = main_lines(capsys, [path])
    assert code == 2 and len(lines) == 1, lines
    assert "already holds an earlier run's results" in lines[0] and "--fresh" in lines[0]
    assert "step/0000099" in zarr.open_group(config.checkpoint_path, mode="r")
    assert os.path.getmtime(os.path.join(config.output_dir, "summary.json")) == first

    code, lines = main_lines(capsys, [path, "train.fresh=true", "train.resume=true"])
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: train.fresh"), lines

    assert main_lines(capsys, [path, "--fresh"])[0] == 0
    assert "step/0000099" not in zarr.open_group(config.checkpoint_path, mode="r")
    assert checkpoints.complete_steps(config.checkpoint_path) == [0, config.train.steps]
    assert main_lines(capsys, [path, "train.resume=true", "train.steps=7"])[0] == 0
    assert checkpoints.latest_complete_step(config.checkpoint_path) == 7

    with OutputLock(config.output_dir):  # in-process callers get the exception
        with pytest.raises(OutputBusy, match=f"pid {os.getpid()}"):
            run_training(config)


def test_a_fresh_run_refused_before_its_first_step_keeps_the_old_results(
        tmp_path, tiny_dataset_factory, capsys):
    """`--fresh` sets the earlier run's results aside until the new run has results of
    its own: a run refused once it started (here its dataset, found damaged as the run
    opens it) puts them back, and the same command with a good dataset replaces them."""
    config = reference_config(tmp_path, tiny_dataset_factory("float32"))
    path = write_config(tmp_path, config)
    assert main_lines(capsys, [path])[0] == 0
    before = {name: os.path.getmtime(os.path.join(config.output_dir, name))
              for name in ("summary.json", "config.yaml", "trace.json")}
    store = copy_store(tmp_path, tiny_dataset_factory)
    labels = np.asarray(zarr.open_array(store, path="train/labels")[:])
    labels[7] = 10  # 10 classes: labels 0..9
    relabel(store, "train", labels)

    code, lines = main_lines(capsys, [path, "--fresh", f"data.path={store}"])
    assert code == 1 and len(lines) == 1 and "outside [0, 10)" in lines[0], lines
    assert {name: os.path.getmtime(os.path.join(config.output_dir, name))
            for name in before} == before
    assert checkpoints.complete_steps(config.checkpoint_path) == [0, config.train.steps]
    assert sorted(os.listdir(config.output_dir)) == sorted(
        ["checkpoints.zarr", "config.yaml", "record.zarr", "summary.json", "trace.json"])

    def stopped(*args, **kwargs):  # Ctrl-C as the run builds its dataset
        raise Interrupted(signal.SIGINT)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline_run, "prepare_dataset", stopped)
        code, lines = main_lines(capsys, [path, "--fresh"])
    assert code == 130 and lines == [
        f"interrupted (SIGINT) before the first checkpoint; the earlier run's results in "
        f"{config.output_dir} are kept; run the same command again to start over"], lines
    assert os.path.getmtime(os.path.join(config.output_dir, "summary.json")) == \
        before["summary.json"]

    assert main_lines(capsys, [path, "--fresh"])[0] == 0
    assert os.path.getmtime(os.path.join(config.output_dir, "summary.json")) > \
        before["summary.json"]
    assert not [name for name in os.listdir(config.output_dir) if name.endswith(".aside")]


def test_files_a_killed_fresh_run_set_aside_are_settled_by_the_next_run(
        tmp_path, tiny_dataset_factory, capsys):
    """A fresh run killed before its first step leaves the earlier run's files aside:
    the next run puts them back (so a plain rerun is refused over them, with a note);
    one killed after it trained has results of its own, and they are removed.
    `--check` refuses the set-aside results as the run will, moving nothing."""
    config = reference_config(tmp_path, tiny_dataset_factory("float32"))
    path = write_config(tmp_path, config)
    assert main_lines(capsys, [path])[0] == 0
    summary = os.path.join(config.output_dir, "summary.json")
    first = os.path.getmtime(summary)
    set_aside(config.output_dir)  # as the killed fresh run did, then wrote its step 0
    checkpoints.create_checkpoint(config.checkpoint_path, 0, {"w": (2,)}, {}, "float32")
    code, lines = main_lines(capsys, [path, "--check"])  # moves nothing, refuses as the run
    assert code == 2 and len(lines) == 1 and f"{ASIDE}/summary.json" in lines[0], lines
    assert os.path.isdir(os.path.join(config.output_dir, ASIDE))
    code, lines = main_lines(capsys, [path])
    assert code == 2 and len(lines) == 2 and "put back" in lines[0], lines
    assert "already holds an earlier run's results" in lines[1], lines
    assert os.path.getmtime(summary) == first and not os.path.exists(
        os.path.join(config.output_dir, ASIDE))

    set_aside(config.output_dir)  # this time the killed fresh run trained: its own steps
    shutil.copytree(os.path.join(config.output_dir, ASIDE, "checkpoints.zarr"),
                    config.checkpoint_path)
    code, lines = main_lines(capsys, [path])
    assert code == 2 and len(lines) == 1 and "checkpoints.zarr" in lines[0], lines
    assert not os.path.exists(summary) and not os.path.exists(
        os.path.join(config.output_dir, ASIDE))


def test_a_run_refuses_a_config_or_trace_it_did_not_write(tmp_path, tiny_dataset_factory,
                                                          capsys):
    """A config.yaml or trace.json in the output directory beside no run's results is
    the user's (`python -m pipeline.train exp/config.yaml output=exp`): the run and
    `--check` refuse it in one line naming it, exit 2, `--fresh` too, and it is left as
    it was; beside an earlier run's results it is that run's, replaced as they are."""
    config = reference_config(tmp_path, tiny_dataset_factory("float32"))
    own = tmp_path / "exp"
    own.mkdir()
    users = {"config.yaml": "# my notes\n" + yaml.safe_dump(to_dict(config), sort_keys=False),
             "trace.json": '{"mine": true}'}
    for name, text in users.items():
        written = own / name
        written.write_text(text)
        for extra in ([], ["--fresh"], ["--check"], ["--check", "--fresh"]):
            code, lines = main_lines(capsys, [str(own / "config.yaml") if name == "config.yaml"
                                              else write_config(tmp_path, config),
                                              f"output={own}", *extra])
            assert code == 2 and len(lines) == 1, (extra, lines)
            assert lines[0].startswith("error: output: ") and str(written) in lines[0], lines
        assert written.read_text() == text
        assert sorted(os.listdir(own)) in ([name], [name, LOCK_NAME])
        written.rename(tmp_path / name)
    path = write_config(tmp_path, config)
    assert main_lines(capsys, [path])[0] == 0  # an earlier run's: replaced by --fresh
    assert main_lines(capsys, [path, "--fresh", "--check"])[0] == 0
    assert main_lines(capsys, [path, "--fresh"])[0] == 0


def test_sweep_reruns_a_point_over_its_old_results(tmp_path, tiny_dataset_factory):
    sweep_file = tmp_path / "sweep.yaml"
    base = to_dict(reference_config(tmp_path, tiny_dataset_factory("float32")))
    del base["output"]
    sweep_file.write_text(yaml.safe_dump({
        "name": "retry", "base": base, "measure": {"warmup_steps": 1, "steps": 2},
        "axes": {"train.batch": [8, 16]}}))
    sweep = load_sweep(str(sweep_file), [], None, str(tmp_path / "retry.zarr"))
    for point in sweep.points:  # what a failed attempt left in the points' directories
        os.makedirs(point.config.output_dir)
        for name in ("summary.json", "trace.json"):
            with open(os.path.join(point.config.output_dir, name), "w") as handle:
                handle.write("{}")
    code = run_sweep(sweep, out=io.StringIO(), err=io.StringIO())
    assert code == 0
    assert (ResultStore(sweep.store_path).status() == DONE).all()
    for point in sweep.points:
        with open(os.path.join(point.config.output_dir, "summary.json")) as handle:
            assert json.load(handle)["strategy"] == "reference"  # replaced, not kept


# Stale workspaces ---------------------------------------------------------------------


def test_run_removes_stale_workspaces_only(tmp_path, tiny_dataset_factory,
                                           three_worker_cluster):
    shared = tmp_path / "workspaces"
    make = ("from storage.exchange import SlotSpec, create_exchange\n"
            "create_exchange({!r}, [SlotSpec('x', (4,), 'float32')])")
    dead = holder(make.format(str(shared / "dead.zarr")))
    kill(dead)
    live = holder(make.format(str(shared / "live.zarr")))
    os.makedirs(shared / "unowned.zarr")  # no owner record: never ours to judge
    try:
        create_exchange(str(shared / "mine.zarr"), [SlotSpec("x", (4,), "float32")])
        config = tiny_config(tmp_path, tiny_dataset_factory("float32"), strategy="single",
                             **{"workspace.path": str(shared), "train.steps": 1,
                                "train.warmup_steps": 0, "train.eval_samples": 0})
        client, cluster = three_worker_cluster  # `single`: the first shared CPU worker
        config.cluster.workers = cluster.workers
        register_setup(client, config.cluster)
        run_training(config, client=client)
        left = sorted(os.listdir(shared))
        assert left == ["live.zarr", "mine.zarr", "unowned.zarr"], left  # run's own: removed
        assert remove_stale_exchanges(str(shared)) == []
    finally:
        kill(live)
    removed = remove_stale_exchanges(str(shared))
    assert len(removed) == 1 and f"pid {live.pid}" in removed[0]
    assert sorted(os.listdir(shared)) == ["mine.zarr", "unowned.zarr"]


def test_a_run_removes_the_default_root_only_when_that_leaves_it_empty(
        tmp_path, tiny_dataset_factory, three_worker_cluster, monkeypatch):
    """Nothing is left in /dev/shm after a run; but what another run keeps in the root
    (its workspace, a linked run's pin: pipeline/cluster/links.py) keeps it."""
    root = f"{default_workspace_root()}-test-{os.getpid()}-{tmp_path.name}"
    monkeypatch.setattr(engine, "default_workspace_root", lambda: root)
    client, cluster = three_worker_cluster  # `single`: the first shared CPU worker
    register_setup(client, cluster)

    def run(name: str) -> None:
        config = tiny_config(tmp_path / name, tiny_dataset_factory("float32"),
                             strategy="single", **{"train.steps": 1, "train.eval_samples": 0})
        config.cluster.workers = cluster.workers
        assert run_training(config, client=client).record.sizes["step"] == 1

    pin = os.path.join(root, f"{links.PIN_PREFIX}other")
    os.makedirs(root)
    open(pin, "w").close()
    try:
        run("pinned")
        assert os.listdir(root) == [os.path.basename(pin)]  # its workspace went, not the pin
        os.remove(pin)
        run("alone")
        assert not os.path.exists(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_workspace_is_made_even_when_its_empty_root_goes_meanwhile(tmp_path, monkeypatch):
    made, real = [], os.makedirs

    def racing(path, mode=0o777, exist_ok=False):  # the root made, then removed by another run
        made.append(path)
        real(path, mode, exist_ok=exist_ok)
        if len(made) == 1:
            os.rmdir(path)
            os.rmdir(os.path.dirname(path))
            raise FileNotFoundError(path)

    monkeypatch.setattr(os, "makedirs", racing)
    make_folder(str(tmp_path / "root" / "run.zarr"))
    assert len(made) == 2 and os.path.isdir(tmp_path / "root" / "run.zarr")


# Dataset integrity --------------------------------------------------------------------


def copy_store(tmp_path, tiny_dataset_factory) -> str:
    path = str(tmp_path / "data.zarr")
    shutil.copytree(tiny_dataset_factory("float32"), path)
    return path


def shard_file(store: str, split: str = "train", shard: int = 0) -> str:
    return os.path.join(store, split, "images", "c", str(shard), "0", "0", "0")


def test_flipped_dataset_chunk_is_detected(tmp_path, tiny_dataset_factory, capsys):
    store = copy_store(tmp_path, tiny_dataset_factory)
    ok = cli("storage.datasets", "verify", store)
    assert ok.returncode == 0 and "ok (4 arrays" in ok.stdout, ok.stderr
    flip_bit(shard_file(store), 1000, 0x10)  # one bit of one image
    bad = cli("storage.datasets", "verify", store)
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert bad.returncode == 1 and len(lines) == 1, bad.stderr
    assert "array train/images fails its crc32c checksum" in lines[0]
    config = reference_config(tmp_path, store)
    code, lines = main_lines(capsys, [write_config(tmp_path, config)])
    assert code == 1 and len(lines) == 1 and "array train/images" in lines[0], lines
    assert not os.path.exists(config.checkpoint_path)  # stopped before training

    flip_bit(shard_file(store), 1000, 0x10)  # back as it was
    verify_dataset(store)
    os.remove(shard_file(store, "test"))
    with pytest.raises(DatasetDamaged, match="array test/images: chunk file c/0/0/0/0 is "
                                             "missing"):
        verify_dataset(store)


def relabel(store: str, split: str, labels: np.ndarray) -> None:
    """Write labels and re-record their checksum: a store built with these labels."""
    zarr.open_array(store, path=f"{split}/labels", mode="r+")[:] = labels
    root = zarr.open_group(store, mode="r+")
    sums = root.attrs["checksums"]
    folder = os.path.join(store, split, "labels")
    sums["arrays"][f"{split}/labels"] = {
        name: list(file_crc32c(os.path.join(folder, *name.split("/"))))
        for name in sums["arrays"][f"{split}/labels"]}
    root.attrs["checksums"] = sums


def test_out_of_range_labels_are_refused(tmp_path, tiny_dataset_factory, capsys):
    store = copy_store(tmp_path, tiny_dataset_factory)
    labels = np.asarray(zarr.open_array(store, path="train/labels")[:])
    labels[7] = 10  # 10 classes: labels 0..9
    relabel(store, "train", labels)
    with pytest.raises(DatasetDamaged, match=r"array train/labels holds labels from 0 to 10, "
                                             r"outside \[0, 10\)"):
        verify_dataset(store)
    with pytest.raises(DatasetDamaged, match="train/labels"):
        read_batch(store, "train", np.arange(4))  # what a worker opens
    code, lines = main_lines(capsys, [write_config(tmp_path, reference_config(tmp_path, store))])
    assert code == 1 and len(lines) == 1 and "outside [0, 10)" in lines[0], lines

    def blocks():
        yield 0, np.zeros((4, 1, 2, 2)), np.array([0, 1, -1, 1])
    with pytest.raises(DatasetDamaged, match="train/labels holds labels from -1"):
        write_store(str(tmp_path / "bad.zarr"), False, {"classes": 2}, (1, 2, 2), "float32",
                    {"train": (4, blocks)})
    assert not os.path.exists(tmp_path / "bad.zarr")


def test_old_store_is_rebuilt_or_refused(tmp_path, tiny_dataset_factory):
    store = copy_store(tmp_path, tiny_dataset_factory)
    root = zarr.open_group(store, mode="r+")
    attrs = root.attrs.asdict()
    root.attrs.update({"format_version": 1, "checksums": None})
    with pytest.raises(DatasetError, match="format version 1; this code reads version 2"):
        verify_dataset(store)
    build = attrs["build"]
    info = ensure_dataset("synthetic", store, train_samples=build["train_samples"],
                          test_samples=build["test_samples"], seed=build["seed"])
    assert verify_dataset(info.path).files > 0  # rebuilt from its source, with checksums


# Checkpoints ------------------------------------------------------------------------


def chunk_of(config, step: int, tensor: str) -> str:
    folder = os.path.join(config.checkpoint_path, "step", f"{step:07d}", *tensor.split("/"))
    return os.path.join(folder, "c", *["0"] * len(zarr.open_array(folder).shape))


def test_resume_falls_back_past_damaged_checkpoints(tmp_path, tiny_dataset_factory, capsys):
    dataset = tiny_dataset_factory("float32")
    straight = reference_config(tmp_path / "a", dataset, **{"train.steps": 8})
    run_training(straight)
    config = reference_config(tmp_path / "b", dataset, **{"train.steps": 6,
                                                         "train.checkpoint_every": 2})
    run_training(config)
    assert checkpoints.complete_steps(config.checkpoint_path) == [0, 2, 4, 6]
    with open(chunk_of(config, 6, "weights/0.weight"), "r+b") as handle:
        handle.truncate(100)  # a torn write of the newest checkpoint
    flip_bit(chunk_of(config, 4, "momentum/3.bias"), 5, 0x01)  # and one in the one before
    capsys.readouterr()
    resumed = run_training(reference_config(tmp_path / "b", dataset, **{
        "train.steps": 8, "train.checkpoint_every": 2, "train.resume": True}))
    lines = [line for line in capsys.readouterr().err.splitlines() if "train.resume" in line]
    assert len(lines) == 1, lines
    assert re.search(r"step 6: it cannot be read .*; step 4: tensor momentum/3.bias does not "
                     r"match its checksum\); resuming from step 2", lines[0]), lines[0]
    # the first run's steps before checkpoint 2, then the resumed start's
    assert list(resumed.record.step.values) == list(range(8))
    assert list(resumed.record.start.values) == [0, 0] + [1] * 6
    assert json.loads(resumed.record.attrs["notes"]) == [
        *lines, "record: steps 2-5 of start 0 ran past checkpoint 2, which this start "
        "resumes from; its own steps replace them"]
    for kind in ("weights", "momentum"):  # the fallback lost nothing but time
        assert max_relative_error(checkpoints.read_tensors(config.checkpoint_path, 8, kind),
                                  checkpoints.read_tensors(straight.checkpoint_path, 8, kind)
                                  ) < 1e-5

    for step in checkpoints.complete_steps(config.checkpoint_path):
        os.remove(chunk_of(config, step, "weights/0.bias"))
    code, lines = main_lines(capsys, [write_config(tmp_path, config), "train.resume=true"])
    assert code == 1 and len(lines) == 1, lines
    assert "no checkpoint in" in lines[0] and "train.fresh=true" in lines[0]


def test_resume_refuses_an_unreadable_record(tmp_path, tiny_dataset_factory, capsys):
    """A resume continues the record of the run's earlier starts; one it cannot read
    is refused before any training (one line, exit 2), and left as it is, rather than
    replaced by the resume's steps alone."""
    config = reference_config(tmp_path, tiny_dataset_factory("float32"), **{
        "train.steps": 4, "train.checkpoint_every": 2})
    run_training(config)
    metadata = os.path.join(config.output_dir, "record.zarr", "zarr.json")
    with open(metadata, "w", encoding="utf-8") as handle:
        handle.write("{ torn")
    before = run_files(tmp_path / "run" / "record.zarr")
    code, lines = main_lines(capsys, [write_config(tmp_path, config), "train.resume=true",
                                      "train.steps=6"])
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: train.resume: the record of the run's earlier "
                               f"start(s), {config.output_dir}/record.zarr, cannot be read")
    assert "--fresh" in lines[0], lines[0]
    assert run_files(tmp_path / "run" / "record.zarr") == before
    assert checkpoints.latest_complete_step(config.checkpoint_path) == 4  # nothing trained


def test_config_rejects_fresh_with_resume(tmp_path, tiny_dataset_factory):
    with pytest.raises(ConfigError, match="train.fresh"):
        reference_config(tmp_path, tiny_dataset_factory("float32"),
                         **{"train.fresh": True, "train.resume": True})


# The reliability page ---------------------------------------------------------------


def page_rows(heading: str = SECTION) -> list[list[str]]:
    """The table rows of a section of docs/reliability.md (this module's by default)."""
    text = open(PAGE, encoding="utf-8").read()
    assert heading in text, f"{PAGE} lacks the section {heading!r}"
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("|")]
    return rows[2:]  # after the header and its rule


def test_reliability_page_lists_these_faults():
    rows = page_rows()
    assert {row[0]: row[-1].strip("`") for row in rows} == FAULTS
    for test in FAULTS.values():
        assert callable(globals().get(test)), test
    text = open(PAGE, encoding="utf-8").read().split(SECTION, 1)[1].split("\n## ", 1)[0]
    figures = re.search(r"(\d+) faults injected, (\d+) handled as described, (\d+) results? "
                        r"lost", text)
    assert figures, "the section's summary line is missing"
    assert [int(v) for v in figures.groups()] == [len(FAULTS), len(FAULTS), 0]


def test_an_arrays_checksum_is_of_its_bytes_in_c_order_and_copies_no_contiguous_array():
    """A checkpoint's tensors are checksummed as their C-order bytes: the same value for
    any dtype, view or shape as the bytes themselves, read in place when contiguous."""
    import tracemalloc
    rng = np.random.default_rng(0)
    for dtype in ("float32", "float64", "int64", "uint8", "bool"):
        array = (rng.random((7, 5, 3)) * 100).astype(dtype)
        for view in (array, array[:, 1], array.T, array[0, 0, 0], array[:0]):
            assert crc32c(view) == crc32c(np.asarray(view).tobytes()), (dtype, view.shape)
    big = np.ones(2_000_000, dtype="float32")  # 8 MB
    tracemalloc.start()
    try:
        crc32c(big)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, peak
