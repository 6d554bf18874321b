"""What a run measured, as an xarray Dataset and a printed summary.

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
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import dask
import distributed
import numpy as np
import torch
import xarray as xr
import zarr

from pipeline.records.step_breakdown import record_breakdown
from tasks.layout import DENSE_HEAD
from pipeline.records.memory import memory_lines, memory_summary
from tasks.memory import LIFETIME, PER_STRETCH, MemoryPeak
from tasks.receipts import Receipt


@dataclass
class StepResult:
    """One finished step: its training loss and the receipts of its tasks."""

    step: int
    loss: float
    receipts: list[Receipt]

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
        self.steps[result.step] = {"step_time": wall_s, "loss": result.loss,
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


def client_cpu_summary(tail: xr.Dataset) -> dict:
    """The client process's CPU per measured step, and as a share of one core: on a
    machine whose cores the workers fill, this is time taken from them."""
    if "client_cpu_time" not in tail or not np.isfinite(tail.client_cpu_time.values).any():
        return {}
    cpu = tail.client_cpu_time
    return {"client_cpu_per_step": float(cpu.median()),
            "client_core_share": float((cpu / tail.step_time).median())}


def summarize(ds: xr.Dataset, warmup_steps: int, batch: int, in_client: bool = False) -> dict:
    """Median step time and spread over the measured (post-warm-up) steps
    (`in_client`: the run trained in the client's process, for its memory figures)."""
    tail = ds.isel(step=slice(warmup_steps, None)) if ds.sizes["step"] > warmup_steps else ds
    times = np.asarray(tail.step_time.values, dtype=float)
    median = float(np.median(times)) if times.size else float("nan")

    def percentile(q: float) -> float:
        return float(np.percentile(times, q)) if times.size else float("nan")

    return {
        "measured_steps": int(times.size),
        "step_time_median": median,
        "step_time_p25": percentile(25), "step_time_p75": percentile(75),
        "step_time_min": percentile(0), "step_time_max": percentile(100),
        "throughput": batch / median if times.size and median > 0 else float("nan"),
        "final_loss": float(ds.loss.values[-1]) if ds.sizes["step"] else float("nan"),
        "compute_time_median": float(tail.compute_time.max("worker").median()),
        "storage_time_median": float((tail.read_time + tail.write_time).max("worker").median()),
        "wait_time_median": float(tail.wait_time.median()),
        "master_time_median": float(tail.master_time.median()),
        **client_cpu_summary(tail),
        # steps per Dask task (train.steps_per_task); older records lack it
        **({"task_steps_median": float(tail.task_steps.median())} if "task_steps" in tail
           else {}),
        "bytes_per_step": float(tail.workspace_bytes.sum("worker").median()),
        # where a step's time goes along its critical worker (pipeline/records/step_breakdown.py)
        "critical_breakdown": record_breakdown(ds, warmup_steps),
        **memory_summary(ds, in_client),
    }


def _task_steps(summary: dict) -> str:
    """", N steps per task" where a run's tasks held several steps."""
    steps = summary.get("task_steps_median")
    return f", {steps:g} steps per task (median)" if steps and steps > 1 else ""


def format_summary(name: str, strategy: str, summary: dict, workers: list[str]) -> str:
    """The closing lines a run prints."""
    spread = (f"IQR {summary['step_time_p25']:.3f}-{summary['step_time_p75']:.3f} s, "
              f"range {summary['step_time_min']:.3f}-{summary['step_time_max']:.3f} s")
    lines = [
        f"run {name}: strategy {strategy} on {', '.join(workers)}",
        f"  step time   median {summary['step_time_median']:.3f} s over "
        f"{summary['measured_steps']} measured steps ({spread})",
        f"  throughput  {summary['throughput']:.1f} samples/s",
        f"  breakdown   compute {summary['compute_time_median']:.3f} s, exchange "
        f"{summary['storage_time_median']:.3f} s, dense head {summary['master_time_median']:.3f}"
        f" s, wait {summary['wait_time_median']:.3f} s (medians per step)",
        *([f"  client      {summary['client_cpu_per_step'] * 1e3:.1f} ms CPU per step "
           f"({summary['client_core_share']:.0%} of a core: the client and an embedded "
           f"scheduler){_task_steps(summary)}"]
          if summary.get("client_cpu_per_step") is not None else []),
        *(["  critical    " + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in
                                          summary["critical_breakdown"].items())
           + " (medians along each step's critical worker)"]
          if summary.get("critical_breakdown") else []),
        f"  exchange    {summary['bytes_per_step'] / 1e6:.2f} MB per step (workspace "
        "reads and writes)",
        *memory_lines(summary),
        f"  loss        {summary['final_loss']:.4f} (last step)",
    ]
    if summary.get("test_accuracy") is not None:
        lines.append(f"  accuracy    {summary['test_accuracy']:.3f} on "
                     f"{summary['test_samples']} test images")
    choice = summary.get("strategy_choice")
    if choice:
        runner = choice.get("runner_up")
        lines.append(f"  auto        chose {choice['chosen']} (master {choice['master']}, "
                     f"placement {choice['placement']}): predicted "
                     f"{choice['predicted_step_time']:.4f} s/step"
                     + (f"; runner-up {runner['strategy']} {runner['predicted_step_time']:.4f}"
                        " s/step" if runner else ""))
    if summary.get("predicted_step_time") is not None and summary.get("prediction_error") \
            is not None:
        compute = summary.get("compute_error")
        lines.append(f"  predicted   {summary['predicted_step_time']:.4f} s/step by the model "
                     f"({summary['prediction_error']:+.0%} against the median"
                     + (f"; its compute {compute:+.0%} against this run's" if compute is not None
                        else "") + ")")
    if summary.get("link_bytes_sent"):
        lines.append(
            f"  links       {sum(summary['link_bytes_received'].values()) / 1e6:.2f} MB to "
            f"the workers, {sum(summary['link_bytes_sent'].values()) / 1e6:.2f} MB from them "
            f"({summary['workspace_transport']} workspace)")
    for line in summary.get("left_out") or []:
        lines.append(f"  left out    {line}")
    for r in summary.get("recoveries", []):
        lines.append(f"  recovered   {', '.join(r['lost_workers'])} {r.get('cause', 'lost')} "
                     f"at step {r['lost_at_step']}: back to checkpoint {r['restored_step']}, "
                     f"{r['replayed_steps']} step(s) replayed on {', '.join(r['workers'])} "
                     f"({r['seconds']:.1f} s)"
                     + (f"; {r['late_writes']} late write(s) of the ended attempt discarded"
                        if r.get("late_writes") else ""))
    for j in summary.get("joins", []):
        lines.append(f"  joined      {', '.join(j['joined_workers'])} at step {j['at_step']}: "
                     f"from then on {', '.join(j['workers'])}")
    return "\n".join(lines)


#: Why a split is what it is, by placement method (the placement line's end).
PLACEMENT_WHY = {"even": "an even split", "single": "one worker",
                 "calibrated": "measured speeds (placement: calibrated)",
                 "model": "the performance model (placement: model)",
                 "recorded": "a recorded split (placement: recorded)"}


def placement_line(method: str, split: dict[str, Any], workers: list[str], master: str,
                   choice: dict[str, Any]) -> str:
    """The one line a run prints once its work is placed: each worker's share
    (kernels per conv layer, or samples of the batch), the master, the predicted step
    where the placement predicted one, and why (`PLACEMENT_WHY`, the candidate it
    chose, units moved to fit memory). `split` is the strategy's record of its split
    (``kernel_split`` ``[layer][worker]`` or ``batch_split`` ``[worker]``), `choice`
    the placement's (`SplitChoice.record`, with ``memory``)."""
    if "kernel_split" in split:
        rows = split["kernel_split"]
        shares = [f"{name} {'+'.join(str(row[w]) for row in rows)}"
                  for w, name in enumerate(workers)]
        what = "kernels per conv layer"
    else:
        shares = [f"{name} {count}" for name, count in zip(workers, split["batch_split"])]
        what = "samples of each batch"
    why = PLACEMENT_WHY.get(method, method)
    if choice.get("chosen"):
        why += f", the {choice['chosen']} split"
    moved = (choice.get("memory") or {}).get("units_moved") or 0
    if moved:
        why += f", {moved} unit(s) moved to fit memory"
    predicted = choice.get("predicted_step_time")
    step = f"; predicted {predicted:.4f} s/step" if predicted else ""
    return f"placed: {what}: {', '.join(shares)} (master {master}){step}; by {why}"


def left_out_lines(placement: str, left_out: list[str], choice: dict[str, Any],
                   seconds_per_unit: dict[str, list[float]], unit: str = "kernel"
                   ) -> list[str]:
    """One line per worker a placement gave nothing: which worker, its measured speed
    against the fastest worker's, and why (the best split that gives it work is
    predicted slower than the split chosen without it).

    `choice` is the placement's record (`SplitChoice.record`: ``workers``, ``chosen``,
    ``predicted_step_time``, ``alternatives``, among them every worker alone as
    ``single:<name>``); `seconds_per_unit` its calibration (seconds per kernel per
    conv layer, or per sample, by worker); `unit` what they count. Speed is the
    predicted step of the worker alone, its fixed costs included; without those
    predictions, the calibration's seconds per unit. A placement that measured
    nothing (even, recorded) only says it gave the worker none.
    """
    alternatives = choice.get("alternatives", {})
    alone = {key.partition(":")[2]: alt["predicted_step_time"]
             for key, alt in alternatives.items() if key.startswith("single:")}
    per_unit = {name: sum(row) for name, row in seconds_per_unit.items() if row}
    speed, what = ((alone, f"s/step predicted for it alone by the {placement} placement")
                   if alone else (per_unit, f"s per {unit}" + (
                       ", summed over conv layers" if unit == "kernel" else "")))
    kept = {n: t for n, t in speed.items() if n not in left_out and t > 0}
    fastest = min(kept, key=kept.__getitem__) if kept else None
    names = list(choice.get("workers", []))
    chosen, chosen_time = choice.get("chosen"), choice.get("predicted_step_time")
    lines = []
    for name in left_out:
        line = f"worker {name} left out"
        if fastest is not None and speed.get(name, 0) > 0:
            line += (f": measured {speed[name] / kept[fastest]:.1f}x slower than {fastest} "
                     f"({speed[name]:.3g} against {kept[fastest]:.3g} {what})")
        else:
            line += f": {placement} placement gave it no work"
        with_it = {key: alt["predicted_step_time"] for key, alt in alternatives.items()
                   if name in names and alt.get("predicted_step_time") is not None
                   and any(row[names.index(name)] > 0 for row in alt["split"])}
        if with_it and chosen_time is not None:
            best = min(with_it, key=with_it.__getitem__)
            why = ("giving it {u}s would lengthen the step" if with_it[best] > chosen_time
                   else "the split without it was kept (no faster split gives it {u}s)")
            line += (f"; {why.format(u=unit)} ('{chosen}' without it is predicted "
                     f"{chosen_time:.3g} s/step, the fastest split with it, '{best}', "
                     f"{with_it[best]:.3g} s/step)")
        lines.append(line)
    return lines


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
