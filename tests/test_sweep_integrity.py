"""A sweep's results store is checked like a run's: damage to a finished point's chunk
files, to the store's metadata, and a store written before checksums.

The sweep is two in-process `reference` points (no cluster), run once for the module;
each test damages a copy of its store and meets it through the sweep (its `main` or
`run_sweep`, in this process) and the report.

`FAULTS` names every fault this module injects and the test that does; the
reliability page (docs/reliability.md, "Sweep results stores") lists the same, and
`test_reliability_page_lists_these_faults` keeps the two in step.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import time

import pytest
import xarray as xr

from experiments.report import cli as report
from experiments.sweep import store_growth
from experiments.sweep.results import ResultStore
from experiments.sweep.store_layout import DONE, FAILED, PENDING, build_template
from experiments.sweep.config import load_sweep
from experiments.sweep.run import run_sweep
from storage.labelled import write_dataset
from tests.helpers import run_main
from tests.test_integrity import PAGE, page_rows
from tests.test_report_gaps import unrendered
from tests.test_scaling import write_scaling
from tests.test_sweep import no_cluster_probes, write_sweep  # noqa: F401 - autouse fixture

SECTION = "## Sweep results stores"
POINT_8, POINT_16 = ("strategy=reference, batch=8, repeat=0",
                     "strategy=reference, batch=16, repeat=0")

#: fault injected -> the test that injects it (the reliability page lists the same).
FAULTS = {
    "chunk file of a finished point deleted": "test_a_damaged_point_is_named_and_runs_again",
    "byte flipped in a finished point's chunk": "test_a_damaged_point_is_named_and_runs_again",
    "truncated zarr.json of a variable": "test_damaged_metadata_is_one_line",
    "truncated zarr.json of the store": "test_damaged_metadata_is_one_line",
    "store written before checksums (format 2)": "test_a_store_without_checksums",
    "byte flipped in a scaling store": "test_a_damaged_scaling_store_is_named",
    "growth (--extend) stopped before its swap": "test_a_growth_stopped_anywhere_leaves_one_whole_store",
    "growth stopped between the two renames of a swap":
        "test_a_growth_stopped_anywhere_leaves_one_whole_store",
}


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_dataset_factory) -> tuple[str, str]:
    """(sweep file, store) of a finished two-point sweep; tests damage copies."""
    tmp_path = tmp_path_factory.mktemp("sweep-integrity")
    config = write_sweep(tmp_path, tiny_dataset_factory("float32"),
                         {"strategy": ["reference"], "train.batch": [8, 16]})
    store = str(tmp_path / "done.zarr")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CNN_PREDICT_PROBE", "never")
        patch.setenv("CNN_PROBE_CACHE", str(tmp_path / "probes"))
        assert run_sweep(load_sweep(config, out=store), out=io.StringIO(),
                         err=io.StringIO()) == 0
    return config, store


@pytest.fixture(autouse=True)
def figures_not_rendered(monkeypatch):
    """The reports here are read for what they refuse or say, not for their pictures
    (tests/test_report.py renders those): drawn, not laid out or written."""
    unrendered(monkeypatch)


def copy_of(finished: tuple[str, str], tmp_path) -> tuple[str, str]:
    config, store = finished
    copy = str(tmp_path / "copy.zarr")
    shutil.copytree(store, copy)
    return config, copy


def run_ids(store: str) -> list[str]:
    return [str(v) for v in xr.open_zarr(store).run_id.values.ravel()]


def files_of(store: str) -> dict[str, float]:
    """Every file of a store with its modification time."""
    return {os.path.join(folder, name): os.path.getmtime(os.path.join(folder, name))
            for folder, _dirs, names in os.walk(store) for name in names}


def report_lines(store: str, capsys) -> tuple[int, list[str]]:
    """`python -m experiments.report STORE` in this process: exit status, stderr lines."""
    capsys.readouterr()
    status = report.main([store, "--out", store + ".report"])
    return status, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def resume(config: str, store: str) -> tuple[int, str, list[str]]:
    """The same sweep run again (`run_sweep`, as the CLI runs it): status, out, err lines."""
    out, err = io.StringIO(), io.StringIO()
    status = run_sweep(load_sweep(config, out=store), out=out, err=err)
    return status, out.getvalue(), [line for line in err.getvalue().splitlines() if line]


def test_a_damaged_point_is_named_and_runs_again(finished, tmp_path, capsys):
    config, store = copy_of(finished, tmp_path)
    first, second = run_ids(store)  # batch 8, batch 16
    os.remove(os.path.join(store, "step_time", "c", "0", "0", "0"))  # batch 8's measurement

    status, lines = report_lines(store, capsys)
    assert status == 1 and len(lines) == 1, lines
    assert f"point ({POINT_8}) is damaged: step_time/c/0/0/0 is missing" in lines[0]
    assert "the same sweep command runs damaged points again" in lines[0]
    assert not os.path.exists(store + ".report")  # nothing drawn from a damaged store

    status, out, err = resume(config, store)
    assert status == 0, err
    assert "1 done before, 1 to run" in out and out.count("s/step") == 1
    assert len(err) == 1 and f"({POINT_8})" in err[0] and \
        "step_time/c/0/0/0 is missing; it runs again" in err[0], err
    ds = xr.open_zarr(store).load()
    assert (ds.status == DONE).all() and ds.step_time.notnull().all()
    again = run_ids(store)
    assert again[0] != first and again[1] == second  # only the damaged point ran

    loss = os.path.join(store, "loss", "c", "0", "1", "0")  # batch 16's
    with open(loss, "r+b") as handle:
        content = handle.read()
        handle.seek(len(content) - 1)
        handle.write(bytes([content[-1] ^ 0x01]))
    status, lines = report_lines(store, capsys)
    assert status == 1 and len(lines) == 1, lines
    assert f"({POINT_16}) is damaged: loss/c/0/1/0 fails its crc32c checksum" in lines[0]
    status, out, err = resume(config, store)
    assert status == 0 and "1 done before, 1 to run" in out
    assert len(err) == 1 and "loss/c/0/1/0 fails its crc32c checksum" in err[0], err
    assert run_ids(store)[0] == again[0] and run_ids(store)[1] != second
    assert report_lines(store, capsys)[0] == 0


@pytest.mark.parametrize("damaged", ["step_time/zarr.json", "zarr.json"])
def test_damaged_metadata_is_one_line(finished, tmp_path, capsys, damaged):
    config, store = copy_of(finished, tmp_path)
    path = os.path.join(store, *damaged.split("/"))
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) // 2)
    before = files_of(store)

    status, lines, out = run_main("sweep", [config, "--out", store])
    assert status == 1 and len(lines) == 1, lines
    assert lines[0].startswith("error: ") and f"{path} is not valid JSON" in lines[0]
    assert "--fresh" in lines[0] and "s/step" not in out
    status, report_err = report_lines(store, capsys)
    assert status == 1 and len(report_err) == 1, report_err
    assert f"{path} is not valid JSON" in report_err[0]
    assert files_of(store) == before  # refused without a write

    # --fresh starts over, even where the root metadata no longer says it is a sweep's
    status, lines, out = run_main("sweep", [config, "--out", store, "--fresh"])
    assert status == 0, lines
    assert out.count("s/step") == 2 and report_lines(store, capsys)[0] == 0


def test_a_store_without_checksums(finished, tmp_path, capsys):
    """A store of format 2 (one chunk a variable, no checksums.json): the sweep refuses
    it in one line naming --fresh; the report reads it, saying it is unchecked."""
    config, store = finished
    old = xr.open_zarr(store).load()
    old.attrs["store_format"] = "hetcnn-sweep/2"
    path = str(tmp_path / "old.zarr")
    write_dataset(old, path)

    status, lines, out = run_main("sweep", [config, "--out", path])
    assert status == 2 and len(lines) == 1, lines
    assert "before sweep stores recorded checksums" in lines[0] and "--fresh" in lines[0]
    status, lines = report_lines(path, capsys)
    assert status == 0 and len(lines) == 1, lines
    assert lines[0].startswith("warning: ") and "reported unchecked" in lines[0]
    assert os.path.exists(os.path.join(path + ".report", "report.md"))
    status, lines, out = run_main("sweep", [config, "--out", path, "--fresh"])
    assert status == 0 and out.count("s/step") == 2, lines  # what the refusal names
    assert ResultStore(path).record.verify().intact


def test_a_damaged_scaling_store_is_named(tmp_path, capsys):
    """`mode: scaling` stores, rewritten whole by every run, carry checksums of every
    file; a report names a damaged one, and running the sweep again rewrites it."""
    config = write_scaling(tmp_path, {"hardware.devices": [1, 2]})
    store = str(tmp_path / "scale.zarr")
    assert run_main("sweep", [config, "--out", store])[0] == 0
    chunk = os.path.join(store, "predicted_step_time", "c", "0", "0")
    with open(chunk, "r+b") as handle:
        content = handle.read()
        handle.seek(0)
        handle.write(bytes([content[0] ^ 0x80]))
    status, lines = report_lines(store, capsys)
    assert status == 1 and len(lines) == 1, lines
    assert "predicted_step_time/c/0/0 fails its crc32c checksum" in lines[0]
    assert "run the same sweep command again" in lines[0]
    assert run_main("sweep", [config, "--out", store])[0] == 0
    assert report_lines(store, capsys)[0] == 0


def test_a_write_stopped_at_any_step_never_leaves_a_point_done(tmp_path):
    """The store alone (no training): a failed point rewritten as done, its write's
    steps taken by hand, the store verified after each as a sweep killed there would
    leave it: pending (or damaged, once recorded without its status), never done."""
    sweep = load_sweep(write_sweep(tmp_path, "unused.zarr", {"train.batch": [8, 16]}),
                       out=str(tmp_path / "steps.zarr"))
    store = ResultStore(sweep.store_path)
    store.create(build_template(sweep, {"fingerprint": sweep.fingerprint}))
    store.write_failure((0, 0), "ClusterError: gone", {}, {})

    def verdict() -> tuple[int, str]:
        found = ResultStore(sweep.store_path).record.verify()
        return int(found.status[0, 0]), str(found.damaged.get("0/0", ""))

    assert verdict() == (FAILED, "")
    group = store._begin((0, 0))  # the entry, then the point's files, go
    assert verdict() == (PENDING, "")
    group["step_time"][0, 0] = 0.5  # figures written, not yet recorded
    assert verdict() == (PENDING, "")
    store.record.record_point((0, 0), DONE, store._status_file(DONE))
    status, damage = verdict()  # recorded, its status not yet written
    assert status == PENDING and damage == ("status/c/0/0 is missing (damaged, or a sweep "
                                            "stopped while writing the point)")
    group["status"][0, 0] = DONE
    assert verdict() == (DONE, "")


GROWN = ["repeats=2", "axes.train.batch=[4,8,16]"]  # the finished sweep, grown


def point_files(store: str) -> dict[str, dict[str, bytes]]:
    """Each recorded point's chunk files (by point key, then variable) and their bytes."""
    record = ResultStore(store).record
    return {key: {name.split("/")[0]: open(os.path.join(store, name), "rb").read()
                  for name in entry["files"]}
            for key, entry in record.data["points"].items()}


def test_growing_a_finished_sweep_keeps_its_points_and_runs_the_new_ones(finished, tmp_path,
                                                                          capsys):
    """More repeats and one more batch (before the others): the two finished points
    move to their new cells with every file byte for byte, are not run again (their
    run_id), the four new points run, and the report reads the grown store."""
    config, store = copy_of(finished, tmp_path)
    before, ids = point_files(store), run_ids(store)
    status, lines, out = run_main("sweep", [config, "--out", store, *GROWN, "--extend"])
    assert status == 0, lines
    assert "grew " in out and "4 new point(s) (2 -> 6: repeats: 1 there, 2 here; " \
        "axes.train.batch: [8, 16] there, [4, 8, 16] here)" in out, out
    assert "2 done before, 4 to run" in out and out.count("s/step") == 4, out
    after = point_files(store)
    assert after["0/1/0"] == before["0/0/0"] and after["0/2/0"] == before["0/1/0"]  # batch 8, 16
    ds = xr.open_zarr(store).load()
    assert list(ds.batch.values) == [4, 8, 16] and ds.sizes["repeat"] == 2
    assert (ds.status == DONE).all() and ds.step_time.notnull().all()
    assert [str(ds.run_id.sel(batch=b, repeat=0).item()) for b in (8, 16)] == ids
    assert len(set(run_ids(store))) == 6  # the others ran, each once
    assert ResultStore(store).record.verify().intact
    assert not os.path.exists(store + ".growing")
    assert report_lines(store, capsys) == (0, [])
    status, lines, out = run_main("sweep", [config, "--out", store, *GROWN])  # a resume
    assert status == 0 and "6 done before, 0 to run" in out, (lines, out)


def test_a_growth_is_refused_without_extend_and_anything_else_even_with_it(finished,
                                                                            tmp_path):
    """Without --extend, one line names what growing adds and the flag; a removed value
    or a changed base field is another sweep, --extend or not; the dry run with
    --extend says what it would add. None of them writes to the store."""
    config, store = copy_of(finished, tmp_path)
    unchanged = files_of(store)
    status, lines, out = run_main("sweep", [config, "--out", store, *GROWN])
    assert status == 2 and len(lines) == 1 and out == "", lines
    assert lines[0] == (f"error: {store} holds this sweep with fewer points: it would add 4 "
                        "new point(s) (2 -> 6: repeats: 1 there, 2 here; axes.train.batch: "
                        "[8, 16] there, [4, 8, 16] here); pass --extend to add them, keeping "
                        "every finished point (or --fresh to start over, --out for a new "
                        "store)")
    for change, first in ((["axes.train.batch=[4,8]"],
                           "axes.train.batch: [8, 16] there, [4, 8] here"),
                          (["repeats=2", "train.lr=0.5"], "base.train.lr: (none) there, 0.5 "
                           "here")):
        for extra in ([], ["--dry-run"]):
            status, lines, out = run_main("sweep", [config, "--out", store, *change,
                                                    "--extend", *extra])
            assert status == 2 and len(lines) == 1 and out == "", lines
            assert f"holds a different sweep (first difference: {first}) (--extend adds " \
                "only repeats and values of the axes the store has)" in lines[0], lines
    status, lines, out = run_main("sweep", [config, "--out", store, *GROWN, "--extend",
                                            "--dry-run"])
    assert status == 0 and "the run grows the store first (--extend): 4 new point(s)" in out
    assert out.count("  done") == 2 and out.count("  pending") == 4, out
    assert files_of(store) == unchanged


def test_a_growth_stopped_anywhere_leaves_one_whole_store(finished, tmp_path, monkeypatch):
    """A growth stopped after the grown store was built, before its swap (raised in
    this process, or killed: its leftover): the old store stays, verifies and
    resumes. Stopped between the two renames of a swap where the file system cannot
    exchange directories: the next sweep puts the grown store, complete, in place."""
    config, store = copy_of(finished, tmp_path)
    unchanged = point_files(store)

    def stopped(grown: str, path: str) -> None:
        assert ResultStore(grown).record.verify().intact  # built whole, not yet swapped
        raise KeyboardInterrupt
    monkeypatch.setattr(store_growth, "swap_in", stopped)
    status, lines, out = run_main("sweep", [config, "--out", store, *GROWN, "--extend"])
    assert status == 130 and os.path.exists(store + ".growing"), lines
    assert point_files(store) == unchanged and ResultStore(store).record.verify().intact
    status, out, err = resume(config, store)  # the finished sweep's own command
    assert status == 0 and "2 done before, 0 to run" in out, (out, err)
    assert not os.path.exists(store + ".growing") and point_files(store) == unchanged
    def failed_copy(*args) -> None:
        raise OSError("copy failed")
    monkeypatch.setattr(store_growth, "copy_points", failed_copy)  # while building
    status, lines, out = run_main("sweep", [config, "--out", store, *GROWN, "--extend"])
    assert status == 1 and lines == ["error: copy failed"], lines
    assert not os.path.exists(store + ".growing") and point_files(store) == unchanged
    monkeypatch.undo()

    def renamed_aside(grown: str, path: str) -> None:
        os.rename(path, path + store_growth.REPLACED)  # the first of the two renames
        raise KeyboardInterrupt
    monkeypatch.setattr(store_growth, "swap_in", renamed_aside)
    assert run_main("sweep", [config, "--out", store, *GROWN, "--extend"])[0] == 130
    assert not os.path.exists(store) and os.path.exists(store + ".growing")
    # the next sweep on the store (here, the finished one's: refused) settles it first
    status, lines, out = run_main("sweep", [config, "--out", store])
    assert status == 2 and "holds a different sweep" in lines[0], lines
    assert not os.path.exists(store + ".replaced") and not os.path.exists(store + ".growing")
    grown = point_files(store)
    assert grown["0/1/0"] == unchanged["0/0/0"] and grown["0/2/0"] == unchanged["0/1/0"]
    found = ResultStore(store).record.verify()
    assert found.intact and int((found.status == DONE).sum()) == 2 and found.status.size == 6


def test_verification_is_quick(finished):
    """Every file is read at each resume and report: a two-point store takes
    milliseconds (docs/reliability.md has a 288-point one)."""
    store = ResultStore(finished[1])
    started = time.perf_counter()
    found = store.record.verify()
    assert found.intact and (found.status == DONE).all()
    assert time.perf_counter() - started < 0.5


def test_reliability_page_lists_these_faults():
    rows = page_rows(SECTION)
    assert {row[0]: row[-1].strip("`") for row in rows} == FAULTS
    for test in FAULTS.values():
        assert callable(globals().get(test)), test
    text = open(PAGE, encoding="utf-8").read().split(SECTION, 1)[1].split("\n## ", 1)[0]
    figures = re.search(r"(\d+) faults injected, (\d+) handled as described", text)
    assert figures and [int(v) for v in figures.groups()] == [len(FAULTS)] * 2
