"""Run a grid of trainings: ``python -m experiments.sweep CONFIG [options] [key=value ...]``.

    python -m experiments.sweep experiments/configs/quick.yaml
    python -m experiments.sweep quick.yaml --scheduler tcp://HOST:8786 --out results/quick-mine.zarr
    python -m experiments.sweep quick.yaml --dry-run axes.train.batch=[32,64]
    python -m experiments.sweep experiments/configs/scaling.yaml   # mode: scaling

A file with ``mode: scaling`` describes hypothetical clusters instead of run
configs; the performance model predicts every point and nothing trains (see
:mod:`experiments.scaling.run`).

Points run one at a time (timings must not share the cluster). With no scheduler,
an embedded cluster is started per distinct worker set and reused by the
consecutive points that share it, its worker processes replaced by fresh ones
before each (so that no point inherits what an earlier one left in them);
`reference` points need none and run first.
Results go to one Zarr store (default ``results/<name>.zarr``), one point at a
time, so running the same command again resumes; ``--fresh`` starts over;
``--extend`` grows a store of this sweep written with fewer repeats or axis values,
keeping its points (:mod:`experiments.sweep.store_growth`).

Exit status: 0 all points done, 1 some point failed (each is recorded with its
reason, and the sweep went on) or the store's metadata is damaged (one line naming
the file; a damaged point is only named, and runs again), 2 bad config or a store
of another sweep (or of the format before checksums), 3 the
store is in use by another sweep, 128 + the signal's number when stopped by Ctrl-C
(130), SIGHUP (129) or SIGTERM (143); the point being run stays pending, so the
same command resumes (a second signal stops at once).

This module is the command line: arguments, the checks made before anything
runs, ``--dry-run``, and exit codes. The run loop is :mod:`experiments.sweep.run`,
one point's measurement :mod:`experiments.sweep.measure`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, TextIO

import numpy as np

from experiments.sweep.measure import predicted_step_time
from experiments.sweep.speedup import missing_baseline_note, speedup_caveat
from experiments.sweep.results import ResultStore, StoreBusy, StoreMismatch, SweepLock
from experiments.sweep.results_checksums import StoreDamaged
from experiments.sweep.store_layout import DONE, INFEASIBLE, SKIPPED
from experiments.sweep.results_checksums import point_key
from experiments.scaling.run import dry_run_scaling, run_scaling_sweep
from experiments.scaling.config import ScalingSweep, is_scaling_sweep, load_scaling_sweep
from experiments.sweep.config import (Sweep, ignored_prediction_note, load_sweep,
                                     store_sharing_runs)
from experiments.sweep.growth import Growth
from experiments.sweep.points import Point
from experiments.sweep.run import STORE, check_store, run_sweep
from pipeline.cli import (CONFIG_ERROR, IN_USE, RUNTIME_ERROR, Interrupted, OneLineParser,
                          UsageError, exit_with, fail, quiet_dask,
                          stops_on_signals)
from pipeline.cluster.connect import check_scheduler_answers
from pipeline.cluster.workers import SchedulerUnreachable, scheduler_address
from pipeline.strategies import strategy_of
from pipeline.prediction import check_probe_environment, predict_point
from pipeline.preflight import (check_before_start, check_own_dir, check_run,
                                check_writable_dir)
from pipeline.config.schema import ConfigError, to_dict
from pipeline.placement.memory_fit import MemoryRefused
from pipeline.placement.split import PlacementError
from storage.space import NoSpace, is_full


def contention_warning(sweep: Sweep) -> str | None:
    """One line when points run more threads than this machine has cores."""
    cores = os.cpu_count() or 1
    worst, count = 0, 0
    for point in sweep.points:
        if point.cluster_key is None:
            threads = point.config.reference.threads
        elif point.cluster_key == "external" or point.config.cluster.jobqueue is not None:
            continue  # the workers may be elsewhere (batch jobs: where the queue puts
            # them); the scheduler knows, we do not
        else:
            # The master mostly waits while workers compute, so it is not counted.
            threads = sum(w.threads for w in point.config.cluster.worker_list())
        if threads > cores:
            worst, count = max(worst, threads), count + 1
    if not count:
        return None
    return (f"warning: {count} of {len(sweep.points)} points run up to {worst} threads "
            f"(workers' threads) on {cores} cores: their timings measure "
            "contention as well as the strategy")


#: The command, as the store records it (with its arguments, quoted for a shell).
SWEEP_COMMAND = ("python", "-m", "experiments.sweep")
#: How the dry run shows a point's status in an existing store.
STATUS_WORDS = {0: "pending", 1: "done", 2: "failed", 3: "not applicable"}


def dry_run(sweep: Sweep, out: TextIO, fresh: bool = False, extend: bool = False) -> None:
    """Print the points in run order (with the model's predicted time if there is one).

    A dry run runs nothing: a model that would measure the cluster first is asked
    to use only what it measured before (CNN_PREDICT_PROBE=cached, unless set). A
    store the run would refuse is refused here first, in the run's words
    (`store_status`); the caller turns that into the run's exit status. A store the
    run would grow (`extend`) is left as it is: its points are shown in their new
    cells, and a line says what growing adds.
    """
    os.environ.setdefault("CNN_PREDICT_PROBE", "cached")
    status, damaged, growth = store_status(sweep, fresh, extend)
    shape = " x ".join(f"{len(a)} {a.dim}" for a in sweep.axes) or "1 point"
    print(f"sweep {sweep.config.name}: {len(sweep.points)} points ({shape} x "
          f"{sweep.config.repeats} repeat(s)) -> {sweep.store_path}", file=out)
    if growth is not None:
        print(f"the run grows the store first (--extend): {growth.describe()}; its "
              "recorded points are kept", file=out)
    rows = []
    # without a store, a status column only where some point will not run as pending
    not_all_pending = any(p.infeasible or p.skip for p in sweep.points)
    for number, point in enumerate(sweep.points, start=1):
        cluster = "none" if point.cluster_key is None else (
            "external" if point.cluster_key == "external"
            else f"{len(point.config.cluster.worker_list())} worker(s)")
        predicted = predicted_step_time(predict_point, point, None)
        row = [str(number), point.describe(), cluster,
               "-" if np.isnan(predicted) else f"{predicted:.4f} s"]
        shown = status is not None and int(status[point.region]) in (DONE, SKIPPED)
        if point.infeasible and not point.skip and not shown:  # what the run records
            row.append("not run: beyond its workers' memory")
        elif status is not None:
            code = int(status[point.region])
            row.append("damaged, runs again" if point_key(point.region) in damaged else
                       STATUS_WORDS[SKIPPED if point.skip and code == 0 else code])
        elif not_all_pending:
            row.append(STATUS_WORDS[SKIPPED] if point.skip else "pending")
        rows.append(row)
    header = ["#", "point", "cluster", "predicted"] + (
        ["status"] if status is not None or not_all_pending else [])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    for row in [header] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip(), file=out)


def store_status(sweep: Sweep, fresh: bool, extend: bool = False
                 ) -> tuple[np.ndarray | None, dict, Growth | None]:
    """What the store says of each point, checked as the run checks it before it
    writes anything (`experiments.sweep.run._prepare_store`): the status array (None
    where no kept store has one), the damaged points, and the growth the run makes
    first (with `extend`; the status and damage are then in the grown grid's cells).

    Raises what the run raises: StoreMismatch (another sweep's store, or not a sweep
    store) and StoreDamaged (damaged metadata of a finished store): a dry run that
    listed the points without a status would say "fine" (exit 0) to a command the
    run refuses."""
    store = ResultStore(sweep.store_path)
    kept, growth = check_store(store, sweep, fresh, extend)
    if not kept:
        return None, {}, None  # none yet, replaced, or left half-made: every point runs
    try:
        found = store.verify()  # changes nothing: the run mends a damaged point
    except KeyError:  # a record without a part the verdict needs
        return None, {}, None
    if growth is None:
        return found.status, found.damaged, None
    status, damaged = np.zeros(sweep.shape, dtype=np.int8), {}  # the new points: pending
    for region in growth.old_regions():
        status[growth.new_region(region)] = found.status[region]
        if point_key(region) in found.damaged:
            damaged[point_key(growth.new_region(region))] = found.damaged[point_key(region)]
    return status, damaged, growth


def check_sweep_paths(sweep: Sweep | ScalingSweep, field: str) -> None:
    """Before anything runs (dry runs too): the store can be written, and every point
    passes the checks `python -m pipeline.train --check` makes of a single run
    (`check_point`), so a bad path or a point its run would refuse is one line now,
    naming the point, rather than a traceback or a failure recorded point by point.
    `field` is what named the store (``--out`` or ``output``). A point that fits
    none of its workers' memory (`MemoryRefused`) alone does not stop the sweep: it
    gets `Point.infeasible` (the run records it as failed and runs the others). A
    scaling sweep's points are hypothetical clusters, with no run config to check."""
    check_writable_dir(sweep.store_path, field)
    check_own_dir(sweep.store_path, field)
    if isinstance(sweep, ScalingSweep):
        return
    check_own_dir(sweep.runs_dir, field)
    check_runs_not_shared(sweep, field)
    checked: dict[str, MemoryRefused | None] = {}
    for point in sorted(sweep.points, key=lambda p: p.order):  # the first in grid order
        # Points that differ only in their name and run directory (repeats, and most
        # points of a big grid share a few configs) are checked once: the directories
        # are siblings in the sweep's runs folder, all writable if one is.
        same = {k: v for k, v in to_dict(point.config).items() if k not in ("name", "output")}
        key = json.dumps(same, sort_keys=True, default=str)
        if key not in checked:
            checked[key] = None
            try:
                check_point(point, sweep.config.mode, field)
            except MemoryRefused as refused:  # the point alone: recorded, not run
                checked[key] = refused
            except (ConfigError, PlacementError) as error:  # as `--check` refuses (exit 2)
                where = " ".join(f"{dim}={label}" for dim, label in point.labels.items())
                raise ConfigError(f"{error} (at point {where})") from None
        refused = checked[key]
        if refused is not None:
            point.infeasible = f"{INFEASIBLE}{refused}"
            point.needed = np.nan if refused.needed is None else float(refused.needed)


def infeasible_line(sweep: Sweep | ScalingSweep) -> str | None:
    """One line naming the points `check_sweep_paths` found too big for their workers'
    memory: they are recorded as failed with the reason and not run."""
    if isinstance(sweep, ScalingSweep):
        return None
    points = [p for p in sweep.points if p.infeasible and not p.skip]
    if not points:
        return None
    where = sorted({" ".join(f"{d}={v}" for d, v in p.labels.items()) for p in points})
    named = "; ".join(where[:3]) + (f"; and {len(where) - 3} more" if len(where) > 3 else "")
    first = points[0].infeasible.removeprefix(INFEASIBLE).split("; ")[0]
    return (f"warning: {len(points)} of {len(sweep.points)} point(s) do not fit their "
            "workers' memory and will not run (each recorded as failed, with the "
            f"reason): {named} (first: {first})")


def check_runs_not_shared(sweep: Sweep, field: str) -> None:
    """Refuse a store whose run directories (results/x.runs) are another existing
    store's (results/x.zarr beside results/x): its points would replace that sweep's
    records, and `--fresh` would delete them."""
    other = store_sharing_runs(sweep.store_path)
    try:
        runs = ResultStore(other).attrs().get("runs_dir") if os.path.isdir(other) else None
    except Exception:  # noqa: BLE001 - no readable store there: nothing to share
        runs = None
    if runs == os.path.abspath(sweep.runs_dir):
        raise ConfigError(f"{field}: {sweep.store_path} would keep its runs in "
                          f"{sweep.runs_dir}, which holds those of the sweep store {other}; "
                          "name the store apart from it (e.g. another stem)")


def check_point(point: Point, mode: str, field: str) -> None:
    """What `--check` checks of the point's run (`pipeline.preflight`): a measured
    point whose sweep starts its cluster gets `check_before_start` (its workers' tags
    and memory too); a predicted one (`mode: predict`) starts none, so `check_run`.
    `field` names the store in the line of an unwritable run directory."""
    if mode == "measure":
        check_before_start(point.config, output_field=field)
    else:
        check_run(point.config, output_field=field)


def scaling_main(args: argparse.Namespace, argv: list[str]) -> int:
    """``mode: scaling``: predict a grid of hypothetical clusters (no cluster, no training).

    Raises ConfigError for a bad file (the caller prints it, exit 2).
    """
    if args.scheduler:
        raise ConfigError("--scheduler: a scaling sweep predicts hypothetical clusters and "
                          "connects to none")
    sweep = load_scaling_sweep(args.config, args.overrides, args.out)
    check_sweep_paths(sweep, "--out" if args.out else "output")
    if args.dry_run:
        return _print_dry_run(dry_run_scaling, sweep, args.fresh, args.extend)
    return _run_store_guarded(
        lambda: run_scaling_sweep(sweep, args.fresh, argv=[*SWEEP_COMMAND, *argv],
                                  extend=args.extend),
        "interrupted: the previous store, if any, is unchanged", sweep.store_path)


def _print_dry_run(printer: Callable[[Any, Any, bool, bool], None], sweep: Any, fresh: bool,
                   extend: bool) -> int:
    """Run a dry-run printer; a store the run would refuse gets the run's line and
    exit status (the printer checks it before it prints anything)."""
    try:
        SweepLock(sweep.store_path).check_free()  # as the run would refuse it
        printer(sweep, sys.stdout, fresh, extend)
    except StoreBusy as error:
        return fail(error, IN_USE)
    except StoreMismatch as error:
        return fail(error, CONFIG_ERROR)
    except StoreDamaged as error:  # the data, not the input, as in the run
        return fail(error, RUNTIME_ERROR)
    except BrokenPipeError:  # `... --dry-run | head`
        sys.stdout = open(os.devnull, "w", encoding="utf-8")
    return 0


def check_sweep_scheduler(sweep: Sweep) -> None:
    """Ask the scheduler the sweep's points train on (`--scheduler`, or
    $DASK_SCHEDULER_ADDRESS) for its handshake before anything runs or is listed, as
    `pipeline.train --check` does: a wrong address failed only at the first point on
    it, after the points that need no cluster had run and been stored under it."""
    for point in sweep.points:
        if strategy_of(point.config).uses_cluster and scheduler_address(point.config.cluster):
            check_scheduler_answers(point.config.cluster)
            return


def _run_store_guarded(run: Callable[[], int], interrupted: str, store_path: str) -> int:
    """Run a sweep, turning store refusals, a full disk and interruption (Ctrl-C,
    SIGTERM, SIGHUP: `stops_on_signals`) into exit codes."""
    try:
        with stops_on_signals():
            return run()
    except StoreMismatch as error:
        return fail(error, CONFIG_ERROR)
    except StoreDamaged as error:  # the data, not the input: nothing is changed
        return fail(error, RUNTIME_ERROR)
    except StoreBusy as error:
        return fail(error, IN_USE)
    except SchedulerUnreachable as error:  # as a run says it: the points stay pending
        return fail(error, RUNTIME_ERROR)
    except OSError as error:  # the disk, not the input: the store keeps what it has
        if is_full(error):
            full = error if isinstance(error, NoSpace) else NoSpace(STORE, store_path)
            return fail(no_space_line(full, store_path), RUNTIME_ERROR)
        return fail(error, RUNTIME_ERROR)
    except Interrupted as stop:
        print(interrupted.replace("interrupted", f"interrupted ({stop.name})", 1),
              file=sys.stderr)
        return stop.status
    except KeyboardInterrupt:  # raised by hand, or with the signals left to Python
        print(interrupted, file=sys.stderr)
        return 130


def no_space_line(error: NoSpace, store_path: str) -> str:
    """What a sweep stopped by a full disk says: which store's disk (and its path),
    the points kept, and that the same command runs the rest once there is room."""
    try:
        status = ResultStore(store_path).status()
        kept = (f"{int((status == DONE).sum())} of {int((status != SKIPPED).sum())} "
                f"point(s) finished, in {store_path}")
    except Exception:  # noqa: BLE001 - no store yet, or one the full disk left unmade
        kept = "no finished point"
    return (f"{error}; kept: {kept}; the point being run stays pending: free some space, "
            "then run the same command again to run the rest")


def main(argv: list[str] | None = None) -> int:
    quiet_dask()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = OneLineParser(
        prog="python -m experiments.sweep",
        description="Run a grid of trainings and collect the results in one Zarr store.")
    parser.add_argument("config", help="sweep config (YAML)")
    parser.add_argument("overrides", nargs="*", help="key=value: sweep keys (repeats=2, "
                        "axes.train.batch=[32,64]) or base run-config fields (train.lr=0.1)")
    parser.add_argument("--scheduler", help="Dask scheduler address (default: an embedded "
                        "cluster per worker set, or $DASK_SCHEDULER_ADDRESS)")
    parser.add_argument("--out", help="results store (default results/<name>.zarr)")
    parser.add_argument("--fresh", action="store_true", help="discard earlier results")
    parser.add_argument("--extend", action="store_true", help="grow this sweep's store, "
                        "written with fewer repeats or axis values, to the file's: its "
                        "recorded points are kept, the new ones run")
    parser.add_argument("--dry-run", action="store_true", help="print the points, run nothing")
    try:
        # Options and key=value overrides in any order (`cfg --dry-run repeats=2`).
        args = parser.parse_intermixed_args(argv)
        if args.fresh and args.extend:
            raise UsageError("--fresh --extend: --fresh discards the store's results, "
                             "--extend keeps them and grows the store; give one of the two")
        if is_scaling_sweep(args.config, args.overrides):
            return scaling_main(args, argv)
        sweep = load_sweep(args.config, args.overrides, args.scheduler, args.out)
        check_sweep_paths(sweep, "--out" if args.out else "output")
        check_probe_environment()
        check_sweep_scheduler(sweep)
    except (UsageError, ConfigError) as error:
        return fail(error, CONFIG_ERROR)
    except SchedulerUnreachable as error:  # before any point: none is stored under it
        return fail(error, RUNTIME_ERROR)
    for note in filter(None, (infeasible_line(sweep), speedup_caveat(sweep),
                              ignored_prediction_note(sweep))):
        print(note, file=sys.stderr)
    if args.dry_run:
        status = _print_dry_run(dry_run, sweep, args.fresh, args.extend)
    else:
        warning = contention_warning(sweep) if sweep.config.mode == "measure" else None
        if warning:
            print(warning, file=sys.stderr)
        status = _run_store_guarded(
            lambda: run_sweep(sweep, args.fresh, argv=[*SWEEP_COMMAND, *argv],
                              extend=args.extend),
            "interrupted: finished points are kept; run the same command again to resume",
            sweep.store_path)
    note = missing_baseline_note(sweep)
    if note and status == 0:  # closing the listing or the sweep; not beside a refusal
        print(note, file=sys.stderr)
    return status


if __name__ == "__main__":
    exit_with(main())
