"""`strategy: reference`: plain in-process PyTorch, what a user would otherwise run.

No Dask, no workspace: one nn.Sequential and torch.optim.SGD with a chosen number of
threads, reading the same batches from the same dataset store and starting from the
same checkpoint as every other strategy. It is both the speedup baseline and the
arithmetic the distributed strategies must reproduce.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn

from pipeline.config import RunConfig
from pipeline.network import load_sequential
from pipeline.sampler import step_indices
from storage import checkpoints
from storage.datasets import read_batch
from tasks.receipts import Receipt
from tasks.specs import NetworkSpec
from tasks.worker_state import configure_process

REFERENCE_WORKER = "reference"


class ReferenceTrainer:
    """Same interface as KernelParallelEngine, for the train loop."""

    def __init__(self, config: RunConfig, network: NetworkSpec, train_samples: int) -> None:
        self.config = config
        self.network = network
        self.train_samples = train_samples
        self.model: nn.Sequential | None = None
        self.optimizer: torch.optim.SGD | None = None
        self.loss_fn = nn.CrossEntropyLoss()

    def start(self, from_step: int) -> None:
        configure_process(self.config.reference.threads)
        path = self.config.checkpoint_path
        self.model = load_sequential(self.network,
                                     checkpoints.read_tensors(path, from_step, "weights"))
        opt = self.config.optimizer_spec()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=opt.lr,
                                         momentum=opt.momentum,
                                         weight_decay=opt.weight_decay, nesterov=opt.nesterov)
        if opt.momentum and from_step > 0:
            momentum = checkpoints.read_tensors(path, from_step, "momentum")
            for key, param in self.model.named_parameters():
                self.optimizer.state[param]["momentum_buffer"] = torch.from_numpy(
                    momentum[key].copy())

    def step(self, step: int) -> tuple[float, list[Receipt], dict[str, float]]:
        assert self.model is not None and self.optimizer is not None
        indices = step_indices(self.config.train.seed, step, self.config.train.batch,
                               self.train_samples)
        started = time.time()
        t0 = time.perf_counter()
        images, labels = read_batch(self.config.dataset_path, "train", indices)
        read_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(torch.from_numpy(images)), torch.from_numpy(labels))
        loss.backward()
        self.optimizer.step()
        compute_s = time.perf_counter() - t0
        receipt = Receipt("step", -1, 0, step, REFERENCE_WORKER, compute_s=compute_s,
                          read_s=read_s, read_bytes=images.nbytes + labels.nbytes,
                          start=started, end=time.time())
        return float(loss.detach()), [receipt], {
            "master_s": 0.0, "master_compute_s": 0.0, "master_read_s": 0.0,
            "master_write_s": 0.0, "master_bytes": 0}

    def finish_pending(self) -> list[Receipt]:
        return []

    def checkpoint(self, done_steps: int, indices: np.ndarray) -> list[Receipt]:
        assert self.model is not None and self.optimizer is not None
        path = self.config.checkpoint_path
        shapes = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        checkpoints.create_checkpoint(path, done_steps, shapes, {}, self.network.dtype)
        for key, param in self.model.named_parameters():
            checkpoints.write_slice(path, done_steps, "weights", key, 0,
                                    param.detach().numpy())
            buffer = self.optimizer.state.get(param, {}).get("momentum_buffer")
            buffer = torch.zeros_like(param) if buffer is None else buffer
            checkpoints.write_slice(path, done_steps, "momentum", key, 0,
                                    buffer.detach().numpy())
        return []

    def close(self) -> None:
        self.model = None
