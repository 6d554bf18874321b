"""The client's side of checkpoints: the step-0 weights every strategy starts from,
and closing a checkpoint once every worker has written its work."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from typing import Any, Callable, Collection, Protocol

import numpy as np

from pipeline.config.run_config import RunConfig, build_run_config
from pipeline.engine.sampler import step_indices
from pipeline.config.schema import ConfigError, to_dict, yaml_load
from storage import checkpoints
from storage.datasets.store import DatasetInfo
from storage.space import writing
from tasks.lr_schedule import TORCH_WARMUP_FACTOR
from tasks.network import initial_state, checkpoint_shapes
from tasks.specs import NetworkSpec


class SavesCheckpoints(Protocol):
    def checkpoint(self, done_steps: int) -> str | None: ...


class CheckpointError(RuntimeError):
    """No checkpoint to resume from can be trusted."""


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


def network_fingerprint(network: NetworkSpec) -> str:
    """What a checkpoint store records of the network its tensors were made for."""
    return json.dumps(asdict(network), sort_keys=True)


#: The settings a resume may not change: with any other, the weights it continues
#: would have come from other arithmetic (batch, SGD and its learning-rate schedule,
#: seeds, data, batch norm's rows, the hybrid's dense updates) and the record would
#: hold two runs' steps under one's attributes. The rest may change (`train.steps`,
#: checkpoints, the strategy, the placement, the cluster, the workspace, ...): every
#: strategy's arithmetic is single-process SGD's, and the record's `starts` says what
#: each start ran on. `train.steps` is fixed only under `train.lr_decay: cosine`, whose
#: rates it spreads the decay over (`made_with` records it only there).
RESUME_FIXED = ("data.source", "data.image_size", "data.train_samples",
                "data.test_samples", "data.seed", "data.augment", "data.augment_padding",
                "train.batch", "train.lr",
                "train.momentum", "train.weight_decay", "train.nesterov", "train.seed",
                "train.lr_decay", "train.lr_milestones", "train.lr_gamma", "train.lr_warmup",
                "train.lr_warmup_factor", "train.steps",
                "train.batch_norm", "hybrid.dense_batch", "hybrid.conv_lr_scaling")
#: The schedule a store that recorded none trained with (written before schedules
#: existed): a constant rate.
CONSTANT_SCHEDULE = {"train.lr_decay": "none", "train.lr_milestones": [],
                     "train.lr_gamma": 0.1, "train.lr_warmup": 0,
                     "train.lr_warmup_factor": TORCH_WARMUP_FACTOR}
#: Settings of `RESUME_FIXED` added after stores began to record them, as a store
#: that does not record them trained: without augmentation, at a constant rate.
RECORDED_LATER = {"data.augment": "none", "data.augment_padding": None, **CONSTANT_SCHEDULE}
#: Settings only some strategies use, as single-process SGD has them: the value a
#: strategy that does not use them trains with, whatever the config says (which a
#: strategy uses is its `Strategy.arithmetic_settings`).
SGD_VALUES = {"train.batch_norm": "sync", "hybrid.dense_batch": "full",
              "hybrid.conv_lr_scaling": "none"}
#: A strategy's name -> the settings of `SGD_VALUES` its arithmetic uses (None: compare
#: every one as written): `pipeline.strategies.arithmetic_settings`, which this layer
#: may not import.
SettingsOf = Callable[[str], Collection[str] | None]


def _as_written(strategy: str) -> None:
    return None


def made_with(config: RunConfig, network: NetworkSpec, settings_of: SettingsOf = _as_written
              ) -> dict[str, Any]:
    """The settings of `RESUME_FIXED` a run trains with (defaults filled in; a setting
    its strategy, or its network, does not use as single-process SGD has it), and its
    network section, which names what differs when the network does."""
    data, train = config.data, config.train
    train_samples, test_samples = data.sample_counts()
    values = {"data.source": data.source, "data.image_size": data.image_side(),
              "data.train_samples": train_samples, "data.test_samples": test_samples,
              "data.seed": data.seed, "data.augment": data.augment,
              # the padding of no augmentation is none, whatever the config says
              "data.augment_padding": data.augment_padding if data.augment != "none" else None,
              "hybrid.dense_batch": config.hybrid.dense_batch,
              "hybrid.conv_lr_scaling": config.hybrid.conv_lr_scaling,
              **{f"train.{name}": getattr(train, name) for name in
                 ("batch", "lr", "momentum", "weight_decay", "nesterov", "seed",
                  "batch_norm")},
              **schedule_settings(config)}
    used = settings_of(config.strategy)
    for key, sgd in SGD_VALUES.items():
        if used is not None and key not in used:
            values[key] = sgd
    if not any(layer.batch_norm for layer in network.conv):
        values["train.batch_norm"] = "sync"  # no batch norm: `local` is the same
    values["network"] = dotted(to_dict(config.network), "network")
    return values


def schedule_settings(config: RunConfig) -> dict[str, Any]:
    """The learning-rate schedule's settings as they give the rates: a setting its
    schedule does not use at its default (`lr_gamma` outside `step`, the warm-up's
    factor without a warm-up), so that changing it alone is no change; `train.steps`
    under `cosine` only."""
    train = config.train
    values = {**CONSTANT_SCHEDULE, "train.lr_decay": train.lr_decay,
              "train.lr_warmup": train.lr_warmup}
    if train.lr_decay == "step":
        values.update({"train.lr_milestones": list(train.lr_milestones),
                       "train.lr_gamma": train.lr_gamma})
    if train.lr_warmup:
        values["train.lr_warmup_factor"] = train.lr_warmup_factor
    if train.lr_decay == "cosine":
        values["train.steps"] = train.steps
    return values


def dotted(value: Any, prefix: str) -> dict[str, Any]:
    """A nested mapping (and lists) as dotted keys, `network.conv.0.kernels`."""
    items = (value.items() if isinstance(value, dict) else enumerate(value)
             if isinstance(value, list) else None)
    if items is None:
        return {prefix: value}
    return {key: leaf for name, inner in items
            for key, leaf in dotted(inner, f"{prefix}.{name}").items()}


def _earlier_settings(config: RunConfig, network: NetworkSpec, settings_of: SettingsOf
                      ) -> dict[str, Any] | None:
    """What the checkpoints were made with: as the store records it, else (a store
    written before it did) as the run folder's config.yaml says; None if neither."""
    recorded = checkpoints.made_with(config.checkpoint_path)
    if recorded is not None:
        return recorded
    try:
        with open(os.path.join(config.output_dir, "config.yaml"), encoding="utf-8") as file:
            return made_with(build_run_config(yaml_load(file.read())), network, settings_of)
    except (OSError, ConfigError, ValueError):
        return None


def _change(key: str, before: Any, after: Any) -> str:
    """`train.nesterov=false (now true)`: values as a config writes them."""
    def shown(value: Any) -> str:
        return json.dumps(value) if value is None or isinstance(value, bool) else str(value)
    return f"{key}={shown(before)} (now {shown(after)})"


def check_resumed_run(config: RunConfig, network: NetworkSpec,
                      settings_of: SettingsOf = _as_written) -> None:
    """A resume (`train.resume`) of checkpoints made for another network or with other
    settings of `RESUME_FIXED` is refused, in one line naming each setting with the
    checkpointed value and the new one. Reads only the store's attributes (and the
    run folder's config.yaml), so `--check` asks it too (`pipeline.preflight.check_run`)."""
    path = config.checkpoint_path
    if not (config.train.resume and checkpoints.complete_steps(path)):
        return
    other_network = checkpoints.made_for(path) != network_fingerprint(network)
    earlier = _earlier_settings(config, network, settings_of) or {}
    if earlier:
        earlier = {**RECORDED_LATER, **earlier}
    now = made_with(config, network, settings_of)
    differ = [_change(key, earlier[key], now[key]) for key in RESUME_FIXED
              if key in earlier and key in now and earlier[key] != now[key]]
    if other_network:
        before, after = earlier.get("network", {}), now["network"]
        named = [_change(key, before.get(key), after.get(key)) for key in sorted(set(before) | set(after)) if before.get(key) != after.get(key)]
        differ[:0] = named or ["the network (now another)"]
    if differ:
        raise ConfigError(f"train.resume: the checkpoints in {path} were made for a "
                          f"different run: {', '.join(differ)}; resume with the values it "
                          "had, or set a new `output` to start another run")


def data_made_on(info: DatasetInfo) -> dict[str, Any]:
    """What a checkpoint store records of the dataset its steps trained on: the store's
    content identity, and what names it in a refusal."""
    return {"identity": info.identity, "store": info.path, "source": info.source,
            "train_samples": info.train_samples, "test_samples": info.test_samples}


def recorded_data(path: str) -> dict[str, Any]:
    """What the checkpoints at `path` recorded of the dataset they trained on
    (`data_made_on`; empty where they recorded none, or there are none)."""
    made = checkpoints.made_with(path) if os.path.exists(path) else None
    recorded = (made or {}).get("dataset")
    return recorded if isinstance(recorded, dict) else {}


def data_identity(path: str) -> str:
    """The identity of the dataset store the checkpoints at `path` trained on ("" if
    they recorded none): what every read of the run's steps checks it reads."""
    return str(recorded_data(path).get("identity") or "")


def check_same_data(config: RunConfig, info: DatasetInfo) -> None:
    """A resume on other images than its checkpoints trained on is refused: the same
    `data.*` settings can give another store when the source changed (an image folder
    with an image added, removed or replaced rebuilds its store). Checked once the
    store is open, so by the run, not by `--check`; a store that recorded no identity
    (written before it did) is not checked."""
    earlier = recorded_data(config.checkpoint_path)
    if not earlier.get("identity") or not info.identity or earlier["identity"] == info.identity:
        return
    counts = (f"{earlier.get('train_samples')}/{earlier.get('test_samples')} train/test "
              f"images then, {info.train_samples}/{info.test_samples} now")
    raise ConfigError(f"train.resume: the checkpoints in {config.checkpoint_path} trained on "
                      f"other images: the dataset store {info.path} holds other images now "
                      f"(rebuilt from {info.source} since: {counts}); restore the source as "
                      "it was, or set a new `output` to start another run")


def prepare_checkpoints(config: RunConfig, network: NetworkSpec,
                        say: Callable[[str], None] = _to_stderr,
                        settings_of: SettingsOf = _as_written,
                        data: DatasetInfo | None = None) -> int:
    """The step to start from: the newest valid checkpoint if resuming, else 0 (a
    resume with no complete checkpoint starts over, and says so through `say`).

    A resume passes over complete checkpoints that fail their checksums (a torn or
    flipped chunk), saying so in one line through `say`; if every one is damaged it
    raises CheckpointError rather than start over on its own. A fresh run replaces
    any old checkpoints and writes step 0 from the seeded PyTorch initialisation,
    which every strategy then loads. `data`, the store the run opened, is recorded
    with a fresh run's settings and must be what a resume's checkpoints trained on.
    """
    path = config.checkpoint_path
    fingerprint = network_fingerprint(network)
    if config.train.resume and checkpoints.complete_steps(path):
        check_resumed_run(config, network, settings_of)
        if data is not None:
            check_same_data(config, data)
        checkpoints.discard_attempts(path)  # staging areas a killed run left: never read
        latest, passed = checkpoints.latest_valid_step(path)
        damaged = "; ".join(f"step {step}: {problem}" for step, problem in passed)
        if latest is None:
            raise CheckpointError(f"train.resume: no checkpoint in {path} is valid "
                                  f"({damaged}); start over with train.fresh=true")
        if passed:
            say(f"warning: train.resume: passed over damaged checkpoint(s) in {path} "
                f"({damaged}); resuming from step {latest}, the newest valid one")
        return latest
    if config.train.resume:  # a mistyped output would otherwise start over unnoticed
        say(f"train.resume: no complete checkpoint in {path} to resume from; starting at "
            "step 0")
    with writing("checkpoint store", path):
        settings = made_with(config, network, settings_of)
        if data is not None:
            settings["dataset"] = data_made_on(data)
        checkpoints.start_fresh(path, fingerprint, settings)
        # one chunk per tensor: this process writes them whole, and a worker reading
        # its slice reads only its rows' bytes (storage/chunk_files.py)
        checkpoints.create_checkpoint(path, 0, checkpoint_shapes(network), {}, network.dtype)
        for key, value in initial_state(network, config.train.seed).items():
            checkpoints.write_slice(path, 0, "weights", key, 0, value)
            checkpoints.write_slice(path, 0, "momentum", key, 0, np.zeros_like(value))
        checkpoints.mark_complete(path, 0, {"step": 0})
    return 0


def save_checkpoint(config: RunConfig, trainer: SavesCheckpoints, since: int, done: int,
                    train_samples: int) -> None:
    """Checkpoint `done`: the trainer's weights, the sample indices of steps since the
    last checkpoint, then the mark that makes it count (for a trainer that staged it,
    an attempt's staging area, the mark moves it in: storage/checkpoints.py)."""
    path = config.checkpoint_path
    with writing("checkpoint store", path):  # the workers' writes raise NoSpace themselves
        attempt = trainer.checkpoint(done)
        train = config.train
        indices = np.stack([step_indices(train.seed, s, train.batch, train_samples)
                            for s in range(since, done)])
        checkpoints.write_sample_indices(path, since, indices, train.steps)
        checkpoints.mark_complete(path, done, {"step": done}, attempt=attempt)
