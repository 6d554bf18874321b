"""The schema of one training run's config, and how to load it.

A run config is YAML; `load_run_config` validates it into `RunConfig` and applies
dotted ``key=value`` overrides from the command line first. Sweeps (in
`experiments`) build on the same schema and only add axes.
"""

from __future__ import annotations

import copy
import hashlib
import os
import re
from dataclasses import dataclass
from typing import Any, Literal

from pipeline.config.data_config import DataConfig
from pipeline.config.cluster_config import ClusterConfig, LinkConfig, WorkerConfig
from pipeline.config.jobqueue_config import JobGroupConfig, JobqueueConfig
from pipeline.config.schema import (ConfigError, FieldError, check_range, described, from_dict,
                                    load_yaml, parse_override, set_dotted)
from storage.private import default_workspace_root
from pipeline.config.network_config import NetworkConfig
from pipeline.config.train_config import TrainConfig
from tasks.specs import NetworkSpec, OptimizerSpec


@dataclass
class WorkspaceConfig:
    path: str | None = described(
        None, "the exchange workspace's folder or fsspec URL, one every worker's host "
        "shares (null: `/dev/shm` when all workers are local)")
    channel_quantum: int | Literal["auto"] = described(
        "auto", "the unit a split is made of: a placement gives each worker whole multiples "
        "of this many channels of a layer (the last holder the rest); `auto`: about 1/32 "
        "of each layer's kernels, at least 4: fine enough for a split that follows speeds "
        "to within ~2 %, and few enough units that the search over splits stays quick")
    sync: Literal["markers", "scheduler"] = described(
        "markers", "how a task waits for another worker's data: `markers`, by polling its "
        "ready marker in the workspace, one task per worker and `train.steps_per_task` "
        "steps; `scheduler`, through Dask dependencies, a task per stretch between "
        "exchanges (about 1.5x slower here)")
    wait_timeout: float = described(600.0, "seconds a task waits for a peer's data before "
                                    "failing")

    def folder(self) -> str | None:
        """`path` as the workers are handed it: absolute (they resolve a relative path
        against their own working directory), a URL as written; None when unset."""
        if not self.path or "://" in self.path:
            return self.path
        return os.path.abspath(self.path)

    def __post_init__(self) -> None:
        if isinstance(self.channel_quantum, int):
            check_range(self, "channel_quantum", low=1)
        check_range(self, "wait_timeout", low=0, low_open=True)


@dataclass
class ReferenceConfig:
    threads: int = described(1, "torch threads of the in-process `reference` run")

    def __post_init__(self) -> None:
        check_range(self, "threads", low=1)


@dataclass
class HybridConfig:
    """Krizhevsky's hybrid: conv layers data-parallel, dense layers split by neurons."""

    scheme: Literal["a", "b", "c"] = described(
        "a", "how the dense layers get the conv features: `a` all at once (all-gather), `b` "
        "one worker's share at a time, `c` the k-th fraction of every share at a time "
        "(all-to-all)")
    dense_batch: Literal["full", "worker"] = described(
        "full", "`full`: the dense layers step once a step (the arithmetic of single-process "
        "SGD); `worker`: after each part, on its mean loss (Krizhevsky's variable batch "
        "size; schemes `b` and `c`: `a` has one part)")
    conv_lr_scaling: Literal["none", "linear", "sqrt"] = described(
        "none", "the conv layers' learning rate times 1 (`none`), the workers (`linear`), or "
        "their square root (`sqrt`)")

    def __post_init__(self) -> None:
        if self.dense_batch == "worker" and self.scheme == "a":  # it would change nothing
            raise FieldError("dense_batch", "`worker` steps the dense layers after each "
                             "part of a step, and scheme `a` has one part (all at once), so "
                             "it is `full` there: set hybrid.scheme to b or c with it")


#: The longest run name: a name is a folder's (runs/<name>, its workspace's), and a
#: name of megabytes had `--check` parse it for minutes.
NAME_MAX = 100
_NAME_CHARACTERS = re.compile(r"[A-Za-z0-9._-]+")


def name_problem(name: str) -> str | None:
    """Why `name` cannot name a run (None if it can): one path segment of at most
    `NAME_MAX` letters, digits, '-', '_' and '.', not '.' or '..'. The length is
    checked first, so a name of megabytes costs nothing more."""
    if len(name) > NAME_MAX:
        return (f"{len(name)} characters; a run's name names its folder (runs/<name>): at "
                f"most {NAME_MAX}")
    if name in (".", ".."):
        return f"'{name}' is not a folder's name; use letters, digits, '-', '_' or '.'"
    if not _NAME_CHARACTERS.fullmatch(name):
        unsafe = "".join(sorted({c for c in name if not _NAME_CHARACTERS.fullmatch(c)}))
        return (f"{name!r} has characters a run's name cannot have ({unsafe!r}); it names "
                "its folder (runs/<name>): use letters, digits, '-', '_' or '.'")
    return None


@dataclass
class RunConfig:
    name: str = described(
        "run", "the run's name (default: the config file's name), which names its output "
        "folder (`runs/<name>`) and workspace: at most 100 letters, digits, `-`, `_` and "
        "`.` (not `.` or `..`)")
    strategy: str = described(
        "kernel", "`kernel`, `single`, `data`, `hybrid`, `reference`, `auto` (the model's "
        "pick among the distributed ones), or a strategy you registered")
    placement: Literal["calibrated", "even", "model", "recorded"] = described(
        "calibrated", "`calibrated` (kernels, or for `data`/`hybrid` the batch's samples, by "
        "measured speed where that clearly beats an even split; a worker may get nothing), "
        "`even`, `model` (the split the performance model predicts fastest; `data` and "
        "`hybrid` refuse it), or `recorded` (the split `split_from` gives)")
    split_from: str | list[list[int]] | None = described(
        None, "`placement: recorded`: an earlier run's directory (its `summary.json`), or the "
        "split itself as a run's summary holds it (`kernel_split`, or `batch_split` for "
        "`data`/`hybrid`)")
    network: NetworkConfig = described(factory=NetworkConfig, doc="the network")
    data: DataConfig = described(factory=DataConfig, doc="the dataset")
    train: TrainConfig = described(factory=TrainConfig, doc="the training: SGD, steps, "
                                   "checkpoints, tasks")
    cluster: ClusterConfig = described(factory=ClusterConfig, doc="the workers")
    workspace: WorkspaceConfig = described(factory=WorkspaceConfig,
                                           doc="the exchange workspace between workers")
    reference: ReferenceConfig = described(factory=ReferenceConfig,
                                           doc="the `reference` strategy")
    hybrid: HybridConfig = described(factory=HybridConfig, doc="the `hybrid` strategy")
    output: str | None = described(None, "the run's output directory (record, summary, "
                                   "trace, checkpoints, config; null: `runs/<name>`)")
    progress: bool = described(True, "the progress bar, the start-up phase lines and the "
                               "placement line (`false`: none of them)")
    prediction: Literal["auto", "cached", "never"] = described(
        "cached", "the model's step time for this run, written next to the measured one "
        "(`predicted_step_time`, `prediction_error` in `summary.json`; "
        "`predicted_step_time` in the record's attrs; pipeline/prediction.py), and beside "
        "the error `compute_error`, the model's compute against the run's (the closing "
        "lines say both): `cached` predicts from a probe of this cluster made "
        "earlier (by a sweep, `placement: model` or `auto`) and says in `prediction_note` "
        "when there is none; `auto` probes the cluster after the run if none is cached "
        "(seconds to a minute, once per cluster, network and batch); `never` skips it")

    def __post_init__(self) -> None:
        if not self.name:
            raise FieldError("name", "a run needs a name (it names runs/<name>)")
        problem = name_problem(self.name)
        if problem:
            raise FieldError("name", problem)
        if (self.placement == "recorded") != (self.split_from is not None):
            raise FieldError("split_from", "placement 'recorded' takes a split_from (a run "
                             "directory or a split), and split_from needs placement "
                             "'recorded'")
        if self.placement == "model" and self.cluster.workspace_transport() == "s3":
            raise FieldError("placement", "placement 'model' probes the cluster, and the "
                             "probe exchanges over sftp, not the s3 workspace: use "
                             "'calibrated' or 'even'")
        if self.workspace.sync == "scheduler" and self.train.steps_per_task not in ("auto", 1):
            raise FieldError("train.steps_per_task", "several steps per task need "
                             "workspace.sync: markers (with 'scheduler' a step's tasks "
                             "wait for each other through the scheduler): use 1 or auto")
        if self.workspace.path and self.cluster.workspace_transport() == "s3":
            raise FieldError("cluster.link.workspace", "s3 puts the exchange workspace in "
                             "the run's own object store: unset workspace.path, or use "
                             "cluster.link.workspace: sftp")

    # Derived values -------------------------------------------------------------

    # The paths below are absolute: the workers are handed them, and a worker started
    # in another directory would resolve a relative one against its own.

    @property
    def output_dir(self) -> str:
        return os.path.abspath(self.output or os.path.join("runs", self.name))

    @property
    def dataset_path(self) -> str:
        return os.path.abspath(self._dataset_path())

    def built_dataset(self) -> str | None:
        """`dataset_path` where its store exists, else None: what a probe of this run
        trains on (without one it makes a small synthetic store of the same shape)."""
        return self.dataset_path if os.path.exists(self.dataset_path) else None

    def _dataset_path(self) -> str:
        if self.data.path:
            return self.data.path
        train, test = self.data.sample_counts()
        side = self.data.image_side()
        size = "" if side == DataConfig.DEFAULT_IMAGE_SIZE else f"-{side}px"
        if self.data.source == "synthetic":
            return os.path.join("data", f"synthetic-{train}-{test}-s{self.data.seed}{size}-"
                                f"{self.network.dtype}.zarr")
        source = os.path.abspath(self.data.source)  # its digest: CIFAR archives share names
        where = hashlib.sha256(source.encode()).hexdigest()[:8]
        counts = "" if train is None and test is None else f"-{train or 'all'}-{test or 'all'}"
        seed = f"-s{self.data.seed}" if self.data.seed else ""  # an image folder's order
        return os.path.join("data", f"{os.path.basename(source).split('.')[0]}-{where}"
                            f"{counts}{seed}{size}-{self.network.dtype}.zarr")

    def shared_directories(self) -> list[str]:
        """The absolute directories a run's workers read and write (exchange workspace
        root, unless it is in an object store; dataset store's folder; output
        directory): what linked hosts mount."""
        directories = [os.path.dirname(self.dataset_path), self.output_dir]
        if self.cluster.workspace_transport() == "s3":
            return directories
        return [os.path.abspath(self.workspace.path or default_workspace_root()), *directories]

    @property
    def checkpoint_path(self) -> str:
        return os.path.join(self.output_dir, "checkpoints.zarr")

    def network_spec(self, image_shape: tuple[int, int, int]) -> NetworkSpec:
        """The network's shapes, given the dataset's (channels, height, width)."""
        return self.network.spec(image_shape)

    def channel_quanta(self, network: NetworkSpec) -> list[int]:
        """The channel quantum of every conv layer: a placement's unit (see WorkspaceConfig)."""
        quantum = self.workspace.channel_quantum
        if quantum == "auto":
            return auto_channel_quanta(network)
        return [quantum] * len(network.conv)

    def steps_per_task(self) -> int | Literal["auto"]:
        """`train.steps_per_task` as a run on workers applies it: one step per task
        where the scheduler orders a step's tasks (`workspace.sync: scheduler`). A
        strategy that runs no tasks says its own (`Strategy.steps_per_task`)."""
        if self.workspace.sync == "scheduler":
            return 1
        return self.train.steps_per_task

    def optimizer_spec(self) -> OptimizerSpec:
        """Every SGD of the run: its base rate, momentum, decay and the rate's schedule."""
        t = self.train
        return OptimizerSpec(t.lr, t.momentum, t.weight_decay, t.nesterov, t.lr_schedule())

    def next_checkpoint(self, step: int) -> int:
        """The first step after `step` after which a checkpoint is written: the next
        multiple of `train.checkpoint_every`, or the run's last step. Computed, not
        looked up in a set of them: a run of 10^8 steps has as many."""
        every, steps = self.train.checkpoint_every, self.train.steps
        return min(steps, (step // every + 1) * every) if every else steps


def auto_channel_quanta(network: NetworkSpec) -> list[int]:
    """`workspace.channel_quantum: auto`: about 1/32 of each conv layer's kernels, at
    least 4 (WorkspaceConfig's description says why)."""
    return [max(4, -(-layer.kernels // 32)) for layer in network.conv]


#: The network fields a preset takes the place of (`build_run_config`).
PRESET_REPLACES = ("conv", "layers", "hidden")


def build_run_config(data: dict[str, Any], overrides: list[str] = ()) -> RunConfig:
    """Validate raw config data after applying ``key=value`` overrides."""
    return from_dict(RunConfig, with_overrides(data, overrides))


def with_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of raw config data with ``key=value`` overrides applied as the command
    line means them: a `network.preset` replaces the network's own layers (its `conv`,
    `layers`, `hidden`), and a layer set after it is refused (FieldError)."""
    data = copy.deepcopy(data)
    layer_keys = []  # overrides inside the layer lists a preset replaces
    for text in overrides:
        if text.startswith("name=") and len(text) > len("name=''") + NAME_MAX:
            raise FieldError("name", name_problem(text[len("name="):]) or "")  # unparsed
        key, value = parse_override(text)
        if key == "network.preset" and isinstance(data.get("network"), dict):
            for replaced in PRESET_REPLACES:  # the preset is the network, as it comes last
                data["network"].pop(replaced, None)
            layer_keys = []
        if key.split(".")[:2] in (["network", name] for name in PRESET_REPLACES):
            layer_keys.append(key)
        set_dotted(data, key, value)
    network = data.get("network")
    preset = network.get("preset") if isinstance(network, dict) else None
    if preset and layer_keys:  # a layer set after the preset: on nothing it has
        raise FieldError(layer_keys[0], f"network.preset {preset} gives the layers "
                         "(network.width scales their channels; network.layers, without a "
                         "preset, builds a network of your own)")
    return data


def load_run_config(path: str, overrides: list[str] = ()) -> RunConfig:
    """Load, override and validate a run config file; raises ConfigError."""
    data = load_yaml(path)
    data.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    return build_run_config(data, overrides)
