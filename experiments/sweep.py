"""Run a grid of trainings: ``python -m experiments.sweep CONFIG [options] [key=value ...]``.

    python -m experiments.sweep experiments/configs/quick.yaml
    python -m experiments.sweep marques_cpu.yaml --scheduler tcp://HOST:8786
    python -m experiments.sweep quick.yaml --dry-run axes.train.batch=[32,64]
    python -m experiments.sweep experiments/configs/scaling.yaml   # mode: scaling

A file with ``mode: scaling`` describes hypothetical clusters instead of run
configs; the performance model predicts every point and nothing trains (see
:mod:`experiments.scaling`).

Points run one at a time (timings must not share the cluster). With no scheduler,
an embedded cluster is started per distinct worker set and reused by the
consecutive points that share it; `reference` points need none and run first.
Results go to one Zarr store (default ``results/<name>.zarr``), one point at a
time, so running the same command again resumes; ``--fresh`` starts over.

Exit status: 0 all points done, 1 some point failed (each is recorded with its
reason, and the sweep went on), 2 bad config or a store of another sweep, 3 the
store is in use by another sweep, 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import inspect
import json
import os
import shutil
import signal
import sys
import time
import uuid
from contextlib import ExitStack
from typing import Any, Callable, TextIO

import numpy as np
import xarray as xr
from tqdm import tqdm

from experiments.provenance import code_revision, machine_info
from experiments.results import (DONE, FAILED, SKIPPED, PointResult, ResultStore, StoreBusy,
                                 StoreMismatch, SweepLock, build_template)
from experiments.scaling import dry_run_scaling, run_scaling_sweep
from experiments.scaling_config import ScalingSweep, is_scaling_sweep, load_scaling_sweep
from experiments.summary import format_table, summary_table
from experiments.sweep_config import Sweep, load_predictor, load_sweep
from experiments.sweep_points import Point
from pipeline.cli import (CONFIG_ERROR, RUNTIME_ERROR, OneLineParser, UsageError, fail,
                          quiet_dask)
from pipeline.cluster import SchedulerLost, WorkerLost, open_client, register_setup
from pipeline.preflight import check_run, check_writable_dir
from pipeline.records import software_versions
from pipeline.schema import ConfigError
from pipeline.train import run_training
from storage.locks import now_text

Predictor = Callable[[Any, "dict | None"], "float | None"]


def one_line(error: BaseException) -> str:
    """A failure reason that fits one line of the store and of the log.

    A point that lost its workers or scheduler can simply run again: the reason
    says so (a sweep reruns failed points), not how to resume a single run.
    """
    text = " ".join(str(error).split()) or repr(error)
    if isinstance(error, (WorkerLost, SchedulerLost)):
        text = text[:400] + "; run the same sweep command again (once the cluster is back) " \
            "to rerun this point"
    return f"{type(error).__name__}: {text}"[:500]


# Cluster ----------------------------------------------------------------------------


class ClusterPool:
    """At most one open client: the external scheduler's, or the embedded cluster of
    the current worker set, replaced when a point needs another set."""

    def __init__(self, echo: Callable[[str], None]) -> None:
        self.echo = echo
        self.key: str | None = None
        self.client: Any = None
        self._stack: ExitStack | None = None

    def client_for(self, point: Point) -> Any:
        if point.cluster_key is None:
            return None
        if self.client is not None and self.key == point.cluster_key:
            return self.client
        self.close()
        stack = ExitStack()
        try:
            client = stack.enter_context(open_client(point.config.cluster))
            register_setup(client, point.config.cluster)
        except BaseException:
            stack.close()
            raise
        self._stack, self.client, self.key = stack, client, point.cluster_key
        self.echo(self._describe(point, client))
        return client

    @staticmethod
    def _describe(point: Point, client: Any) -> str:
        if point.cluster_key == "external":
            where = f"scheduler {client.scheduler.address}"
        else:
            workers = point.config.cluster.worker_list()
            where = (f"embedded cluster of {len(workers)} worker(s) "
                     f"[{' '.join(w.name or '' for w in workers)}]")
        if importlib.util.find_spec("bokeh") is None:
            return f"{where}; dask dashboard: not served (pip install bokeh>=3.1 for it)"
        return f"{where}; dask dashboard: {client.dashboard_link}"

    def discard(self) -> None:
        """Drop the cluster after a failed point: a worker may be dead or hold state."""
        self.close()

    def close(self) -> None:
        if self._stack is not None:
            stack, self._stack, self.client, self.key = self._stack, None, None, None
            stack.close()


# One point --------------------------------------------------------------------------


def _predict(predictor: Predictor | None, point: Point, summary: dict | None,
             client: Any = None) -> float:
    """The model's step time for the point (NaN where it has none).

    A live client is handed on when the model takes one, so that a model which
    probes the cluster uses the one already running instead of starting another.
    """
    if predictor is None:
        return float("nan")
    kwargs = {}
    if client is not None and "client" in inspect.signature(predictor).parameters:
        kwargs["client"] = client
    try:
        value = predictor(point.config, summary, **kwargs)
    except Exception:  # noqa: BLE001 - a model's gap must not fail a measured point
        return float("nan")
    try:
        return float("nan") if value is None else float(value)
    except (TypeError, ValueError):
        return float("nan")


def capacity(point: Point, record: xr.Dataset) -> float:
    """What the point was given to run on: `reference`'s threads, else the summed
    relative speed of its workers, those the placement left out included (a device
    left idle still counts against the point's efficiency)."""
    if point.config.strategy == "reference":
        return float(point.config.reference.threads)
    speeds = {w.name: w.speed for w in point.config.cluster.worker_list()}
    idle = json.loads(record.attrs.get("left_out", "[]"))
    return float(record.emulated_speed.sum()) + sum(speeds.get(name, 1.0) for name in idle)


def measure_point(point: Point, client: Any, predictor: Predictor | None,
                  keep_checkpoints: bool) -> PointResult:
    """Train the point's config and turn its summary into the store's figures."""
    # The point's own directory: what an earlier, failed or interrupted attempt left
    # there is replaced, under the run's lock (the sweep never resumes a point).
    config = dataclasses.replace(
        point.config, train=dataclasses.replace(point.config.train, fresh=True, resume=False))
    started = time.time()
    result = run_training(config, client=client)
    finished = time.time()
    summary, record = result.summary, result.record
    if not keep_checkpoints:
        shutil.rmtree(config.checkpoint_path, ignore_errors=True)
    step_time = summary["step_time_median"]
    predicted = _predict(predictor, point, summary, client)
    accuracy = summary.get("test_accuracy")
    values = {
        "step_time": step_time, "step_time_p25": summary["step_time_p25"],
        "step_time_p75": summary["step_time_p75"], "step_time_min": summary["step_time_min"],
        "step_time_max": summary["step_time_max"], "throughput": summary["throughput"],
        "compute_time": summary["compute_time_median"],
        "storage_time": summary["storage_time_median"],
        "master_time": summary["master_time_median"],
        "wait_time": summary["wait_time_median"], "bytes_moved": summary["bytes_per_step"],
        "loss": summary["final_loss"],
        "accuracy": float("nan") if accuracy is None else float(accuracy),
        "n_workers": float(record.sizes["worker"]),
        "capacity": capacity(point, record),
        "measured_steps": float(summary["measured_steps"]),
        "predicted_step_time": predicted,
        "prediction_error": (predicted - step_time) / step_time if step_time else np.nan,
        "started": started, "finished": finished, "wall_time": finished - started,
        "recoveries": float(len(summary.get("recoveries", []))),
    }
    texts = {"failure": "", "run_id": uuid.uuid4().hex,
             "kernel_split": json.dumps(summary.get("kernel_split", [])),
             "batch_split": json.dumps(summary.get("batch_split", [])),
             "worker_labels": ", ".join(str(w) for w in summary.get("workers", [])),
             "worker_devices": json.dumps([[w["name"], w["tag"], w["device"]]
                                           for w in summary.get("worker_devices", [])]),
             "recovery_log": json.dumps(summary.get("recoveries", []))}
    series = {"step_time_series": np.asarray(record.step_time.values, dtype=float),
              "loss_series": np.asarray(record.loss.values, dtype=float)}
    return PointResult(values, texts, series)


def predict_only(point: Point, predictor: Predictor) -> PointResult:
    """`mode: predict`: the model's step time, no training."""
    started = time.time()
    predicted = _predict(predictor, point, None)
    finished = time.time()
    if np.isnan(predicted):
        raise RuntimeError("the performance model gave no prediction for this point "
                           "(no probe of its cluster: see CNN_PREDICT_PROBE)")
    return PointResult({"predicted_step_time": predicted, "started": started,
                        "finished": finished, "wall_time": finished - started},
                       {"failure": "", "run_id": uuid.uuid4().hex}, {})


# The sweep --------------------------------------------------------------------------


def contention_warning(sweep: Sweep) -> str | None:
    """One line when points run more threads than this machine has cores."""
    cores = os.cpu_count() or 1
    worst, count = 0, 0
    for point in sweep.points:
        if point.cluster_key is None:
            threads = point.config.reference.threads
        elif point.cluster_key == "external":
            continue  # the workers may be elsewhere; the scheduler knows, we do not
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


def _prepare_store(sweep: Sweep, store: ResultStore, fresh: bool, argv: list[str]) -> None:
    if fresh:
        if store.exists() and not store.is_sweep_store():
            raise StoreMismatch(f"{store.path} is not a sweep results store; --fresh replaces "
                                "only those: choose another --out")
        shutil.rmtree(sweep.runs_dir, ignore_errors=True)
    elif store.exists():
        store.check(sweep.fingerprint, sweep.text)
        if store.is_complete():
            return
    started = now_text()
    attrs = {
        "title": f"sweep {sweep.config.name}", "sweep_name": sweep.config.name,
        "mode": sweep.config.mode, "speedup_baseline": sweep.config.speedup_baseline,
        "config": sweep.text, "config_file": os.path.abspath(sweep.source),
        "fingerprint": sweep.fingerprint, "repeats": sweep.config.repeats,
        "versions": json.dumps(software_versions()), "machine": json.dumps(machine_info()),
        "code_revision": code_revision(), "command": " ".join(argv),
        "started": started, "finished": "", "sessions": "[]",
        "runs_dir": os.path.abspath(sweep.runs_dir),
        "axes": json.dumps({axis.dim: list(axis.fields) for axis in sweep.axes}),
    }
    store.create(build_template(sweep, attrs))


def _point_line(done: int, total: int, elapsed: float, point: Point, result: PointResult | None,
                reason: str | None, seconds: float) -> str:
    eta = elapsed / done * (total - done) if done else 0.0
    head = f"[{done}/{total} {_clock(elapsed)} eta {_clock(eta)}] {point.describe()}"
    if reason is not None:
        return f"{head}  FAILED {reason}"
    values = result.values if result else {}
    if "step_time" not in values:
        predicted = values.get("predicted_step_time", float("nan"))
        return f"{head}  predicted {predicted:.4f} s/step"
    text = (f"{head}  {values['step_time']:.4f} s/step (IQR {values['step_time_p25']:.4f}-"
            f"{values['step_time_p75']:.4f})  {values['throughput']:.0f} samples/s  "
            f"loss {values['loss']:.3f}")
    if not np.isnan(values["accuracy"]):
        text += f"  acc {values['accuracy']:.3f}"
    if not np.isnan(values["predicted_step_time"]):
        text += (f"  predicted {values['predicted_step_time']:.4f} "
                 f"({values['prediction_error']:+.0%})")
    return text + f"  [{seconds:.1f} s]"


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else \
        f"{rest // 60:02d}:{rest % 60:02d}"


def run_sweep(sweep: Sweep, fresh: bool = False, out: TextIO | None = None,
              err: TextIO | None = None, argv: list[str] | None = None) -> int:
    """Run every point not done yet; returns the exit status (see the module doc)."""
    out = out or sys.stdout
    err = err or sys.stderr
    echo = lambda line: tqdm.write(line, file=out)  # noqa: E731 - keeps the bar intact
    store = ResultStore(sweep.store_path)
    predictor = load_predictor()
    with SweepLock(sweep.store_path) as lock:
        if lock.stale_note():
            print(lock.stale_note(), file=err)
        _prepare_store(sweep, store, fresh, argv or sys.argv)
        status = store.status()
        for point in sweep.points:
            if point.skip and status[point.region] != SKIPPED:
                store.write_skipped(point.region, point.skip)
        todo = [p for p in sweep.points if not p.skip and status[p.region] != DONE]
        session = {"started": now_text(), "pid": os.getpid(), "host": os.uname().nodename,
                   "code_revision": code_revision(), "points_run": 0, "interrupted": True}
        skipped = sum(1 for p in sweep.points if p.skip)
        echo(f"sweep {sweep.config.name}: {len(sweep.points)} points, "
             f"{len(sweep.points) - len(todo) - skipped} done before, {len(todo)} to run"
             + (f", {skipped} not applicable" if skipped else "") + f" -> {sweep.store_path}")
        pool = ClusterPool(echo)
        failed, stopped = 0, 0
        begun = time.perf_counter()
        bar = tqdm(total=len(todo), unit="point", desc=sweep.config.name, file=err,
                   disable=None, leave=False, dynamic_ncols=True)
        try:
            for done, point in enumerate(todo, start=1):
                bar.set_postfix_str(point.describe()[:60])
                t0 = time.perf_counter()
                started = time.time()
                result, reason = None, None
                try:
                    if sweep.config.mode == "predict":
                        assert predictor is not None  # checked at load
                        result = predict_only(point, predictor)
                    else:
                        client = pool.client_for(point)
                        result = measure_point(point, client, predictor,
                                               sweep.config.keep_checkpoints)
                except KeyboardInterrupt:
                    raise
                except (Exception, asyncio.CancelledError) as error:  # noqa: BLE001
                    reason = one_line(error)
                    finished = time.time()
                    store.write_failure(point.region, reason,
                                        {"started": started, "finished": finished,
                                         "wall_time": finished - started},
                                        {"run_id": uuid.uuid4().hex})
                    failed += 1
                    if point.cluster_key is not None:
                        pool.discard()
                    if isinstance(error, SchedulerLost) and point.cluster_key == "external":
                        stopped = len(todo) - done
                else:
                    store.write_point(point.region, result)
                    store.refresh_derived()
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
            session["finished"] = now_text()
            sessions = json.loads(store.attrs().get("sessions", "[]")) + [session]
            store.refresh_derived()
            store.set_attrs(finished=session["finished"], sessions=json.dumps(sessions))
    with xr.open_zarr(sweep.store_path) as ds:
        failed_total = int((ds.status == FAILED).sum())
        echo("")
        echo(format_table(summary_table(ds.load())))
    echo(f"\nresults: {sweep.store_path}  (xr.open_zarr; report: python -m experiments.report "
         f"{sweep.store_path})")
    if failed_total:
        echo(f"{failed_total} point(s) failed; their reasons are in the store's `failure` "
             "variable. Run the same command again to retry them.")
        return 1
    return 0


def dry_run(sweep: Sweep, out: TextIO) -> None:
    """Print the points in run order (with the model's predicted time if there is one).

    A dry run runs nothing: a model that would measure the cluster first is asked
    to use only what it measured before (CNN_PREDICT_PROBE=cached, unless set).
    """
    os.environ.setdefault("CNN_PREDICT_PROBE", "cached")
    predictor = load_predictor()
    status = None
    store = ResultStore(sweep.store_path)
    if store.exists():
        try:
            store.check(sweep.fingerprint, sweep.text)
            status = store.status()
        except (StoreMismatch, KeyError):
            status = None
    shape = " x ".join(f"{len(a)} {a.dim}" for a in sweep.axes) or "1 point"
    print(f"sweep {sweep.config.name}: {len(sweep.points)} points ({shape} x "
          f"{sweep.config.repeats} repeat(s)) -> {sweep.store_path}", file=out)
    rows = []
    for number, point in enumerate(sweep.points, start=1):
        cluster = "none" if point.cluster_key is None else (
            "external" if point.cluster_key == "external"
            else f"{len(point.config.cluster.worker_list())} worker(s)")
        row = [str(number), point.describe(), cluster]
        if predictor is not None:
            predicted = _predict(predictor, point, None)
            row.append("-" if np.isnan(predicted) else f"{predicted:.4f} s")
        if status is not None:
            row.append({0: "pending", 1: "done", 2: "failed"}[int(status[point.region])])
        rows.append(row)
    header = ["#", "point", "cluster"] + (["predicted"] if predictor else []) + \
        (["status"] if status is not None else [])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    for row in [header] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip(), file=out)


def check_sweep_paths(sweep: Sweep | ScalingSweep, field: str) -> None:
    """Before anything runs (dry runs too): the store and the points' run directories
    can be written, and each distinct dataset and workspace can be had, so a bad path
    is one line now rather than a traceback, or a failure recorded at every point.
    `field` is what named the store (``--out`` or ``output``)."""
    check_writable_dir(sweep.store_path, field)
    if isinstance(sweep, ScalingSweep):
        return
    checked: set[tuple] = set()
    for point in sweep.points:
        config = point.config
        key = (config.dataset_path, config.data.source, config.workspace.path,
               config.strategy == "reference")
        if key not in checked:
            checked.add(key)
            check_run(config, output_field=field)


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
        return _print_dry_run(dry_run_scaling, sweep)
    return _run_store_guarded(
        lambda: run_scaling_sweep(sweep, args.fresh, argv=["python -m experiments.sweep", *argv]),
        "interrupted: the previous store, if any, is unchanged")


def _print_dry_run(printer: Callable[[Any, Any], None], sweep: Any) -> int:
    try:
        printer(sweep, sys.stdout)
    except BrokenPipeError:  # `... --dry-run | head`
        sys.stdout = open(os.devnull, "w", encoding="utf-8")
    return 0


def _run_store_guarded(run: Callable[[], int], interrupted: str) -> int:
    """Run a sweep, turning store refusals and interruption into exit codes."""
    try:
        return run()
    except StoreMismatch as error:
        return fail(error, CONFIG_ERROR)
    except StoreBusy as error:
        return fail(error, 3)
    except OSError as error:  # the disk, not the input: the store keeps what it has
        return fail(error, RUNTIME_ERROR)
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return 130


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


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
    parser.add_argument("--dry-run", action="store_true", help="print the points, run nothing")
    try:
        # Options and key=value overrides in any order (`cfg --dry-run repeats=2`).
        args = parser.parse_intermixed_args(argv)
        if is_scaling_sweep(args.config, args.overrides):
            return scaling_main(args, argv)
        sweep = load_sweep(args.config, args.overrides, args.scheduler, args.out)
        check_sweep_paths(sweep, "--out" if args.out else "output")
    except (UsageError, ConfigError) as error:
        return fail(error, CONFIG_ERROR)
    if args.dry_run:
        return _print_dry_run(dry_run, sweep)
    warning = contention_warning(sweep) if sweep.config.mode == "measure" else None
    if warning:
        print(warning, file=sys.stderr)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return _run_store_guarded(
            lambda: run_sweep(sweep, args.fresh, argv=["python -m experiments.sweep", *argv]),
            "interrupted: finished points are kept; run the same command again to resume")
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
