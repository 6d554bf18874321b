"""The dense head: flatten -> dense layers -> softmax cross-entropy, on the master.

Dense layers hold most of the parameters and little of the compute, so in
kernel-parallel training they stay on one device, the *master* (a worker chosen by
`cluster.master`), which also owns the loss. The head runs forward, backward and
its SGD update on that worker's device and hands back the gradient of its input.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tasks.network import dense_head
from tasks.optim import make_sgd, momentum_of, restore_momentum, weights_of
from tasks.specs import NetworkSpec, OptimizerSpec


class DenseHead:
    """Dense layers with their own SGD (same hyper-parameters as the convs)."""

    def __init__(self, spec: NetworkSpec, optimizer: OptimizerSpec,
                 weights: dict[str, np.ndarray], momentum: dict[str, np.ndarray],
                 device: str) -> None:
        model, full_indices = dense_head(spec)
        self.model = model.to(device)
        # head key "1.weight" <-> network key f"{full_indices[1]}.weight"
        self.to_full = {f"{i}.{name}": f"{full_indices[i]}.{name}"
                        for i, module in enumerate(self.model) if isinstance(module, nn.Linear)
                        for name in ("weight", "bias")}
        self.model.load_state_dict({k: torch.from_numpy(np.asarray(weights[v]))
                                    for k, v in self.to_full.items()})
        self.optimizer = make_sgd(self.model.parameters(), optimizer)
        restore_momentum(self.optimizer, self._named(),
                         {key: momentum[key] for key in self.to_full.values()})
        self.loss_fn = nn.CrossEntropyLoss()

    def _named(self) -> dict[str, torch.Tensor]:
        """Parameters under the full network's keys ("5.weight", ...)."""
        params = dict(self.model.named_parameters())
        return {full: params[key] for key, full in self.to_full.items()}

    def step(self, features: torch.Tensor, labels: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward/backward/update; the loss (a 0-d tensor) and dLoss/dfeatures."""
        x = features.detach().flatten(1).requires_grad_(True)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(x), labels)
        loss.backward()
        self.optimizer.step()
        return loss.detach(), x.grad.view(features.shape)

    def state(self) -> dict[str, dict[str, np.ndarray]]:
        """Weights and momentum under the full network's keys, as numpy."""
        named = self._named()
        return {"weights": weights_of(named), "momentum": momentum_of(self.optimizer, named)}
