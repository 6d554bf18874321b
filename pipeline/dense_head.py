"""The master's part of the network: flatten -> dense layers -> softmax cross-entropy.

Dense layers hold most of the parameters and little of the compute, so in
kernel-parallel training they stay on the master, which also owns the loss.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pipeline.network import dense_head
from tasks.specs import NetworkSpec, OptimizerSpec


class DenseHead:
    """Dense layers with their own SGD optimizer (same hyper-parameters as the convs)."""

    def __init__(self, spec: NetworkSpec, optimizer: OptimizerSpec,
                 weights: dict[str, np.ndarray], momentum: dict[str, np.ndarray] | None,
                 from_step: int) -> None:
        self.model, full_indices = dense_head(spec)
        # head key "1.weight" <-> network key f"{full_indices[1]}.weight"
        self.to_full = {f"{i}.{name}": f"{full_indices[i]}.{name}"
                        for i, module in enumerate(self.model) if isinstance(module, nn.Linear)
                        for name in ("weight", "bias")}
        self.model.load_state_dict({k: torch.from_numpy(np.asarray(weights[v]))
                                    for k, v in self.to_full.items()})
        self.optimizer = torch.optim.SGD(
            self.model.parameters(), lr=optimizer.lr, momentum=optimizer.momentum,
            weight_decay=optimizer.weight_decay, nesterov=optimizer.nesterov)
        if momentum is not None and optimizer.momentum and from_step > 0:
            params = dict(self.model.named_parameters())
            for key, full in self.to_full.items():
                self.optimizer.state[params[key]]["momentum_buffer"] = torch.from_numpy(
                    np.asarray(momentum[full]).copy())
        self.loss_fn = nn.CrossEntropyLoss()

    def step(self, features: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
        """One forward/backward/update; returns the loss and dLoss/dfeatures."""
        x = torch.from_numpy(features).requires_grad_(True)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(x), torch.from_numpy(labels))
        loss.backward()
        self.optimizer.step()
        return float(loss.detach()), x.grad.numpy()

    def tensors(self) -> dict[str, dict[str, np.ndarray]]:
        """Weights and momentum buffers under the full network's keys."""
        params = dict(self.model.named_parameters())
        weights, momentum = {}, {}
        for key, full in self.to_full.items():
            weights[full] = params[key].detach().numpy().copy()
            buffer = self.optimizer.state.get(params[key], {}).get("momentum_buffer")
            momentum[full] = (np.zeros_like(weights[full]) if buffer is None
                              else buffer.detach().numpy().copy())
        return {"weights": weights, "momentum": momentum}
