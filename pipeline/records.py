"""What a run measured, as an xarray Dataset and a printed summary.

Per step: wall time, loss, the master's time; per step and worker: compute (with the
emulated part apart), storage read/write time and bytes. `wait_time` is the part of
a step's wall time that neither the master nor the busiest worker spent working:
Dask hops, stragglers and idle time.
"""

from __future__ import annotations

import json
import platform
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import xarray as xr

from tasks.receipts import Receipt

PER_WORKER = {
    "compute_time": ("s", "conv compute per worker (forward+backward+update), emulated part included"),
    "emulated_time": ("s", "sleep added to emulate a slower device (0 on real devices)"),
    "read_time": ("s", "storage read time per worker"),
    "write_time": ("s", "storage write time per worker"),
    "read_bytes": ("B", "bytes read from storage per worker"),
    "write_bytes": ("B", "bytes written to storage per worker"),
}
PER_STEP = {
    "step_time": ("s", "wall time of the step as seen by the master"),
    "loss": ("1", "training cross-entropy loss of the step's batch"),
    "master_time": ("s", "master's own work: dense head plus its storage I/O"),
    "master_compute_time": ("s", "master's dense-head compute"),
    "master_storage_time": ("s", "master's storage read+write time"),
    "wait_time": ("s", "wall time not covered by the master or the busiest worker"),
}


@dataclass
class RunRecorder:
    """Collects step timings and receipts during a run."""

    workers: list[str]
    worker_labels: list[str]
    emulated_speeds: list[float]
    devices: list[str] = field(default_factory=list)
    by_shard: dict[tuple[int, int, str], float] = field(default_factory=dict)
    checkpoint_s: float = 0.0  # time spent saving checkpoints, outside every step
    final_drain_s: float = 0.0  # the last step's backward, after the last window
    steps: dict[int, dict[str, float]] = field(default_factory=dict)
    by_step_worker: dict[tuple[int, str], dict[str, float]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(float)))

    def add_step(self, step: int, wall_s: float, loss: float, master: dict[str, float]) -> None:
        self.steps[step] = {"step_time": wall_s, "loss": loss,
                            "master_time": master["master_s"],
                            "master_compute_time": master["master_compute_s"],
                            "master_storage_time": master["master_read_s"]
                            + master["master_write_s"]}

    def add_receipts(self, receipts: list[Receipt]) -> None:
        for r in receipts:
            if r.phase not in ("forward", "backward", "step"):
                continue
            shard_key = (r.step, r.layer, r.worker)
            self.by_shard[shard_key] = self.by_shard.get(shard_key, 0.0) + r.compute_s
            cell = self.by_step_worker[(r.step, r.worker)]
            cell["compute_time"] += r.compute_s
            cell["emulated_time"] += r.emulated_s
            cell["read_time"] += r.read_s
            cell["write_time"] += r.write_s
            cell["read_bytes"] += r.read_bytes
            cell["write_bytes"] += r.write_bytes

    def to_dataset(self, attrs: dict) -> xr.Dataset:
        steps = sorted(self.steps)
        data = {}
        for name, (units, description) in PER_STEP.items():
            if name == "wait_time":
                continue
            data[name] = xr.Variable(("step",), [self.steps[s][name] for s in steps],
                                     {"units": units, "description": description})
        for name, (units, description) in PER_WORKER.items():
            values = np.array([[self.by_step_worker.get((s, w), {}).get(name, 0.0)
                                for w in self.workers] for s in steps], dtype=float)
            data[name] = xr.Variable(("step", "worker"), values,
                                     {"units": units, "description": description})
        layers = sorted({layer for (_s, layer, _w) in self.by_shard if layer >= 0})
        if layers:
            data["shard_compute_time"] = xr.Variable(
                ("step", "layer", "worker"),
                np.array([[[self.by_shard.get((s, layer, w), 0.0) for w in self.workers]
                           for layer in layers] for s in steps], dtype=float),
                {"units": "s", "description": "forward+backward compute of each conv "
                 "layer's shard on each worker (emulated part included)"})
        busy = (data["compute_time"].values + data["read_time"].values
                + data["write_time"].values)
        wait = (data["step_time"].values - data["master_time"].values
                - (busy.max(axis=1) if busy.size else 0.0))
        units, description = PER_STEP["wait_time"]
        data["wait_time"] = xr.Variable(("step",), np.maximum(wait, 0.0),
                                        {"units": units, "description": description})
        coords = {"step": steps, "worker": self.workers,
                  **({"layer": layers} if layers else {}),
                  "worker_label": ("worker", self.worker_labels),
                  "emulated_speed": ("worker", self.emulated_speeds),
                  "device": ("worker", self.devices or ["cpu"] * len(self.workers))}
        return xr.Dataset(data, coords=coords, attrs=attrs)


def summarize(ds: xr.Dataset, warmup_steps: int, batch: int) -> dict:
    """Median step time and spread over the measured (post-warm-up) steps."""
    measured = ds.step_time.values[warmup_steps:] if ds.sizes["step"] > warmup_steps \
        else ds.step_time.values
    times = np.asarray(measured, dtype=float)
    median = float(np.median(times)) if times.size else float("nan")
    summary = {
        "measured_steps": int(times.size),
        "step_time_median": median,
        "step_time_p25": float(np.percentile(times, 25)) if times.size else float("nan"),
        "step_time_p75": float(np.percentile(times, 75)) if times.size else float("nan"),
        "step_time_min": float(times.min()) if times.size else float("nan"),
        "step_time_max": float(times.max()) if times.size else float("nan"),
        "throughput": batch / median if times.size and median > 0 else float("nan"),
        "final_loss": float(ds.loss.values[-1]) if ds.sizes["step"] else float("nan"),
    }
    tail = ds.isel(step=slice(warmup_steps, None)) if ds.sizes["step"] > warmup_steps else ds
    summary["compute_time_median"] = float(tail.compute_time.max("worker").median())
    summary["storage_time_median"] = float((tail.read_time + tail.write_time)
                                           .max("worker").median())
    summary["wait_time_median"] = float(tail.wait_time.median())
    summary["master_time_median"] = float(tail.master_time.median())
    summary["bytes_per_step"] = float((tail.read_bytes + tail.write_bytes).sum("worker")
                                      .median())
    return summary


def format_summary(name: str, strategy: str, summary: dict, workers: list[str]) -> str:
    """The closing lines a run prints."""
    spread = (f"IQR {summary['step_time_p25']:.3f}-{summary['step_time_p75']:.3f} s, "
              f"range {summary['step_time_min']:.3f}-{summary['step_time_max']:.3f} s")
    lines = [
        f"run {name}: strategy {strategy} on {', '.join(workers)}",
        f"  step time   median {summary['step_time_median']:.3f} s over "
        f"{summary['measured_steps']} measured steps ({spread})",
        f"  throughput  {summary['throughput']:.1f} samples/s",
        f"  breakdown   compute {summary['compute_time_median']:.3f} s, storage "
        f"{summary['storage_time_median']:.3f} s, master {summary['master_time_median']:.3f} s,"
        f" wait {summary['wait_time_median']:.3f} s (medians per step)",
        f"  loss        {summary['final_loss']:.4f} (last step)",
    ]
    if summary.get("test_accuracy") is not None:
        lines.append(f"  accuracy    {summary['test_accuracy']:.3f} on "
                     f"{summary['test_samples']} test images")
    return "\n".join(lines)


def software_versions() -> dict[str, str]:
    import dask
    import distributed
    import torch
    import zarr

    return {"python": platform.python_version(), "torch": torch.__version__,
            "dask": dask.__version__, "distributed": distributed.__version__,
            "zarr": zarr.__version__, "xarray": xr.__version__, "numpy": np.__version__}


def jsonable(value: object) -> str:
    return json.dumps(value, default=str)
