"""What a run measured, as an xarray Dataset.

A trainer hands the loop one `StepResult` per step (its loss and the receipts of
its tasks); the loop adds the step's wall time. From the receipts' phases
(tasks/receipts.py) the record derives, per step and worker: compute (emulated
part apart), workspace reads and writes (time and bytes), time blocked waiting for
a peer's data, dataset reads; per step: wall time, loss, the dense head's compute,
and `wait_time`, the part of the step the busiest worker did not spend on its own
work (waiting for peers, Dask dispatch). Memory: per step and worker the most its
process held while it ran the step's ops (host resident memory; on a GPU also what
torch allocated and reserved), per step the client's, as tasks/memory.py measures
them; the summary gives each one's peak over the run, and its "working" memory,
that peak less what a bare process that has imported the run's libraries holds.
The summary over the measured steps and the lines a run prints are
pipeline/records/summary.py.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections import defaultdict
from dataclasses import dataclass, field

import dask
import distributed
import numpy as np
import torch
import xarray as xr
import zarr

from tasks.layout import DENSE_HEAD
from tasks.memory import LIFETIME, PER_STRETCH, MemoryPeak
from tasks.receipts import Receipt


@dataclass
class StepResult:
    """One finished step: its training loss, the receipts of its tasks and the learning
    rate its SGD took (the dense layers' where the hybrid scales the conv layers')."""

    step: int
    loss: float
    receipts: list[Receipt]
    lr: float = float("nan")

    @property
    def finished(self) -> float:
        """When its last task finished (epoch seconds, on the workers' clocks)."""
        return max(r.end for r in self.receipts)


PER_WORKER = {
    "compute_time": ("s", "compute per worker (conv forward+backward+update, the dense "
                     "head on the master), emulated part included"),
    "emulated_time": ("s", "sleep added to emulate a slower device (0 on real devices)"),
    "read_time": ("s", "workspace read time per worker"),
    "write_time": ("s", "workspace write time per worker"),
    "read_bytes": ("B", "bytes read from the workspace per worker"),
    "write_bytes": ("B", "bytes written to the workspace per worker"),
    "workspace_bytes": ("B", "workspace bytes read + written per worker (dataset apart)"),
    "exchange_wait_time": ("s", "time blocked until a peer's data was ready"),
    "dataset_time": ("s", "time reading the batch (or labels) from the dataset store"),
    "dataset_bytes": ("B", "bytes read from the dataset store"),
}
PER_STEP = {
    "step_time": ("s", "wall time of the step, from the previous step's completion to "
                  "its own (steps are submitted ahead; pipeline/engine/task_steps.py)"),
    "loss": ("1", "training cross-entropy loss of the step's batch"),
    "lr": ("1", "the learning rate of the step's SGD update (train.lr as its schedule "
           "moves it: train.lr_decay, train.lr_warmup; the dense layers' under "
           "hybrid.conv_lr_scaling)"),
    "master_time": ("s", "the dense head's compute on the master worker"),
    "wait_time": ("s", "step time the busiest worker spent not working on its own "
                  "compute, workspace I/O or dataset reads (waiting for peers, dispatch)"),
    "client_cpu_time": ("s", "CPU time of the client's process over the step: the client's "
                        "submits and collects, an embedded cluster's scheduler, and for "
                        "`reference` the training itself; a task's CPU shared out "
                        "evenly over its steps"),
    "task_steps": ("1", "steps in the task that ran the step (train.steps_per_task)"),
}
#: name -> (key in a receipt's ``extra["memory"]``, description): maxima, not sums.
MEMORY = {
    "memory_peak": ("rss", "most host resident memory the worker's process held while it "
                    "ran the step's ops (everything it held already included)"),
    "memory_held": ("held", "host resident memory of the worker's process when it started "
                    "the step's ops: what it holds between steps (freed pages its heap keeps "
                    "for reuse included); the peak less this is the step's own"),
    "gpu_allocated_peak": ("gpu_allocated", "most GPU memory torch had allocated on the "
                           "worker's device during the step (torch.cuda.max_memory_allocated;"
                           " 0 on a CPU worker)"),
    "gpu_reserved_peak": ("gpu_reserved", "most GPU memory torch's caching allocator held "
                          "on the worker's device during the step (max_memory_reserved)"),
}
_PHASES = {"compute_time": ("compute", "emulated"), "emulated_time": ("emulated",),
           "read_time": ("read",), "write_time": ("write",),
           "exchange_wait_time": ("wait",), "dataset_time": ("dataset",)}
_BYTES = {"read_bytes": ("read",), "write_bytes": ("write",),
          "workspace_bytes": ("read", "write"), "dataset_bytes": ("dataset",)}


@dataclass
class RunRecorder:
    """Collects step results (and every receipt, for the trace) during a run."""

    workers: list[str]
    worker_labels: list[str]
    emulated_speeds: list[float]
    devices: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)  # the resource tag each worker served
    checkpoint_s: float = 0.0  # time spent saving checkpoints, outside every step
    steps: dict[int, dict[str, float]] = field(default_factory=dict)
    cells: dict[tuple[int, str], dict[str, float]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    by_shard: dict[tuple[int, int, str], float] = field(default_factory=dict)
    receipts: list[Receipt] = field(default_factory=list)
    memory: dict[tuple[int, str], dict[str, float]] = field(default_factory=dict)
    client_memory: dict[int, float] = field(default_factory=dict)
    memory_kinds: set[str] = field(default_factory=set)

    def add_step(self, result: StepResult, wall_s: float,
                 client: MemoryPeak | None = None, client_cpu_s: float = float("nan"),
                 task_steps: int = 1) -> None:
        """Add a finished step; `client` is the client process's memory peak over it,
        `client_cpu_s` its CPU time, `task_steps` the steps its task ran."""
        dense = 0.0
        if client is not None:
            self.client_memory[result.step] = float(client.rss)
            self.memory_kinds.add(client.kind)
        for receipt in result.receipts:
            self.receipts.append(receipt)
            peak = receipt.extra.get("memory")
            if peak:  # a step's tasks on one worker: the most any of them held
                held = self.memory.setdefault((result.step, receipt.worker), {})
                for name, (key, _description) in MEMORY.items():
                    held[name] = max(held.get(name, 0.0), float(peak.get(key, 0)))
                self.memory_kinds.add(str(peak.get("kind", "")))
            cell = self.cells[(result.step, receipt.worker)]
            for name, kinds in _PHASES.items():
                cell[name] += sum(receipt.seconds(kind) for kind in kinds)
            for name, kinds in _BYTES.items():
                cell[name] += sum(receipt.nbytes(kind) for kind in kinds)
            for event in receipt.events:
                busy = sum(p.seconds for p in event.phases if p.kind in ("compute", "emulated"))
                if event.name == DENSE_HEAD:
                    dense += busy
                elif event.layer >= 0:
                    key = (result.step, event.layer, receipt.worker)
                    self.by_shard[key] = self.by_shard.get(key, 0.0) + busy
        self.steps[result.step] = {"step_time": wall_s, "loss": result.loss, "lr": result.lr,
                                   "master_time": dense, "client_cpu_time": client_cpu_s,
                                   "task_steps": task_steps}

    def forget_from(self, step: int) -> None:
        """Drop the figures of steps `step`.. (lost with a worker; they will be replayed
        and recorded once). Their receipts stay, for the trace's timeline."""
        self.steps = {s: v for s, v in self.steps.items() if s < step}
        for key in [k for k in self.cells if k[0] >= step]:
            del self.cells[key]
        self.memory = {k: v for k, v in self.memory.items() if k[0] < step}
        self.client_memory = {s: v for s, v in self.client_memory.items() if s < step}
        self.by_shard = {k: v for k, v in self.by_shard.items() if k[0] < step}

    def ensure_workers(self, workers: list, devices: list[str]) -> None:
        """Note the devices of an engine's workers (`ClusterWorker`s, as it reports them),
        adding a column for any worker a re-placed run uses that the record lacks."""
        self.devices += ["cpu"] * (len(self.workers) - len(self.devices))
        self.tags += [""] * (len(self.workers) - len(self.tags))
        for worker, device in zip(workers, devices):
            if worker.name in self.workers:
                self.devices[self.workers.index(worker.name)] = device
                continue
            self.workers.append(worker.name)
            self.worker_labels.append(worker.label)
            self.emulated_speeds.append(worker.emulated_speed)
            self.devices.append(device)
            self.tags.append(worker.resource)

    def task_steps_median(self, warmup_steps: int) -> dict[str, float]:
        """``{"task_steps_median": ...}`` over the measured steps (as `summarize` gives
        it), for the model to price the tasks the run ran; {} before any step."""
        steps = sorted(self.steps)
        counts = [self.steps[s]["task_steps"] for s in steps[warmup_steps:] or steps]
        return {"task_steps_median": float(np.median(counts))} if counts else {}

    def to_dataset(self, attrs: dict) -> xr.Dataset:
        steps = sorted(self.steps)
        data = {}
        for name, (units, description) in PER_STEP.items():
            if name != "wait_time":
                data[name] = xr.Variable(("step",), [self.steps[s][name] for s in steps],
                                         {"units": units, "description": description})
        for name, (units, description) in PER_WORKER.items():
            values = np.array([[self.cells.get((s, w), {}).get(name, 0.0) for w in self.workers]
                               for s in steps], dtype=float)
            data[name] = xr.Variable(("step", "worker"), values,
                                     {"units": units, "description": description})
        layers = sorted({layer for (_s, layer, _w) in self.by_shard})
        if layers:
            data["shard_compute_time"] = xr.Variable(
                ("step", "layer", "worker"),
                np.array([[[self.by_shard.get((s, layer, w), 0.0) for w in self.workers]
                           for layer in layers] for s in steps], dtype=float),
                {"units": "s", "description": "forward+backward compute of each conv "
                 "layer's shard on each worker (emulated part included)"})
        data.update(self._memory_variables(steps))
        busy = sum(data[name].values for name in ("compute_time", "read_time", "write_time",
                                                  "dataset_time"))
        wait = data["step_time"].values - (busy.max(axis=1) if busy.size else 0.0)
        units, description = PER_STEP["wait_time"]
        data["wait_time"] = xr.Variable(("step",), np.maximum(wait, 0.0),
                                        {"units": units, "description": description})
        coords = {"step": steps, "worker": self.workers,
                  **({"layer": layers} if layers else {}),
                  "worker_label": ("worker", self.worker_labels),
                  "emulated_speed": ("worker", self.emulated_speeds),
                  "device": ("worker", self.devices or ["cpu"] * len(self.workers)),
                  "resource_tag": ("worker", self.tags or [""] * len(self.workers))}
        return xr.Dataset(data, coords=coords, attrs=attrs)

    def _memory_variables(self, steps: list[int]) -> dict[str, xr.Variable]:
        """The memory figures (NaN where a step reported none); the GPU's only where
        some worker has one."""
        kind = LIFETIME if LIFETIME in self.memory_kinds else PER_STRETCH
        how = ("; the process's lifetime peak up to the step (this system cannot reset it)"
               if kind == LIFETIME else "")
        data = {}
        for name, (_key, description) in MEMORY.items():
            values = np.array([[self.memory.get((s, w), {}).get(name, np.nan)
                                for w in self.workers] for s in steps], dtype=float)
            if name.startswith("gpu") and not np.nansum(values):
                continue
            data[name] = xr.Variable(("step", "worker"), values, {
                "units": "B", "description": description + how, "peak_kind": kind})
        data["client_memory_peak"] = xr.Variable(
            ("step",), np.array([self.client_memory.get(s, np.nan) for s in steps], dtype=float),
            {"units": "B", "peak_kind": kind, "description": "most host resident memory the "
             "client process held while it submitted and collected the step" + how})
        return data


def link_attrs(transport: str, before: dict[str, tuple[int, int]],
               after: dict[str, tuple[int, int]]) -> dict[str, str]:
    """The record's attributes of the bytes that crossed each worker's link between two
    readings of its counters ((to the worker, from it) by name, as
    `LinkedHosts.counters` gives them): what each worker received and sent, all
    traffic (workspace, dataset, checkpoints, Dask's messages, protocol overhead)."""
    names = [name for name in after if name in before]
    return {"workspace_transport": transport,
            "link_bytes_received": jsonable({n: after[n][0] - before[n][0] for n in names}),
            "link_bytes_sent": jsonable({n: after[n][1] - before[n][1] for n in names})}


def code_revision() -> str:
    """The git revision of this code, '-dirty' if tracked files have changed: a figure
    from an uncommitted tree says so."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here,
                                  capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return revision + ("-dirty" if dirty.strip() else "")


def software_versions() -> dict[str, str]:
    return {"python": platform.python_version(), "torch": torch.__version__,
            "dask": dask.__version__, "distributed": distributed.__version__,
            "zarr": zarr.__version__, "xarray": xr.__version__, "numpy": np.__version__}


def jsonable(value: object) -> str:
    return json.dumps(value, default=str)
