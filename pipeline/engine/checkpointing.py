"""The client's side of checkpoints: the step-0 weights every strategy starts from,
and closing a checkpoint once every worker has written its work."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Callable, Protocol

import numpy as np

from pipeline.config.run_config import RunConfig
from pipeline.engine.sampler import step_indices
from pipeline.config.schema import ConfigError
from storage import checkpoints
from storage.space import writing
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


def check_resumed_network(config: RunConfig, network: NetworkSpec) -> None:
    """A resume (`train.resume`) of checkpoints made for another network is refused:
    their tensors would not fit. Reads only the store's attributes, so `--check` asks
    it too (`pipeline.preflight.check_run`)."""
    path = config.checkpoint_path
    if (config.train.resume and checkpoints.complete_steps(path)
            and checkpoints.made_for(path) != network_fingerprint(network)):
        raise ConfigError(f"train.resume: the checkpoints in {path} were made for a "
                          "different network")


def prepare_checkpoints(config: RunConfig, network: NetworkSpec,
                        say: Callable[[str], None] = _to_stderr) -> int:
    """The step to start from: the newest valid checkpoint if resuming, else 0 (a
    resume with no complete checkpoint starts over, and says so through `say`).

    A resume passes over complete checkpoints that fail their checksums (a torn or
    flipped chunk), saying so in one line through `say`; if every one is damaged it
    raises CheckpointError rather than start over on its own. A fresh run replaces
    any old checkpoints and writes step 0 from the seeded PyTorch initialisation,
    which every strategy then loads.
    """
    path = config.checkpoint_path
    fingerprint = network_fingerprint(network)
    if config.train.resume and checkpoints.complete_steps(path):
        check_resumed_network(config, network)
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
        checkpoints.start_fresh(path, fingerprint)
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
