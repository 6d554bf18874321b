"""Predicted step time of a run config on this cluster (the sweep's ``predictor``).

:func:`predict_config` is the model proper: a run config plus a probe of the
cluster (:mod:`pipeline.probe`) gives a :class:`~pipeline.costmodel.Prediction`
of the engine's step, access by access (see :mod:`pipeline.costmodel.kernel`):

- ``reference``: the whole network in this process with ``reference.threads``
  threads (each layer timed inside whole steps), plus one batch read (a
  :class:`~pipeline.probe.MasterProbe`);
- ``single``: one worker running the whole step as one task: every layer, the
  dense head, the batch read, and the gap between its queued step tasks;
- ``kernel``: ``P`` workers with the run's split (the split the run recorded, if
  given; else the one its placement would choose) and master, exchanging
  through the workspace as the engine does (see :mod:`pipeline.costmodel.kernel`);
- on an embedded cluster whose workers fill the cores, each of these plus the
  client's share of them (`with_contention`, :mod:`pipeline.costmodel.contention`).

:func:`predict_point` is what the sweep calls after each point (and, with no
summary, in ``mode: predict`` and dry runs).  Without a probe it takes one
from the cache, or measures one, as the policy ``$CNN_PREDICT_PROBE`` says
(pipeline/model_probe.py); ``reference`` is timed in this process, ``never``
included.  Dry runs of a sweep call it too: set ``CNN_PREDICT_PROBE=cached`` there
to measure nothing.
It returns a dict, which converts to ``float`` (the predicted seconds) for
callers that only want the number. A config of ``strategy: auto`` (which never runs
as itself) is predicted as the strategy it would pick on the same probe, that
choice recorded beside it as a run of it records its own.

:func:`predict_run` is what a finished run records: `predict_point` for its own
split and cluster, as ``prediction`` allows, a note in place of a figure where the
model cannot give one (no probe cached, a gap in the model, the scheduler silent
while the model probes); it never fails a finished run.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from distributed import Client

from pipeline.cluster.scheduler_guard import SchedulerSilentThen, guarded
from pipeline.cluster.workers import ClusterWorker, scheduler_address
from pipeline.config.run_config import RunConfig
from pipeline.costmodel import Prediction
from pipeline.costmodel.contention import (UNMEASURED_SHARE, contended_step,
                                          cores_filled, median_task_share)
from pipeline.costmodel.memory import Footprint, element_bytes
from pipeline.records.memory import machine_memory_constants
from pipeline.model_probe import check_probe_environment, probe_for_config, probe_policy
from pipeline.probe import ClusterProbe, DaskProbe, MasterProbe, cached_master_probe, model_network
from pipeline.strategies import strategy_named
from pipeline.strategies.auto import Refusal, choose_strategy
from pipeline.preflight_memory import memory_refusal, memory_refusal_on
from pipeline.strategies.base import network_for
from pipeline.engine.task_steps import median_task_steps

__all__ = ["PointPrediction", "band", "check_probe_environment", "predict_config",
           "predict_point", "predict_run", "prediction_stopped", "network_for",
           "probe_for_config", "probe_policy", "with_contention"]


class PointPrediction(dict):
    """A prediction as a dict (``predicted_step_time``, ``breakdown``, ...).

    ``float(p)`` is the predicted step time, so a caller that expects a number
    (the sweep runner) can take it as one.
    """

    def __float__(self) -> float:
        return float(self["predicted_step_time"])


def predict_config(config: RunConfig, probe: ClusterProbe | MasterProbe,
                   kernel_split: list[list[int]] | None = None,
                   batch_split: list[int] | None = None,
                   task_steps: int | None = None,
                   split_workers: list[str] | None = None) -> Prediction:
    """The model's step for ``config`` on the probed machine (its strategy's
    `predict_run`).

    Parameters
    ----------
    config : RunConfig
        The run (strategy, network, batch, workers used, placement).
    probe : ClusterProbe or MasterProbe
        A cluster probe for the distributed strategies; a master probe with the
        config's thread count for ``reference``.
    kernel_split : list of list of int, optional
        ``kernel``/``single``: the split actually run (``summary["kernel_split"]``);
        default the one the config's placement would choose.
    batch_split : list of int, optional
        ``data``/``hybrid``: the samples each worker got (``summary["batch_split"]``);
        default an even split.
    task_steps : int, optional
        Steps per Dask task the run used (``summary["task_steps_median"]``); default
        the median a run of the config's steps, checkpoints and ``train.steps_per_task``
        will run at the predicted step (`median_task_steps`). The probe's per-task costs
        are shared out over them.
    split_workers : list of str, optional
        The workers the splits' columns are (``summary["split_workers"]``): a run that
        left a probed worker out has no column for it (default: the first probed ones).
    """
    spec = network_for(config)
    if isinstance(probe, ClusterProbe) and (probe.batch != config.train.batch
                                            or probe.network_spec() != spec):
        raise ValueError("the probe was made for another network or batch")
    splits = {"kernel_split": kernel_split, "batch_split": batch_split,
              "split_workers": split_workers}

    def predict(on: ClusterProbe | MasterProbe) -> Prediction:
        prediction = strategy_named(config.strategy).predict_run(
            config, on, model_network(config, spec), splits)
        return with_contention(prediction, on) if isinstance(on, ClusterProbe) else prediction

    prediction = predict(probe)
    if not isinstance(probe, ClusterProbe):
        return prediction
    if task_steps is None:
        train = config.train
        task_steps = median_task_steps(
            strategy_named(config.strategy).steps_per_task(config), prediction.step_time,
            train.steps, train.checkpoint_every, train.inflight, train.warmup_steps)
    if task_steps > 1:
        prediction = predict(per_step_task_costs(probe, task_steps))
    return dataclasses.replace(prediction, details={**prediction.details,
                                                    "task_steps": task_steps})


def per_step_task_costs(probe: ClusterProbe, task_steps: int) -> ClusterProbe:
    """The probe with its per-task Dask costs (the gap between a worker's tasks, the
    client's CPU per task) as a run's median step carries them at `task_steps` steps
    per task (`median_task_share`: all at one, half at two, none at three or more),
    the gap between steps inside a task (`DaskProbe.step_gap_s`) for the rest: the
    probe measured them per task (pipeline/probe/runs.py, `PlanEngines.run`)."""
    share = median_task_share(task_steps)
    dask = probe.dask
    in_task = dask.step_gap_s or 0.0
    dask = dataclasses.replace(dask, task_s=dask.task_s * share + in_task * (1.0 - share),
                               client_cpu_per_task_s=dask.client_cpu_per_task_s * share)
    return dataclasses.replace(probe, dask=dask)


def with_contention(prediction: Prediction, probe: ClusterProbe) -> Prediction:
    """The prediction with the client's share of the cores (pipeline/costmodel/
    contention.py) added as ``breakdown["contention"]``, where the probed cluster's
    scheduler ran in the client's process and the workers the step uses fill the
    cores it had; unchanged otherwise. What is added is the client's CPU per task
    (one task per worker, shared out over the run's steps per task) times the share of
    it that lands on the step: the probe's measurement (`DaskProbe.contention_share`),
    else the bound `UNMEASURED_SHARE`; the details say which (``contention_share``,
    ``contention_share_source``)."""
    compute = prediction.breakdown.get("compute")
    workers = len(compute) if isinstance(compute, list) else 1
    dask = probe.dask
    threads = [w.threads for w in probe.workers[:workers]]
    if not dask.scheduler_here or not cores_filled(threads, dask.host_cores):
        return prediction
    share, source = contention_share(dask)
    step = contended_step(prediction.step_time, workers, dask.client_cpu_per_task_s, share)
    breakdown = {**prediction.breakdown, "contention": step - prediction.step_time}
    details = {**prediction.details, "contention_share": share,
               "contention_share_source": source}
    return dataclasses.replace(prediction, step_time=step, breakdown=breakdown,
                               details=details)


def contention_share(dask: DaskProbe) -> tuple[float, str]:
    """The share of the client's CPU that delays the step, and where it comes from:
    ``"probe"`` (measured on this machine) or ``"bound"`` (the probe could not
    measure it: `UNMEASURED_SHARE`, all of it)."""
    if dask.contention_share is None:
        return UNMEASURED_SHARE, "bound"
    return dask.contention_share, "probe"


def predict_point(config: RunConfig, result_summary: dict | None = None,
                  probe: ClusterProbe | MasterProbe | None = None, *, client: Any = None,
                  offered: Any = None, policy: str | None = None) -> PointPrediction | None:
    """Predicted step of one sweep point, with its breakdown.

    Parameters
    ----------
    config : RunConfig
        The point's run config.
    result_summary : dict, optional
        The run's summary: its ``kernel_split`` is the split predicted, and its
        ``step_time_median`` gives ``prediction_error`` (predicted / measured - 1).
    probe : ClusterProbe or MasterProbe, optional
        Measured constants; default a cached or fresh probe (module doc).
    client, offered : optional
        A live cluster to probe if nothing is cached.
    policy : str, optional
        ``auto``, ``cached`` or ``never`` (module doc); default ``$CNN_PREDICT_PROBE``.

    Returns
    -------
    PointPrediction or None
        ``predicted_step_time`` and its band ``predicted_low``..``predicted_high``
        (:func:`band`), ``breakdown`` (seconds on the critical path:
        ``compute_critical``, ``master``, ``storage``, ``communication``,
        ``overhead``; ``compute`` per worker), ``kernel_split``, ``task_steps``
        (steps per Dask task assumed; None for ``reference``),
        ``probe_key`` and ``probe_age_s`` (seconds since it, or its newest sample,
        was measured), ``probe_samples`` (how many probes its figures are the
        medians of),
        ``constants``, ``contention_share`` and its
        ``contention_share_source`` (``probe`` or ``bound``; None where the client
        had a core of its own) and, with a summary, ``measured_step_time``
        and ``prediction_error``; ``None`` where no probe can be had. For ``auto``,
        the prediction of the strategy it would pick on the probe
        (`pipeline.strategies.auto.choose_strategy`, as a run of it picks), with
        that choice's record as ``strategy_choice`` and the chosen one as
        ``strategy``.
    """
    summary = result_summary or {}
    policy = policy or probe_policy()
    strategy = strategy_named(config.strategy)
    choice = None
    if strategy.chosen_by_model:  # `auto`: predicted as what it would pick on the probe
        if not isinstance(probe, ClusterProbe):
            probe = probe_for_config(config, client, offered, policy)
            if probe is None:
                return None
        config, _chosen, choice = choose_strategy(config, strategy, probe, predict_config,
                                                  auto_refusal(config, probe, client, offered))
    if not strategy_named(config.strategy).uses_cluster:  # timed in this process
        if not isinstance(probe, MasterProbe) or probe.threads != config.reference.threads:
            probe = cached_master_probe(network_for(config), config.train.batch,
                                        config.reference.threads, config.built_dataset(),
                                        measure=policy != "cached",
                                        optimizer=config.optimizer_spec())
            if probe is None:
                return None
    elif not isinstance(probe, ClusterProbe):
        probe = probe_for_config(config, client, offered, policy)
        if probe is None:
            return None
    task_steps = summary.get("task_steps_median")
    prediction = predict_config(config, probe, kernel_split=summary.get("kernel_split"),
                                batch_split=summary.get("batch_split"),
                                task_steps=int(task_steps) if task_steps else None,
                                split_workers=summary.get("split_workers"))
    low, high = band(config, probe, prediction, summary)
    out = PointPrediction(
        strategy=config.strategy, predicted_step_time=prediction.step_time,
        predicted_low=low, predicted_high=high,
        breakdown={k: v for k, v in prediction.breakdown.items()},
        kernel_split=prediction.kernel_counts,
        bytes_moved=prediction.details.get("bytes_moved"),
        task_steps=prediction.details.get("task_steps"), probe_key=probe.key,
        probe_age_s=time.time() - probe.created,
        probe_samples=len(probe.created_times()),
        constants=constants(probe),
        contention_share=prediction.details.get("contention_share"),
        contention_share_source=prediction.details.get("contention_share_source"))
    if choice is not None:
        out["strategy_choice"] = choice
    measured = summary.get("step_time_median")
    if measured:
        out["measured_step_time"] = float(measured)
        out["prediction_error"] = prediction.step_time / float(measured) - 1.0
    return out


def band(config: RunConfig, probe: ClusterProbe | MasterProbe, prediction: Prediction,
         summary: dict) -> tuple[float, float]:
    """How sure the prediction is: its step with every shard and the dense head at the
    lower, then the upper quartile of the steps the probe timed (``probe.at``), the
    split held at the one predicted. The spread of the probe's timings, not the
    model's own error (docs/model.md)."""
    recorded = bool(summary.get("kernel_split") or summary.get("batch_split"))
    kernel_split = summary.get("kernel_split") or prediction.kernel_counts
    batch_split = summary.get("batch_split") or prediction.details.get("batch_shares")
    low, high = (predict_config(config, probe.at(bound), kernel_split=kernel_split,
                                batch_split=batch_split,
                                task_steps=prediction.details.get("task_steps"),
                                split_workers=summary.get("split_workers") if recorded
                                else None).step_time
                 for bound in ("low", "high"))
    return min(low, prediction.step_time), max(high, prediction.step_time)


def constants(probe: ClusterProbe | MasterProbe) -> dict[str, Any]:
    """The probe's headline figures, for recording next to a prediction."""
    if isinstance(probe, MasterProbe):
        return {"threads": probe.threads, "dense_s": probe.dense_s,
                "dataset_read_s": probe.dataset_read_s,
                "conv_s": [t.forward_s + t.backward_s for t in probe.timings]}
    s, d = probe.store, probe.dask
    return {"store_read_bw": s.read_bw, "store_write_bw": s.write_bw,
            "store_read_latency_s": s.read_latency_s, "store_write_latency_s": s.write_latency_s,
            "dataset_read_s": s.dataset_read_s, "task_gap_s": d.task_s, "sync_s": d.sync_s,
            "hop_s": d.hop_s, "client_round_trip_s": d.round_trip_s,
            "client_cpu_per_task_s": d.client_cpu_per_task_s,
            "client_cpu_rate": d.client_cpu_rate, "host_cores": d.host_cores,
            "contention_share": d.contention_share,
            "master_dense_s": probe.master.dense_s,
            "calibration_s_per_kernel": probe.calibration()}


def auto_refusal(config: RunConfig, probe: ClusterProbe, client: Client | None,
                 offered: list[ClusterWorker] | None) -> Refusal | None:
    """The memory check `auto`'s choice makes in a run (`choose_strategy`): on the
    cluster's workers where they are at hand, else on the probe's workers with the
    limits an embedded cluster's config gives them; None where none is known."""
    if client is not None and offered:
        return memory_refusal_on(client, config, offered)
    if scheduler_address(config.cluster) is not None:
        return None
    given = {w.name: w for w in config.cluster.worker_list()}
    known = [given.get(w.name) for w in probe.workers]
    capacities = [float((w.memory_bytes() if w else None) or math.inf) for w in known]
    if all(capacity == math.inf for capacity in capacities):
        return None
    workers = [(p.name, (w.resources or {}) if w else {}, w.device if w else "cpu")
               for p, w in zip(probe.workers, known)]
    constants = machine_memory_constants()
    return lambda candidate: memory_refusal(candidate, workers, capacities, constants)


def predict_memory(config: RunConfig, summary: dict | None = None) -> Footprint | None:
    """The model's peak memory per worker for a run config (docs/model.md, "Memory per
    device"): under the split its run used (`summary`'s split, with its master), else
    the even split over the config's workers; for `auto`, of the strategy the run
    chose (`summary`'s ``strategy_choice``); on this machine's bare processes
    (`machine_memory_constants`). None for a strategy the memory count does not know."""
    strategy = strategy_named(config.strategy)
    choice = (summary or {}).get("strategy_choice")
    if strategy.chosen_by_model and choice:
        config = dataclasses.replace(config, strategy=choice["chosen"])
        strategy = strategy_named(config.strategy)
    if not strategy.memory_model:
        return None
    spec = network_for(config)
    network = model_network(config, spec)
    s = element_bytes(spec.dtype)
    batch, summary = config.train.batch, summary or {}
    constants = machine_memory_constants()
    if not strategy.uses_cluster:  # the training process itself
        return strategy.peak_memory(network, batch, s=s, constants=constants)
    names = summary.get("split_workers") or [
        w.name for w in config.cluster.worker_list()][:config.cluster.use_workers or None]
    names = names[:strategy.devices_used(len(names))]
    master = names.index(summary["master"]) if summary.get("master") in names else 0
    split = (strategy.recorded_split(summary)
             or strategy.even_split(config, spec, len(names))[0])
    devices = {w.name: w.device for w in config.cluster.worker_list()}
    gpu = [devices.get(name, "cpu").startswith("cuda") for name in names]
    return strategy.peak_memory(network, batch, split, s, master, constants, gpu=gpu)


def prediction_stopped(signal_name: str) -> dict[str, Any]:
    """The prediction of a run stopped while the model probed its cluster: none."""
    return {"predicted_step_time": None,
            "prediction_note": f"stopped ({signal_name}) while the model probed the cluster; "
                               "the run's results are complete without its prediction"}


def predict_run(config: RunConfig, split: dict[str, Any], client: Client | None,
                offered: list[ClusterWorker] | None, changed: bool = False
                ) -> dict[str, Any]:
    """The model's step time for this run on its own cluster and links, as
    `config.prediction` allows (pipeline/prediction.py): ``predicted_step_time``
    (None where the model has no probe, with ``prediction_note`` saying why) and the
    probe it came from. A gap in the model never fails a finished run."""
    if config.prediction == "never":
        return {"predicted_step_time": None, "prediction_note": "prediction: never"}
    if client is not None and client.status != "running":  # closed on a silent scheduler
        return {"predicted_step_time": None,
                "prediction_note": "the Dask scheduler stopped answering after the last "
                                   "step; the run's results are complete without its "
                                   "prediction"}
    try:
        with guarded(client, config.cluster.scheduler_timeout, "predicting the run"):
            predicted = predict_point(config, split, client=client, offered=offered,
                                      policy="cached" if changed else config.prediction)
    except SchedulerSilentThen as silent:  # every step is done: the results stand
        return {"predicted_step_time": None,
                "prediction_note": f"the Dask scheduler at {silent.address} stopped "
                                   f"answering while the model probed the cluster "
                                   f"({silent.silent}); the run's results are complete "
                                   "without its prediction"}
    except Exception as error:  # noqa: BLE001 - reported in the summary, not raised
        return {"predicted_step_time": None,
                "prediction_note": f"the model failed: {type(error).__name__}: {error}"}
    if predicted is None:
        return {"predicted_step_time": None,
                "prediction_note": "no probe of this cluster is cached: set prediction: auto "
                                   "to probe it once, or predict it in a sweep"}
    return {"predicted_step_time": predicted["predicted_step_time"],
            "predicted_low": predicted.get("predicted_low"),
            "predicted_high": predicted.get("predicted_high"),
            "prediction_probe": predicted["probe_key"],
            "prediction_probe_age_s": predicted["probe_age_s"],
            "prediction_probe_samples": predicted["probe_samples"],
            "predicted_breakdown": predicted["breakdown"]}
