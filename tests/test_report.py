"""The report from a real sweep store: every figure the store's axes call for, and the
markdown table, written next to the store."""

from __future__ import annotations

import io
import json
import os

import matplotlib.image
import numpy as np
import pandas as pd
import pytest
import xarray as xr

from experiments.report import cli as report
from experiments.report.report_folder import report_file
from experiments.report.view import StoreView
from experiments.sweep.run import run_sweep
from experiments.sweep.config import load_sweep
from storage.labelled import write_dataset
from tests.test_sweep import ROOT, write_sweep

UNEQUAL = [{"speed": 1.0}, {"speed": 0.5}]


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_dataset_factory):
    """A real sweep: strategy x batch x network size x devices (equal and unequal
    workers, calibrated and even placement): two embedded clusters, 12 tiny points
    (one network size: a dim of its own, as a sweep over sizes has, at the cost of
    one size's runs)."""
    tmp_path = tmp_path_factory.mktemp("report")
    config = write_sweep(tmp_path, tiny_dataset_factory("float32"),
                         {"strategy": ["single", "kernel"], "train.batch": [8, 16]},
                         zip=[{"dim": "kernels", "fields": {"network.conv.0.kernels": [12],
                                                            "network.conv.1.kernels": [16]}},
                              {"dim": "devices", "fields": {
                                  "cluster.workers": [2, UNEQUAL, UNEQUAL],
                                  "placement": ["calibrated", "calibrated", "even"]}}],
                         name="paperlike")
    path = str(tmp_path / "paperlike.zarr")
    sweep = load_sweep(config, out=path)
    with pytest.MonkeyPatch.context() as patch:  # as in test_sweep: no cluster probes
        patch.setenv("CNN_PREDICT_PROBE", "never")
        patch.setenv("CNN_PROBE_CACHE", str(tmp_path / "probes"))
        assert run_sweep(sweep, out=io.StringIO(), err=io.StringIO()) == 0
    return path


def test_report_cli_writes_figures_and_table_next_to_the_store(store, capsys, monkeypatch):
    """The command's main in this process, from the project's root (that `python -m
    experiments.report` starts as a process is tests/test_cli.py's
    test_the_documented_commands_start_as_modules): an interpreter importing torch,
    xarray and matplotlib less."""
    monkeypatch.chdir(ROOT)
    status = report.main([store])
    result = capsys.readouterr()
    assert status == 0, result.err
    out_dir = store[: -len(".zarr")] + ".report"
    expected = ["speedup.png", "breakdown.png", "batch.png", "placement.png",
                "memory.png", "step_times.png", "growth_single.png", "growth_kernel.png", "report.md"]
    assert sorted(os.listdir(out_dir)) == sorted(expected)
    assert all(report_file(out_dir, name) for name in expected)  # replaced by the next report
    mixes = open(os.path.join(out_dir, "report.md")).read().split("## Device mixes")[1]
    assert "kernels 12/16, devices 1+0.5/even | " in mixes  # one row per point
    assert "cpu-0 (cpu, CPU) 57%, cpu-1 (cpu, CPU) 43% |" in mixes  # 16/28, 12/28 kernels
    assert result.out.split() == [os.path.join(out_dir, name) for name in expected]
    for name in expected[:-1]:
        image = matplotlib.image.imread(os.path.join(out_dir, name))
        assert image.shape[0] > 300 and image.shape[1] > 400, name
        assert image[..., :3].std() > 0.05, name  # not blank

    text = open(os.path.join(out_dir, "report.md"), encoding="utf-8").read()
    assert "## How cost grows" in text  # a batch and a workers dim: one figure a strategy
    for name in expected[:-1]:
        assert f"]({name})" in text
    assert "| strategy | batch | kernels | devices | runs | step s |" in text
    assert "working MB |" in text  # the fullest worker's memory, per point
    # `single` runs on one worker: measured on the first device set only, the other 4
    # points recorded as not applicable and left out of the table
    # (and one row each in the two error tables: step time, memory)
    assert text.count("| kernel |") == 7 and text.count("| single |") == 3
    assert "8 done, 0 failed, 0 pending, 4 not applicable" in text
    assert "1+0.5/even" in text and "code revision" in text and "cores" in text
    ds = xr.open_zarr(store)
    assert "placement" in ds.coords and list(ds.placement.values) == ["calibrated",
                                                                      "calibrated", "even"]


def test_report_frame_puts_unequal_workers_at_their_summed_speed(store):
    sweep = StoreView(xr.open_zarr(store).load())
    frame = sweep.points()
    kernel = frame[frame["strategy"] == "kernel"]
    assert sorted(kernel["relative_capacity"].round(6).unique()) == [1.5, 2.0]
    assert set(kernel[~kernel["equal_workers"]]["devices"]) == {"1+0.5/calibrated",
                                                                 "1+0.5/even"}
    assert sweep.worker_dim == "devices" and sweep.network_dims == ["kernels"]


def test_the_store_carries_each_points_memory(store):
    ds = xr.open_zarr(store).load()
    done = ds.status == 1
    # every done point measured, none stand-ins (a tiny network's working memory, the
    # peak less a bare process, is near zero and may fall below it: README, summary.json)
    assert (ds.memory_peak.where(done) > 0).sum() == done.sum()
    assert ds.memory_working.where(done).notnull().sum() == done.sum()
    assert (ds.memory_peak.where(done) > ds.memory_working.where(done)).sum() == done.sum()
    assert ds.client_memory_peak.where(done).notnull().sum() == done.sum()
    per_worker = json.loads(str(ds.memory_per_worker.sel(strategy="kernel").values.flat[0]))
    assert set(per_worker) == {"cpu-0", "cpu-1"}
    assert all(peak > max(working, 0) for peak, working in per_worker.values())


def test_report_refuses_what_is_not_a_sweep_store(tmp_path, capsys):
    assert report.main([str(tmp_path / "missing.zarr")]) == 2
    write_dataset(xr.Dataset({"a": ("x", [1.0])}), str(tmp_path / "other.zarr"))
    assert report.main([str(tmp_path / "other.zarr")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 2 and "no such results store" in lines[0]
    assert "not a sweep results store" in lines[1]


@pytest.mark.parametrize("argv", [[], ["x.zarr", "--bogus"]])
def test_a_bad_report_command_line_is_one_line(argv, capsys):
    """No usage block: one line naming the problem, exit 2, as the other commands."""
    from experiments.report import trace_plot
    assert report.main(argv) == 2
    assert trace_plot.main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 2 and all(line.startswith("error: ") for line in lines), lines
    assert "--help)" in lines[0] and "--help)" in lines[1]


def test_the_help_names_the_report_folder_the_report_writes(capsys):
    """It said `<store>.report/`: results/quick.zarr.report, where the report is
    results/quick.report."""
    with pytest.raises(SystemExit):
        report.main(["--help"])
    assert "results/quick.report/ for results/quick.zarr" in " ".join(
        capsys.readouterr().out.split())
    assert report.default_out_dir("results/quick.zarr") == "results/quick.report"


def test_a_report_folder_inside_the_store_is_refused(store, capsys):
    """Its figures would be files the store's checksums do not know: every later
    report and resume would call the store damaged."""
    before = sorted(os.listdir(store))
    for out in (store, os.path.join(store, "report")):
        assert report.main([store, "--out", out]) == 2
        [line] = [line for line in capsys.readouterr().err.splitlines() if line]
        assert line == f"error: --out: {out} is inside the results store {store}; choose a " \
                       "directory outside it"
    assert sorted(os.listdir(store)) == before


def test_a_report_folder_that_cannot_be_made_is_one_line(store, tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    assert report.main([store, "--out", str(tmp_path / "a-file")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith(f"error: --out: {tmp_path / 'a-file'} "), lines
    assert (tmp_path / "a-file").read_text() == ""


def test_a_report_folder_holds_one_report(store, tmp_path, capsys):
    """A measured sweep's figures were left beside a scaling sweep's report.md written
    into the same --out, and a run's folder, configs or a sweep's .runs took a report
    among their files. Now an earlier report, of any store, is replaced wholly, and a
    folder holding anything else is refused untouched."""
    from tests.test_scaling import TINY_AXES, write_scaling
    from experiments.sweep import cli as sweep_cli
    scaling = str(tmp_path / "tinyscale.zarr")
    assert sweep_cli.main([write_scaling(tmp_path, TINY_AXES), "--out", scaling]) == 0
    out = tmp_path / "report"
    capsys.readouterr()
    assert report.main([store, "--out", str(out)]) == 0
    measured = sorted(os.listdir(out))
    assert "speedup.png" in measured and "growth_kernel.png" in measured
    capsys.readouterr()
    assert report.main([scaling, "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert sorted(os.listdir(out)) == sorted(os.path.basename(path) for path in printed)
    assert not set(measured) - {"report.md"} & set(os.listdir(out))
    assert report.main([store, "--out", str(out)]) == 0  # and back: the scaling's removed
    assert sorted(os.listdir(out)) == measured
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text("{}")
    (run / "speedup.png").write_text("mine")
    refused = {str(run): "summary.json", os.path.join(ROOT, "configs"): "paper.yaml",
               os.path.dirname(store): "paperlike.runs",
               str(tmp_path / "tinyscale.runs"): "run", str(tmp_path): "report"}
    capsys.readouterr()
    for folder, named in refused.items():
        (tmp_path / "tinyscale.runs" / "run").mkdir(parents=True, exist_ok=True)
        before = sorted(os.listdir(folder))
        assert report.main([scaling, "--out", folder]) == 2
        [line] = [line for line in capsys.readouterr().err.splitlines() if line]
        assert line.startswith(f"error: --out: {folder} holds files or folders that are not "
                               "a report's (") and named in line, line
        assert sorted(os.listdir(folder)) == before
    assert (run / "speedup.png").read_text() == "mine"


def test_the_filesystem_root_is_no_report_folder(store):
    """`--out /` wrote /report.md and figures into the root."""
    from experiments.report.report_folder import OutDirRefused, prepare_report_folder
    with pytest.raises(OutDirRefused, match="^--out: / is the filesystem root"):
        prepare_report_folder(os.sep, store)


def test_speedup_labels_and_range_fit_what_was_measured():
    """The 2-thread `reference` is named by its threads, never 'unequal workers'; the
    x axis ends at the sweep's capacities, and the paper's 4-CPU point, beyond a
    2-worker sweep, is named in the legend rather than stretching the axis."""
    from experiments.report.figures import speedup_label, speedup_range
    names = ["strategy", "equal_workers"]
    assert speedup_label(("reference", False), names, [2.0]) == \
        "reference, 2 thread(s) (one process)"
    assert speedup_label(("kernel", False), names, [1.5]) == "kernel, unequal workers (at 1.5 only)"
    assert speedup_label(("kernel", True), names, [1.0, 2.0]) == "kernel, equal workers"
    top, paper_inside = speedup_range([1.0, 1.5, 2.0])
    assert top == pytest.approx(2.16) and not paper_inside
    assert speedup_range([1.0, 4.0]) == (pytest.approx(4.32), True)


def test_a_store_without_its_speedup_baseline_says_it_has_no_speedup():
    """A sweep whose baseline (`single` at the fewest workers) never ran, or never
    finished, has no speedup: report.md says so rather than what it would be against."""
    from experiments.report.markdown import _provenance
    nan = float("nan")
    ds = xr.Dataset({"status": (("strategy", "repeat"), [[1]]),
                     "speedup": (("strategy", "repeat"), [[nan]])},
                    coords={"strategy": ["kernel"]}, attrs={"speedup_baseline": "single"})
    lines = _provenance(ds)
    assert "- no speedup: it is taken against `single` (`speedup_baseline`) on the fewest " \
           "workers, and this store has no done point of it" in lines
    assert not any(line.startswith("- speedup is against") for line in lines)
    ds["speedup"] = (("strategy", "repeat"), [[1.5]])
    assert any(line.startswith("- speedup is against `single`") for line in _provenance(ds))


def test_figures_that_do_not_apply_are_not_written_nor_listed(tmp_path):
    """A maker that says its figure does not apply (False) leaves no file, and the
    report lists only the figures drawn, in the makers' order."""
    from experiments.report.figure_files import write_figures

    def draw(path: str) -> bool:
        with open(path, "wb") as handle:
            handle.write(b"new")
        return True

    written = write_figures([("growth_kernel.png", draw), ("speedup.png", lambda p: False),
                             ("batch.png", draw)], str(tmp_path))
    assert written == ["growth_kernel.png", "batch.png"]
    assert sorted(os.listdir(tmp_path)) == ["batch.png", "growth_kernel.png"]


def test_a_sweep_stopped_with_points_pending_is_not_said_finished():
    """An interrupted sweep's store: its last session's end is no finish."""
    from experiments.report.markdown import _provenance
    ds = xr.Dataset({"status": (("point", "repeat"), [[1], [0]])},
                    attrs={"started": "T0", "finished": "T1"})
    assert "- started T0, last session ended T1 with 1 point(s) pending" in _provenance(ds)
    ds["status"] = (("point", "repeat"), [[1], [2]])
    assert "- started T0, finished T1" in _provenance(ds)
    ds.attrs["finished"] = ""  # its first session still running, or killed
    assert "- started T0, no session ended yet (a sweep running, or one killed)" in \
        _provenance(ds)


def test_the_breakdown_says_its_parts_are_medians_beside_the_median_step(store, tmp_path,
                                                                         monkeypatch):
    """Its stacked bars are each part's own median over the steps, which need not add
    up to the median step: the figure drew the step as a tick over the stack, with
    nothing saying so, and stacked the dense head twice (`master_time` on top of the
    compute that holds it). Now the parts are the step's along its critical worker
    (each step's add up to it), the median step is a bar of its own beside them, and
    the figure and report.md say the medians need not add up."""
    from experiments.report import breakdown as figures
    seen = {}

    def save(fig, path):
        ax = fig.axes[0]
        seen["bars"] = {label: [p.get_height() for p in container.patches]
                        for container, label in zip(ax.containers,
                                                    [c.get_label() for c in ax.containers])}
        seen["text"] = " ".join(t.get_text() for t in fig.texts)
        seen["rows"] = [t.get_text() for t in ax.get_xticklabels()]
        fig.clf()
    monkeypatch.setattr(figures, "save_figure", save)
    sweep = StoreView(xr.open_zarr(store).load())
    frame = sweep.points()
    assert figures.breakdown_figure(sweep, frame, str(tmp_path / "breakdown.png"))
    assert list(seen["bars"]) == ["compute", "exchange", "dataset", "wait", "client",
                                  figures.STEP_BAR]
    shown = figures.with_missing(figures.slice_of_others(
        sweep, frame, ["strategy", "devices"])[0], "step_time")
    assert seen["bars"][figures.STEP_BAR] == pytest.approx(list(shown["step_time"]))
    assert seen["bars"]["compute"] == pytest.approx(list(shown["critical_compute"]))
    assert "need not add up to the median step" in seen["text"]
    from tests.test_report_gaps import unrendered
    unrendered(monkeypatch)  # report.md is read here; the CLI test renders it all
    report.make_report(store, str(tmp_path / "report"))
    text = open(tmp_path / "report" / "report.md", encoding="utf-8").read()
    assert "![Time breakdown](breakdown.png)\n\n*Each part of a step is its own median" in text


def test_a_zipped_batch_axis_draws_its_batch_lines(tmp_path, tiny_dataset_factory,
                                                   monkeypatch):
    """A batch zipped with another field (here the workers: weak scaling) has labels
    such as `2/16`: batch.png read those as numbers, got none and drew no line
    (memory.png's batch panel neither). Now both take the zip group's `train.batch`
    coordinate, and the axis says what moves with it.

    The store's speedup was the 1-worker step time (batch 8) over the 2-worker one
    (batch 16): a step of twice the samples counted as one, and an efficiency
    above 1 where the workers kept pace. Now it counts the samples a second."""
    from tests.test_report_gaps import drawn
    monkeypatch.setenv("CNN_PREDICT_PROBE", "never")
    monkeypatch.setenv("CNN_PROBE_CACHE", str(tmp_path / "probes"))
    config = write_sweep(tmp_path, tiny_dataset_factory("float32"),
                         {"strategy": ["single", "kernel"]},
                         zip=[{"dim": "scaled", "fields": {"cluster.workers": [1, 2],
                                                           "train.batch": [8, 16]}}],
                         name="zipped")
    path = str(tmp_path / "zipped.zarr")
    assert run_sweep(load_sweep(config, out=path), out=io.StringIO(),
                     err=io.StringIO()) == 0
    ds = xr.open_zarr(path).load()
    single, kernel = ds.step_time.values[0, 0, 0], ds.step_time.values[1, :, 0]
    assert ds.speedup.values[1, :, 0] == pytest.approx(single / kernel * [1, 2])
    assert ds.efficiency.values[1, 1, 0] == pytest.approx(single / kernel[1])  # 2 workers
    seen = drawn(monkeypatch, render=False)  # its lines are read, not its pictures
    report.make_report(path, str(tmp_path / "report"))
    for name, panel in (("batch.png", 0), ("batch.png", 1), ("memory.png", -1)):
        lines = {line[0]: line for line in seen[name][panel][:-1] if line[1].size}
        assert list(lines["kernel"][1]) == [8, 16], name
        assert np.isfinite(lines["kernel"][2]).all(), name


def test_the_speedup_panel_names_a_zoo_network_by_its_preset():
    """A sweep of a zoo network (no conv widths in its base) titled its speedup panel
    'network as configured'; now the preset and its width."""
    from experiments.report.figures import _base_network
    for network, title in (({"preset": "resnet20", "width": 0.25}, "resnet20 (width 0.25)"),
                           ({"preset": "vgg11"}, "vgg11"),
                           ({"conv": [{"kernels": 32}, {"kernels": 64}]}, "32/64")):
        ds = xr.Dataset(attrs={"config": json.dumps({"base": {"network": network}})})
        assert _base_network(ds) == title


@pytest.mark.parametrize("config, paper", [
    ("experiments/configs/marques_cpu.yaml", True),  # a zip row of network.conv.N.kernels
    ("experiments/configs/links_paper.yaml", True),  # its base
    ("experiments/configs/krizhevsky.yaml", False),
    ("experiments/configs/growth.yaml", False)])
def test_the_papers_point_is_drawn_beside_the_papers_network_only(config, paper):
    """Every speedup figure carried "Marques et al. 2018: 3.28x on 4 CPUs", whatever
    network it measured (16/32 kernels too), and report.md compared its kernel
    speedup with the paper's; now only a store that trains the paper's 500/1500."""
    from experiments.report.markdown import _paper_comparison
    from experiments.report.view import StoreView, has_paper_network
    from experiments.sweep.config import load_sweep

    sweep = load_sweep(os.path.join(ROOT, config))
    ds = xr.Dataset({"status": (("strategy", "repeat"), [[1]])},
                    coords={"strategy": ["kernel"], "repeat": [0]},
                    attrs={"config": sweep.text})
    assert has_paper_network(ds) == paper
    frame = pd.DataFrame([{"strategy": "kernel", "equal_workers": True, "n_workers": 4.0,
                           "speedup": 3.0, "efficiency": 0.75}])
    line = _paper_comparison(StoreView(ds), frame)
    assert (line is not None and "the paper reports 3.28x" in line) == paper, line


def test_repeats_that_ran_different_splits_are_named():
    """A calibrated point's two repeats split its work differently (one left the slow
    worker out, the other gave it everything): the main table pooled them unsaid."""
    from experiments.report.repeats import split_changes, split_changes_section
    splits = np.array([[["[[16], [32]]", "[[0, 16], [0, 32]]"], ["[[8, 8]]", "[[8, 8]]"]]],
                      dtype=object)
    devices = np.array([[['[["cpu-0", "CPU", "cpu"]]',
                          '[["cpu-0", "CPU", "cpu"], ["cpu-1", "CPU", "cpu"]]'],
                         ['[["cpu-0", "CPU", "cpu"]]'] * 2]], dtype=object)
    ds = xr.Dataset({"status": (("strategy", "workers", "repeat"), [[[1, 1], [1, 1]]]),
                     "kernel_split": (("strategy", "workers", "repeat"), splits),
                     "worker_devices": (("strategy", "workers", "repeat"), devices)},
                    coords={"strategy": ["kernel"], "workers": ["1+0.5", "1"],
                            "repeat": [0, 1]})
    assert split_changes(ds) == [("strategy=kernel workers=1+0.5", [
        "repeat 0: [[16], [32]] on cpu-0", "repeat 1: [[0, 16], [0, 32]] on cpu-0, cpu-1"])]
    assert split_changes_section(ds)[0] == "## Repeats that ran different splits"
    assert split_changes_section(ds.isel(workers=[1])) == []  # one split: nothing said


def test_emulated_workers_are_called_emulated():
    """report.md showed `1+0.5` and `cpu-1 (cpu, CPU) 8%`: nothing said the half-speed
    worker was this machine's CPU, sleeping in proportion to its compute."""
    from experiments.report.markdown import emulated_speeds, mixes_section
    assert emulated_speeds("cpu-0, cpu-1 (emulated 0.5x speed)") == {
        "cpu-1": ", emulated 0.5x speed"}
    assert emulated_speeds("cpu-0, cpu-1") == {}
    ds = xr.Dataset({"status": (("workers", "repeat"), [[1]]),
                     "step_time": (("workers", "repeat"), [[0.02]]),
                     "kernel_split": (("workers", "repeat"), [["[[16, 8]]"]]),
                     "batch_split": (("workers", "repeat"), [[""]]),
                     "worker_devices": (("workers", "repeat"),
                                        [['[["cpu-0", "CPU", "cpu"], ["cpu-1", "CPU", "cpu"]]']]),
                     "worker_labels": (("workers", "repeat"),
                                       [["cpu-0, cpu-1 (emulated 0.5x speed)"]])},
                    coords={"workers": ["1+0.5"], "repeat": [0]},
                    attrs={"axes": json.dumps({"workers": ["cluster.workers"]})})
    rows = [line for line in mixes_section(ds, StoreView(ds)) if line.startswith("| workers")]
    assert rows == ["| workers 1+0.5 | 20.0 | cpu-0 (cpu, CPU) 67%, "
                    "cpu-1 (cpu, CPU, emulated 0.5x speed) 33% |"], rows


def test_the_report_names_the_commands_of_later_sessions():
    """After `--extend` the store's `command` (its first session's) no longer
    reproduces it, and the sessions did not say theirs: the report names them."""
    from experiments.report.markdown import _later_commands
    first = "python -m experiments.sweep tiny.yaml"
    ds = xr.Dataset(attrs={"command": first, "sessions": json.dumps([
        {"command": first}, {"command": first + " repeats=2 --extend"},
        {"command": first + " repeats=2 --extend"}, {"started": "old: no command"}])})
    assert _later_commands(ds) == [
        f"- later sessions ran: `{first} repeats=2 --extend`"]
    assert _later_commands(xr.Dataset(attrs={"command": first})) == []
