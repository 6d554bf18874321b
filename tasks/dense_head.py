"""The dense head: flatten -> (dropout ->) dense layers -> softmax cross-entropy, on the
master.

Dense layers hold most of the parameters and little of the compute, so in
kernel-parallel training they stay on one device, the *master* (a worker chosen by
`cluster.master`), which also owns the loss. The head runs forward, backward and
its SGD update on that worker's device and hands back the gradient of its input.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tasks.network import dense_stack, set_dropout, to_torch
from tasks.optim import make_sgd, momentum_of, restore_momentum, weights_of
from tasks.specs import NetworkSpec, OptimizerSpec
from tasks.worker_state import current_profile, release_freed_memory


class DenseHead:
    """Dense layers with their own SGD (same hyper-parameters as the convs)."""

    def __init__(self, spec: NetworkSpec, optimizer: OptimizerSpec,
                 weights: dict[str, np.ndarray], momentum: dict[str, np.ndarray],
                 device: str, seed: int = 0) -> None:
        self.model = dense_stack(spec).to(device)  # its keys are the network's
        self.model.load_state_dict(to_torch(weights))
        self.optimizer = make_sgd(self.model.parameters(), optimizer)
        restore_momentum(self.optimizer, self._named(), momentum)
        self.loss_fn = nn.CrossEntropyLoss()
        self.seed = seed

    def _named(self) -> dict[str, torch.Tensor]:
        """Parameters under the full network's keys ("5.weight", "fc.bias", ...)."""
        return dict(self.model.named_parameters())

    def step(self, features: torch.Tensor, labels: torch.Tensor, step: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward/backward/update; the loss (a 0-d tensor) and dLoss/dfeatures.
        Dropout masks are those of `step` (tasks/network.py)."""
        x = features.detach().requires_grad_(True)
        set_dropout(self.model, self.seed, step)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model.head(x), labels)
        loss.backward()
        self.optimizer.step(step)
        return loss.detach(), x.grad

    def state(self) -> dict[str, dict[str, np.ndarray]]:
        """Weights and momentum under the full network's keys, as numpy."""
        named = self._named()
        return {"weights": weights_of(named), "momentum": momentum_of(self.optimizer, named)}


def time_dense_head(spec: NetworkSpec, rows: int, start_at: float, repeats: int = 5) -> dict:
    """Seconds of the dense head's forward and backward (its dropout and its input's
    gradient included, its update not) on `rows` samples, as a ``data`` replica runs
    it on its rows, on this worker's device, emulated slowness included.

    Why apart from the master's timing of the whole head: a product's rate depends on
    its rows (the weights stream once whatever the rows: vgg11 at a quarter width took
    28 ms on 64 rows, not half its 48 ms on 128), and replicas run theirs all at once.
    The timing starts at wall-clock time `start_at`, as every worker's does."""
    profile = current_profile()
    seconds = _time_head(spec, rows, profile.device, start_at,
                         lambda one_round: profile.time_rounds(one_round, repeats))
    release_freed_memory()
    return {"worker": profile.name, "rows": rows, "seconds": seconds}


def _time_head(spec: NetworkSpec, rows: int, device: str, start_at: float,
               time_rounds) -> float:
    """The median round of `time_rounds` over the head's forward and backward."""
    head = dense_stack(spec).to(device).train()
    set_dropout(head, 0, 0)
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(rows, spec.flat_features, generator=generator,
                           dtype=getattr(torch, spec.dtype)).to(device)
    labels = torch.randint(0, spec.classes, (rows,), generator=generator).to(device)

    def one_round() -> None:
        x = features.detach().requires_grad_(True)
        head.zero_grad(set_to_none=True)
        F.cross_entropy(head.head(x), labels).backward()

    one_round()
    time.sleep(max(0.0, start_at - time.time()))
    return float(np.median(time_rounds(one_round)))
