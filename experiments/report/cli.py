"""Figures and a table from a sweep's store: ``python -m experiments.report RESULTS``.

Writes, into ``<name>.report/`` next to the store ``<name>.zarr`` (or ``--out DIR``):

- ``strategies.png``: every strategy side by side (step time measured and
  predicted, speedup, exchange bytes), if three or more strategies are swept;
- ``speedup.png``: speedup against workers (summed relative speed for unequal
  devices), one panel per network size, one line per strategy/batch/other
  setting, with the ideal line and Marques et al.'s 3.28x on 4 CPUs (drawn where
  the axis, which ends at the sweep's own capacities, reaches 4; named in the legend
  otherwise); a setting measured once is a dotted line (`reference`: its threads,
  one process);
- ``breakdown.png``: where a step's time goes (compute, exchange, dataset, wait, client
  along each step's critical worker) per strategy and worker set, each part its own
  median, beside the median step measured (the medians need not add up to it);
- ``batch.png``: step time and throughput against batch size (if batch is swept);
- ``placement.png``: calibrated against even placement on unequal workers (if
  placement is swept);
- ``memory.png``: the fullest worker's working memory against workers and batch,
  per strategy, beside plain PyTorch's (`reference`), where the store has memory;
- ``step_times.png``: the spread of every point's measured steps;
- ``prediction.png``: predicted against measured step time (once predicted);
- ``predicted.png``: a ``mode: predict`` store's step times, the model's alone, with
  their band, against workers (the only figure such a store gets: the others draw
  measured steps);
- ``growth_<strategy>.png``: how a strategy's step time and its parts (compute,
  exchange, dataset, wait, client) grow with batch and workers, beside the model's
  (:mod:`experiments.report.growth`; stores with the parts and a batch or workers dim);
- ``report.md``: provenance, the figures, the main table and any failures (of a
  ``mode: predict`` store, the predicted figure and table, saying what is left out).

The folder holds one report: an earlier one there (this store's or another's) is
replaced wholly, and a folder holding anything else is refused, exit 2
(:mod:`experiments.report.report_folder`, which knows every file a report writes).
A report stopped by Ctrl-C, SIGTERM or SIGHUP removes the files it wrote (none looks
like a whole report) and exits 128 + the signal's number with one line.

The store's checksums are verified first: a damaged file (a point's, the
coordinates', the metadata's) is one line naming it and exit 1, and nothing is
drawn; the sweep's same command runs damaged points again. A store of the format
before checksums is reported with a warning that nothing could be checked.

A scaling store (``mode: scaling``, predictions over hypothetical clusters) gets
its own figures instead: which strategy wins over devices x batch and devices x
bandwidth, and the speedup curves (:mod:`experiments.scaling.report`).

Figures use medians over the done repeats, with the repeats' range as error bars. A
point with no done repeat that failed (or is still pending) is a gap in its line, marked
on the x axis (`x`: failed; hollow circle: not run yet; hollow square: not run, beyond
its workers' memory), and a labelled empty slot in ``breakdown.png``
(:mod:`experiments.report.gaps`).

This module is the command line and the list of files: the figures are drawn by
:mod:`experiments.report.figures`, :mod:`experiments.report.breakdown` and
:mod:`experiments.report.strategies` from
:mod:`experiments.report.view`'s table of points, and report.md is written by
:mod:`experiments.report.markdown`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import xarray as xr

from experiments.report.figure_files import write_figures
from experiments.report.breakdown import breakdown_figure
from experiments.report.figures import (batch_figure, placement_figure, predicted_figure,
                                        prediction_figure, speedup_figure, step_times_figure)
from experiments.report.growth import growth_figure, growth_strategies
from experiments.report.links import link_figure
from experiments.report.markdown import write_markdown
from experiments.report.memory import memory_figure
from experiments.report.report_folder import (OutDirRefused, prepare_report_folder,
                                             remove_report)
from experiments.report.strategies import strategies_figure
from experiments.report.view import StoreView
from experiments.sweep.results import ResultStore, StoreMismatch
from experiments.sweep.results_checksums import StoreDamaged
from experiments.scaling.report import make_scaling_report
from pipeline.cli import Interrupted, OneLineParser, UsageError, stops_on_signals


class ReportError(ValueError):
    """The path is not a sweep store that can be reported on."""


def default_out_dir(store: str) -> str:
    stem = store.rstrip("/")
    return (stem[: -len(".zarr")] if stem.endswith(".zarr") else stem) + ".report"


def make_report(store: str, out_dir: str | None = None) -> list[str]:
    """Write the figures and report.md; returns the paths written."""
    if not os.path.exists(store):
        raise ReportError(f"{store}: no such results store")
    try:  # StoreDamaged (a damaged file, named) passes to the caller
        unchecked = ResultStore(store).verify_for_reading()
    except StoreMismatch as error:
        raise ReportError(str(error)) from None
    if unchecked:
        print(unchecked, file=sys.stderr)
    try:
        ds = xr.open_zarr(store).load()
    except Exception as error:  # noqa: BLE001 - any unreadable store gets one line
        raise ReportError(f"{store}: not a readable Zarr store ({error})") from None
    if "status" not in ds:
        raise ReportError(f"{store}: not a sweep results store")
    out_dir = out_dir or default_out_dir(store)
    prepare_report_folder(out_dir, store)  # an earlier report there is removed
    try:
        if ds.attrs.get("mode") == "scaling":  # predicted over hypothetical clusters
            return make_scaling_report(ds, out_dir)
        return make_measured_report(ds, out_dir)
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM, SIGHUP: no half report that looks whole
        remove_report(out_dir)
        raise


def make_measured_report(ds: xr.Dataset, out_dir: str) -> list[str]:
    """A measured (or predict) store's figures and report.md; returns the paths."""
    sweep = StoreView(ds)
    frame = sweep.points()
    makers: list[tuple[str, Any]] = [
        ("strategies.png", lambda p: strategies_figure(sweep, frame, p)),
        ("speedup.png", lambda p: speedup_figure(sweep, frame, p)),
        ("breakdown.png", lambda p: breakdown_figure(sweep, frame, p)),
        ("batch.png", lambda p: batch_figure(sweep, frame, p)),
        ("placement.png", lambda p: placement_figure(sweep, frame, p)),
        ("memory.png", lambda p: memory_figure(sweep, frame, p)),
        ("step_times.png", lambda p: step_times_figure(sweep, p)),
        ("prediction.png", lambda p: prediction_figure(frame, p)),
        ("predicted.png", lambda p: predicted_figure(sweep, frame, p)),
        ("links.png", lambda p: link_figure(sweep, frame, p)),
        *((f"growth_{s}.png", lambda p, s=s: growth_figure(sweep, frame, s, p))
          for s in growth_strategies(sweep, frame)),
    ]
    written = write_figures(makers, out_dir)
    report = os.path.join(out_dir, "report.md")
    write_markdown(ds, sweep, frame, written, report)
    return [os.path.join(out_dir, name) for name in written] + [report]


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m experiments.report",
                           description="Figures and a table from a sweep's store.")
    parser.add_argument("results", help="the sweep's Zarr store (results/<name>.zarr)")
    parser.add_argument("--out", help="directory for the files (default: beside the store, "
                        f"e.g. {default_out_dir('results/quick.zarr')}/ for results/quick.zarr)")
    try:
        args = parser.parse_args(argv)
        with stops_on_signals():
            paths = make_report(args.results, args.out)
    except Interrupted as stop:
        print(f"interrupted ({stop.name}): no report was written (its partial files are "
              "removed); run the same command again", file=sys.stderr)
        return stop.status
    except KeyboardInterrupt:  # raised by hand, or with the signals left to Python
        print("interrupted: no report was written (its partial files are removed); run the "
              "same command again", file=sys.stderr)
        return 130
    except (UsageError, ReportError, OutDirRefused) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except StoreDamaged as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
