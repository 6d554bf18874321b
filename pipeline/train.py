"""One training run: ``python -m pipeline.train CONFIG [--scheduler ADDR] [--fresh] [k=v ...]``.

Loads and validates the config, makes sure the dataset store exists, writes (or
resumes from) the checkpoint that every strategy starts from, trains with the chosen
strategy, scores the final weights on the test set, and writes the run's record
(`record.zarr`, `summary.json`, `trace.json`, `config.yaml`) to its output directory.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable

import xarray as xr
import yaml
from distributed import Client

from pipeline.calibrate import choose_batch_shares, choose_placement
from pipeline.checkpointing import CheckpointError, prepare_checkpoints
from pipeline.cli import (CONFIG_ERROR, IN_USE, RUNTIME_ERROR, OneLineParser, UsageError,
                          fail, quiet_dask)
from pipeline.cluster import (ClusterError, SchedulerLost, WorkerLost, WorkerSlot, add_master,
                              find_workers, open_client, register_setup)
from pipeline.config import RunConfig, load_run_config
from pipeline.engine import StepEngine
from pipeline.evaluate import test_accuracy
from pipeline.loop import Trainer, train_loop
from pipeline.outputs import OutputBusy, owned_output
from pipeline.placement import Placement, PlacementError
from pipeline.preflight import check_embedded_tags, check_run
from pipeline.recovery import History, split_of, train_with_recovery
from pipeline.records import (RunRecorder, format_summary, jsonable,
                              software_versions, summarize)
from pipeline.reference import REFERENCE_WORKER, ReferenceTrainer
from pipeline.schema import ConfigError, to_dict
from pipeline.trace import ClientEvent, write_trace
from storage import checkpoints
from storage.datasets import DatasetDamaged, DatasetError, DatasetInfo, ensure_dataset
from storage.labelled import write_dataset
from tasks.layout import Layout, layout_from_counts
from tasks.replica_layout import DataLayout, HybridLayout, dense_widths, split_counts
from tasks.specs import NetworkSpec
from tasks.worker_state import configure_process


@dataclass
class RunResult:
    """What a finished run hands back (the same is on disk in its output directory)."""

    summary: dict[str, Any]
    record: xr.Dataset
    output_dir: str


def prepare_dataset(config: RunConfig) -> DatasetInfo:
    """Open the run's dataset store, building it (synthetic or CIFAR-10) if missing."""
    train_samples, test_samples = config.data.sample_counts()
    return ensure_dataset(config.data.source, config.dataset_path,
                          train_samples=train_samples, test_samples=test_samples,
                          seed=config.data.seed, dtype=config.network.dtype)


def code_revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=os.path.dirname(__file__)
                              ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def without(names: list[str], gone: list[str], row: list[int]) -> list[int]:
    """`row` (one count per worker of `names`) without the workers in `gone`."""
    return [count for name, count in zip(names, row) if name not in gone]


def distributed_trainer(client: Client, config: RunConfig, network: NetworkSpec,
                        slots: list[WorkerSlot], train_samples: int
                        ) -> tuple[StepEngine, Placement, list[WorkerSlot]]:
    """The engine of a distributed strategy: its workers, its split, its layout.

    `single` runs on the master alone; `kernel` adds a master outside the kernel
    workers (see `cluster.add_master`) holding no kernels; `data` and `hybrid` use
    every worker, each with a share of the batch (the first reports the loss).
    Workers the placement gives nothing (no kernels of any layer, no samples) leave
    the run; the master stays.
    """
    run_id = uuid.uuid4().hex[:8]
    if config.strategy in ("data", "hybrid"):
        placement = choose_batch_shares(client, config, network, list(slots), run_id)
        names = [w.name for w in slots]
        gone = placement.left_out(names)
        workers = [w for w in slots if w.name not in gone]
        layout = replica_layout(config, network, [w.name for w in workers],
                                without(names, gone, placement.counts[0]))
        return StepEngine(client, config, network, workers, layout, train_samples), \
            placement, workers
    workers, master = add_master(client, config.cluster, slots)
    if config.strategy == "single":
        workers, master = [workers[master]], 0
    conv_workers = workers[:len(slots)] if config.strategy != "single" else workers
    placement = choose_placement(client, config, network, conv_workers, run_id)
    names = [w.name for w in workers]
    gone = placement.left_out([w.name for w in conv_workers], master)
    counts = [without(names, gone, row + [0] * (len(workers) - len(conv_workers)))
              for row in placement.counts]
    master_name = names[master]
    workers = [w for w in workers if w.name not in gone]
    names = [w.name for w in workers]
    layout = layout_from_counts(names, counts, names.index(master_name))
    engine = StepEngine(client, config, network, workers, layout, train_samples)
    return engine, placement, workers


def replica_layout(config: RunConfig, network: NetworkSpec, workers: list[str],
                   shares: list[int]) -> Layout:
    """The `data` or `hybrid` layout over `workers` with these batch shares."""
    if config.strategy == "data":
        return DataLayout(tuple(workers), tuple(shares))
    widths = [out for _in, out in dense_widths(network)]
    if min(widths) < len(workers):
        raise ConfigError(f"strategy: hybrid splits every dense layer's neurons over the "
                          f"{len(workers)} workers, but a layer has only {min(widths)}")
    neurons = tuple(tuple(split_counts(width, len(workers))) for width in widths)
    return HybridLayout(tuple(workers), tuple(shares), neurons, config.hybrid.scheme,
                        config.hybrid.dense_batch)


def run_training(config: RunConfig, client: Client | None = None,
                 slots: list[WorkerSlot] | None = None) -> RunResult:
    """Run one training as the config says; a client may be passed in (sweeps reuse one).

    The run holds its output directory throughout (`pipeline.outputs`). What it
    notices on the way (a stale lock taken over, damaged checkpoints passed over)
    goes to stderr, one line each, and into the record's ``notes`` attribute.
    """
    notes: list[str] = []

    def say(line: str) -> None:
        print(line, file=sys.stderr)
        notes.append(line)

    with owned_output(config, say):
        return _train(config, client, slots, say, notes)


def _train(config: RunConfig, client: Client | None, slots: list[WorkerSlot] | None,
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
                             "code_revision": code_revision(), "resumed_from_step": from_step}
    client_events: list[ClientEvent] = []
    history = History()
    with ExitStack() as stack:
        trainer: Trainer
        if config.strategy == "reference":
            trainer = ReferenceTrainer(config, network, info.train_samples)
            recorder = RunRecorder([REFERENCE_WORKER],
                                   [f"in-process, {config.reference.threads} thread(s)"], [1.0])
        else:
            configure_process(1)  # the client must not fight the workers for cores
            if client is None:
                client = stack.enter_context(open_client(config.cluster))
                register_setup(client, config.cluster)
            if slots is None:
                slots = find_workers(client, config.cluster)
            engine, placement, workers = distributed_trainer(client, config, network, slots,
                                                             info.train_samples)
            split = {key: jsonable(value)
                     for key, value in split_of(config.strategy, engine, placement).items()}
            if isinstance(engine.layout, HybridLayout):
                split["hybrid"] = jsonable(to_dict(config.hybrid))
            if config.strategy in ("data", "hybrid"):
                split["gradient_reduction"] = ("workspace: reduce-scatter by range ownership, "
                                               "then all-gather")
            attrs.update({"placement": placement.method, **split,
                          "master": workers[engine.layout.master].name,
                          "workspace_sync": config.workspace.sync,
                          "calibration_s_per_kernel": jsonable(placement.calibration),
                          **({"placement_choice": jsonable(placement.choice)}
                             if placement.choice else {}),
                          # workers the placement gave nothing to do
                          "left_out": jsonable([] if config.strategy == "single" else sorted(
                              {s.name for s in slots} - {w.name for w in workers})),
                          "dashboard": str(client.dashboard_link or "")})
            recorder = RunRecorder([w.name for w in workers], [w.label for w in workers],
                                   [w.emulated_speed for w in workers],
                                   tags=[w.resource for w in workers])
            attrs["split_workers"] = jsonable([w.name for w in workers])  # split columns
        try:
            if config.strategy == "reference":
                trainer.start(from_step)
                recorder.devices = list(trainer.devices)
                train_loop(config, trainer, recorder, client_events, from_step,
                           info.train_samples)
                trainer.close()
            else:
                build = functools.partial(distributed_trainer, client, config, network,
                                          train_samples=info.train_samples)
                history = train_with_recovery(config, client, engine, placement, slots,
                                                 build, recorder, client_events, from_step,
                                                 info.train_samples)
        finally:
            write_trace(os.path.join(config.output_dir, "trace.json"), recorder.receipts,
                        client_events, recorder.workers, started)
    summary_accuracy = None
    if config.train.eval_samples:
        samples = min(config.train.eval_samples, info.test_samples)
        weights = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
        summary_accuracy = test_accuracy(network, weights, info.path, samples)
    attrs["checkpoint_time_s"] = recorder.checkpoint_s
    changes = history.as_json()  # recoveries, joins
    attrs.update({key: jsonable(value) for key, value in changes.items()})
    attrs["notes"] = json.dumps(notes)
    attrs.update({"started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
                  "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
                  "batch": config.train.batch, "inflight": config.train.inflight})
    record = recorder.to_dataset(attrs)
    summary = summarize(record, config.train.warmup_steps, config.train.batch)
    summary.update({"test_accuracy": summary_accuracy,
                    "test_samples": min(config.train.eval_samples, info.test_samples),
                    "strategy": config.strategy, "workers": list(record.worker_label.values),
                    "worker_devices": [
                        {"name": str(name), "tag": str(tag), "device": str(device)}
                        for name, tag, device in zip(record.worker.values,
                                                     record.resource_tag.values,
                                                     record.device.values)]})
    for key in ("kernel_split", "batch_split", "dense_split"):
        if key in attrs:
            summary[key] = json.loads(attrs[key])
    if "master" in attrs:
        summary["master"] = attrs["master"]
        summary["split_workers"] = json.loads(attrs["split_workers"])
    summary.update(changes)
    record.attrs["test_accuracy"] = -1.0 if summary_accuracy is None else summary_accuracy
    write_dataset(record, os.path.join(config.output_dir, "record.zarr"), mode="w")
    with open(os.path.join(config.output_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, default=str)
    with open(os.path.join(config.output_dir, "config.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump(to_dict(config), f, sort_keys=False)
    return RunResult(summary, record, config.output_dir)


def load_checked(argv: list[str] | None) -> tuple[RunConfig, bool]:
    """Parse the command line, load the config and check its paths: everything a run
    can find wrong before it starts. Returns the config and whether only to check."""
    parser = OneLineParser(prog="python -m pipeline.train",
                           description="Train a CNN with one strategy.")
    parser.add_argument("config", help="run config (YAML)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    parser.add_argument("--scheduler", help="Dask scheduler address (default: embedded "
                        "cluster, or $DASK_SCHEDULER_ADDRESS)")
    parser.add_argument("--fresh", action="store_true", help="replace the results of an "
                        "earlier run in the output directory (train.fresh=true)")
    parser.add_argument("--check", action="store_true", help="check the config, its paths "
                        "and the scheduler address, then exit without training")
    args = parser.parse_intermixed_args(argv)
    overrides = list(args.overrides)
    if args.fresh:
        overrides.append("train.fresh=true")
    if args.scheduler:
        overrides.append(f"cluster.scheduler={args.scheduler}")
    config = load_run_config(args.config, overrides)
    check_run(config)
    check_embedded_tags(config)
    return config, args.check


def main(argv: list[str] | None = None) -> int:
    quiet_dask()
    try:
        config, check_only = load_checked(argv)
        if check_only:
            print(f"{config.name}: config and paths are fine ({config.strategy}, "
                  f"output {config.output_dir})")
            return 0
        result = run_training(config)
    except OutputBusy as error:
        return fail(error, IN_USE)
    except (WorkerLost, SchedulerLost) as error:
        return fail(f"{error}; start the run again with train.resume=true to continue from "
                    "the last checkpoint", RUNTIME_ERROR)
    except (ClusterError, FloatingPointError, DatasetDamaged, CheckpointError,
            OSError) as error:
        return fail(error, RUNTIME_ERROR)
    except (UsageError, ConfigError, DatasetError, PlacementError) as error:
        return fail(error, CONFIG_ERROR)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(format_summary(config.name, config.strategy, result.summary,
                         result.summary["workers"]))
    print(f"  record      {os.path.join(result.output_dir, 'record.zarr')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
