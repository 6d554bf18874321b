"""The master's loop of kernel-parallel training (and of `single`, its one-worker case).

Per step (see DESIGN.md, "Data flow of one kernel-parallel step"):

1. Forward: per conv layer, one task per shard, pinned to the owning worker. A task
   depends on every shard of the layer below (their outputs are its input) and on its
   own shard's previous backward (its weights). The whole forward is submitted at once;
   the master waits only for the last layer.
2. The master's dense head reads the last activations, runs forward/backward/update
   and writes the gradient of the last activations.
3. Backward: per layer, top down, one task per shard; each depends on every shard of
   the layer above (their partial input gradients are summed by the readers). The
   master does not wait: the next step's forward depends on these tasks.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from distributed import Client, Future, wait

from pipeline.cluster import ClusterError, WorkerSlot, all_local
from pipeline.config import RunConfig
from pipeline.dense_head import DenseHead
from pipeline.network import checkpoint_row_chunks, conv_keys, parameter_shapes
from pipeline.placement import shard_ranges, split_even, split_proportional
from pipeline.sampler import step_indices
from storage import checkpoints
from storage.arrays import IOMeter, open_cached
from storage.datasets import read_batch
from storage.workspace import (GRAD_TOP, act_path, create_workspace, default_workspace_path,
                               remove_workspace)
from tasks import conv_shard
from tasks.receipts import Receipt
from tasks.specs import NetworkSpec, RunPaths, ShardRange



class _DropAbandonedGather(logging.Filter):
    """Hide the noise of a result fetch `_gather` gave up on.

    When a worker dies holding a finished result, `_gather`'s time limit cancels
    Dask's fetch, and asyncio later logs the fetch's internal `AllExit` with a
    traceback. The run reports the lost worker itself, in one line.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exception = record.exc_info[1] if record.exc_info else None
        return type(exception).__name__ != "AllExit"


logging.getLogger("asyncio").addFilter(_DropAbandonedGather())

@dataclass
class Placement:
    """Which worker owns which kernels of each layer, and why."""

    method: str
    ranges: list[list[ShardRange]]  # [layer][worker]
    calibration: dict[str, list[float]] = field(default_factory=dict)  # worker -> s per kernel
    model: dict[str, Any] = field(default_factory=dict)  # placement "model": its predictions

    def counts(self) -> list[list[int]]:
        return [[r.size for r in layer] for layer in self.ranges]


@dataclass
class StepTiming:
    """What one step cost, as seen by the master."""

    step: int
    wall_s: float
    loss: float
    master_s: float
    master_read_s: float
    master_write_s: float
    master_bytes: int
    receipts: list[Receipt]


class KernelParallelEngine:
    """Drives kernel-parallel steps over a fixed set of workers."""

    def __init__(self, client: Client, config: RunConfig, network: NetworkSpec,
                 slots: list[WorkerSlot], train_samples: int) -> None:
        self.client = client
        self.config = config
        self.network = network
        self.slots = slots
        self.train_samples = train_samples
        self.run_id = f"{config.name}-{uuid.uuid4().hex[:8]}"
        workspace = config.workspace.path or default_workspace_path(
            config.output_dir, self.run_id, all_local(slots))
        self.paths = RunPaths(config.dataset_path, workspace, config.checkpoint_path)
        self.quanta = config.channel_quanta(network)  # per conv layer
        self.placement: Placement | None = None
        self._previous_backward: dict[tuple[int, int], Future] = {}
        self._pending: list[Future] = []
        self.head: DenseHead | None = None
        self.devices: dict[str, str] = {}  # worker name -> "cpu" / "cuda"

    # Setup --------------------------------------------------------------------------

    def _submit(self, function: Any, slot: WorkerSlot, *args: Any, key: str,
                **kwargs: Any) -> Future:
        return self.client.submit(function, *args, workers=[slot.address],
                                  resources={slot.resource: 1}, allow_other_workers=False,
                                  pure=False, key=f"{key}-{self.run_id}", **kwargs)

    def calibrate(self) -> dict[str, list[float]]:
        """Seconds per kernel of every layer's forward+backward, per worker.

        All workers measure at once, as they will run during training, on about a
        quarter of an even share of kernels at the real batch size and shapes.
        """
        batch = self.config.train.batch
        futures = {}
        for layer, spec in enumerate(self.network.conv):
            share = spec.kernels / len(self.slots) / 4
            kernels = int(min(spec.kernels, max(self.quanta[layer], round(share))))
            for slot in self.slots:
                futures[(slot.name, layer)] = self._submit(
                    conv_shard.calibrate_layer, slot, spec, batch, kernels,
                    self.network.dtype, key=f"calibrate-{layer}-{slot.name}",
                    needs_input_grad=layer > 0)
        results = self._gather(list(futures.values()), "calibration")
        per_kernel: dict[str, list[float]] = {slot.name: [] for slot in self.slots}
        for (name, _layer), result in zip(futures, results):
            per_kernel[name].append(result["seconds"] / result["kernels"])
        return per_kernel

    def place(self) -> Placement:
        """Split every layer: calibrated (proportional to speed) or even."""
        layers = self.network.conv
        if self.config.placement == "even" or len(self.slots) == 1:
            counts = [split_even(s.kernels, len(self.slots), q)
                      for s, q in zip(layers, self.quanta)]
            placement = Placement("even", [shard_ranges(l, c) for l, c in enumerate(counts)])
        elif self.config.placement == "model":
            from pipeline.model_placement import model_placement

            counts, calibration, record = model_placement(self)
            placement = Placement("model", [shard_ranges(l, c) for l, c in enumerate(counts)],
                                  calibration, record)
        else:
            calibration = self.calibrate()
            ranges = []
            for layer, spec in enumerate(layers):
                speeds = [1.0 / calibration[slot.name][layer] for slot in self.slots]
                ranges.append(shard_ranges(layer, split_proportional(
                    spec.kernels, speeds, self.quanta[layer])))
            placement = Placement("calibrated", ranges, calibration)
        self.placement = placement
        return placement

    def start(self, from_step: int) -> None:
        """Create the workspace and load every shard (and the head) from a checkpoint."""
        placement = self.placement or self.place()
        layers = self.network.conv
        create_workspace(self.paths.workspace, self.config.train.batch,
                         [(s.kernels, s.out_height, s.out_width) for s in layers],
                         [len(r) for r in placement.ranges], self.quanta,
                         self.network.dtype)
        keys = conv_keys(self.network)
        futures = [
            self._submit(conv_shard.init_shard, slot, self.run_id, layers[layer], shard,
                         index, keys[layer], self.config.optimizer_spec(),
                         self.paths.checkpoints, from_step, key=f"init-{layer}-{index}")
            for layer, ranges in enumerate(placement.ranges)
            for index, (slot, shard) in enumerate(zip(self.slots, ranges))
        ]
        weights = checkpoints.read_tensors(self.paths.checkpoints, from_step, "weights")
        momentum = checkpoints.read_tensors(self.paths.checkpoints, from_step, "momentum")
        self.head = DenseHead(self.network, self.config.optimizer_spec(), weights, momentum,
                              from_step)
        receipts = self._gather(futures, "loading the shards")
        self.devices = {r.worker: r.extra["device"] for r in receipts}
        self._previous_backward = {}

    # Steps --------------------------------------------------------------------------

    def step(self, step: int) -> tuple[float, list[Receipt], dict[str, float]]:
        """Run one training step; returns the loss, finished receipts and master times."""
        assert self.placement is not None and self.head is not None
        layers = len(self.network.conv)
        batch = self.config.train.batch
        indices = step_indices(self.config.train.seed, step, batch, self.train_samples)
        forward: list[list[Future]] = []
        for layer in range(layers):
            below = forward[layer - 1] if layer else []
            forward.append([
                self._submit(conv_shard.conv_forward, slot, self.run_id, layer, step,
                             self.paths, indices if layer == 0 else None,
                             deps=below + self._own_previous(layer, index),
                             key=f"forward-{step}-{layer}-{index}")
                for index, slot in enumerate(self.slots)
            ])
        finished = self._pending + [f for layer_futures in forward for f in layer_futures]
        receipts = self._gather(finished, f"step {step} forward")
        self._pending = []

        master = IOMeter()
        t0 = time.perf_counter()
        features = master.read(open_cached(self.paths.workspace, act_path(layers - 1)))
        labels = read_batch(self.paths.dataset, "train", indices)[1]
        compute_start = time.perf_counter()
        loss, grad = self.head.step(features.reshape(batch, -1), labels)
        compute_s = time.perf_counter() - compute_start
        master.write(open_cached(self.paths.workspace, GRAD_TOP), ...,
                     grad.reshape(features.shape))
        master_s = time.perf_counter() - t0

        backward: list[Future] = []
        above: list[Future] = []
        for layer in reversed(range(layers)):
            current = [
                self._submit(conv_shard.conv_backward, slot, self.run_id, layer, step,
                             self.paths, layer == layers - 1, len(self.slots),
                             deps=above, key=f"backward-{step}-{layer}-{index}")
                for index, slot in enumerate(self.slots)
            ]
            for index, future in enumerate(current):
                self._previous_backward[(layer, index)] = future
            backward += current
            above = current
        self._pending = backward
        return loss, receipts, {
            "master_s": master_s, "master_compute_s": compute_s,
            "master_read_s": master.read_s, "master_write_s": master.write_s,
            "master_bytes": master.read_bytes + master.write_bytes,
        }

    def finish_pending(self) -> list[Receipt]:
        """Wait for the last submitted backward tasks; returns their receipts."""
        receipts = self._gather(self._pending, "backward") if self._pending else []
        self._pending = []
        return receipts

    def checkpoint(self, done_steps: int, indices: np.ndarray) -> list[Receipt]:
        """Save every shard's and the head's state as checkpoint `done_steps`."""
        receipts = self.finish_pending()
        shapes = parameter_shapes(self.network)
        checkpoints.create_checkpoint(self.paths.checkpoints, done_steps, shapes,
                                      checkpoint_row_chunks(self.network, self.quanta),
                                      self.network.dtype)
        futures = [
            self._submit(conv_shard.save_shard, slot, self.run_id, layer,
                         self.paths.checkpoints, done_steps, key=f"save-{done_steps}-{layer}-{i}")
            for layer in range(len(self.network.conv))
            for i, slot in enumerate(self.slots)
        ]
        assert self.head is not None
        for kind, tensors in self.head.tensors().items():
            for key, value in tensors.items():
                checkpoints.write_slice(self.paths.checkpoints, done_steps, kind, key, 0, value)
        self._gather(futures, "checkpoint")
        return receipts

    def close(self) -> None:
        """Free the run's shards on every worker (best effort)."""
        try:
            futures = [self._submit(conv_shard.release_run, slot, self.run_id,
                                    key=f"release-{slot.name}") for slot in self.slots]
            with self.client.as_current():
                wait(futures, timeout=10)
        except Exception:  # noqa: BLE001 - the cluster may already be gone
            pass
        if self.config.workspace.path is None:
            remove_workspace(self.paths.workspace)

    # Helpers ------------------------------------------------------------------------

    def _own_previous(self, layer: int, index: int) -> list[Future]:
        future = self._previous_backward.get((layer, index))
        return [future] if future is not None else []

    def _gather(self, futures: list[Future], what: str) -> list[Any]:
        """Wait for `futures`, failing fast (not hanging) if one of our workers left.

        Results are fetched with a time limit too: a result held by a worker that
        died after finishing would otherwise be waited for forever (the task is
        pinned to that worker, so Dask cannot recompute it elsewhere).
        """
        addresses = {slot.address: slot for slot in self.slots}
        while True:
            try:
                with self.client.as_current():
                    wait(futures, timeout=2.0)
            except TimeoutError:
                pass
            errored = [f for f in futures if f.status == "error"]
            if errored:
                error = errored[0].exception()
                raise ClusterError(f"{what}: a task failed: {type(error).__name__}: {error}")
            if all(f.done() for f in futures):
                try:
                    return self.client.sync(self.client._gather, futures, callback_timeout=10)
                except TimeoutError:
                    pass  # a holder of some result is gone: the check below names it
            alive = set(self.client.scheduler_info(n_workers=-1)["workers"])
            gone = [slot.label for address, slot in addresses.items() if address not in alive]
            if gone:
                raise ClusterError(
                    f"{what}: worker {', '.join(gone)} left the cluster; its shards are lost. "
                    "Start the run again with train.resume=true to continue from the last "
                    "checkpoint")


