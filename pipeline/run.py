"""One training run as a library call: ``run_training(config) -> RunResult``.

Loads the dataset (building its store if missing), writes (or resumes from) the
checkpoint every strategy starts from, trains with the config's strategy, scores the
final weights on the test set, and writes the run's record (`record.zarr`,
`summary.json`, `trace.json`, `config.yaml`) to its output directory. The CLI
(`python -m pipeline.train`), the sweep, the tests and a notebook all call it the same
way. What is specific to a strategy, it asks the strategy object
(pipeline/strategies).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import xarray as xr
import yaml
from distributed import Client

from pipeline.engine.checkpointing import prepare_checkpoints
from pipeline.placement.capacity import capacities_explained, worker_capacities
from pipeline.cli import ResultsFirst
from pipeline.cluster.connect import open_jobqueue, open_run_client
from pipeline.cluster.worker_setup import register_setup, workers_set_up
from pipeline.cluster.workers import ClusterWorker, find_workers, live_workers, scheduler_address
from pipeline.config.run_config import RunConfig
from pipeline.engine.dataset import prepare_dataset
from pipeline.engine.step_engine import StepEngine
from pipeline.training.evaluate import test_accuracy
from pipeline.cluster.links import LinkedHosts
from pipeline.training.loop import train_loop
from pipeline.training.outputs import owned_output, refuse_finished_resume
from pipeline.prediction import predict_point
from pipeline.preflight import check_run, fit_even_split
from pipeline.training.recovery import History, split_of, train_with_recovery
from pipeline.probe.machine import machine_identity
from pipeline.records.record import (RunRecorder, code_revision, jsonable, link_attrs,
                                     software_versions)
from pipeline.records.summary import left_out_lines, placement_line, summarize
from pipeline.training.reference import REFERENCE_WORKER, ReferenceTrainer
from pipeline.config.schema import ConfigError, to_dict
from pipeline.cluster.startup import Startup, contention_warning, start_batch, usable_cores
from pipeline.cluster.shared_paths import check_workers_see
from pipeline.records.step_breakdown import compute_error
from pipeline.strategies import Strategy
from pipeline.placement.strategy_choice import choose_strategy
from pipeline.records.trace import ClientEvent, write_trace
from pipeline.cluster.worker_limits import check_worker_limits, worker_constants
from storage import checkpoints
from storage.datasets import DatasetInfo
from storage.labelled import write_dataset_aside
from storage.space import replace_file, writing
from tasks.specs import NetworkSpec
from tasks.worker_state import configure_process


@dataclass
class RunResult:
    """What a finished run hands back (the same is on disk in its output directory)."""

    summary: dict[str, Any]
    record: xr.Dataset
    output_dir: str


def build_engine(client: Client, config: RunConfig, strategy: Strategy, network: NetworkSpec,
                 train_samples: int, offered: list[ClusterWorker]) -> StepEngine:
    """The engine of `strategy` placed on `offered` (at the start, and again after a
    recovery or a join: pipeline/training/recovery.py)."""
    plan = strategy.plan(client, config, network, offered, uuid.uuid4().hex[:8])
    return StepEngine(client, config, network, plan, train_samples)


def plan_attrs(config: RunConfig, strategy: Strategy, engine: StepEngine,
               offered: list[ClusterWorker], client: Client,
               split: dict[str, Any]) -> dict[str, Any]:
    """What the record keeps of how a distributed run was placed (`split`: its split
    as the strategy records it)."""
    placement, workers = engine.plan.placement, engine.workers
    used = {w.name for w in workers}
    left_out = [] if strategy.one_worker else [s.name for s in offered if s.name not in used]
    return {"placement": placement.method,
            **{key: jsonable(value) for key, value in split.items()},
            **strategy.record_attrs(config),
            "master": workers[engine.layout.master].name,
            "workspace_sync": config.workspace.sync,
            "calibration_s_per_kernel": jsonable(placement.calibration),
            **({"placement_choice": jsonable(placement.choice)} if placement.choice else {}),
            # workers the placement gave nothing to do, and one line each on why
            "left_out": jsonable(left_out),
            "left_out_reasons": jsonable(left_out_lines(
                placement.method, left_out, placement.choice, placement.calibration,
                strategy.split_unit)),
            "dashboard": str(client.dashboard_link or ""),
            "split_workers": jsonable([w.name for w in workers])}  # the split's columns


def run_training(config: RunConfig, client: Client | None = None,
                 offered: list[ClusterWorker] | None = None,
                 links: LinkedHosts | None = None) -> RunResult:
    """Run one training as the config says; a client may be passed in (sweeps reuse one),
    with the links its workers sit behind, if any (their byte counters are recorded).

    Everything that can be checked before it starts is checked first
    (`pipeline.preflight.check_run`, which also finds the strategy). The run holds its
    output directory throughout (`pipeline.training.outputs`). What it notices on the way (a
    stale lock taken over, damaged checkpoints passed over) goes to stderr, one line
    each, and into the record's ``notes`` attribute.
    """
    strategy = check_run(config)
    notes: list[str] = []

    def say(line: str) -> None:
        print(line, file=sys.stderr)
        notes.append(line)

    with owned_output(config, say):
        refuse_finished_resume(config)
        return _train(config, strategy, client, offered, links, say, notes)


def _train(config: RunConfig, strategy: Strategy, client: Client | None,
           offered: list[ClusterWorker] | None, links: LinkedHosts | None,
           say: Callable[[str], None], notes: list[str]) -> RunResult:
    started = time.time()
    os.makedirs(config.output_dir, exist_ok=True)
    info = prepare_dataset(config)
    network = config.network_spec(info.image_shape)
    if config.network.classes != info.classes:
        raise ConfigError(f"network.classes: {config.network.classes}, but the dataset has "
                          f"{info.classes} classes")
    if config.train.batch > info.train_samples:
        raise ConfigError(f"train.batch: {config.train.batch} is larger than the "
                          f"{info.train_samples} training samples")
    from_step = prepare_checkpoints(config, network, say)
    attrs: dict[str, Any] = {"name": config.name, "strategy": config.strategy,
                             "config": yaml.safe_dump(to_dict(config), sort_keys=False),
                             "dataset": info.path, "dataset_source": info.source,
                             "versions": jsonable(software_versions()),
                             "machine": machine_identity(),
                             "code_revision": code_revision(), "resumed_from_step": from_step}
    client_events: list[ClientEvent] = []
    history = History()
    split: dict[str, Any] = {}  # the split as the strategy records it (kernel_split, ...)
    startup = Startup(config.name, config.progress)
    finish = ResultsFirst()  # once every step is done, the results are written first
    with finish, ExitStack() as stack:
        if strategy.uses_cluster:
            configure_process(1)  # the client must not fight the workers for cores
            if client is None:
                client, links = stack.enter_context(start_cluster(config, startup, say))
            counted = links.counters() if links is not None else {}
            if offered is None:
                offered = find_workers(client, config.cluster)
            if scheduler_address(config.cluster) is not None:  # workers started elsewhere
                check_workers_see(client, offered, info.path, config.output_dir)
            if strategy.chosen_by_model:  # `auto`: the model's pick on this cluster
                config, strategy, choice = choose_strategy(config, strategy, client, offered)
                attrs.update(strategy=config.strategy, strategy_choice=json.dumps(choice),
                             config=yaml.safe_dump(to_dict(config), sort_keys=False))
                say(f"strategy auto: the model picks {choice['chosen']} (master "
                    f"{choice['master']}), predicted {choice['predicted_step_time']:.4f} s/step")
            check_memory_before_placing(client, config, offered)
            build = functools.partial(build_engine, client, config, strategy, network,
                                      info.train_samples)
            with startup.phase(f"placing the work on {len(offered)} worker(s) (placement: "
                               f"{config.placement})", "placed"):
                engine = build(offered)
            split = split_of(strategy, engine)
            attrs.update(plan_attrs(config, strategy, engine, offered, client, split))
            startup.say(placement_line(engine.plan.placement.method, split,
                                       json.loads(attrs["split_workers"]), attrs["master"],
                                       engine.plan.placement.choice))
            for line in json.loads(attrs["left_out_reasons"]):  # among the start's lines
                say(line)
            workers = engine.workers
            recorder = RunRecorder([w.name for w in workers], [w.label for w in workers],
                                   [w.emulated_speed for w in workers],
                                   tags=[w.resource for w in workers])
        else:
            trainer = ReferenceTrainer(config, network, info.train_samples)
            recorder = RunRecorder([REFERENCE_WORKER],
                                   [f"in-process, {config.reference.threads} thread(s)"], [1.0])
        trace = functools.partial(write_trace, os.path.join(config.output_dir, "trace.json"),
                                  recorder.receipts, client_events, recorder.workers, started)
        try:
            if strategy.uses_cluster:
                history = train_with_recovery(config, client, strategy, engine, offered, build,
                                              recorder, client_events, from_step,
                                              info.train_samples)
            else:
                trainer.start(from_step)
                recorder.devices = list(trainer.devices)
                train_loop(config, trainer, recorder, client_events, from_step,
                           info.train_samples)
                trainer.close()
        except BaseException:
            with contextlib.suppress(OSError):  # the trace so far, if there is room; the
                trace()  # error that stopped the run is the one to report
            raise
        finish.hold()  # every step is done: a stop now waits for the results
        with writing("output directory", config.output_dir):
            trace()
        if strategy.uses_cluster and links is not None:  # before the links go
            attrs.update(link_attrs(config.cluster.workspace_transport() or "sftp", counted,
                                    links.counters()))
        # a cluster that lost or gained a worker is not probed afresh (cached only)
        changed = bool(history.recoveries or history.joins)
        used = {"split_workers": json.loads(attrs["split_workers"])} \
            if "split_workers" in attrs else {}
        prediction = finish.unless_stopped(lambda: predict_run(
            config, {**split, **used, **recorder.task_steps_median(config.train.warmup_steps)},
            client, offered, changed), prediction_stopped)
        accuracy = None
        if config.train.eval_samples:
            samples = min(config.train.eval_samples, info.test_samples)
            weights = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
            accuracy = test_accuracy(network, weights, info.path, samples)
        return _write_results(config, info, attrs, list(split), recorder, history, notes,
                              started, accuracy, prediction, in_client=not strategy.uses_cluster)


def prediction_stopped(signal_name: str) -> dict[str, Any]:
    """The prediction of a run stopped while the model probed its cluster: none."""
    return {"predicted_step_time": None,
            "prediction_note": f"stopped ({signal_name}) while the model probed the cluster; "
                               "the run's results are complete without its prediction"}


def check_memory_before_placing(client: Client, config: RunConfig,
                                offered: list[ClusterWorker]) -> None:
    """On a cluster the user started, refuse (`MemoryRefused`, one line) a run whose
    even split, moved to fit, overflows what some worker may hold, before calibration
    runs shards on it: a worker that calibration pushes past Dask's limit is lost,
    and no resume can help. Peaks are the model's with the workers' own baseline
    (`worker_constants`); the split chosen later is checked again (`fit_memory`)."""
    if scheduler_address(config.cluster) is None:
        return  # embedded: checked before the cluster started (check_embedded_memory)
    capacities = worker_capacities(client, config.cluster, offered)
    if all(c == float("inf") for c in capacities):
        return
    with capacities_explained(config.cluster):
        fit_even_split(config, [(w.name, {w.resource: 1}, w.device) for w in offered],
                       capacities, worker_constants(client, config.cluster, offered))


def predict_run(config: RunConfig, split: dict[str, Any], client: Client | None,
                offered: list[ClusterWorker] | None, changed: bool = False
                ) -> dict[str, Any]:
    """The model's step time for this run on its own cluster and links, as
    `config.prediction` allows (pipeline/prediction.py): ``predicted_step_time``
    (None where the model has no probe, with ``prediction_note`` saying why) and the
    probe it came from. A gap in the model never fails a finished run."""
    if config.prediction == "never":
        return {"predicted_step_time": None, "prediction_note": "prediction: never"}
    try:
        predicted = predict_point(config, split, client=client, offered=offered,
                                  policy="cached" if changed else config.prediction)
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
            "predicted_breakdown": predicted["breakdown"]}


def _write_results(config: RunConfig, info: DatasetInfo, attrs: dict[str, Any],
                   split_keys: list[str], recorder: RunRecorder, history: History,
                   notes: list[str], started: float, accuracy: float | None,
                   prediction: dict[str, Any], in_client: bool) -> RunResult:
    """The record, the summary and the config, written to the output directory
    (`in_client`: the run trained in this process, as `reference` does)."""
    attrs["checkpoint_time_s"] = recorder.checkpoint_s
    changes = history.as_json()  # recoveries, joins
    attrs.update({key: jsonable(value) for key, value in changes.items()})
    attrs["notes"] = json.dumps(notes)
    attrs.update({"started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
                  "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
                  "batch": config.train.batch, "inflight": config.train.inflight})
    record = recorder.to_dataset(attrs)
    summary = summarize(record, config.train.warmup_steps, config.train.batch, in_client)
    summary.update({"test_accuracy": accuracy,
                    "test_samples": min(config.train.eval_samples, info.test_samples),
                    "strategy": config.strategy, "workers": list(record.worker_label.values),
                    "worker_devices": [
                        {"name": str(name), "tag": str(tag), "device": str(device)}
                        for name, tag, device in zip(record.worker.values,
                                                     record.resource_tag.values,
                                                     record.device.values)]})
    for key in split_keys:
        summary[key] = json.loads(attrs[key])
    if "strategy_choice" in attrs:
        summary["strategy_choice"] = json.loads(attrs["strategy_choice"])
    if "link_bytes_sent" in attrs:  # a linked cluster's (run_training's `links`)
        summary["workspace_transport"] = attrs["workspace_transport"]
        for key in ("link_bytes_received", "link_bytes_sent"):
            summary[key] = json.loads(attrs[key])
    if "master" in attrs:
        summary["master"] = attrs["master"]
        summary["split_workers"] = json.loads(attrs["split_workers"])
        summary["left_out"] = json.loads(attrs["left_out_reasons"])
    summary.update(changes)
    predicted, measured = prediction["predicted_step_time"], summary.get("step_time_median")
    if predicted is not None and measured:
        prediction["prediction_error"] = predicted / measured - 1.0
        prediction["compute_error"] = compute_error(prediction.get("predicted_breakdown"),
                                                    summary.get("critical_breakdown"))
    summary.update(prediction)
    record.attrs["test_accuracy"] = -1.0 if accuracy is None else accuracy
    record.attrs["prediction"] = jsonable(prediction)
    if predicted is not None:
        record.attrs["predicted_step_time"] = float(predicted)
    with writing("output directory", config.output_dir):
        write_dataset_aside(record, os.path.join(config.output_dir, "record.zarr"))
        replace_file(os.path.join(config.output_dir, "summary.json"),
                     json.dumps(summary, indent=2, default=str))
        replace_file(os.path.join(config.output_dir, "config.yaml"),
                     yaml.safe_dump(to_dict(config), sort_keys=False))
    return RunResult(summary, record, config.output_dir)


@contextlib.contextmanager
def start_cluster(config: RunConfig, startup: Startup, say: Callable[[str], None]
                  ) -> Iterator[tuple[Client, LinkedHosts | None]]:
    """A client to the run's own cluster (the embedded one, or `cluster.scheduler`'s),
    its workers set up, and the links they sit behind (None without `cluster.link`).
    Before starting embedded workers, warns when they outnumber the cores
    (`contention_warning`); while they start, tells `startup` how many are up."""
    with contextlib.ExitStack() as stack:
        jobqueue = config.cluster.jobqueue
        if jobqueue is not None:  # batch jobs: the phase counts them, with the queue's word
            jobs = jobqueue.job_count()
            with startup.phase(f"starting {jobs} {jobqueue.system} job(s) for the workers",
                               f"{jobs} worker(s) up") as phase:
                client = stack.enter_context(open_jobqueue(config.cluster, phase.update))
                register_setup(client, config.cluster)
            yield client, None
            return
        if scheduler_address(config.cluster) is not None:
            client, links = stack.enter_context(open_run_client(
                config.cluster, config.shared_directories()))
            check_worker_limits(client, config.cluster, live_workers(client))
            stack.enter_context(workers_set_up(client, config.cluster))
            yield client, links
            return
        workers = config.cluster.worker_list()
        warning = contention_warning(workers, usable_cores())
        if warning:
            say(warning)
        with startup.phase(f"starting {len(workers)} worker(s) on this machine",
                           f"{len(workers)} worker(s) up") as phase:
            client, links = stack.enter_context(open_run_client(
                config.cluster, config.shared_directories(), phase.update,
                start_batch(len(workers), usable_cores())))
            register_setup(client, config.cluster)  # goes with the embedded cluster
        yield client, links
