"""What the project's own processes hold on this machine beyond a bare process, with
no network to speak of: measured by training a tiny network, once per machine.

Why measured and not a constant: a worker's or the training process's runtime (the
Dask worker's own state, the task modules, oneDNN's kernels, the library pages the
work touches) is the machine's and its environment's: how many library pages a
process maps for a page it touches follows how the page cache holds the files (a
fresh install maps whole large folios), and oneDNN's kernels follow the instruction
set. A constant fitted on one machine's runs said nothing of another's. So the memory
model's `worker_runtime` and `client_runtime` (pipeline/costmodel/memory.py) are, for
a run, the working memory of a run of `TINY_NETWORK` on this machine: `single` for a
worker (the peak of its one worker less a forked bare worker), `reference` for the
training process (its peak less a bare client). Each is the run's own record
(summary.json's `memory_working`), the same measurement a run's prediction is
compared with.

Two short runs in subprocesses, at once (about 10 s on a 2-core machine), kept with the bare
processes' figures (pipeline/records/memory.py's cache). `$CNN_MEMORY_RUNTIME=fitted`
skips the measurement and keeps the fitted constants; the tiny runs themselves are
started so, or each would measure again; and without ``$DASK_SCHEDULER_ADDRESS``, so
that they run on this machine's embedded cluster, not on a cluster it names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import yaml

__all__ = ["RUNTIME_VARIABLE", "TINY_NETWORK", "measure_runtimes", "runtimes_wanted"]

#: ``$CNN_MEMORY_RUNTIME``: ``measured`` (default) or ``fitted`` (module doc; ``fitted``
#: keeps the constants' conv workspace too, pipeline/records/conv_workspace.py).
RUNTIME_VARIABLE = "CNN_MEMORY_RUNTIME"
#: A network whose own tensors are a few KB: one conv layer of two 3x3 kernels on 8x8
#: images, a dense layer to 10 classes, batch 32.
TINY_NETWORK = {
    "name": "memory-runtime",
    "placement": "even",
    "network": {"conv": [{"kernels": 2, "size": 3, "padding": 1}], "hidden": [],
                "classes": 10, "dtype": "float32"},
    "data": {"source": "synthetic", "image_size": 8, "train_samples": 64,
             "test_samples": 32},
    "train": {"steps": 3, "batch": 32, "lr": 0.05, "momentum": 0.9, "eval_samples": 0,
              "checkpoint_every": 0},
    "cluster": {"workers": 1, "resource": "CPU"},
    "progress": False,
}
#: A scheduler the environment names, which a run without `cluster.scheduler` would use:
#: the tiny runs measure this machine's own embedded worker, so they never see it.
SCHEDULER_VARIABLE = "DASK_SCHEDULER_ADDRESS"
#: Longest a tiny run may take before the measurement gives up (fitted constants).
RUN_TIMEOUT_S = 300


def runtimes_wanted() -> bool:
    """Whether runtimes are measured (``$CNN_MEMORY_RUNTIME`` is not ``fitted``)."""
    return os.environ.get(RUNTIME_VARIABLE, "measured").strip().lower() != "fitted"


def _tiny_run_working(strategy: str, folder: str, in_client: bool) -> float:
    """The working memory of `TINY_NETWORK` trained by `strategy` in a subprocess:
    its one worker's, or with `in_client` (a strategy that trains in the client
    process) the client's; 0 where the run fails."""
    config_path = os.path.join(folder, f"{strategy}.yaml")
    config = {**TINY_NETWORK, "strategy": strategy,
              "output": os.path.join(folder, strategy),
              "data": {**TINY_NETWORK["data"], "path": os.path.join(folder, f"{strategy}-data.zarr")}}
    with open(config_path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(config, handle)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**{k: v for k, v in os.environ.items() if k != SCHEDULER_VARIABLE},
           RUNTIME_VARIABLE: "fitted", "CNN_PREDICT_PROBE": "never",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", ""))
                                         if p)}
    try:
        subprocess.run([sys.executable, "-m", "pipeline.train", config_path],
                       capture_output=True, timeout=RUN_TIMEOUT_S, env=env, cwd=folder,
                       check=True)
        with open(os.path.join(folder, strategy, "summary.json"), encoding="utf-8") as handle:
            summary = json.load(handle)
    except (OSError, subprocess.SubprocessError, ValueError):
        return 0.0
    working = ([summary.get("client_memory_working")] if in_client
               else list((summary.get("memory_working") or {}).values()))
    figures = [float(w) for w in working if isinstance(w, (int, float)) and w > 0]
    return max(figures, default=0.0)


def measure_runtimes() -> tuple[float, float]:
    """(worker, client) runtime in bytes on this machine, each 0 where it could not be
    measured (module doc)."""
    with tempfile.TemporaryDirectory(prefix="hetcnn-memory-runtime-") as folder, \
            ThreadPoolExecutor(2) as pool:  # each its own process: the two at once
        worker = pool.submit(_tiny_run_working, "single", folder, False)
        client = pool.submit(_tiny_run_working, "reference", folder, True)
        return worker.result(), client.result()
