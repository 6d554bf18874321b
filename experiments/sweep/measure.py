"""One point of a measured sweep: train it (or only predict it) into the store's figures.

`measure_point` trains the point's run config on the client it is given and turns
the run's summary and record into a `PointResult`: the timing figures, the time
breakdown, the point's `capacity`, the model's prediction, the splits and the
per-step series. `predict_only` is `mode: predict` (the model alone), and
`predicted_step_time` asks the model (the sweep's predictor) for a point.

Why here and not in the run loop (:mod:`experiments.sweep.run`): what a point's
figures mean is decided once, in this mapping from a run's summary to the store's
variables (:mod:`experiments.sweep.store_layout` describes them), whatever runs the points.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import shutil
import time
import uuid
from typing import Any, Callable

import numpy as np
import xarray as xr

from experiments.sweep.results import PointResult
from experiments.sweep.store_layout import PREDICTED_COMPONENTS
from experiments.sweep.points import Point
from pipeline.prediction import predict_memory, probe_policy
from pipeline.run import run_training
from pipeline.records.step_breakdown import model_breakdown

Predictor = Callable[[Any, "dict | None"], "float | None"]


def predicted_step_time(predictor: Predictor | None, point: Point, summary: dict | None,
                        client: Any = None) -> float:
    """The model's step time for the point (NaN where it has none)."""
    return prediction_band(predictor, point, summary, client)[0]


def prediction_band(predictor: Predictor | None, point: Point, summary: dict | None,
                    client: Any = None) -> tuple[float, float, float]:
    """The model's step time for the point and its band ``(step, low, high)``: NaN
    where it has none (the band too where the predictor gives a bare number).

    A live client is handed on when the model takes one, so that a model which
    probes the cluster uses the one already running instead of starting another.
    """
    nan = float("nan")
    if predictor is None:
        return nan, nan, nan
    try:
        value = ask_predictor(predictor, point, summary, client)
    except Exception:  # noqa: BLE001 - a model's gap must not fail a measured point
        return nan, nan, nan
    return band_of(value)


def ask_predictor(predictor: Predictor, point: Point, summary: dict | None,
                  client: Any = None) -> Any:
    """What `predictor` gives for the point (a number, a dict or None); its errors
    pass to the caller. A live client is handed on when the model takes one."""
    kwargs = {}
    if client is not None and "client" in inspect.signature(predictor).parameters:
        kwargs["client"] = client
    return predictor(point.config, summary, **kwargs)


def band_of(value: Any) -> tuple[float, float, float]:
    """A predictor's answer as ``(step, low, high)``, NaN where it has none (the band
    too where it is a bare number)."""
    nan = float("nan")
    try:
        step = nan if value is None else float(value)
    except (TypeError, ValueError):
        return nan, nan, nan
    band = value if isinstance(value, dict) else {}
    return step, float(band.get("predicted_low", nan)), float(band.get("predicted_high", nan))


def predicted_peak_memory(point: Point, summary: dict | None) -> float:
    """The model's largest peak memory of a worker (bytes) under the point's split
    (the run's, else even); NaN where it has none."""
    try:
        footprint = predict_memory(point.config, summary)
    except Exception:  # noqa: BLE001 - a model's gap must not fail a measured point
        return float("nan")
    return float("nan") if footprint is None else footprint.largest


def run_prediction_policy(point: Point) -> str:
    """The sweep's probe policy (``$CNN_PREDICT_PROBE``) as the point's run's
    `prediction`: ``never`` probes no cluster, but a run in this process
    (`reference`) still times itself, as it always has in sweeps."""
    policy = probe_policy()
    if policy == "never":
        return "cached" if point.strategy.uses_cluster else "auto"
    return policy


def capacity(point: Point, record: xr.Dataset) -> float:
    """What the point was given to run on: the threads of a strategy that trains in
    this process (`reference`), else the summed relative speed of its workers, those
    the placement left out included (a device left idle still counts against the
    point's efficiency)."""
    if not point.strategy.uses_cluster:
        return float(point.config.reference.threads)
    speeds = {w.name: w.speed for w in point.config.cluster.worker_list()}
    idle = json.loads(record.attrs.get("left_out", "[]"))
    return float(record.emulated_speed.sum()) + sum(speeds.get(name, 1.0) for name in idle)


def offered_workers(record: xr.Dataset) -> float:
    """How many workers the point was given: those it used and those its placement
    left idle, so that two equal workers stay equal when a loaded calibration leaves
    one out."""
    return float(record.sizes["worker"] + len(json.loads(record.attrs.get("left_out", "[]"))))


class SetupNotMeasured(RuntimeError):
    """A point whose run lost workers and, recovering from checkpoint 0, ran every step
    on the survivors: its figures are of fewer workers than the point's, so they are
    not stored as the point's (the point fails, and the same command runs it again)."""

    def __init__(self, recoveries: list[dict]) -> None:
        last = recoveries[-1] if recoveries else {}
        lost = ", ".join(last.get("lost_workers", [])) or "workers"
        on = ", ".join(last.get("workers", [])) or "the survivors"
        super().__init__(f"{lost} lost at step {last.get('lost_at_step', '?')}, and the run "
                         f"recovered from checkpoint {last.get('restored_step', 0)}: every "
                         f"step ran on {on}, not on the point's workers, so none is stored "
                         "as the point's (the run's directory keeps them)")


def measure_point(point: Point, client: Any, keep_checkpoints: bool) -> PointResult:
    """Train the point's config and turn its summary into the store's figures; the
    run records the model's prediction for itself, under the sweep's probe policy."""
    # The point's own directory: what an earlier, failed or interrupted attempt left
    # there is replaced, under the run's lock (the sweep never resumes a point).
    config = dataclasses.replace(
        point.config, train=dataclasses.replace(point.config.train, fresh=True, resume=False),
        prediction=run_prediction_policy(point))
    started = time.time()
    result = run_training(config, client=client)
    finished = time.time()
    summary, record = result.summary, result.record
    if not keep_checkpoints:
        shutil.rmtree(config.checkpoint_path, ignore_errors=True)
    if summary.get("placed_setup_unmeasured"):
        raise SetupNotMeasured(summary.get("recoveries") or [])
    step_time = summary["step_time_median"]
    predicted, low, high = (float("nan") if summary.get(key) is None else float(summary[key])
                            for key in ("predicted_step_time", "predicted_low",
                                        "predicted_high"))
    accuracy = summary.get("test_accuracy")
    values = {
        "step_time": step_time, "step_time_p25": summary["step_time_p25"],
        "step_time_p75": summary["step_time_p75"], "step_time_min": summary["step_time_min"],
        "step_time_max": summary["step_time_max"], "throughput": summary["throughput"],
        "compute_time": summary["compute_time_median"],
        "storage_time": summary["storage_time_median"],
        "master_time": summary["master_time_median"],
        "wait_time": summary["wait_time_median"], "bytes_moved": summary["bytes_per_step"],
        "client_cpu_per_step": summary.get("client_cpu_per_step", np.nan),
        "task_steps": summary.get("task_steps_median", np.nan),
        "loss": summary["final_loss"],
        "accuracy": float("nan") if accuracy is None else float(accuracy),
        "n_workers": float(record.sizes["worker"]),
        "offered_workers": offered_workers(record),
        "capacity": capacity(point, record),
        "measured_steps": float(summary["measured_steps"]),
        "predicted_step_time": predicted,
        "prediction_error": (predicted - step_time) / step_time if step_time else np.nan,
        "predicted_low": low, "predicted_high": high,
        "started": started, "finished": finished, "wall_time": finished - started,
        "recoveries": float(len(summary.get("recoveries", []))),
        **{f"critical_{part}": seconds for part, seconds in
           summary["critical_breakdown"].items()},
        **{f"predicted_{part}": seconds for part, seconds in
           model_breakdown(summary.get("predicted_breakdown")).items()
           if part in PREDICTED_COMPONENTS},
        "compute_error": (np.nan if summary.get("compute_error") is None
                          else float(summary["compute_error"])),
        "predicted_peak_memory": predicted_peak_memory(point, summary),
        **memory_values(summary),
    }
    texts = {"failure": "", "run_id": uuid.uuid4().hex,
             "kernel_split": json.dumps(summary.get("kernel_split", [])),
             "batch_split": json.dumps(summary.get("batch_split", [])),
             "worker_labels": ", ".join(str(w) for w in summary.get("workers", [])),
             "worker_devices": json.dumps([[w["name"], w["tag"], w["device"]]
                                           for w in summary.get("worker_devices", [])]),
             "worker_machines": json.dumps(summary.get("worker_machines", {})),
             "recovery_log": json.dumps(summary.get("recoveries", [])),
             "memory_per_worker": json.dumps({
                 name: [peak, summary["memory_working"][name]]
                 for name, peak in summary.get("memory_peak", {}).items()}),
             "strategy_choice": json.dumps(summary["strategy_choice"])
             if summary.get("strategy_choice") else ""}
    series = {"step_time_series": np.asarray(record.step_time.values, dtype=float),
              "loss_series": np.asarray(record.loss.values, dtype=float)}
    return PointResult(values, texts, series)


def memory_values(summary: dict) -> dict[str, float]:
    """The point's memory figures: its fullest worker's peak and working memory, and the
    client's (NaN where the run measured none)."""
    def most(values: dict) -> float:
        known = [v for v in (values or {}).values() if v is not None]
        return float(max(known)) if known else float("nan")

    client = summary.get("client_memory_peak")
    return {"memory_peak": most(summary.get("memory_peak", {})),
            "memory_working": most(summary.get("memory_working", {})),
            "client_memory_peak": float("nan") if client is None else float(client)}


def predict_only(point: Point, predictor: Predictor) -> PointResult:
    """`mode: predict`: the model's step time, no training. An error of the model
    is the point's failure, in its own words (no measured figure to keep here); an
    `auto` point is its choice's prediction, the choice stored in ``strategy_choice``
    as a measured sweep stores the run's."""
    started = time.time()
    value = ask_predictor(predictor, point, None)
    predicted, low, high = band_of(value)
    finished = time.time()
    if np.isnan(predicted):
        raise RuntimeError("the performance model gave no prediction for this point (no "
                           "probe of its cluster: see CNN_PREDICT_PROBE)")
    choice = value.get("strategy_choice") if isinstance(value, dict) else None
    summary = {"strategy_choice": choice} if choice else None
    return PointResult({"predicted_step_time": predicted, "predicted_low": low,
                        "predicted_high": high,
                        "predicted_peak_memory": predicted_peak_memory(point, summary),
                        "started": started,
                        "finished": finished, "wall_time": finished - started},
                       {"failure": "", "run_id": uuid.uuid4().hex,
                        "strategy_choice": json.dumps(choice) if choice else ""}, {})
