"""`strategy: reference`: plain in-process PyTorch, what a user would otherwise run.

No Dask, no workspace: one nn.Sequential, torch.optim.SGD and torch's own
learning-rate schedulers (torch.optim.lr_scheduler) with a chosen number of threads, reading the same batches from the same dataset store and starting from the
same checkpoint as every other strategy. It is both the speedup baseline and the
arithmetic the distributed strategies must reproduce. A run's reference is on the CPU;
benchmarks/side_by_side.py also runs it on a GPU (`device`), plain PyTorch's loop there.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from pipeline.config.run_config import RunConfig
from pipeline.records.record import StepResult
from pipeline.engine.checkpointing import data_identity
from pipeline.engine.sampler import step_indices
from storage import checkpoints
from storage.datasets import read_batch
from tasks.memory import current_rss, read_peak, reset_peak
from tasks.network import checkpoint_shapes, load_model, set_dropout, to_arrays
from tasks.optim import momentum_of, restore_momentum, torch_scheduler, torch_sgd
from tasks.receipts import Receipt, TaskClock
from tasks.specs import NetworkSpec
from tasks.worker_state import configure_process, release_freed_memory

REFERENCE_WORKER = "reference"


class ReferenceTrainer:
    """The training loop's trainer interface, run synchronously in this process."""

    def __init__(self, config: RunConfig, network: NetworkSpec, train_samples: int,
                 device: str = "cpu") -> None:
        self.config = config
        self.device = device
        self.network = network
        self.train_samples = train_samples
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.SGD | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None  # None: constant
        self.loss_fn = nn.CrossEntropyLoss()
        self.devices = [device]
        self._submitted: dict[int, int] = {}  # first step -> steps
        self.data_identity = ""  # the store the checkpoints trained on: `start` reads it
        self.augmentation = config.data.augmentation(config.train.seed)  # of training images

    def start(self, from_step: int) -> None:
        configure_process(self.config.reference.threads)
        path = self.config.checkpoint_path
        self.data_identity = data_identity(path)
        self.model = load_model(self.network,
                                checkpoints.read_tensors(path, from_step, "weights")
                                ).to(self.device)
        spec = self.config.optimizer_spec()
        self.optimizer = torch_sgd(self.model.parameters(), spec)
        self.scheduler = torch_scheduler(self.optimizer, spec, from_step)
        restore_momentum(self.optimizer, dict(self.model.named_parameters()),
                         checkpoints.read_tensors(path, from_step, "momentum"))
        release_freed_memory()  # as a worker does after loading (tasks/step_task.py)

    def submit(self, first: int, count: int) -> None:
        """Nothing to queue: `collect` runs the steps."""
        self._submitted[first] = count

    def collect(self, first: int) -> list[StepResult]:
        """Run the steps submitted from `first`, one after the other."""
        count = self._submitted.pop(first)
        return [self._step(step) for step in range(first, first + count)]

    def _step(self, step: int) -> StepResult:
        assert self.model is not None and self.optimizer is not None
        indices = step_indices(self.config.train.seed, step, self.config.train.batch,
                               self.train_samples)
        receipt = Receipt(f"step-{step}", REFERENCE_WORKER, step, time.time())
        clock = TaskClock(receipt)
        held = current_rss()
        kind = reset_peak(self.device)
        with clock.op("training-step"):
            with clock.phase("dataset") as phase:
                images, labels = read_batch(self.config.dataset_path, "train", indices,
                                            self.data_identity)
                phase.nbytes = images.nbytes + labels.nbytes
                images = self.augmentation.apply(images, indices, step)
            with clock.phase("compute"):
                lr = self.optimizer.param_groups[0]["lr"]  # this step's
                self.optimizer.zero_grad(set_to_none=True)
                set_dropout(self.model, self.config.train.seed, step)
                loss = self.loss_fn(self.model(torch.from_numpy(images).to(self.device)),
                                    torch.from_numpy(labels).to(self.device))
                loss.backward()
                self.optimizer.step()
                if self.scheduler is not None:
                    self.scheduler.step()
                if self.device != "cpu":  # the step's kernels done, inside its time
                    torch.cuda.synchronize(self.device)
        receipt.end = time.time()
        receipt.extra["memory"] = {**read_peak(self.device, kind).as_dict(), "held": held}
        receipt.loss = float(loss.detach())
        return StepResult(step, receipt.loss, [receipt], lr)

    def checkpoint(self, done_steps: int) -> None:
        """Written in place (one process: no worker can outlive its attempt)."""
        assert self.model is not None and self.optimizer is not None
        path = self.config.checkpoint_path
        named = dict(self.model.named_parameters())
        checkpoints.create_checkpoint(path, done_steps, checkpoint_shapes(self.network), {},
                                      self.network.dtype)
        weights = to_arrays(self.model.state_dict(), self.network.dtype)
        for kind, tensors in (("weights", weights),
                              ("momentum", momentum_of(self.optimizer, named))):
            for key, value in tensors.items():
                checkpoints.write_slice(path, done_steps, kind, key, 0, value)

    def show_waits(self, note: Callable[[str], None]) -> None:
        """Nothing to wait on: the steps run in this process."""

    def close(self) -> None:
        self.model = None
