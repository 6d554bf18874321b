"""Run a measured sweep's points into its store, resumably: `run_sweep`.

Points run one at a time (timings must not share the cluster), in the sweep's
run order; `ClusterPool` (experiments/sweep/cluster_pool.py) keeps one client open
and replaces it only when a point needs another worker set (or after a failed
point); an embedded cluster's workers are restarted before each point it serves
again. The store is made from its
template on the first run and checked against the sweep on later ones; each
point's cells are written as it finishes, a failure with its one-line reason
(`one_line`), and the sweep goes on. A progress line per point goes to `out` and
the summary table at the end.

Why apart from the command line (:mod:`experiments.sweep.cli`): tests and other
drivers run a loaded sweep directly, and the loop's exit status is the CLI's.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import sys
import time
import uuid
from typing import Callable, TextIO

import numpy as np
import xarray as xr
from tqdm import tqdm

from experiments.sweep.measure import measure_point, predict_only
from pipeline.records.record import code_revision, software_versions
from experiments.sweep.provenance import machine_info, resume_warning, session_provenance
from experiments.sweep.results import PointResult, ResultStore, StoreMismatch, SweepLock
from experiments.sweep.store_layout import (DONE, FAILED, INFEASIBLE, SKIPPED, axes_moved,
                                           build_template, infeasible)
from experiments.sweep.summary import clock, format_table, summary_table
from experiments.sweep.config import Sweep
from experiments.sweep.growth import Growth
from experiments.sweep.store_growth import grow_store, settle_growth
from experiments.sweep.points import Point
from experiments.sweep.cluster_pool import ClusterPool
from experiments.sweep.probe_samples import ProbeSampler
from pipeline.cluster.scheduler_guard import guarded
from pipeline.cluster.workers import (SchedulerLost, SchedulerUnreachable, TooFewWorkers,
                                     WorkerLost)
from pipeline.placement.memory_fit import MemoryRefused
from pipeline.prediction import predict_point
from storage.locks import now_text
from storage.space import NoSpace, writing

#: How a full disk's message names the sweep's own store.
STORE = "sweep results store"


def one_line(error: BaseException) -> str:
    """A failure reason that fits one line of the store and of the log.

    A point that lost its workers or scheduler can simply run again: the reason
    says so (a sweep reruns failed points), not how to resume a single run. A point
    its workers' memory cannot hold is `INFEASIBLE`, as the check before the sweep says.
    """
    text = " ".join(str(error).split()) or repr(error)
    if isinstance(error, MemoryRefused):
        return f"{INFEASIBLE}{text}"[:500]
    if isinstance(error, SchedulerLost) or (isinstance(error, WorkerLost) and not error.memory):
        field = getattr(error, "walltime", "")  # batch jobs ended at their walltime
        longer = f" raise {field}, or" if field else ""
        text = text[:400 - len(longer)] + f";{longer} run the same sweep command again to " \
            "rerun this point (once a cluster you started yourself is back)"
    return f"{type(error).__name__}: {text}"[:500]


# Cluster ----------------------------------------------------------------------------


# The sweep --------------------------------------------------------------------------


def check_store(store: ResultStore, sweep: Sweep, fresh: bool,
                extend: bool = False) -> tuple[bool, Growth | None]:
    """The run's refusals of the store at the sweep's path, before anything is written
    (the dry run makes them too): StoreMismatch for another sweep's store (or one
    this sweep would grow, without `extend`), or, with `fresh`, for a path that holds
    no sweep store at all. Returns whether the store is kept and goes on (a finished
    store of this sweep, not replaced by `fresh`), and the growth it needs first."""
    if fresh:
        if store.exists() and not store.is_sweep_store():
            raise StoreMismatch(f"{store.path} is not a sweep results store; --fresh replaces "
                                "only those: choose another --out")
        return False, None
    if not store.exists():
        return False, None
    growth = store.check(sweep.fingerprint, sweep.text, extend)
    moved = axes_moved(store.attrs(), sweep.axes, store.path) if growth is None else None
    if moved:  # (a growth's plan checked the order of the axes itself)
        raise StoreMismatch(moved)
    kept = store.is_complete()
    return kept, growth if kept else None


def _prepare_store(sweep: Sweep, store: ResultStore, fresh: bool, argv: list[str],
                   extend: bool = False, echo: Callable[[str], None] = print) -> list[str]:
    """Make the store, or check the one there and its checksums (a damaged point is
    made pending again), growing it first where `extend` lets it; returns the
    warnings naming the damage."""
    settle_growth(store.path)  # what a growth stopped by a kill left
    kept, growth = check_store(store, sweep, fresh, extend)
    if growth is not None:
        grow_store(store.path, sweep, growth)
        echo(f"grew {store.path}: {growth.describe()}; its recorded points kept")
    if kept:
        return store.verify_for_resume()[1]
    if fresh:
        shutil.rmtree(sweep.runs_dir, ignore_errors=True)
    started = now_text()
    attrs = {
        "title": f"sweep {sweep.config.name}", "sweep_name": sweep.config.name,
        "mode": sweep.config.mode, "speedup_baseline": sweep.config.speedup_baseline,
        "config": sweep.text, "config_file": os.path.abspath(sweep.source),
        "fingerprint": sweep.fingerprint, "repeats": sweep.config.repeats,
        "versions": json.dumps(software_versions()), "machine": json.dumps(machine_info()),
        "code_revision": code_revision(), "command": shlex.join(argv),
        "started": started, "finished": "", "sessions": "[]",
        "runs_dir": os.path.abspath(sweep.runs_dir),
        "axes": json.dumps({axis.dim: list(axis.fields) for axis in sweep.axes}),
    }
    store.create(build_template(sweep, attrs))
    return []


def _point_line(done: int, total: int, elapsed: float, point: Point, result: PointResult | None,
                reason: str | None, seconds: float) -> str:
    eta = elapsed / done * (total - done) if done else 0.0
    head = f"[{done}/{total} {clock(elapsed)} eta {clock(eta)}] {point.describe()}"
    if reason is not None:
        return f"{head}  FAILED {reason}"
    values = result.values if result else {}
    if "step_time" not in values:
        predicted = values.get("predicted_step_time", float("nan"))
        choice = (result.texts.get("strategy_choice") if result else "") or ""
        picks = f" (auto picks {json.loads(choice)['chosen']})" if choice else ""
        return f"{head}  predicted {predicted:.4f} s/step{picks}"
    text = (f"{head}  {values['step_time']:.4f} s/step (IQR {values['step_time_p25']:.4f}-"
            f"{values['step_time_p75']:.4f})  {values['throughput']:.0f} samples/s  "
            f"loss {values['loss']:.3f}")
    if not np.isnan(values["accuracy"]):
        text += f"  acc {values['accuracy']:.3f}"
    if not np.isnan(values["predicted_step_time"]):
        text += f"  predicted {values['predicted_step_time']:.4f} "
        low, high = values.get("predicted_low", np.nan), values.get("predicted_high", np.nan)
        if not (np.isnan(low) or np.isnan(high)):
            text += f"[{low:.4f}-{high:.4f}] "
        compute = values.get("compute_error", np.nan)
        text += (f"({values['prediction_error']:+.0%}" + ("" if np.isnan(compute) else
                                                          f", compute {compute:+.0%}") + ")")
    return text + f"  [{seconds:.1f} s]"


def run_sweep(sweep: Sweep, fresh: bool = False, out: TextIO | None = None,
              err: TextIO | None = None, argv: list[str] | None = None,
              extend: bool = False) -> int:
    """Run every point not done yet, growing the store first where `extend` lets it
    (:mod:`experiments.sweep.store_growth`); returns the exit status (see the module
    doc)."""
    out = out or sys.stdout
    err = err or sys.stderr
    echo = lambda line: tqdm.write(line, file=out)  # noqa: E731 - keeps the bar intact
    store = ResultStore(sweep.store_path)
    with SweepLock(sweep.store_path) as lock:
        if lock.stale_note():
            print(lock.stale_note(), file=err)
        with writing(STORE, store.path):
            for line in _prepare_store(sweep, store, fresh, argv or sys.argv, extend, echo):
                print(line, file=err)
            status = store.status()
            too_big = [p for p in sweep.points
                       if p.infeasible and not p.skip and status[p.region] != DONE]
            for point in sweep.points:
                if point.skip and status[point.region] != SKIPPED:
                    store.write_skipped(point.region, point.skip)
            for point in too_big:  # not run: beyond its workers' memory
                store.write_failure(point.region, point.infeasible,
                                    {"predicted_peak_memory": point.needed}, {})
        todo = [p for p in sweep.points
                if not p.skip and not p.infeasible and status[p.region] != DONE]
        skipped = sum(1 for p in sweep.points if p.skip)
        differs = resume_warning(json.loads(store.attrs().get("sessions", "[]")),
                                 session_provenance(sweep.scheduler)) if todo else None
        if differs:
            print(f"warning: {store.path} holds points measured under another setup than "
                  f"this session's ({differs}): the store will mix them, and its report "
                  "names each session's; --fresh measures every point again", file=err)
        echo(f"sweep {sweep.config.name}: {len(sweep.points)} points, "
             f"{len(sweep.points) - len(todo) - skipped - len(too_big)} done before, "
             f"{len(todo)} to run" + (f", {skipped} not applicable" if skipped else "")
             + (f", {len(too_big)} not run (beyond their workers' memory)" if too_big else "")
             + f" -> {sweep.store_path}")
        _run_points(sweep, store, todo, echo, err, shlex.join(argv or sys.argv))
    return _closing_lines(sweep, echo)


def _run_points(sweep: Sweep, store: ResultStore, todo: list[Point],
                echo: Callable[[str], None], err: TextIO, command: str) -> None:
    """Run `todo` one point after another, a line and a bar step each, and record the
    session in the store's attributes (with its `command`: a store grown by
    `--extend` is reproduced by its last session's, not its first's) however the
    loop ends."""
    session = {"started": now_text(), "pid": os.getpid(), "command": command,
               **session_provenance(sweep.scheduler),
               "points_run": 0, "interrupted": True}
    pool = ClusterPool(echo)
    short: dict[tuple[str, ...], int] = {}  # tags -> workers found, where too few
    sampler = ProbeSampler(sweep.config.mode == "measure"
                           and sweep.config.probe_samples == "per_repeat", echo)
    begun = time.perf_counter()
    bar = tqdm(total=len(todo), unit="point", desc=sweep.config.name, file=err,
               disable=None, leave=False, dynamic_ncols=True)
    try:
        for done, point in enumerate(todo, start=1):
            bar.set_postfix_str(point.describe()[:60])
            t0 = time.perf_counter()
            result, reason, scheduler_lost = _run_point(sweep, store, pool, sampler, point,
                                                        short)
            stopped = len(todo) - done if scheduler_lost else 0
            session["points_run"] = done
            bar.update(1)
            echo(_point_line(done, len(todo), time.perf_counter() - begun, point,
                             result, reason, time.perf_counter() - t0))
            if stopped:
                echo(f"the Dask scheduler is gone: {stopped} point(s) left pending; run "
                     "the same command again once it is back")
                break
        session["interrupted"] = False
    finally:
        bar.close()
        pool.close()
        _end_session(store, session)


def _run_point(sweep: Sweep, store: ResultStore, pool: ClusterPool, sampler: ProbeSampler,
               point: Point, short: dict[tuple[str, ...], int]
               ) -> tuple[PointResult | None, str | None, bool]:
    """Run one point (a probe sample first where `sampler` wants one) and write what it
    gave: its figures, or its failure (the reason, its times); `short` keeps what a
    point on too few workers found (`check_enough_workers`). Returns the result, the
    reason it failed, and whether an external scheduler was lost (the points left stay
    pending)."""
    started = time.time()
    try:
        if sweep.config.mode == "predict":
            result = predict_only(point, predict_point)
        else:
            check_enough_workers(point, short)
            client = pool.client_for(point)
            if sampler.wanted(point):
                with guarded(client, point.config.cluster.scheduler_timeout,
                             "probing the cluster"):
                    sampler.take(point, client)
                client = pool.client_for(point)  # the run on fresh workers again
            result = measure_point(point, client, sweep.config.keep_checkpoints)
    except (KeyboardInterrupt, NoSpace, SchedulerUnreachable):  # a full disk, or a
        raise  # scheduler no point can reach, is no fault of the point: it stays
        # pending, and the sweep stops (one line)
    except (Exception, asyncio.CancelledError) as error:  # noqa: BLE001
        reason = one_line(error)
        finished = time.time()
        with writing(STORE, store.path):
            store.write_failure(point.region, reason,
                                {"started": started, "finished": finished,
                                 "wall_time": finished - started, "predicted_peak_memory":
                                 getattr(error, "needed", None) or np.nan},
                                {"run_id": uuid.uuid4().hex})
        if isinstance(error, TooFewWorkers) and point.cluster_key == "external":
            short[error.tags] = min(short.get(error.tags, error.found), error.found)
        if point.cluster_key is not None:
            pool.discard()
        return None, reason, isinstance(error, SchedulerLost) and point.cluster_key == "external"
    with writing(STORE, store.path):
        store.write_point(point.region, result)
        store.refresh_derived()
    return result, None, False


def check_enough_workers(point: Point, short: dict[tuple[str, ...], int]) -> None:
    """Raise `TooFewWorkers` at once for a point on a scheduler you started that wants
    more workers of its tags than an earlier point found after waiting
    `cluster.wait_timeout` for them (`short`: tags -> workers found): each such point
    waited the whole timeout again, 30 s by default, before it failed alike."""
    cluster = point.config.cluster
    tags, wanted = tuple(cluster.tags()), cluster.use_workers or 1
    found = short.get(tags)
    if point.cluster_key == "external" and found is not None and wanted > found:
        raise TooFewWorkers(f"only {found} of the {wanted} workers needed offer resource "
                            f"'{' or '.join(tags)}' (an earlier point of this sweep waited "
                            f"{cluster.wait_timeout:g} s for more; add workers and run the "
                            "same command again)", list(tags), found, wanted)


def _end_session(store: ResultStore, session: dict) -> None:
    """Add the session to the store's attributes, the derived figures refreshed; a full
    disk here is reported only when nothing else stopped the sweep."""
    session["finished"] = now_text()
    try:
        with writing(STORE, store.path):
            sessions = json.loads(store.attrs().get("sessions", "[]")) + [session]
            store.refresh_derived()
            store.set_attrs(finished=session["finished"], sessions=json.dumps(sessions))
    except NoSpace:
        if session["interrupted"] is False:
            raise  # else the error that stopped the sweep is the one to report


def _closing_lines(sweep: Sweep, echo: Callable[[str], None]) -> int:
    """The store's table, where it is, and the exit status: 1 if any point failed."""
    with xr.open_zarr(sweep.store_path) as ds:
        failed = ds.status.values == FAILED
        too_big = failed & infeasible(ds.failure.values)
        echo("")
        echo(format_table(summary_table(ds.load())))
    echo(f"\nresults: {sweep.store_path}  (xr.open_zarr; report: python -m experiments.report "
         f"{shlex.quote(sweep.store_path)})")
    if too_big.any():
        echo(f"{int(too_big.sum())} point(s) not run: their predicted peak memory exceeds a "
             "worker's limit (see `failure`); lower train.batch or give the workers memory")
    if (failed & ~too_big).any():
        echo(f"{int((failed & ~too_big).sum())} point(s) failed; their reasons are in the "
             "store's `failure` variable. Run the same command again to retry them.")
    return 1 if failed.any() else 0
