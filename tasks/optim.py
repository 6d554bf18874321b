"""The one place SGD is built, and its momentum saved and restored.

Every part of a run uses SGD with the same hyper-parameters and torch's arithmetic,
so that the distributed arithmetic is exactly single-process SGD's: the in-process
reference torch's own `torch.optim.SGD` (it is plain PyTorch), the workers (conv
shards, the dense head, replicas) `WorkerSGD`, the same step without torch.optim's
import of torch._dynamo. A checkpoint stores each parameter's momentum buffer
beside its weights (zeros before the first step). The learning rate follows the
spec's schedule (tasks/lr_schedule.py): a worker's SGD takes the rate of the step it
is taking, the reference's from torch's own schedulers (`torch_scheduler`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Union

import warnings

import numpy as np
import torch
from torch.optim import lr_scheduler

from tasks.specs import OptimizerSpec


def torch_sgd(params: Iterable[torch.Tensor], spec: OptimizerSpec) -> torch.optim.SGD:
    """torch's own SGD with `spec`'s hyper-parameters: the reference's (plain PyTorch)."""
    return torch.optim.SGD(list(params), lr=spec.lr, momentum=spec.momentum,
                           weight_decay=spec.weight_decay, nesterov=spec.nesterov)


def torch_scheduler(optimizer: torch.optim.SGD, spec: OptimizerSpec, from_step: int = 0
                    ) -> lr_scheduler.LRScheduler | None:
    """torch's own schedulers for `spec`'s schedule on the reference's SGD (None for a
    constant rate), stepped on to `from_step`: ``SequentialLR([LinearLR, decay],
    milestones=[warmup])``, or either alone (tasks/lr_schedule.py says why these).

    Checkpoints hold no scheduler state: a step's rate depends on its number alone, so
    a resume builds the schedulers afresh and steps them `from_step` times (torch's
    warning that they step before the optimizer has, which is the point, is silenced)."""
    schedule = spec.schedule
    if schedule.constant:
        return None
    warmup = schedule.warmup
    decay = None
    if schedule.decay == "step":
        decay = lr_scheduler.MultiStepLR(optimizer, [m - warmup for m in schedule.milestones],
                                         gamma=schedule.gamma)
    elif schedule.decay == "cosine":
        decay = lr_scheduler.CosineAnnealingLR(optimizer, T_max=schedule.steps - warmup,
                                               eta_min=0.0)
    scheduler = decay
    if warmup:
        ramp = lr_scheduler.LinearLR(optimizer, start_factor=schedule.warmup_factor,
                                     end_factor=1.0, total_iters=warmup)
        scheduler = ramp if decay is None else lr_scheduler.SequentialLR(
            optimizer, [ramp, decay], milestones=[warmup])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(from_step):
            scheduler.step()
    return scheduler


def make_sgd(params: Iterable[torch.Tensor], spec: OptimizerSpec) -> WorkerSGD:
    """The workers' SGD (`WorkerSGD`) with `spec`'s hyper-parameters."""
    return WorkerSGD(list(params), spec)


class WorkerSGD:
    """torch's SGD step, op for op, without torch.optim.

    Why not ``torch.optim.SGD``: building any torch.optim optimizer imports
    torch._dynamo on its first ``add_param_group`` (a ``torch._disable_dynamo``
    wrapper), and sympy with it: 74-76 MB resident in every process that does, which a
    worker never uses (docs/benchmarks.md, "Memory per worker"). The step below is
    torch's single-tensor SGD (torch/optim/sgd.py, the path torch takes for CPU
    tensors), the same kernels on the same values in the same order, so the weights
    are torch's bit for bit (tests/test_memory.py); one difference: the weight decay
    is added into the gradient in place, where torch's ``grad.add(param)`` makes a
    parameter-sized copy (75 MB for the paper network's second conv layer, at the
    update, when a step holds the most). `state` has torch's shape
    (``state[param]["momentum_buffer"]``), so a checkpoint's momentum goes in and out
    as for torch's SGD.
    """

    def __init__(self, params: list[torch.Tensor], spec: OptimizerSpec) -> None:
        self.params, self.spec = params, spec
        self.state: defaultdict[torch.Tensor, dict[str, torch.Tensor]] = defaultdict(dict)

    @torch.no_grad()
    def step(self, step: int) -> None:
        """Step `step` of the run (its learning rate is the schedule's at that step)
        with each parameter's ``.grad`` (which it consumes: the weight decay is added
        into it); parameters without one are left as they are."""
        spec = self.spec
        lr = spec.lr_at(step)
        for param in self.params:
            grad = param.grad
            if grad is None:
                continue
            if spec.weight_decay:
                grad.add_(param, alpha=spec.weight_decay)
            if spec.momentum:
                buffer = self.state[param].get("momentum_buffer")
                if buffer is None:
                    buffer = self.state[param]["momentum_buffer"] = grad.detach().clone()
                else:
                    buffer.mul_(spec.momentum).add_(grad, alpha=1)
                grad = grad.add(buffer, alpha=spec.momentum) if spec.nesterov else buffer
            param.add_(grad, alpha=-lr)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every parameter's gradient (torch's default, ``set_to_none``)."""
        if not set_to_none:
            raise ValueError("WorkerSGD only drops gradients (set_to_none=True)")
        for param in self.params:
            param.grad = None


AnySGD = Union[WorkerSGD, torch.optim.SGD]


def restore_momentum(optimizer: AnySGD, named: dict[str, torch.Tensor],
                     buffers: dict[str, np.ndarray]) -> None:
    """Load momentum buffers (numpy, by parameter name) next to their parameters.

    Buffers that are all zeros are skipped: a fresh SGD starts its buffer from the
    first gradient, which is what a zero buffer from step 0 means.
    """
    for name, param in named.items():
        buffer = buffers[name]
        if np.any(buffer):
            optimizer.state[param]["momentum_buffer"] = torch.from_numpy(
                np.array(buffer)).to(param.device)


def momentum_of(optimizer: AnySGD, named: dict[str, torch.Tensor]
                ) -> dict[str, np.ndarray]:
    """Every parameter's momentum buffer as numpy (zeros where SGD has none yet), for
    writing at once: a view of a CPU tensor's memory, not a copy (see `weights_of`)."""
    out = {}
    for name, param in named.items():
        buffer = optimizer.state.get(param, {}).get("momentum_buffer")
        out[name] = (np.zeros(tuple(param.shape), dtype=_numpy_dtype(param)) if buffer is None
                     else buffer.detach().to("cpu").numpy())
    return out


def weights_of(named: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Every parameter as numpy, for writing at once (a checkpoint): a view of a CPU
    tensor's memory, not a copy. Copies of a whole replica's weights and momentum were
    158 MB on the paper network, the most a `data` worker held in a run (while saving)."""
    return {name: param.detach().to("cpu").numpy() for name, param in named.items()}


def _numpy_dtype(tensor: torch.Tensor) -> np.dtype:
    return torch.empty((), dtype=tensor.dtype).numpy().dtype
