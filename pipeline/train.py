"""One training run: ``python -m pipeline.train CONFIG [--scheduler ADDR] [key=value ...]``.

Loads and validates the config, makes sure the dataset store exists, writes (or
resumes from) the checkpoint that every strategy starts from, trains with the chosen
strategy, scores the final weights on the test set, and writes the run's record
(`record.zarr`, `summary.json`, `config.yaml`) to its output directory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import xarray as xr
import yaml
from distributed import Client
from tqdm import tqdm

from pipeline.cluster import ClusterError, WorkerSlot, find_workers, open_client, register_setup
from pipeline.config import RunConfig, load_run_config
from pipeline.evaluate import test_accuracy
from pipeline.kernel_engine import KernelParallelEngine
from pipeline.network import checkpoint_row_chunks, initial_state, parameter_shapes
from pipeline.records import (RunRecorder, format_summary, jsonable, software_versions,
                              summarize)
from pipeline.reference import REFERENCE_WORKER, ReferenceTrainer
from pipeline.sampler import step_indices
from pipeline.schema import ConfigError, to_dict
from storage import checkpoints
from storage.labelled import write_dataset
from storage.datasets import DatasetError, DatasetInfo, ensure_dataset
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


def prepare_checkpoints(config: RunConfig, network: NetworkSpec) -> int:
    """The step to start from: the last complete checkpoint if resuming, else 0.

    A fresh run replaces any old checkpoints and writes step 0 from the seeded
    PyTorch initialisation, which every strategy then loads.
    """
    path = config.checkpoint_path
    fingerprint = json.dumps(asdict(network), sort_keys=True)
    if config.train.resume:
        latest = checkpoints.latest_complete_step(path)
        if latest is not None:
            if checkpoints.made_for(path) != fingerprint:
                raise ConfigError(f"train.resume: the checkpoints in {path} were made for a "
                                  "different network")
            return latest
    checkpoints.start_fresh(path, fingerprint)
    checkpoints.create_checkpoint(
        path, 0, parameter_shapes(network),
        checkpoint_row_chunks(network, config.channel_quanta(network)), network.dtype)
    for key, value in initial_state(network, config.train.seed).items():
        checkpoints.write_slice(path, 0, "weights", key, 0, value)
        checkpoints.write_slice(path, 0, "momentum", key, 0, np.zeros_like(value))
    checkpoints.mark_complete(path, 0, {"step": 0})
    return 0


def code_revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=os.path.dirname(__file__)
                              ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _train_loop(config: RunConfig, trainer: Any, recorder: RunRecorder, from_step: int,
                train_samples: int) -> None:
    steps = config.train.steps
    checkpoint_steps = config.checkpoint_steps()
    last_checkpoint = from_step
    bar = tqdm(total=steps, initial=from_step, desc=f"{config.name} [{config.strategy}]",
               unit="step", disable=not config.progress, file=sys.stderr, leave=False)
    previous_end = time.perf_counter()
    carried = 0.0  # a drained backward belongs to the next step's window (see below)
    for step in range(from_step, steps):
        loss, receipts, master = trainer.step(step)
        recorder.add_receipts(receipts)
        done = step + 1
        if not np.isfinite(loss):
            raise FloatingPointError(f"training diverged at step {step}: loss is {loss}")
        # Steps are pipelined: a step's window normally holds the previous step's
        # backward, then its own forward and dense head. Where the loop must drain its
        # own backward early (before a checkpoint, or at the end), that drain is moved
        # to the next step's window (or, after the last step, recorded apart), so that
        # every window holds one step's worth of work.
        drain_start = time.perf_counter()
        if done == steps or done in checkpoint_steps:
            recorder.add_receipts(trainer.finish_pending())
        now = time.perf_counter()
        drained = now - drain_start
        recorder.add_step(step, drain_start - previous_end + carried, loss, master)
        carried = drained
        if done in checkpoint_steps:  # saving is not part of any step's time
            indices = np.stack([step_indices(config.train.seed, s, config.train.batch,
                                             train_samples)
                                for s in range(last_checkpoint, done)])
            recorder.add_receipts(trainer.checkpoint(done, indices))
            checkpoints.write_sample_indices(config.checkpoint_path, last_checkpoint, indices,
                                             steps)
            checkpoints.mark_complete(config.checkpoint_path, done, {"step": done})
            last_checkpoint = done
            recorder.checkpoint_s += time.perf_counter() - now
            now = time.perf_counter()
        previous_end = now
        bar.set_postfix(loss=f"{loss:.3f}", step_s=f"{recorder.steps[step]['step_time']:.2f}")
        bar.update(1)
    bar.close()
    recorder.final_drain_s = carried



def run_training(config: RunConfig, client: Client | None = None,
                 slots: list[WorkerSlot] | None = None) -> RunResult:
    """Run one training as the config says; a client may be passed in (sweeps reuse one)."""
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
    from_step = prepare_checkpoints(config, network)
    attrs: dict[str, Any] = {"name": config.name, "strategy": config.strategy,
                             "config": yaml.safe_dump(to_dict(config), sort_keys=False),
                             "dataset": info.path, "dataset_source": info.source,
                             "versions": jsonable(software_versions()),
                             "code_revision": code_revision(), "resumed_from_step": from_step}
    with ExitStack() as stack:
        if config.strategy == "reference":
            trainer: Any = ReferenceTrainer(config, network, info.train_samples)
            recorder = RunRecorder([REFERENCE_WORKER],
                                   [f"in-process, {config.reference.threads} thread(s)"], [1.0])
        else:
            configure_process(1)  # the master's dense head must not fight the workers
            if client is None:
                client = stack.enter_context(open_client(config.cluster))
                register_setup(client, config.cluster)
            if slots is None:
                slots = find_workers(client, config.cluster)
            if config.strategy == "single":
                slots = slots[:1]
            engine = KernelParallelEngine(client, config, network, slots, info.train_samples)
            stack.callback(engine.close)
            placement = engine.place()
            attrs.update({"placement": placement.method,
                          "kernel_split": jsonable(placement.counts()),
                          "calibration_s_per_kernel": jsonable(placement.calibration),
                          **({"model_placement": jsonable(placement.model)}
                             if placement.model else {}),
                          "dashboard": str(client.dashboard_link or "")})
            trainer = engine
            recorder = RunRecorder([s.name for s in slots], [s.label for s in slots],
                                   [s.emulated_speed for s in slots])
        trainer.start(from_step)
        if isinstance(trainer, KernelParallelEngine):
            recorder.devices = [trainer.devices.get(name, "cpu") for name in recorder.workers]
        _train_loop(config, trainer, recorder, from_step, info.train_samples)
        trainer.close()
    summary_accuracy = None
    if config.train.eval_samples:
        samples = min(config.train.eval_samples, info.test_samples)
        weights = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
        summary_accuracy = test_accuracy(network, weights, info.path, samples)
    attrs["checkpoint_time_s"] = recorder.checkpoint_s
    attrs["final_drain_time_s"] = recorder.final_drain_s  # the last step's own backward
    attrs.update({"started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
                  "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
                  "batch": config.train.batch})
    record = recorder.to_dataset(attrs)
    summary = summarize(record, config.train.warmup_steps, config.train.batch)
    summary.update({"test_accuracy": summary_accuracy,
                    "test_samples": min(config.train.eval_samples, info.test_samples),
                    "strategy": config.strategy, "workers": list(record.worker_label.values)})
    if "kernel_split" in attrs:
        summary["kernel_split"] = json.loads(attrs["kernel_split"])
    record.attrs["test_accuracy"] = -1.0 if summary_accuracy is None else summary_accuracy
    write_dataset(record, os.path.join(config.output_dir, "record.zarr"), mode="w")
    with open(os.path.join(config.output_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, default=str)
    with open(os.path.join(config.output_dir, "config.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump(to_dict(config), f, sort_keys=False)
    return RunResult(summary, record, config.output_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.train",
                                     description="Train a CNN with one strategy.")
    parser.add_argument("config", help="run config (YAML)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    parser.add_argument("--scheduler", help="Dask scheduler address (default: embedded "
                        "cluster, or $DASK_SCHEDULER_ADDRESS)")
    args = parser.parse_intermixed_args(argv)
    overrides = list(args.overrides)
    if args.scheduler:
        overrides.append(f"cluster.scheduler={args.scheduler}")
    try:
        config = load_run_config(args.config, overrides)
        result = run_training(config)
    except (ConfigError, DatasetError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (ClusterError, FloatingPointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(format_summary(config.name, config.strategy, result.summary,
                         result.summary["workers"]))
    print(f"  record      {os.path.join(result.output_dir, 'record.zarr')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
