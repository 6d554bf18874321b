"""Plain single-process PyTorch replays of `data` and `hybrid` runs on any network (the
zoo's, a user's own): what their checkpoints must equal.

The network is the project's plain-PyTorch `SpecNetwork` (nn.Conv2d, nn.BatchNorm2d,
nn.Linear under torchvision's names) loaded strictly from the run's step-0 checkpoint;
the optimizer is torch.optim.SGD, its learning rate moved by torch's own schedulers
(`plain_scheduler`, as a plain PyTorch user writes them); each step's batch is the checkpoint's recorded
sample indices, and its dropout masks are drawn for the step (`set_dropout`). Batch
norm runs as nn.BatchNorm2d in training mode: on the whole batch (sync batch norm's
arithmetic), or, with `replicas`, on each replica's rows with that replica's own
running statistics (DDP's local batch norm; the first replica's are returned, as the
run's checkpoint keeps the first worker's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.optim import lr_scheduler

from pipeline.config.run_config import RunConfig
from storage import checkpoints
from storage.datasets import read_batch
from tests.augment_replay import augmented_batch
from storage.datasets.store import open_dataset_info
from tasks.network import SpecNetwork, load_model, set_dropout

Rows = Sequence[tuple[int, int]]  # each replica's (start, stop) rows of the batch


@dataclass
class Replay:
    weights: dict[str, np.ndarray]  # the state_dict: parameters and running statistics
    momentum: dict[str, np.ndarray]
    losses: list[float]  # per step: the batch's mean loss


def _model(config: RunConfig, dataset: str) -> SpecNetwork:
    spec = config.network_spec(open_dataset_info(dataset).image_shape)
    return load_model(spec, checkpoints.read_tensors(config.checkpoint_path, 0))


def _sgd(params, config: RunConfig, lr: float) -> torch.optim.SGD:
    t = config.train
    return torch.optim.SGD(list(params), lr=lr, momentum=t.momentum,
                           weight_decay=t.weight_decay, nesterov=t.nesterov)


def plain_scheduler(optimizer: torch.optim.SGD, config: RunConfig
                    ) -> lr_scheduler.LRScheduler | None:
    """torch's schedulers for the config's learning-rate schedule, written out as a
    plain PyTorch user would (None: a constant rate): a LinearLR warm-up, then a
    MultiStepLR or a CosineAnnealingLR over the steps after it, in a SequentialLR,
    which counts the second scheduler's steps from the warm-up's end (the config's
    milestones count from the run's start)."""
    t = config.train
    decay = None
    if t.lr_decay == "step":
        decay = lr_scheduler.MultiStepLR(optimizer, [m - t.lr_warmup for m in t.lr_milestones],
                                         gamma=t.lr_gamma)
    elif t.lr_decay == "cosine":
        decay = lr_scheduler.CosineAnnealingLR(optimizer, T_max=t.steps - t.lr_warmup)
    if not t.lr_warmup:
        return decay
    warmup = lr_scheduler.LinearLR(optimizer, start_factor=t.lr_warmup_factor,
                                   total_iters=t.lr_warmup)
    return warmup if decay is None else lr_scheduler.SequentialLR(
        optimizer, [warmup, decay], milestones=[t.lr_warmup])


def step_schedulers(*schedulers: lr_scheduler.LRScheduler | None) -> None:
    """The end of a training step: each scheduler on to the next step's rate."""
    for scheduler in schedulers:
        if scheduler is not None:
            scheduler.step()


class ReplicaStatistics:
    """Each replica's own batch-norm running statistics (local batch norm): the one
    model's batch norms hold a replica's own buffers while it runs that replica's rows
    (the buffers themselves, not copies: autograd keeps them for the backward)."""

    BUFFERS = ("running_mean", "running_var", "num_batches_tracked")

    def __init__(self, model: SpecNetwork, replicas: int) -> None:
        self.norms = [norm for norm in model.norms if norm is not None]
        self.buffers = [[{name: getattr(norm, name).clone() for name in self.BUFFERS}
                         for norm in self.norms] for _ in range(replicas)]

    def hold(self, replica: int) -> None:
        """The model's batch norms hold `replica`'s running statistics."""
        for norm, buffers in zip(self.norms, self.buffers[replica]):
            for name, buffer in buffers.items():
                setattr(norm, name, buffer)

    def run_as(self, replica: int, function):
        """`function()` with the model holding `replica`'s running statistics."""
        self.hold(replica)
        return function()


def _trunk(model: SpecNetwork, x: torch.Tensor, replicas: Rows | None,
           statistics: ReplicaStatistics | None) -> torch.Tensor:
    """The conv layers' output: on the whole batch, or replica by replica."""
    if replicas is None:
        return model.trunk(x)
    return torch.cat([statistics.run_as(d, lambda a=a, b=b: model.trunk(x[a:b]))
                      for d, (a, b) in enumerate(replicas)])


def replay_network(config: RunConfig, dataset: str, replicas: Rows | None = None,
                   parts: list[list[int]] | None = None, conv_lr_scale: float = 1.0
                   ) -> Replay:
    """Train `config`'s steps in plain PyTorch from its step-0 checkpoint.

    Without `parts`: SGD on the whole batch (the loss the batch's mean). With `parts`
    (rows of the batch, in order): hybrid's per-part dense updates, as
    tests/helpers.py's `replay_hybrid_in_pytorch` (each part's mean loss and dense
    SGD step; the conv layers step once on every part's feature gradient weighted by
    its share of the batch). The conv layers (and their batch norms) learn at
    `conv_lr_scale` times the learning rate (hybrid's `conv_lr_scaling`).
    `replicas`: local batch norm over these rows (module doc).
    """
    model = _model(config, dataset)
    dense = {f"{name}.{kind}" for name in model.spec.dense_names for kind in ("weight", "bias")}
    named = dict(model.named_parameters())
    trunk_opt = _sgd([p for n, p in named.items() if n not in dense], config,
                     config.train.lr * conv_lr_scale)
    head_opt = _sgd([p for n, p in named.items() if n in dense], config, config.train.lr)
    schedulers = [plain_scheduler(trunk_opt, config), plain_scheduler(head_opt, config)]
    statistics = ReplicaStatistics(model, len(replicas)) if replicas else None
    indices = checkpoints.read_sample_indices(config.checkpoint_path)
    seed, losses = config.train.seed, []
    for step in range(config.train.steps):
        images, labels = read_batch(dataset, "train", indices[step])
        x, y = augmented_batch(config, images, indices[step], step), torch.from_numpy(labels)
        batch = len(y)
        trunk_opt.zero_grad()
        head_opt.zero_grad()
        features = _trunk(model, x, replicas, statistics)
        if parts is None:
            set_dropout(model, seed, step)
            loss = F.cross_entropy(model.head(features), y)
            loss.backward()
            head_opt.step()
            losses.append(float(loss.detach()))
        else:
            grad = torch.zeros_like(features)
            total = 0.0
            for rows in parts:
                part = features.detach()[rows].requires_grad_(True)
                head_opt.zero_grad()
                set_dropout(model, seed, step, rows, batch)
                logits = model.head(part)
                total += float(F.cross_entropy(logits.detach(), y[rows], reduction="sum")) / batch
                F.cross_entropy(logits, y[rows]).backward()
                head_opt.step()
                grad[rows] = part.grad * (len(rows) / batch)
            features.backward(grad)
            losses.append(total)
        trunk_opt.step()
        step_schedulers(*schedulers)
    if statistics is not None:
        statistics.hold(0)
    momentum = {name: trunk_opt.state.get(p, head_opt.state.get(p, {}))
                .get("momentum_buffer", torch.zeros_like(p)).detach().numpy()
                for name, p in named.items()}
    return Replay({k: v.detach().numpy() for k, v in model.state_dict().items()}, momentum,
                  losses)
