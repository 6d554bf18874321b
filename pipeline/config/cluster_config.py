"""The cluster a run uses: its workers (embedded, behind links, as batch jobs, or one
you started), the tags that pick them, and how long it waits for them.

Part of the run config (`pipeline.config.run_config.RunConfig.cluster`); apart from
it because the cluster's rules (devices, tags, links, jobs) are a topic of their own.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from typing import Literal

from pipeline.cluster.links import rate_bits
from pipeline.cluster.security import TlsConfig
from pipeline.config.addresses import address_problem
from pipeline.config.jobqueue_config import JobqueueConfig
from pipeline.config.schema import FieldError, check_range, described, parse_size


#: `cluster.workers` and `cluster.threads` where a config leaves them out.
DEFAULT_WORKERS, DEFAULT_THREADS = 2, 1
#: A worker's device as configs write it.
DEVICE_NAME = re.compile(r"cpu|cuda(:\d+)?")


@dataclass
class WorkerConfig:
    """One worker of the embedded cluster."""

    name: str | None = described(None, "the worker's name, one no other worker has "
                                 "(null: its tag and index, `cpu-0`)")
    resources: dict[str, float] | None = described(
        None, "its Dask resource tags (null: `{GPU: 1}` for a CUDA device, else `{CPU: 1}`)")
    threads: int = described(1, "its torch threads")
    speed: float = described(1.0, "below 1 emulates a slower device: its tasks sleep in "
                             "proportion to their compute (labelled \"emulated\" everywhere)")
    device: str = described("cpu", "`cpu` or `cuda:N`: where the worker's tensors live")
    link: str | None = described(None, "its host's link rate in tc units (`1gbit`), "
                                 "overriding `cluster.link.rate`")
    memory_limit: str | int | None = described(
        None, "the memory the worker may use (`2GB`, `1.5GiB` or bytes): placement keeps "
        "every split's predicted peak within it (docs/model.md); null: its device's (a "
        "GPU's total memory; a CPU worker is unlimited). Not handed to Dask's nanny")

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

    rate: str = described("1gbit", "every linked worker's rate in tc units: `kbit`, "
                          "`mbit`, `gbit` (bits/s), `mbps` (bytes/s), ...")
    workspace: Literal["sftp", "s3"] = described(
        "sftp", "where the exchange workspace lives: `sftp`, a folder of the client's "
        "mounted over sshfs in each worker's namespace; `s3`, a bucket of an S3 server the "
        "run starts on its bridge (pipeline/cluster/object_store.py). Dataset and "
        "checkpoints stay on sftp")

    def __post_init__(self) -> None:
        _check_rate(self.rate, "rate")


@dataclass
class ClusterConfig:
    scheduler: str | None = described(
        None, "the address of a scheduler you started (`tcp://HOST:8786`, `tls://...`); "
        "null: `DASK_SCHEDULER_ADDRESS`, else an embedded cluster the run starts")
    workers: int | list[WorkerConfig] | None = described(
        None, "the embedded cluster: a count of CPU workers, or a list of workers (null: "
        "2; under `jobqueue`: a count, its jobs; null: `jobqueue.jobs`, else 2)")
    devices: list[str] | None = described(
        None, "instead of `workers`, one worker per device, e.g. `[cuda:0, cpu, cpu]` (GPU "
        "ones tagged GPU, CPU ones CPU, each CPU worker with `threads` torch threads)")
    threads: int | None = described(
        None, "torch threads of each CPU worker that `workers: N` or `devices` makes (null: "
        "1; under `jobqueue`: each job's cores; null: `jobqueue.cores`, else 1)")
    resource: str = described("CPU", "the tag whose workers train (`GPU` runs the shards "
                              "on CUDA)")
    resources: list[str] | None = described(
        None, "several tags: every worker offering any of them, ordered by tag then name "
        "(`[GPU, CPU]` puts the GPU workers first, and the first is the default master), "
        "each serving under the first tag it offers")
    use_workers: int | None = described(None, "how many tagged workers to use (null: all)")
    memory_margin: float = described(
        0.15, "the share of each predicted peak placement keeps free on a worker with a "
        "capacity (`memory_limit`, a `dask worker`'s `--memory-limit`, a GPU's total) for "
        "the memory model's error: every split is planned with peak x (1 + this) within "
        "it (docs/memory.md); 0: plan to the limit")
    wait_timeout: float = described(30.0, "seconds to wait for workers offering the tag")
    connect_timeout: float = described(
        10.0, "seconds to connect to a scheduler you started and hear its handshake (an "
        "address that accepts but does not speak Dask, such as the dashboard's port, is "
        "refused after this)")
    master: str | None = described(
        None, "the worker with the dense head (the seed papers' master): a worker name or a "
        "resource tag (its first worker by name); null: the run's first worker. A master "
        "outside the kernel workers holds no kernels")
    link: LinkConfig | None = described(
        None, "every embedded worker behind a shaped link, each in a network namespace of "
        "its own, the run's directories reached over sftp (pipeline/cluster/links.py); a "
        "`workers` entry's `link` overrides its rate; null: all on one host")
    stall_timeout: float | None | Literal["auto"] = described(
        "auto", "seconds without a finished task after which the workers holding the run's "
        "tasks are probed, and one that does not answer (stopped, its link cut) is removed "
        "from the cluster and recovered from like a lost worker, while stores none of the "
        "workers can list within 5 s stop the run; `auto`: max(30 s, 10x the median task "
        "of `train.steps_per_task` steps), 120 s before the first step; null: never")
    scheduler_timeout: float | None = described(
        300.0, "seconds the run waits for a scheduler that stops answering (stopped, its "
        "host frozen) before it stops as with a lost scheduler, its checkpoints kept; a "
        "warning comes after 30 s (or half the limit); null: wait for ever")
    tls: TlsConfig | None = described(
        None, "the client's certificates for a `tls://` scheduler (PEM files; "
        "docs/multihost.md); null: Dask's own TLS config, if any")
    jobqueue: JobqueueConfig | None = described(
        None, "the run's workers as Slurm, PBS or SGE batch jobs it submits itself "
        "(docs/multihost.md); null: none")

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
        if self.devices is not None and self.workers not in (None, DEFAULT_WORKERS):
            raise FieldError("devices", "set either cluster.devices or cluster.workers")
        if self.jobqueue is None:
            self._fill_defaults()
        else:  # the jobs' figures, or the defaults
            self._jobs_from_workers()
        if self.devices is not None:
            for index, device in enumerate(self.devices):
                if not DEVICE_NAME.fullmatch(device):
                    raise FieldError(f"devices.{index}",
                                     f"expected 'cpu' or 'cuda:N', got {device!r}")
        count = len(self.worker_list())
        if count < 1:
            raise FieldError("workers", "at least one worker is needed")
        check_range(self, "threads", low=1)
        check_range(self, "use_workers", low=1)
        check_range(self, "memory_margin", low=0, high=1)
        check_range(self, "wait_timeout", low=0, low_open=True)
        check_range(self, "connect_timeout", low=0, low_open=True)
        check_range(self, "scheduler_timeout", low=0, low_open=True)
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
        self._check_names()
        self._check_links()
        self._check_jobqueue()

    def _fill_defaults(self) -> None:
        """`workers` and `threads` left unset (null) take their defaults, 2 and 1; unset
        rather than written as 2 and 1, so that under `jobqueue` a figure written can be
        told from one left out (`_jobs_from_workers`). `devices` makes the workers."""
        if self.workers is None and self.devices is None:
            self.workers = DEFAULT_WORKERS
        if self.threads is None:
            self.threads = DEFAULT_THREADS

    def _check_names(self) -> None:
        """Every embedded worker's name, given or made (`cpu-1`), is its own: Dask keeps
        one worker of a name, so two entries of one name would start two processes and
        train on one, every figure then one worker's under a count of two."""
        field = "devices" if self.devices is not None else "workers"
        first: dict[str, int] = {}
        for index, worker in enumerate(self.worker_list()):
            if worker.name in first:
                given = (isinstance(self.workers, list)
                         and self.workers[index].name is not None)
                what = repr(worker.name) if given else f"its default name {worker.name!r}"
                raise FieldError(f"{field}.{index}.name",
                                 f"{what} is already used (by cluster.{field}."
                                 f"{first[worker.name]}); give each worker a name of its own")
            first[worker.name] = index

    def _check_jobqueue(self) -> None:
        """Batch jobs are the run's own workers: no other scheduler, links or client
        certificates with them, and every kind of job offers one of the run's tags."""
        if self.jobqueue is None:
            return
        for other in ("scheduler", "link", "tls"):
            if getattr(self, other) is not None:
                raise FieldError("jobqueue", f"the run starts its own scheduler for its "
                                 f"batch jobs: unset cluster.{other} or cluster.jobqueue")
        jobs = self.jobqueue.job_count()
        if self.use_workers and self.use_workers > jobs:
            raise FieldError("use_workers", f"{self.use_workers}, but cluster.jobqueue submits "
                             f"{jobs} job(s) of one worker each")
        tags = self.tags()
        for index, group in enumerate(self.jobqueue.group_list(tags[0])):
            if not any(group.resources.get(tag, 0) >= 1 for tag in tags):
                where = f"groups.{index}." if self.jobqueue.groups else ""
                raise FieldError(f"jobqueue.{where}resources",
                                 f"its workers offer {sorted(group.resources)}, none of the "
                                 f"run's tags ({', '.join(tags)})")

    def _jobs_from_workers(self) -> None:
        """Under `cluster.jobqueue` the workers are its jobs: a count of
        `cluster.workers` and `cluster.threads` are its unset `jobs` and `cores`, and
        the config then says the jobs' count and cores in both places (a sweep's
        `cluster.workers` axis, its dry run and its report count jobs; with `groups`,
        `workers` is their total). What describes the embedded cluster only (a list of
        workers, devices), or contradicts a job count or cores given, is refused naming
        both fields, `workers: 2` against `jobs: 4` as `workers: 3` against `jobs: 2`
        (the defaults are null, so a figure written is told from one left out):
        ignored, 3 workers asked for trained on 2 jobs, and emulated speeds on
        full-speed jobs."""
        jobqueue = self.jobqueue
        assert jobqueue is not None
        if self.devices is not None:
            raise FieldError("devices", "lists the embedded cluster's devices, but under "
                             "cluster.jobqueue the workers are batch jobs: drop "
                             "cluster.devices (GPU jobs: cluster.jobqueue.groups)")
        if isinstance(self.workers, list):
            raise FieldError("workers", "a list describes the embedded cluster's workers "
                             "(emulated speeds, devices, memory limits), but under "
                             "cluster.jobqueue the workers are batch jobs: give "
                             "cluster.workers a count, or jobs of several kinds in "
                             "cluster.jobqueue.groups")
        if jobqueue.groups and jobqueue.jobs is None:  # a group's unset count
            jobqueue.jobs = DEFAULT_WORKERS
        for mine, theirs, what in (("workers", "jobs", "the number of jobs"),
                                  ("threads", "cores", "each job's cores")):
            value, given = getattr(self, mine), getattr(jobqueue, theirs)
            if value is None:  # left out: the jobs' figure, else the default
                if given is None:
                    given = DEFAULT_WORKERS if mine == "workers" else DEFAULT_THREADS
                    setattr(jobqueue, theirs, given)
                # say the jobs' figure where the run reads it (groups: their total)
                setattr(self, mine, jobqueue.job_count() if mine == "workers" else given)
            elif jobqueue.groups and mine == "workers":
                if value != jobqueue.job_count():
                    raise FieldError("workers", f"{value}, but cluster.jobqueue.groups give "
                                     f"{jobqueue.job_count()} job(s): set the groups' jobs "
                                     "(cluster.jobqueue.groups.N.jobs) and drop "
                                     "cluster.workers")
            elif given is None:
                setattr(jobqueue, theirs, value)
            elif given != value:
                raise FieldError(mine, f"{value}, but cluster.jobqueue.{theirs} is {given} "
                                 f"(under cluster.jobqueue, cluster.{mine} is {what}): set "
                                 "one of them")

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
