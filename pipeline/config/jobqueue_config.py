"""`cluster.jobqueue`: the run's workers as batch jobs (Slurm, PBS, SGE) it submits
itself, one kind or several (`groups`), each field's meaning beside it.

Part of the cluster config (`pipeline.config.cluster_config.ClusterConfig.jobqueue`,
which also says how `cluster.workers` and `threads` meet `jobs` and `cores`); apart
from it as the batch system's fields are a topic of their own.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from pipeline.config.schema import FieldError, check_range, described, parse_size

#: A job's walltime as every batch system takes it (hours may pass 23), or Slurm's
#: days before it; the batch system refused anything else only once submitted.
WALLTIME = re.compile(r"(\d+-)?\d+:[0-5]\d:[0-5]\d")


@dataclass
class JobGroupConfig:
    """One kind of batch job of `cluster.jobqueue` (a partition's jobs): each runs one
    Dask worker. A field left unset takes the `cluster.jobqueue` value of that name."""

    jobs: int | None = described(None, "how many jobs (workers) of this kind")
    cores: int | None = described(None, "the job's cores: the worker's torch threads")
    memory: str | None = described(None, "the job's memory (`4GB`): the batch system's "
                                   "limit")
    walltime: str | int | None = described(None, "`HH:MM:SS` (Slurm also `D-HH:MM:SS`; a "
                                           "number: seconds); the job (its worker) ends then")
    queue: str | None = described(None, "the Slurm partition, PBS or SGE queue (null: the "
                                  "default)")
    account: str | None = described(None, "the Slurm/PBS account to charge (SGE: none)")
    extra: list[str] | None = described(None, "more directives, e.g. `[\"--gres=gpu:1\"]` "
                                        "for Slurm")
    resources: dict[str, float] | None = described(None, "the worker's tags (null: the "
                                                   "run's first tag)")
    prologue: list[str] | None = described(None, "shell lines run before the worker "
                                           "(`source .venv/bin/activate`)")

    def __post_init__(self) -> None:
        check_range(self, "jobs", low=1)
        check_range(self, "cores", low=1)
        if self.memory is not None:
            parse_size(self.memory, "memory")
        if isinstance(self.walltime, int):  # seconds; YAML reads 12:00:00 so (base 60)
            if self.walltime < 1:
                raise FieldError("walltime", f"expected at least 1 second, got "
                                 f"{self.walltime}")
            hours, rest = divmod(self.walltime, 3600)
            self.walltime = f"{hours:02d}:{rest // 60:02d}:{rest % 60:02d}"
        if self.walltime is not None and not WALLTIME.fullmatch(self.walltime):
            raise FieldError("walltime", f"expected HH:MM:SS (Slurm also D-HH:MM:SS), got "
                             f"{self.walltime!r}")
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

    system: Literal["slurm", "pbs", "sge"] = described("slurm", "the batch system")
    jobs: int | None = described(None, "how many jobs (workers); null: `cluster.workers`, "
                                 "a count")
    cores: int | None = described(None, "each job's cores: its worker's torch threads; "
                                  "null: `cluster.threads`")
    memory: str | None = described("4GB", "each job's memory: the batch system's limit")
    walltime: str | int | None = described("01:00:00", "`HH:MM:SS` (Slurm also `D-HH:MM:SS`; "
                                           "a number: seconds); a job (its worker) ends then")
    host: str = described("127.0.0.1", "where the run's scheduler listens: an address of "
                          "this host the jobs reach (loopback: jobs on this machine only)")
    interface: str | None = described(None, "or a network interface's name (`ib0`) the "
                                      "scheduler listens on, instead of `host`")
    directory: str | None = described(
        None, "the folder the jobs read their TLS credentials and write their logs in: one "
        "on a file system every node sees, as the same user (null: a folder in $HOME)")
    groups: list[JobGroupConfig] | None = described(
        None, "jobs of several kinds (a GPU partition and a CPU one), each a tagged group "
        "of workers whose unset fields take the values above; null: one kind")

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
