"""A failed point in the report's line figures: a gap and a mark, never a line drawn
past it as if it had been measured (experiments/report/gaps.py)."""

from __future__ import annotations

import io
import shutil

import matplotlib.pyplot as plt
import numpy as np
import pytest
import xarray as xr

from experiments.report import cli as report
from experiments.report import breakdown, figures, growth, links, memory, strategies
from experiments.report.view import StoreView
from experiments.sweep.config import load_sweep
from experiments.sweep.results import ResultStore
from experiments.sweep.run import run_sweep
from tests.test_sweep import write_sweep


@pytest.fixture(scope="module")
def done_store(tmp_path_factory, tiny_dataset_factory):
    """A real sweep, every point done: single and kernel on 1 and 2 workers at batch
    8, 16 and 32 (single's 2-worker points not applicable)."""
    tmp_path = tmp_path_factory.mktemp("gaps")
    config = write_sweep(tmp_path, tiny_dataset_factory("float32"),
                         {"strategy": ["single", "kernel"], "cluster.workers": [1, 2],
                          "train.batch": [8, 16, 32]}, name="gaps")
    return swept(tmp_path, config, "gaps.zarr")


def swept(tmp_path, config: str, name: str) -> str:
    """The store of sweep file `config`, run to its end in `tmp_path` (as in test_sweep:
    no cluster probes)."""
    path = str(tmp_path / name)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CNN_PREDICT_PROBE", "never")
        patch.setenv("CNN_PROBE_CACHE", str(tmp_path / "probes"))
        assert run_sweep(load_sweep(config, out=path), out=io.StringIO(),
                         err=io.StringIO()) == 0
    return path


def with_failed_point(done_store, tmp_path, strategy: str, workers: int) -> str:
    """A copy of the sweep's store with `strategy` on `workers` at batch 16 failed, as
    the sweep records a point that failed (its figures cleared, the reason, status 2)."""
    path = str(tmp_path / "gaps.zarr")
    shutil.copytree(done_store, path)
    with xr.open_zarr(path) as ds:
        region = (list(ds.strategy.values).index(strategy),
                  list(ds.workers.values).index(workers), list(ds.batch.values).index(16), 0)
    store = ResultStore(path)
    store.write_failure(region, "FloatingPointError: training diverged at step 1", {}, {})
    store.refresh_derived()
    return path


@pytest.fixture
def failed_store(done_store, tmp_path):
    """The sweep's store with kernel at 2 workers, batch 16 failed, as the sweep
    records a point that failed (its figures cleared, the reason, status 2)."""
    return with_failed_point(done_store, tmp_path, "kernel", 2)


def drawn(monkeypatch, render: bool = True) -> dict[str, list]:
    """Each figure's axes as drawn, by file name: [(line label, x, y, marker), ...]
    per axes, then (legend label, ...) as the last entry, taken as the figure is
    saved. With `render` False no figure is laid out or written (each closed as it
    would be saved), for a test that reads the lines and report.md only: laying out
    and writing the PNGs is most of a report's CPU. The stores with a failed point
    are rendered (the failed and beyond-memory one, the failed-baseline one): the
    done store is theirs but for that point."""
    seen: dict[str, list] = {}
    for module in (figures, memory):
        real = module.save_figure if render else close_unsaved

        def save(fig, path, real=real):
            seen[path.rsplit("/", 1)[-1]] = [
                [(line.get_label(), np.asarray(line.get_xdata(), dtype=float),
                  np.asarray(line.get_ydata(), dtype=float), line.get_marker())
                 for line in ax.get_lines()] + [("legend", *ax.get_legend_handles_labels()[1])]
                for ax in fig.axes]
            real(fig, path)
        monkeypatch.setattr(module, "save_figure", save)
    if not render:
        for module in (breakdown, growth, links, strategies):
            monkeypatch.setattr(module, "save_figure", close_unsaved)
    return seen


def close_unsaved(fig, path: str) -> None:
    """`save_figure` without the layout and the file: the figure closed."""
    plt.close(fig)


def unrendered(monkeypatch) -> None:
    """A report's figures drawn but neither laid out nor written (`drawn`'s `render`
    False), for a test of what a report says or refuses, not of its pictures (which
    tests/test_report.py's CLI test renders): most of a report's CPU."""
    drawn(monkeypatch, render=False)


def test_a_failed_point_breaks_its_line_and_is_marked(failed_store, tmp_path, monkeypatch):
    frame = StoreView(xr.open_zarr(failed_store).load()).points()
    row = frame[(frame.strategy == "kernel") & (frame.workers == "2") & (frame.batch == "16")]
    assert list(row["missing"]) == ["failed"]
    assert set(frame["missing"]) == {"", "failed"}  # not applicable points are no gap
    seen = drawn(monkeypatch, render=False)  # rendered with more marks in the test below
    report.make_report(failed_store, str(tmp_path / "report"))

    # batch.png: kernel on 2 workers over batch 8, 16, 32: a gap at 16 and its mark
    step_time = seen["batch.png"][0]
    line = next(x_y for x_y in step_time if x_y[0] == "kernel, workers 2")
    assert list(line[1]) == [8, 16, 32]
    assert np.isfinite(line[2][[0, 2]]).all() and np.isnan(line[2][1])
    marks = [x_y for x_y in step_time if x_y[3] == "x" and x_y[1].size]
    assert [list(m[1]) for m in marks] == [[16.0]]
    assert any(label.startswith("failed point") for label in step_time[-1])

    # speedup.png: kernel at batch 16 measured on 1 worker only; its failed 2-worker
    # point is marked where 2 workers are (from the other 2-worker points)
    lines = seen["speedup.png"][0]
    marks = [x_y for x_y in lines[:-1] if x_y[3] == "x" and x_y[1].size]
    assert [list(m[1]) for m in marks] == [[pytest.approx(2.0)]]
    assert "kernel, batch 16 (at 1 only)" in lines[-1]

    # memory.png, against batch (at 2 workers): the same gap and mark
    against_batch = seen["memory.png"][1]
    kernel = next(x_y for x_y in against_batch[:-1] if x_y[0] == "kernel")
    assert list(kernel[1]) == [8, 16, 32] and np.isnan(kernel[2][1])
    assert [list(m[1]) for m in against_batch[:-1] if m[3] == "x" and m[1].size] == [[16.0]]

    text = open(tmp_path / "report" / "report.md", encoding="utf-8").read()
    assert "- strategy=kernel, workers=2, batch=16: FloatingPointError" in text


def test_a_store_with_every_point_done_has_no_marks(done_store, tmp_path, monkeypatch):
    seen = drawn(monkeypatch, render=False)  # rendered but for one point below
    report.make_report(done_store, str(tmp_path / "report"))
    for name in ("batch.png", "speedup.png", "memory.png"):
        for axes in seen[name]:
            assert not any(x_y[3] == "x" for x_y in axes[:-1]), name
            assert not any(label.startswith(("failed", "point not run")) for label in axes[-1])


def test_the_docs_xarray_example_draws_speedup_lines(done_store):
    """README's and docs/sweeps.md's line of xarray on a sweep's store: it drew a
    heatmap of workers x repeat on the quick sweep's store and raised a TypeError on
    any store with one more axis (here batch); it draws a line per batch now."""
    import matplotlib.pyplot as plt

    from tests.test_sweep import ROOT
    lines = {path: [line.strip().split("   #")[0] for line in open(f"{ROOT}/{path}").read()
                    .splitlines() if line.strip().startswith("ds.speedup.")]
             for path in ("README.md", "docs/sweeps.md")}
    assert lines["README.md"] == lines["docs/sweeps.md"] and len(lines["README.md"]) == 1
    ds = xr.open_zarr(done_store)  # noqa: F841 - the example's name
    drawn_lines = eval(lines["README.md"][0])
    assert [type(line).__name__ for line in drawn_lines] == ["Line2D"] * ds.sizes["batch"]
    plt.close("all")


def test_a_point_beyond_its_workers_memory_is_marked_apart_from_failures(failed_store,
                                                                        tmp_path, monkeypatch):
    """A point the sweep did not run because its predicted peak exceeds a worker's
    limit (recorded as failed, `failure` starting "Infeasible: ") is its own mark and
    legend entry, its breakdown slot says so, and report.md lists it apart from the
    points that failed while running and does not count it among them."""
    with xr.open_zarr(failed_store) as ds:
        region = (list(ds.strategy.values).index("kernel"), list(ds.workers.values).index(1),
                  list(ds.batch.values).index(32), 0)
    store = ResultStore(failed_store)
    store.write_failure(region, "Infeasible: memory: worker cpu-0 needs 328 MB (predicted "
                        "peak), has 284 MB; no split of this run fits its workers' memory",
                        {"predicted_peak_memory": 328e6}, {})
    store.refresh_derived()
    frame = StoreView(xr.open_zarr(failed_store).load()).points()
    kernel = frame[frame.strategy == "kernel"].set_index(["workers", "batch"])["missing"]
    assert kernel[("1", "32")] == "beyond memory" and kernel[("2", "16")] == "failed"
    seen = drawn(monkeypatch)
    report.make_report(failed_store, str(tmp_path / "report"))
    step_time = seen["batch.png"][0]
    squares = [list(m[1]) for m in step_time[:-1] if m[3] == "s" and m[1].size]
    crosses = [list(m[1]) for m in step_time[:-1] if m[3] == "x" and m[1].size]
    assert squares == [[32.0]] and crosses == [[16.0]]
    assert any(label.startswith("not run: predicted peak beyond") for label in step_time[-1])
    text = open(tmp_path / "report" / "report.md", encoding="utf-8").read()
    assert "1 failed, 1 not run (predicted beyond their workers' memory)" in text
    failed, not_run = text.split("## Failed points")[1].split(
        "## Points not run: beyond their workers' memory")
    assert "batch=16: FloatingPointError" in failed and "Infeasible" not in failed
    assert "- strategy=kernel, workers=1, batch=32: Infeasible: memory: worker cpu-0 " \
        "needs 328 MB" in not_run


def test_a_line_without_its_baseline_is_named_not_left_out(done_store, tmp_path,
                                                           monkeypatch):
    """Where the speedup baseline (single on 1 worker) failed at batch 16, kernel's
    measured batch-16 points have no speedup: speedup.png left their line out without
    a word, as if batch 16 had never been swept. Now the legend names it and why."""
    path = with_failed_point(done_store, tmp_path, "single", 1)
    seen = drawn(monkeypatch)
    report.make_report(path, str(tmp_path / "report"))
    legend = seen["speedup.png"][0][-1]
    assert "kernel, batch 16: measured, no speedup (its 'single' baseline did not " \
           "finish)" in legend, legend
    assert "kernel, batch 8" in legend and "kernel, batch 32" in legend
    assert not any(label.startswith(("kernel, batch 8:", "kernel, batch 32:"))
                   for label in legend)


def test_an_unequal_pair_measured_at_one_setting_is_a_point_not_a_line(
        tmp_path, tiny_dataset_factory, monkeypatch):
    """kernel on an unequal pair (1 and 0.5: capacity 1.5) was drawn as a dotted line
    across the whole axis, as a baseline in one process is; it is a point at 1.5, in
    memory.png too."""
    config = write_sweep(tmp_path, tiny_dataset_factory("float32"),
                         {"strategy": ["single", "kernel"],
                          "cluster.workers": [1, [{"speed": 1.0}, {"speed": 0.5}]]},
                         name="pair")
    path = swept(tmp_path, config, "pair.zarr")
    seen = drawn(monkeypatch, render=False)
    report.make_report(path, str(tmp_path / "report"))
    axes = seen["speedup.png"][0]
    assert "kernel, unequal workers (at 1.5 only)" in axes[-1]  # the legend
    points = [line for line in axes[:-1]  # at the pair's capacity, about 1.5
              if len(line[1]) == 1 and 1.4 < line[1][0] < 1.6 and line[3] == "o"]
    assert len(points) == 1 and np.isfinite(points[0][2]).all(), axes
    assert not [line for line in axes[:-1] if line[0].startswith("kernel")], axes  # no line
    # memory.png against workers: the pair at its capacity, as in speedup.png (it was
    # at the median of the workers its repeats' placements used)
    (kernel,) = [line for line in seen["memory.png"][0][:-1] if line[0] == "kernel"]
    assert len(kernel[1]) == 2 and kernel[1][0] == 1.0 and 1.4 < kernel[1][1] < 1.6, kernel
