"""The schema of one training run's config, and how to load it.

A run config is YAML; `load_run_config` validates it into `RunConfig` and applies
dotted ``key=value`` overrides from the command line first. Sweeps (in
`experiments`) build on the same schema and only add axes.
"""

from __future__ import annotations

import copy
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.config.addresses import address_problem
from pipeline.cluster.links import rate_bits
from pipeline.config.schema import (ConfigError, FieldError, check_range, from_dict, load_yaml,
                                    parse_override, parse_size, set_dotted)
from pipeline.cluster.security import TlsConfig
from storage.private import default_workspace_root
from tasks.specs import ConvLayerSpec, NetworkSpec, OptimizerSpec


@dataclass
class ConvLayerConfig:
    kernels: int
    size: int = 5
    padding: int = 2
    pool: int = 2

    def __post_init__(self) -> None:
        for name in ("kernels", "size", "pool"):
            check_range(self, name, low=1)
        check_range(self, "padding", low=0)


@dataclass
class NetworkConfig:
    conv: list[ConvLayerConfig] = field(
        default_factory=lambda: [ConvLayerConfig(32), ConvLayerConfig(64)]
    )
    hidden: list[int] = field(default_factory=list)
    classes: int = 10
    dtype: Literal["float32", "float64"] = "float32"

    def __post_init__(self) -> None:
        if not self.conv:
            raise FieldError("conv", "at least one conv layer is needed")
        for index, width in enumerate(self.hidden):
            if width < 1:
                raise FieldError(f"hidden.{index}", f"expected an integer >= 1, got {width}")
        check_range(self, "classes", low=1)


@dataclass
class DataConfig:
    source: str = "synthetic"  # "synthetic", or a path to CIFAR-10's python archive/folder
    path: str | None = None  # the Zarr store; default data/<source name>.zarr
    train_samples: int | None = None  # None: 5000 synthetic, or all of CIFAR-10
    test_samples: int | None = None  # None: 1000 synthetic, or all of CIFAR-10
    seed: int = 0  # of the synthetic set

    SYNTHETIC_DEFAULTS = (5000, 1000)

    def __post_init__(self) -> None:
        if not self.source:
            raise FieldError("source", "expected 'synthetic' or a path to CIFAR-10, got ''")
        check_range(self, "train_samples", low=1)
        check_range(self, "test_samples", low=1)
        check_range(self, "seed", low=0)

    def sample_counts(self) -> tuple[int | None, int | None]:
        """(train, test) samples to build the store with."""
        if self.source == "synthetic":
            train, test = self.SYNTHETIC_DEFAULTS
            return self.train_samples or train, self.test_samples or test
        return self.train_samples, self.test_samples


@dataclass
class TrainConfig:
    steps: int = 20
    batch: int = 64
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    nesterov: bool = False
    seed: int = 0
    warmup_steps: int = 1  # excluded from the timing summary
    checkpoint_every: int = 0  # 0: only step 0 and the last step
    eval_samples: int = 1000  # test images scored at the end (0: skip)
    resume: bool = False
    # Replace the results of an earlier run in the output directory (checkpoints,
    # record, summary); without it (or resume) a run refuses a directory that has them.
    fresh: bool = False
    # Consecutive steps one Dask task runs on a worker (pipeline/engine/task_steps.py): Dask's
    # per-task costs are paid once per task. "auto": tasks of about a second (one step
    # until a step is measured, at most 32); 1: a task per step. The arithmetic is the
    # same whatever it is; needs workspace.sync "markers" above 1.
    steps_per_task: int | Literal["auto"] = "auto"
    # Tasks submitted ahead of the one being collected: the workers find their next
    # task queued when they finish one (1: submit each task when the last is done).
    inflight: int = 2
    # data/hybrid: every replica reports a fingerprint of its weights each step, and
    # the run stops if two differ (costs a hash of the weights per step).
    check_replicas: bool = False
    # A lost worker: restore the last complete checkpoint, re-place its share on the
    # survivors and replay, at most this many times a run (0: stop at the first loss).
    max_recoveries: int = 3

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "inflight"):
            check_range(self, name, low=1)
        if self.steps_per_task != "auto":
            check_range(self, "steps_per_task", low=1)
        for name in ("checkpoint_every", "warmup_steps", "eval_samples", "weight_decay", "seed",
                     "max_recoveries"):
            check_range(self, name, low=0)
        check_range(self, "lr", low=0, low_open=True)
        check_range(self, "momentum", low=0, high=1, high_open=True)
        if self.nesterov and self.momentum == 0:
            raise FieldError("nesterov", "Nesterov momentum needs train.momentum > 0")
        if self.fresh and self.resume:
            raise FieldError("fresh", "train.fresh: true discards the results that "
                             "train.resume: true continues from; set one of them")


#: A worker's device as configs write it.
DEVICE_NAME = re.compile(r"cpu|cuda(:\d+)?")


@dataclass
class WorkerConfig:
    """One worker of the embedded cluster."""

    name: str | None = None
    # Dask resource tags; default {GPU: 1} for a CUDA device, else {CPU: 1}.
    resources: dict[str, float] | None = None
    threads: int = 1
    speed: float = 1.0  # < 1 emulates a slower device (labelled "emulated" everywhere)
    device: str = "cpu"  # "cpu" or "cuda:N": where the worker's tensors live
    link: str | None = None  # its host's link rate in tc units ("1gbit"); see cluster.link
    # Memory the worker may use ("2GB", "1.5GiB", or bytes): placement keeps every
    # split's predicted peak within it (docs/model.md). None: its device's (a GPU's
    # total memory; a CPU worker is unlimited). Not handed to Dask's nanny.
    memory_limit: str | int | None = None

    def __post_init__(self) -> None:
        check_range(self, "threads", low=1)
        self.memory_bytes()
        _check_rate(self.link, "link")
        check_range(self, "speed", low=0, high=1, low_open=True)
        if not DEVICE_NAME.fullmatch(self.device):
            raise FieldError("device", f"expected 'cpu' or 'cuda:N', got {self.device!r}")
        if self.resources is None:
            self.resources = {"GPU": 1.0} if self.device.startswith("cuda") else {"CPU": 1.0}
        for tag, amount in self.resources.items():
            if not tag or not math.isfinite(amount) or amount < 0:
                raise FieldError(f"resources.{tag}",
                                 f"expected a tag and a number >= 0, got {amount!r}")


    def memory_bytes(self) -> float | None:
        """`memory_limit` in bytes (None: not given)."""
        return parse_size(self.memory_limit, "memory_limit")


def _check_rate(rate: str | None, name: str) -> None:
    if rate is not None:
        try:
            rate_bits(rate)
        except ValueError as error:
            raise FieldError(name, str(error)) from None


@dataclass
class LinkConfig:
    """Every embedded worker on a host of its own behind a link shaped at `rate`
    (pipeline/cluster/links.py); a worker's own `link` overrides the rate."""

    rate: str = "1gbit"  # tc units: kbit, mbit, gbit (bits/s), mbps (bytes/s), ...
    # Where the exchange workspace lives: "sftp", a folder of the client's mounted over
    # sshfs in each worker's namespace; "s3", a bucket of an S3 server the run starts
    # on its bridge (pipeline/cluster/object_store.py). Dataset and checkpoints stay on sftp.
    workspace: Literal["sftp", "s3"] = "sftp"

    def __post_init__(self) -> None:
        _check_rate(self.rate, "rate")


@dataclass
class JobGroupConfig:
    """One kind of batch job of `cluster.jobqueue` (a partition's jobs): each runs one
    Dask worker. A field left unset takes the `cluster.jobqueue` value of that name."""

    jobs: int | None = None  # how many jobs (workers) of this kind
    cores: int | None = None  # the job's cores: the worker's torch threads
    memory: str | None = None  # the job's memory ("4GB"): the batch system's limit
    walltime: str | None = None  # "HH:MM:SS"; the job (its worker) ends then
    queue: str | None = None  # Slurm partition / PBS or SGE queue (None: the default)
    account: str | None = None  # Slurm/PBS account to charge (SGE: none)
    extra: list[str] | None = None  # more directives, e.g. ["--gres=gpu:1"] for Slurm
    resources: dict[str, float] | None = None  # the worker's tags (default: the run's)
    prologue: list[str] | None = None  # shell lines before the worker ("source .venv/...")

    def __post_init__(self) -> None:
        check_range(self, "jobs", low=1)
        check_range(self, "cores", low=1)
        if self.memory is not None:
            parse_size(self.memory, "memory")
        for tag, amount in (self.resources or {}).items():
            if not tag or not math.isfinite(amount) or amount < 1:
                raise FieldError(f"resources.{tag}",
                                 f"expected a tag and a number >= 1, got {amount!r}")


@dataclass
class JobqueueConfig(JobGroupConfig):
    """The run's workers as batch jobs of Slurm, PBS or SGE, through dask-jobqueue
    (pipeline/cluster/jobqueue.py): the run's scheduler on `host` (or `interface`), one job
    per worker. `groups` lists jobs of several kinds (a GPU partition and a CPU one),
    each a tagged group of workers; without it, this one kind."""

    system: Literal["slurm", "pbs", "sge"] = "slurm"
    jobs: int | None = 2
    cores: int | None = 1
    memory: str | None = "4GB"
    walltime: str | None = "01:00:00"
    # Where the run's scheduler listens: an address of this host the jobs reach
    # (loopback: jobs on this machine only), or a network interface's name ("ib0").
    host: str = "127.0.0.1"
    interface: str | None = None
    # The folder the jobs read their TLS credentials and write their logs in: one on a
    # file system every node sees, as the same user (default: a folder in $HOME).
    directory: str | None = None
    groups: list[JobGroupConfig] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.groups is not None and not self.groups:
            raise FieldError("groups", "list at least one group of jobs, or leave it out")
        if self.interface is not None and self.host != "127.0.0.1":
            raise FieldError("interface", "set either cluster.jobqueue.host or "
                             "cluster.jobqueue.interface")

    def job_count(self) -> int:
        """How many jobs (workers) the run asks for, in all."""
        return sum(group.jobs or self.jobs or 0 for group in self.groups or [self])

    def group_list(self, tag: str) -> list[JobGroupConfig]:
        """Every kind of job with each field filled in (from this config, and `tag`
        for resources)."""
        groups = self.groups or [JobGroupConfig()]
        filled = []
        for group in groups:
            values = {name: getattr(group, name) if getattr(group, name) is not None
                      else getattr(self, name) for name in JobGroupConfig.__dataclass_fields__}
            values["resources"] = values["resources"] or {tag: 1.0}
            values["extra"], values["prologue"] = values["extra"] or [], values["prologue"] or []
            filled.append(JobGroupConfig(**values))
        return filled


@dataclass
class ClusterConfig:
    scheduler: str | None = None  # None: DASK_SCHEDULER_ADDRESS, else an embedded cluster
    # The embedded cluster: a count of CPU workers, or a list of workers.
    workers: int | list[WorkerConfig] = 2
    # ...or one worker per device, e.g. [cuda:0, cpu, cpu] (GPU ones tagged GPU, CPU
    # ones CPU), each CPU worker with `threads` torch threads. Replaces `workers`.
    devices: list[str] | None = None
    threads: int = 1  # torch threads of each CPU worker that `workers: N` or `devices` makes
    resource: str = "CPU"  # the tag whose workers run the conv tasks
    # Several tags: every worker offering any of them, ordered by tag then name (so
    # [GPU, CPU] puts the GPU workers first, and the first is the default master).
    resources: list[str] | None = None
    use_workers: int | None = None  # how many tagged workers to use (None: all)
    wait_timeout: float = 30.0  # seconds to wait for workers offering the tag
    # The worker that runs the dense head (the seed papers' master): a worker name or
    # a resource tag (its first worker by name). None: the first worker of the run.
    master: str | None = None
    # Workers behind shaped links, each in a network namespace of its own, the run's
    # directories reached over sftp (pipeline/cluster/links.py). None: all on one host.
    link: LinkConfig | None = None
    # Seconds a worker may hold an unfinished task of the run while the run makes no
    # progress before it is probed and, if it does not answer, declared lost (a
    # SIGSTOPped or frozen process). "auto": max(30 s, 10x the median step), 120 s
    # before any step is measured; None: never.
    stall_timeout: float | None | Literal["auto"] = "auto"
    # The client's certificates for a tls:// scheduler ({ca_file, cert, key}: PEM files;
    # docs/multihost.md). None: Dask's own TLS config, if any.
    tls: TlsConfig | None = None
    # The run's workers as batch jobs (Slurm, PBS, SGE) it submits itself; None: none.
    jobqueue: JobqueueConfig | None = None

    def link_rates(self) -> dict[str, str] | None:
        """Each embedded worker's link rate by name; None when no link is configured."""
        workers = self.worker_list()
        if self.link is None and all(w.link is None for w in workers):
            return None
        default = self.link.rate if self.link else None
        return {w.name: w.link or default for w in workers}

    def workspace_transport(self) -> str | None:
        """How linked workers reach the exchange workspace ("sftp", "s3"); None when
        no link is configured (workers share the client's host)."""
        if self.link_rates() is None:
            return None
        return self.link.workspace if self.link else LinkConfig.workspace

    def tags(self) -> list[str]:
        """The resource tags whose workers this run uses, in order of preference.

        `resources` if set; else, with `devices` and the default `resource`, every
        device listed (GPU workers first); else `resource`.
        """
        if self.resources:
            return list(self.resources)
        if self.devices is not None and self.resource == "CPU":
            return [t for t in ("GPU", "CPU")
                    if any(t in (w.resources or {}) for w in self.worker_list())]
        return [self.resource]

    def worker_list(self) -> list[WorkerConfig]:
        """The embedded cluster's workers, with names filled in."""
        if self.devices is not None:
            workers = [WorkerConfig(device=device,
                                    threads=1 if device.startswith("cuda") else self.threads)
                       for device in self.devices]
        elif isinstance(self.workers, int):
            workers = [WorkerConfig(threads=self.threads) for _ in range(self.workers)]
        else:
            workers = [copy.copy(w) for w in self.workers]
        for index, worker in enumerate(workers):
            if worker.name is None:
                tag = "-".join(sorted(worker.resources or {})).lower() or "worker"
                worker.name = f"{tag}-{index}"
        return workers

    def __post_init__(self) -> None:
        if self.devices is not None:
            if not isinstance(self.workers, int) or self.workers != 2:
                raise FieldError("devices", "set either cluster.devices or cluster.workers")
            for index, device in enumerate(self.devices):
                if not DEVICE_NAME.fullmatch(device):
                    raise FieldError(f"devices.{index}",
                                     f"expected 'cpu' or 'cuda:N', got {device!r}")
        count = len(self.worker_list())
        if count < 1:
            raise FieldError("workers", "at least one worker is needed")
        check_range(self, "threads", low=1)
        check_range(self, "use_workers", low=1)
        check_range(self, "wait_timeout", low=0, low_open=True)
        if self.stall_timeout != "auto":
            check_range(self, "stall_timeout", low=0, low_open=True)
        if not self.resource:
            raise FieldError("resource", "expected a resource tag such as 'CPU', got ''")
        if self.resources is not None:
            if not self.resources or not all(self.resources):
                raise FieldError("resources", "list at least one tag, none empty")
            if self.resource != "CPU":
                raise FieldError("resources", "set either cluster.resource or "
                                 "cluster.resources")
        problem = address_problem(self.scheduler) if self.scheduler else None
        if problem:
            raise FieldError("scheduler", problem)
        if self.tls and self.scheduler and not self.scheduler.startswith("tls://"):
            raise FieldError("tls", f"certificates are for a tls:// scheduler, not "
                             f"{self.scheduler}")
        self._check_links()
        self._check_jobqueue()

    def _check_jobqueue(self) -> None:
        """Batch jobs are the run's own workers: no other scheduler, links or client
        certificates with them, and every kind of job offers one of the run's tags."""
        if self.jobqueue is None:
            return
        for other in ("scheduler", "link", "tls"):
            if getattr(self, other) is not None:
                raise FieldError("jobqueue", f"the run starts its own scheduler for its "
                                 f"batch jobs: unset cluster.{other} or cluster.jobqueue")
        tags = self.tags()
        for index, group in enumerate(self.jobqueue.group_list(tags[0])):
            if not any(group.resources.get(tag, 0) >= 1 for tag in tags):
                where = f"groups.{index}." if self.jobqueue.groups else ""
                raise FieldError(f"jobqueue.{where}resources",
                                 f"its workers offer {sorted(group.resources)}, none of the "
                                 f"run's tags ({', '.join(tags)})")

    def _check_links(self) -> None:
        """Links shape an embedded cluster only, and every worker needs a rate."""
        rates = self.link_rates()
        if rates is None:
            return
        if self.scheduler:
            raise FieldError("link", "links shape the embedded cluster a run starts; "
                             "unset cluster.scheduler or the links")
        if self.tls:
            raise FieldError("tls", "certificates are for an external tls:// scheduler; the "
                             "linked cluster a run starts talks tcp on its private bridge")
        for index, (name, rate) in enumerate(rates.items()):
            if rate is None:
                raise FieldError(f"workers.{index}.link", f"worker {name} has no link rate; "
                                 "give it one, or set cluster.link.rate for all")


@dataclass
class WorkspaceConfig:
    path: str | None = None  # default: /dev/shm when all workers are local, else <output>
    # Shards own whole multiples of this many channels (one Zarr chunk each). "auto":
    # about 1/32 of each layer's kernels, at least 4: fine enough for a split that
    # follows speeds to within ~2 %, and few enough chunks that Zarr's per-chunk cost
    # (~0.3 ms on /dev/shm) stays small.
    channel_quantum: int | Literal["auto"] = "auto"
    # How a task waits for another worker's data: "markers" (one task per worker and
    # step; the reader polls the writer's ready marker in the workspace) or
    # "scheduler" (a Dask dependency, one task per stretch between exchanges).
    sync: Literal["markers", "scheduler"] = "markers"
    wait_timeout: float = 600.0  # seconds a task waits for a peer's data before failing

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
    threads: int = 1  # torch threads of the in-process reference run

    def __post_init__(self) -> None:
        check_range(self, "threads", low=1)


@dataclass
class HybridConfig:
    """Krizhevsky's hybrid: conv layers data-parallel, dense layers split by neurons."""

    # How the dense layers get the conv features: "a" all at once (all-gather), "b"
    # one worker's share at a time, "c" the k-th fraction of every share at a time.
    scheme: Literal["a", "b", "c"] = "a"
    # "full": the dense layers step once a step (single-process SGD arithmetic);
    # "worker": after each part, on its mean loss (Krizhevsky's variable batch size).
    dense_batch: Literal["full", "worker"] = "full"
    # The conv layers' learning rate times 1, the workers, or their square root.
    conv_lr_scaling: Literal["none", "linear", "sqrt"] = "none"


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
    name: str = "run"
    strategy: str = "kernel"  # a name in pipeline.strategies.STRATEGIES (checked there)
    placement: Literal["calibrated", "even", "model", "recorded"] = "calibrated"
    # placement "recorded": the split to reuse, as a run's summary.json holds it
    # (kernel_split, or batch_split for data/hybrid), or an earlier run's directory
    split_from: str | list[list[int]] | None = None
    network: NetworkConfig = field(default_factory=NetworkConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    workspace: WorkspaceConfig = field(default_factory=WorkspaceConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    hybrid: HybridConfig = field(default_factory=HybridConfig)
    output: str | None = None  # default: runs/<name>
    progress: bool = True
    # The model's step time for this run, recorded next to the measured one
    # (pipeline/prediction.py): "cached" predicts from a probe of this cluster made
    # earlier (a sweep or `auto` makes one), "auto" probes the cluster after the run
    # if none is cached (seconds to a minute, once per cluster), "never" skips it.
    prediction: Literal["auto", "cached", "never"] = "cached"

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

    def _dataset_path(self) -> str:
        if self.data.path:
            return self.data.path
        train, test = self.data.sample_counts()
        if self.data.source == "synthetic":
            return os.path.join(
                "data", f"synthetic-{train}-{test}-s{self.data.seed}-{self.network.dtype}.zarr")
        base = os.path.basename(os.path.normpath(self.data.source)).split(".")[0]
        counts = "" if train is None and test is None else f"-{train or 'all'}-{test or 'all'}"
        return os.path.join("data", f"{base}{counts}-{self.network.dtype}.zarr")

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
        channels, height, width = image_shape
        layers = []
        for layer in self.network.conv:
            spec = ConvLayerSpec(channels, layer.kernels, layer.size, layer.padding,
                                 layer.pool, height, width)
            if spec.out_height < 1 or spec.out_width < 1:
                raise ConfigError(
                    f"network.conv.{len(layers)}: the image is only {height}x{width} here, "
                    "too small for this kernel/pool"
                )
            layers.append(spec)
            channels, height, width = spec.kernels, spec.out_height, spec.out_width
        return NetworkSpec(tuple(layers), tuple(self.network.hidden),
                           self.network.classes, self.network.dtype)

    def channel_quanta(self, network: NetworkSpec) -> list[int]:
        """The chunk quantum of every conv layer (see WorkspaceConfig)."""
        quantum = self.workspace.channel_quantum
        if quantum == "auto":
            return [max(4, -(-layer.kernels // 32)) for layer in network.conv]
        return [quantum] * len(network.conv)

    def steps_per_task(self) -> int | Literal["auto"]:
        """`train.steps_per_task` as a run on workers applies it: one step per task
        where the scheduler orders a step's tasks (`workspace.sync: scheduler`). A
        strategy that runs no tasks says its own (`Strategy.steps_per_task`)."""
        if self.workspace.sync == "scheduler":
            return 1
        return self.train.steps_per_task

    def optimizer_spec(self) -> OptimizerSpec:
        t = self.train
        return OptimizerSpec(t.lr, t.momentum, t.weight_decay, t.nesterov)

    def checkpoint_steps(self) -> set[int]:
        """Steps after which a checkpoint is written (0 = the initial weights)."""
        steps = {0, self.train.steps}
        if self.train.checkpoint_every:
            steps.update(range(0, self.train.steps, self.train.checkpoint_every))
        return steps


def build_run_config(data: dict[str, Any], overrides: list[str] = ()) -> RunConfig:
    """Validate raw config data after applying ``key=value`` overrides."""
    data = copy.deepcopy(data)
    for text in overrides:
        if text.startswith("name=") and len(text) > len("name=''") + NAME_MAX:
            raise FieldError("name", name_problem(text[len("name="):]) or "")  # unparsed
        key, value = parse_override(text)
        set_dotted(data, key, value)
    return from_dict(RunConfig, data)


def load_run_config(path: str, overrides: list[str] = ()) -> RunConfig:
    """Load, override and validate a run config file; raises ConfigError."""
    data = load_yaml(path)
    data.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    return build_run_config(data, overrides)
