"""One training run as a library call: ``run_training(config) -> RunResult``.

Checks the config once, loads the dataset (building its store if missing), writes
(or resumes from) the checkpoint every strategy starts from, trains with the config's
strategy, scores the final weights on the test set, and writes the run's record
(`record.zarr`, `summary.json`, `trace.json`, `config.yaml`) to its output directory.
The CLI (`python -m pipeline.train`), the sweep, the tests and a notebook all call it
the same way. What is specific to a strategy, it asks the strategy object
(pipeline/strategies); the one fork is at the top of `_train`: a strategy trains on
the cluster's workers (`_train_on_cluster`) or in this process (`_train_in_process`,
``reference``), and both hand the same `Trained` to the results.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import yaml
from distributed import Client

from pipeline.cli import ResultsFirst
from pipeline.cluster.workers import (ClusterWorker, SchedulerLost, WorkerLost, find_workers,
                                      scheduler_address, started_elsewhere)
from pipeline.cluster.links import LinkedHosts
from pipeline.cluster.shared_paths import check_workers_code, check_workers_see
from pipeline.cluster.scheduler_guard import guarded
from pipeline.cluster.shared_use import SharedUseWatch
from pipeline.cluster.startup import Startup, start_cluster
from pipeline.cluster.worker_limits import worker_constants
from pipeline.config.run_config import RunConfig
from pipeline.config.schema import to_dict
from pipeline.engine.checkpointing import prepare_checkpoints
from pipeline.engine.dataset import check_dataset_fits, prepare_dataset
from pipeline.engine.step_engine import StepEngine
from pipeline.placement.capacity import capacities_explained, worker_capacities
from pipeline.prediction import (predict_config, predict_run, prediction_stopped,
                                 probe_for_config)
from pipeline.preflight import check_before_start, check_run
from pipeline.preflight_memory import fit_even_split, memory_refusal_on
from pipeline.probe.machine import machine_identity, worker_machines
from pipeline.records.record import (RunRecorder, code_revision, jsonable, link_attrs,
                                     software_versions)
from pipeline.records.starts import EarlierRecord, read_earlier
from pipeline.records.summary import left_out_lines, placement_line
from pipeline.records.trace import ClientEvent, write_trace
from pipeline.strategies import arithmetic_settings
from pipeline.strategies.base import Strategy
from pipeline.strategies.auto import choice_words, choose_strategy
from pipeline.training.evaluate import accuracy_or_why
from pipeline.training.loop import train_loop
from pipeline.training.outputs import (RunResult, owned_output, refuse_finished_resume,
                                       write_results)
from pipeline.training.recovery import (History, build_engine, split_of, survivors,
                                        train_with_recovery)
from pipeline.training.reference import REFERENCE_WORKER, ReferenceTrainer
from storage import checkpoints
from storage.datasets.store import DatasetInfo
from storage.space import writing
from tasks.specs import NetworkSpec
from tasks.worker_state import configure_process


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
                strategy.split_unit, [s.name for s in offered], placement.counts)),
            "dashboard": str(client.dashboard_link or ""),
            "split_workers": jsonable([w.name for w in workers]),  # the split's columns
            "worker_machines": jsonable(worker_machines(client, workers))}  # as each says


def run_training(config: RunConfig, client: Client | None = None,
                 offered: list[ClusterWorker] | None = None,
                 links: LinkedHosts | None = None) -> RunResult:
    """Run one training as the config says; a client may be passed in (sweeps reuse one),
    with the links its workers sit behind, if any (their byte counters are recorded).

    Everything that can be checked before it starts is checked first, once
    (`pipeline.preflight.check_before_start`, which also finds the strategy; with a
    client passed in, the config's own workers are not the run's, so only
    `check_run`). The run holds its output directory throughout
    (`pipeline.training.outputs`). What it notices on the way (a stale lock taken over,
    damaged checkpoints passed over) goes to stderr, one line each, and into the
    record's ``notes`` attribute.
    """
    strategy = check_run(config) if client is not None else check_before_start(config)
    notes: list[str] = []

    def say(line: str) -> None:
        print(line, file=sys.stderr)
        notes.append(line)

    with owned_output(config, say):
        refuse_finished_resume(config)
        return _train(config, strategy, client, offered, links, say, notes)


@dataclass
class Start:
    """What a run has before its strategy trains: the dataset, the network, the step it
    starts from (its checkpoint written or found), and what its record keeps."""

    started: float  # the run's start (time.time())
    info: DatasetInfo
    network: NetworkSpec
    from_step: int
    attrs: dict[str, Any]  # the record's attributes; the placement adds its own
    client_events: list[ClientEvent]  # the trace's client-side events
    say: Callable[[str], None]  # one line to stderr and the record's notes
    notes: list[str]  # the lines `say` said
    earlier: EarlierRecord | None = None  # a resumed run's steps of its earlier starts


@dataclass
class Trained:
    """A run whose steps are all done, and what the results need of how it ran."""

    config: RunConfig  # the config it ran (`auto`'s: the chosen strategy's)
    recorder: RunRecorder
    history: History = field(default_factory=History)
    split: dict[str, Any] = field(default_factory=dict)  # as the strategy records it
    client: Client | None = None
    offered: list[ClusterWorker] | None = None
    links: LinkedHosts | None = None  # the links the workers sat behind,
    counted: dict[str, Any] = field(default_factory=dict)  # and their counters at start
    in_client: bool = False  # trained in this process (`reference`)


def _train(config: RunConfig, strategy: Strategy, client: Client | None,
           offered: list[ClusterWorker] | None, links: LinkedHosts | None,
           say: Callable[[str], None], notes: list[str]) -> RunResult:
    """The run, top to bottom: prepare, train (on the cluster, or in this process for
    a strategy that uses none), then the results."""
    start = _prepare(config, say, notes)
    finish = ResultsFirst()  # once every step is done, the results are written first
    with finish, ExitStack() as stack:
        if strategy.uses_cluster:
            trained = _train_on_cluster(config, strategy, start, client, offered, links, stack)
        else:
            trained = _train_in_process(config, start, client, offered)
        finish.hold()  # every step is done: a stop now waits for the results
        with writing("output directory", config.output_dir):
            _write_trace(trained.config, trained.recorder, start)
        return _finish(trained, start, finish, notes)


def _prepare(config: RunConfig, say: Callable[[str], None], notes: list[str]) -> Start:
    """The dataset (built if missing) and the checkpoint every strategy starts from
    (written, or found for a resume), checked against the config; for a resume, the
    record of the run's earlier starts (read now: one it cannot read is refused before
    any training)."""
    started = time.time()
    os.makedirs(config.output_dir, exist_ok=True)
    info = prepare_dataset(config, say)
    network = config.network_spec(info.image_shape)
    check_dataset_fits(config, info.classes, info.train_samples)
    from_step = prepare_checkpoints(config, network, say, arithmetic_settings, info)
    attrs: dict[str, Any] = {"name": config.name, "strategy": config.strategy,
                             "config": yaml.safe_dump(to_dict(config), sort_keys=False),
                             "dataset": info.path, "dataset_source": info.source,
                             "versions": jsonable(software_versions()),
                             "machine": machine_identity(),
                             "code_revision": code_revision(), "resumed_from_step": from_step}
    earlier = read_earlier(config.output_dir, from_step, say) if config.train.resume else None
    return Start(started, info, network, from_step, attrs, [], say, notes, earlier)


def _train_in_process(config: RunConfig, start: Start, client: Client | None,
                      offered: list[ClusterWorker] | None) -> Trained:
    """Train in this process with plain PyTorch (`reference`)."""
    trainer = ReferenceTrainer(config, start.network, start.info.train_samples)
    recorder = RunRecorder([REFERENCE_WORKER],
                           [f"in-process, {config.reference.threads} thread(s)"], [1.0])
    trained = Trained(config, recorder, client=client, offered=offered, in_client=True)
    with _kept_if_stopped(trained, start):
        trainer.start(start.from_step)
        recorder.devices = list(trainer.devices)
        train_loop(config, trainer, recorder, start.client_events, start.from_step,
                   start.info.train_samples)
        trainer.close()
    return trained


def _train_on_cluster(config: RunConfig, strategy: Strategy, start: Start,
                      client: Client | None, offered: list[ClusterWorker] | None,
                      links: LinkedHosts | None, stack: ExitStack) -> Trained:
    """Train on the workers of `client` (else of the run's own cluster, started and
    kept open on `stack`): `auto` resolved, the work placed, lost workers recovered."""
    configure_process(1)  # the client must not fight the workers for cores
    startup = Startup(config.name, config.progress)
    if client is None:
        client, links = stack.enter_context(start_cluster(config, startup, start.say,
                                                           strategy.one_worker))
    counted = links.counters() if links is not None else {}
    with guarded(client, config.cluster.scheduler_timeout, "placing the work"):
        if offered is None:
            offered = find_workers(client, config.cluster)
        if started_elsewhere(config.cluster):  # by hand, or batch jobs
            check_workers_see(client, offered, start.info.path, config.output_dir)
            check_workers_code(client, offered)
        config, strategy, engine, split, offered = _placed_surviving(
            config, strategy, start, client, offered, startup)
        shared_use = SharedUseWatch(client, config.cluster, start.say)
        shared_use.check("as the run starts")
    workers = engine.workers
    recorder = RunRecorder([w.name for w in workers], [w.label for w in workers],
                           [w.emulated_speed for w in workers],
                           tags=[w.resource for w in workers])
    trained = Trained(config, recorder, History(), split, client, offered, links, counted)
    with _kept_if_stopped(trained, start):
        train_with_recovery(config, client, strategy, start.network, engine, offered,
                            recorder, start.client_events, start.from_step,
                            start.info.train_samples, trained.history, shared_use)
    if scheduler_address(config.cluster) is not None:  # only a cluster the user started
        # every step is done: a lost or silent scheduler costs this line only (the
        # prediction's note says so)
        with contextlib.suppress(Exception), guarded(
                client, config.cluster.scheduler_timeout, "asking for other clients"):
            shared_use.check("as its steps ended")
    return trained


def _placed_surviving(config: RunConfig, strategy: Strategy, start: Start, client: Client,
                      offered: list[ClusterWorker], startup: Startup
                      ) -> tuple[RunConfig, Strategy, StepEngine, dict[str, Any],
                                 list[ClusterWorker]]:
    """`auto` resolved, the memory checked and the work placed over `offered`; where a
    worker is lost meanwhile (killed, or frozen: the calibration is stall-watched),
    all of it again over the survivors, as often as `train.max_recoveries` allows.
    Returns the config and strategy chosen, the engine, its split and its workers."""
    replaced = 0
    while True:
        try:
            chosen, chosen_strategy = config, strategy
            if strategy.chosen_by_model:  # `auto`: the model's pick on this cluster
                chosen, chosen_strategy = _resolve_auto(config, strategy, client, offered, start)
            check_memory_before_placing(client, chosen, offered)
            engine, split = _place(chosen, chosen_strategy, start, client, offered, startup)
            offered = startup.placed(chosen_strategy, engine.workers, offered)  # jobs left idle
            return chosen, chosen_strategy, engine, split, offered
        except WorkerLost as lost:
            if replaced >= config.train.max_recoveries:
                raise
            replaced += 1
            offered = survivors(client, offered, lost)
            if not offered:
                raise lost.reworded(f"{lost}, and no worker of the run is left to place "
                                    "its work on") from None
            start.say(f"warning: {lost}; placing the work again over {len(offered)} "
                      "worker(s)")


def _resolve_auto(config: RunConfig, auto: Strategy, client: Client,
                  offered: list[ClusterWorker], start: Start) -> tuple[RunConfig, Strategy]:
    """The config and strategy the model picks for `auto` on this cluster, recorded and
    said."""
    probe = probe_for_config(config, client, offered, policy="auto")
    config, strategy, choice = choose_strategy(config, auto, probe, predict_config,
                                               memory_refusal_on(client, config, offered))
    start.attrs.update(strategy=config.strategy, strategy_choice=json.dumps(choice),
                       config=yaml.safe_dump(to_dict(config), sort_keys=False))
    start.say(f"strategy auto: {choice_words(choice)}")
    return config, strategy


def _place(config: RunConfig, strategy: Strategy, start: Start, client: Client,
           offered: list[ClusterWorker], startup: Startup
           ) -> tuple[StepEngine, dict[str, Any]]:
    """The first engine, placed on `offered`, and its split as the strategy records it;
    the placement goes into the record and the start's lines."""
    with startup.phase(f"placing the work on {len(offered)} worker(s) (placement: "
                       f"{config.placement})", "placed"):
        engine = build_engine(client, config, strategy, start.network,
                              start.info.train_samples, offered)
    split = split_of(strategy, engine)
    attrs = start.attrs
    attrs.update(plan_attrs(config, strategy, engine, offered, client, split))
    startup.say(placement_line(engine.plan.placement.method, split,
                               json.loads(attrs["split_workers"]), attrs["master"],
                               engine.plan.placement.choice))
    for line in json.loads(attrs["left_out_reasons"]):  # among the start's lines
        start.say(line)
    return engine, split


def _write_trace(config: RunConfig, recorder: RunRecorder, start: Start) -> None:
    """The run's `trace.json`: its tasks' receipts and the client's events."""
    write_trace(os.path.join(config.output_dir, "trace.json"), recorder.receipts,
                start.client_events, recorder.workers, start.started)


@contextlib.contextmanager
def _kept_if_stopped(trained: Trained, start: Start) -> Iterator[None]:
    """Around a run's steps: a run stopped by an error keeps its trace so far, if there
    is room (the error that stopped it is the one to report). One stopped by a signal
    (Ctrl-C, SIGTERM, SIGHUP), by losing workers it cannot go on without (none left, as
    when batch jobs reach their walltime together; or `train.max_recoveries` used up)
    or its scheduler, also writes its record and summary over the steps it ran, with the
    earlier starts' (`write_results`), so that its resume keeps what it measured; a
    write that fails is said in one line and the stop goes on."""
    try:
        yield
    except (KeyboardInterrupt, WorkerLost, SchedulerLost) as stop:
        with contextlib.suppress(OSError):
            _write_trace(trained.config, trained.recorder, start)
        ended = ("workers lost" if isinstance(stop, WorkerLost)
                 else "scheduler lost" if isinstance(stop, SchedulerLost)
                 else getattr(stop, "name", "KeyboardInterrupt"))
        try:
            _write_stopped(trained, start, ended)
        except Exception as error:  # noqa: BLE001 - the stop is what to report
            print(f"warning: the record of the steps before the stop was not written: "
                  f"{type(error).__name__}: {error}", file=sys.stderr)
        raise
    except BaseException:
        with contextlib.suppress(OSError):
            _write_trace(trained.config, trained.recorder, start)
        raise


def _write_stopped(trained: Trained, start: Start, signal_name: str) -> None:
    """The results of a start stopped by `signal_name` (or "workers lost") before its
    last step: its record and summary over the steps it ran (none: nothing is
    written), without a test accuracy or a prediction (neither is made on a stop)."""
    if not trained.recorder.steps:
        return
    write_results(trained.config, start.info, start.attrs, list(trained.split),
                  trained.recorder, trained.history, start.notes, start.started, None,
                  {"predicted_step_time": None,
                   "prediction_note": f"stopped ({signal_name}) before the last step"},
                  in_client=trained.in_client, earlier=start.earlier, ended=signal_name)


def _finish(trained: Trained, start: Start, finish: ResultsFirst,
            notes: list[str]) -> RunResult:
    """The results of a run whose steps are done: its links' bytes, the model's
    prediction, the test accuracy, and the record and summary written."""
    config, recorder, attrs = trained.config, trained.recorder, start.attrs
    if trained.links is not None:  # before the links go
        attrs.update(link_attrs(config.cluster.workspace_transport() or "sftp",
                                trained.counted, trained.links.counters()))
    # a cluster that lost or gained a worker is not probed afresh (cached only)
    changed = bool(trained.history.recoveries or trained.history.joins)
    used = {"split_workers": json.loads(attrs["split_workers"])} \
        if "split_workers" in attrs else {}
    prediction = finish.unless_stopped(lambda: predict_run(
        config, {**trained.split, **used,
                 **recorder.task_steps_median(config.train.warmup_steps)},
        trained.client, trained.offered, changed), prediction_stopped)
    accuracy = None
    if config.train.eval_samples:
        samples = min(config.train.eval_samples, start.info.test_samples)
        weights = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
        accuracy, why = accuracy_or_why(start.network, weights, start.info.path, samples,
                                        identity=start.info.identity)
        if why:
            start.say(f"warning: {why}")
    return write_results(config, start.info, attrs, list(trained.split), recorder,
                         trained.history, notes, start.started, accuracy, prediction,
                         in_client=trained.in_client, earlier=start.earlier)


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
