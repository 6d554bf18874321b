"""A run owns its output directory for its lifetime.

Two runs into one directory used to mix their checkpoints, and a rerun silently
replaced some results and left others beside them. So a run holds the directory's
lock (`run.lock`, the same flock-based lock as a sweep store's, `storage.locks`)
from start to end: a second run is refused at once, naming the holder, and a lock
left by a killed run is taken over with a note. Under the lock, a directory that
already holds results is refused unless the run resumes them (`train.resume`) or
replaces them (`train.fresh`, `--fresh`); so is a `config.yaml` or `trace.json` there
beside none of a run's files (a user's own: `--fresh` replaces a run's files only). A
fresh run moves them aside (`ASIDE`, in the directory) as it starts and removes them
only once it ends with results of its own: a run refused before its first step (a
damaged dataset, a scheduler it cannot reach) puts them back, so nothing is lost to a
run that never trained; one killed meanwhile leaves them aside, and the next run into
the directory settles them the same way. At its end the run writes its results there
(`write_results`: the record, the summary and the config it ran).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import xarray as xr
import yaml

from pipeline.config.run_config import RunConfig
from pipeline.config.schema import ConfigError, to_dict
from pipeline.probe.machine import machine_identity
from pipeline.records.record import RunRecorder, jsonable
from pipeline.records.starts import EarlierRecord, continue_record
from pipeline.records.summary import summarize
from pipeline.records.step_breakdown import compute_error
from pipeline.training.recovery import History
from storage import checkpoints
from storage.datasets import DatasetInfo
from storage.labelled import write_dataset_aside
from storage.locks import LockBusy, OwnerLock
from storage.private import owner_problem
from storage.space import replace_file, writing

LOCK_NAME = "run.lock"
#: What makes a directory hold an earlier run's results.
RESULTS = ("checkpoints.zarr", "record.zarr", "summary.json")
#: What a fresh run removes: the results and the rest of a run's files.
OUTPUTS = RESULTS + ("trace.json", "config.yaml", "record.zarr.partial", "record.zarr.old")
#: Where a fresh run keeps the earlier run's files until it has results of its own.
ASIDE = "earlier-run.aside"
#: A run's files that are no results: a user's own of these names is refused, not replaced.
RUN_FILES = ("trace.json", "config.yaml")
#: The attribute that marks an error that ended a fresh run whose earlier files were put back.
KEPT_MARK = "earlier_results_kept"


class OutputBusy(LockBusy):
    """Another run is writing the output directory."""


class RunComplete(Exception):
    """A resume of a run whose checkpoints already reach its last step: there is nothing
    to train, and nothing in its output directory is changed. The message is the one
    line that says so."""


class OutputLock(OwnerLock):
    """The lock of one run output directory."""

    busy_error = OutputBusy

    def __init__(self, output_dir: str) -> None:
        super().__init__(os.path.join(output_dir, LOCK_NAME), f"output directory {output_dir}",
                         "another run")



#: The summary's keys of the model's prediction, there in every run (`null` where the
#: run has none, `prediction_note` saying why: docs/outputs.md).
PREDICTION_KEYS = ("predicted_step_time", "predicted_low", "predicted_high",
                   "predicted_breakdown", "prediction_error", "compute_error",
                   "prediction_probe", "prediction_probe_age_s", "prediction_probe_samples")


def earlier_results(output_dir: str) -> list[str]:
    """The results of an earlier run found in `output_dir`. Checkpoints that hold only
    the initial weights are none: a run stopped before its first step (an unreachable
    scheduler, a tag no worker offers) leaves them, and its seed makes them again."""
    return [name for name in RESULTS if os.path.lexists(os.path.join(output_dir, name))
            and not (name == "checkpoints.zarr"
                     and initial_weights_only(os.path.join(output_dir, name)))]


def initial_weights_only(path: str) -> bool:
    """Whether the checkpoint store at `path` has no complete checkpoint past step 0
    (one it cannot read counts as more: it is left to the user)."""
    try:
        return not any(checkpoints.complete_steps(path))
    except Exception:  # noqa: BLE001 - unreadable: kept, and so refused as results
        return False


def check_earlier_results(config: RunConfig) -> None:
    """Raise ConfigError if the output directory holds an earlier run's results that
    `config` neither resumes nor replaces (the run's refusal, and `--check`'s). Results
    a fresh run set aside and was stopped before replacing count: the run puts them
    back before it looks (`settle_aside`), and `--check`, which moves nothing, must
    refuse them as the run will."""
    found = earlier_results(config.output_dir)
    aside = os.path.join(config.output_dir, ASIDE)
    if not found and os.path.isdir(aside):
        found = [os.path.join(ASIDE, name) for name in earlier_results(aside)]
    if found and not (config.train.fresh or config.train.resume):
        raise ConfigError(f"output: {config.output_dir} already holds an earlier run's "
                          f"results ({', '.join(found)}); pass --fresh (train.fresh=true) "
                          "to replace them, train.resume=true to continue that run, or "
                          "choose another output")


def foreign_files(output_dir: str) -> list[str]:
    """The files a run writes beside its results (`RUN_FILES`) that `output_dir` holds
    with none of a run's other files beside them (not even checkpoints of the initial
    weights only, or what a fresh run set aside): a user's own, as when the config a
    run reads sits in its output directory (`exp/config.yaml output=exp`)."""
    if os.path.lexists(os.path.join(output_dir, ASIDE)) or any(
            os.path.lexists(os.path.join(output_dir, name))
            for name in OUTPUTS if name not in RUN_FILES):
        return []
    return [name for name in RUN_FILES if os.path.lexists(os.path.join(output_dir, name))]


def check_output_dir(config: RunConfig) -> None:
    """Raise ConfigError if the output directory holds an earlier run's results that
    `config` neither resumes nor replaces, or a file the run would write over that is
    no run's: `--fresh` replaces a run's files only (the run's refusal, and
    `--check`'s)."""
    check_earlier_results(config)
    found = foreign_files(config.output_dir)
    if found:
        named = " and ".join(os.path.join(config.output_dir, name) for name in found)
        raise ConfigError(f"output: {named} {'is' if len(found) == 1 else 'are'} no earlier "
                          "run's (no run's results beside it) and the run would write over "
                          "it (--fresh replaces a run's files only): move it elsewhere or "
                          "choose another output")


def clear_outputs(output_dir: str) -> None:
    """Remove a run's files from `output_dir` (the caller holds its lock)."""
    paths = [os.path.join(output_dir, name) for name in OUTPUTS]
    for path in paths + glob.glob(os.path.join(output_dir, "workspace-*.zarr")):
        _remove(path)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def set_aside(output_dir: str) -> None:
    """Move an earlier run's files into `ASIDE` (renames in one directory: no copy, no
    space), its stale workspaces removed; the caller holds the lock."""
    aside = os.path.join(output_dir, ASIDE)
    found = [name for name in OUTPUTS if os.path.lexists(os.path.join(output_dir, name))]
    if found:  # none: nothing to keep, nothing to say was kept
        os.makedirs(aside)
    for name in found:
        os.rename(os.path.join(output_dir, name), os.path.join(aside, name))
    clear_outputs(output_dir)  # the workspaces: never results


def earlier_kept(stop: BaseException) -> bool:
    """Whether `stop` ended a fresh run before it had results, and the earlier run's
    were put back: what the run's last line says is then of those, not of a resume."""
    return bool(getattr(stop, KEPT_MARK, False))


def settle_aside(output_dir: str) -> bool:
    """The files a fresh run set aside: removed if the directory holds results of its
    own (that run trained), else put back in place of what it left (its initial
    checkpoint, a trace). Returns whether results were put back (not only initial
    weights, which the seed makes again)."""
    aside = os.path.join(output_dir, ASIDE)
    if not os.path.isdir(aside):
        return False
    restore = not earlier_results(output_dir) and bool(os.listdir(aside))
    if restore:  # its workspaces (never results) are left as a failed run leaves them
        for name in OUTPUTS:
            _remove(os.path.join(output_dir, name))
        for name in os.listdir(aside):
            os.rename(os.path.join(aside, name), os.path.join(output_dir, name))
    shutil.rmtree(aside)
    return restore and bool(earlier_results(output_dir))


def refuse_finished_resume(config: RunConfig) -> None:
    """Raise RunComplete when `config` resumes a run whose newest complete checkpoint,
    whole, is at or past `train.steps` (a damaged one is left to the resume, which
    passes over it). Reads only: the record, summary and trace stay as they are."""
    path = config.checkpoint_path
    step = checkpoints.latest_complete_step(path) if config.train.resume else None
    if step is None or step < config.train.steps or checkpoints.damage(path, step):
        return
    steps = config.train.steps
    reached = f"step {step}" if step == steps else f"step {step}, past train.steps {steps}"
    missing = [name for name in ("record.zarr", "summary.json")
               if not os.path.lexists(os.path.join(config.output_dir, name))]
    lost = (f"; its {' and '.join(missing)} were never written (the run was killed after "
            "its last step), and its per-step figures are gone: --fresh measures them "
            "again") if missing else ""
    raise RunComplete(f"{config.name}: the run in {config.output_dir} is complete (its "
                      f"checkpoints reach {reached}); nothing to resume, nothing changed{lost}"
                      "; to train on, raise train.steps")


@contextmanager
def owned_output(config: RunConfig, say: Callable[[str], None]) -> Iterator[None]:
    """Hold the run's output directory, refused (OutputBusy) if another run does and
    (ConfigError) if it holds results the config neither resumes nor replaces."""
    output_dir = config.output_dir
    lock = OutputLock(output_dir)
    with writing("output directory", output_dir):
        os.makedirs(output_dir, exist_ok=True)
        lock.acquire()
    try:
        problem = owner_problem(output_dir)  # made by another user since the preflight
        if problem:
            raise ConfigError(f"output: {problem}; choose another path")
        note = lock.stale_note()
        if note:
            say(note)
        if settle_aside(output_dir):  # a fresh run killed before its first step
            say(f"note: {output_dir}: the files of the run before an interrupted fresh "
                "run were put back")
        check_output_dir(config)
        if config.train.fresh:
            set_aside(output_dir)
        try:
            yield
        except BaseException as error:
            with contextlib.suppress(Exception):  # the error is what to report; a
                if config.train.fresh and settle_aside(output_dir):  # next run settles
                    setattr(error, KEPT_MARK, True)
            raise
        settle_aside(output_dir)
    finally:
        lock.release()


@dataclass
class RunResult:
    """What a finished run hands back (the same is on disk in its output directory)."""

    summary: dict[str, Any]
    record: xr.Dataset
    output_dir: str


def write_results(config: RunConfig, info: DatasetInfo, attrs: dict[str, Any],
                  split_keys: list[str], recorder: RunRecorder, history: History,
                  notes: list[str], started: float, accuracy: float | None,
                  prediction: dict[str, Any], in_client: bool,
                  earlier: EarlierRecord | None = None, ended: str = "complete") -> RunResult:
    """The record, the summary and the config, written to the output directory
    (`in_client`: the run trained in this process, as `reference` does).

    The record is the whole run's: the steps `earlier` starts of a resumed run kept,
    then this start's (pipeline/records/starts.py). `ended` says how this start ended:
    "complete", or the signal that stopped it before its last step (its steps so far
    are written then, so that a resume keeps them)."""
    attrs["checkpoint_time_s"] = recorder.checkpoint_s
    changes = history.as_json()  # recoveries, joins
    attrs.update({key: jsonable(value) for key, value in changes.items()})
    attrs["notes"] = json.dumps(notes)
    if in_client:  # `reference`: its one worker is this process, on the client's machine
        attrs["worker_machines"] = jsonable({name: {
            "machine": machine_identity(), "torch_threads": config.reference.threads}
            for name in recorder.workers})
    attrs.update({"started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
                  "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
                  "batch": config.train.batch, "inflight": config.train.inflight})
    from_step = int(attrs.get("resumed_from_step", 0))
    record = continue_record(earlier, recorder.to_dataset(attrs), {
        "from_step": from_step, "to_step": max(recorder.steps, default=from_step - 1) + 1,
        "ended": ended, "started": attrs["started"], "finished": attrs["finished"],
        "strategy": attrs.get("strategy"), "placement": config.placement,
        "batch": config.train.batch, "code_revision": attrs.get("code_revision"),
        "workers": list(recorder.workers), "notes": notes, **changes,
        "worker_machines": json.loads(attrs.get("worker_machines", "{}"))})
    summary = summarize(record, config.train.warmup_steps, config.train.batch, in_client)
    summary.update({"ended": ended, "test_accuracy": accuracy,
                    "test_samples": 0 if accuracy is None else min(config.train.eval_samples,
                                                                   info.test_samples),
                    # the last start's workers: the record's span every start's
                    "strategy": config.strategy, "workers": list(recorder.worker_labels),
                    "worker_devices": [
                        {"name": str(name), "tag": str(tag), "device": str(device)}
                        for name, tag, device in zip(record.worker.values,
                                                     record.resource_tag.values,
                                                     record.device.values)]})
    for key in split_keys:
        summary[key] = json.loads(attrs[key])
    if "strategy_choice" in attrs:
        summary["strategy_choice"] = json.loads(attrs["strategy_choice"])
    if "batch_norm" in attrs:  # data and hybrid: the replicas' batch-norm statistics
        summary["batch_norm"] = attrs["batch_norm"]
    if "link_bytes_sent" in attrs:  # a linked cluster's (run_training's `links`)
        summary["workspace_transport"] = attrs["workspace_transport"]
        for key in ("link_bytes_received", "link_bytes_sent"):
            summary[key] = json.loads(attrs[key])
    if "worker_machines" in attrs:  # which machines trained, as each worker said
        summary["worker_machines"] = json.loads(attrs["worker_machines"])
    if "master" in attrs:
        summary["master"] = attrs["master"]
        summary["split_workers"] = json.loads(attrs["split_workers"])
        summary["left_out"] = json.loads(attrs["left_out_reasons"])
    summary.update(changes)
    predicted, measured = prediction["predicted_step_time"], summary.get("step_time_median")
    if predicted is not None and summary["placed_setup_unmeasured"]:
        prediction["prediction_note"] = ("no measured step ran on the set-up it prices: a "
                                         "recovery placed every step again")
    elif predicted is not None and measured:
        prediction["prediction_error"] = predicted / measured - 1.0
        prediction["compute_error"] = compute_error(prediction.get("predicted_breakdown"),
                                                    summary.get("compute_time_median"))
    summary.update({key: None for key in PREDICTION_KEYS}, **prediction)  # null: none
    if accuracy is not None:  # none measured: no attribute, as the summary's is null
        record.attrs["test_accuracy"] = accuracy
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
