"""Data-parallel training on a worker: a full replica, and the gradient reduction.

`data` (tasks/replica_layout.py, `DataLayout`): every worker holds the whole network
(a `SpecNetwork`, plain torch modules). ``replica-step`` trains it on the worker's rows of the
batch with the loss summed over them and divided by the whole batch, so that the
workers' gradients add up to the whole batch's; ``grad-reduce`` sums the range of
the flat gradient this worker owns (its own and every other worker's, in worker
order) and ``grad-update`` gathers every summed range and steps SGD. Every replica
applies the very same summed gradient, so the replicas stay identical. `hybrid`
(tasks/hybrid_ops.py) reduces its conv gradients with the same two ops.

Batch norm: with the layout's ``batch_norm: sync`` the replica's batch norms take the
whole batch's statistics, exchanged inside ``replica-step`` (tasks/sync_batch_norm.py),
and a replica without rows still runs the step on no rows, to take part; with
``local`` each replica normalises by its own rows, as DDP does, and the running
statistics of the first worker's replica are the checkpoint's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from storage import checkpoints
from storage.datasets import read_batch
from tasks.layout import StepOp
from tasks.network import SpecNetwork, build_network, set_dropout, to_arrays, to_torch
from tasks.optim import WorkerSGD, make_sgd, momentum_of, restore_momentum
from tasks.receipts import TaskClock
from tasks.replica_layout import GRAD_REDUCE, GRAD_UPDATE, REPLICA_STEP, DataLayout
from tasks.run_state import RunState, WorkerSide
from tasks.specs import Arithmetic, NetworkSpec, OptimizerSpec
from tasks.sync_batch_norm import (BatchNormExchange, ComputeSpans, ReplicaBatchNorm2d,
                                   exchanging, synchronise)
from tasks.worker_state import current_profile, release_freed_memory


@dataclass
class Gradients:
    """The flat gradient a step reduces (the parameters' gradients end to end): this
    worker's own range of it, then that range's sum over the workers."""

    params: list[tuple[str, torch.Tensor]]  # the parameters it covers, in order
    local: torch.Tensor | None = None  # this worker's gradient over its owned range
    own_sum: torch.Tensor | None = None

    @property
    def size(self) -> int:
        """Elements of the flat gradient."""
        return sum(p.numel() for _, p in self.params)

    def range(self, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of the flat gradient, copied out of the parameters'
        gradients (zeros for a parameter without one): one range at a time, so that a
        step never holds the whole flat gradient beside them (79 MB more on the paper
        network, at the moment after the backward when a step holds the most)."""
        pieces, offset = [], 0
        for _, param in self.params:
            count = param.numel()
            a, b = max(start, offset), min(stop, offset + count)
            if a < b:
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
                pieces.append(grad.reshape(-1)[a - offset:b - offset])
            offset += count
        if not pieces:
            return torch.empty(0, dtype=self.params[0][1].dtype,
                               device=self.params[0][1].device)
        return torch.cat(pieces)

    def assign(self, flat: torch.Tensor) -> None:
        """Set every parameter's .grad from a flat gradient."""
        offset = 0
        for _, param in self.params:
            count = param.numel()
            param.grad = flat[offset:offset + count].view_as(param)
            offset += count

    def digest(self, buffers: list[torch.Tensor] = ()) -> str:
        """A fingerprint of the parameters' values and of `buffers` (replicas must
        agree on it)."""
        sha = hashlib.sha1()
        for tensor in [param for _, param in self.params] + list(buffers):
            sha.update(tensor.detach().to("cpu").numpy().tobytes())
        return sha.hexdigest()


def synced_buffers(norms: list[ReplicaBatchNorm2d]) -> list[torch.Tensor]:
    """The running statistics every replica keeps alike under sync batch norm."""
    return [buffer for norm in norms for buffer in norm.buffers()]


def batch_norm_exchange(run: RunState, step: int, spans: ComputeSpans) -> BatchNormExchange:
    """Where this worker's synchronised batch norms swap partial sums in this op."""
    return BatchNormExchange(run.mover, run.me, len(run.layout.workers), step, spans)


@dataclass
class DataWork:
    """A full replica and its optimizer."""

    model: SpecNetwork
    optimizer: WorkerSGD
    grads: Gradients
    check_replicas: bool
    seed: int = 0  # the run's, for the dropout masks
    norms: list[ReplicaBatchNorm2d] = field(default_factory=list)  # sync batch norm's

    def apply_reduced(self, layout: DataLayout, step: int) -> None:
        """SGD step `step`, once the summed gradient is in every parameter's .grad."""
        self.optimizer.step(step)


# Loading and saving ----------------------------------------------------------------------


def load_data(layout: DataLayout, me: int, network: NetworkSpec, checkpoint_path: str,
              step: int, arithmetic: Arithmetic, device: str) -> DataWork:
    """The whole network and its momentum from checkpoint `step` (every replica alike)."""
    model = build_network(network, fast_pool=True)
    model.load_state_dict(read_tensors(checkpoint_path, step, "weights"))
    model.to(device)
    sgd = make_sgd(model.parameters(), arithmetic.optimizer)
    named = dict(model.named_parameters())
    restore_momentum(sgd, named, checkpoints.read_tensors(checkpoint_path, step, "momentum"))
    norms = synchronise(model) if layout.batch_norm == "sync" else []
    return DataWork(model, sgd, Gradients(list(named.items())), arithmetic.check_replicas,
                    arithmetic.seed, norms)


def save_data(work: DataWork, me: int, checkpoint_path: str, step: int) -> None:
    """Replicas are identical: the first worker writes the whole network."""
    if me == 0:
        named = dict(work.model.named_parameters())
        write_tensors(checkpoint_path, step, to_arrays(work.model.state_dict(), dtype_of(named)),
                      momentum_of(work.optimizer, named), 0)


def read_tensors(path: str, step: int, kind: str) -> dict[str, torch.Tensor]:
    """Every tensor of one kind ("weights", "momentum") of checkpoint `step`, as torch."""
    return to_torch(checkpoints.read_tensors(path, step, kind))


def dtype_of(named: dict[str, torch.Tensor]) -> str:
    """The checkpoint dtype of a model's parameters ("float32", "float64")."""
    return str(next(iter(named.values())).dtype).removeprefix("torch.")


def write_tensors(path: str, step: int, weights: dict[str, np.ndarray],
                  momentum: dict[str, np.ndarray], start: int) -> None:
    """Write weights and momentum into checkpoint `step`, rows from `start` on."""
    for kind, tensors in (("weights", weights), ("momentum", momentum)):
        for key, value in tensors.items():
            checkpoints.write_slice(path, step, kind, key, start, value)


# Calibration -----------------------------------------------------------------------------


def calibrate_replica(network: NetworkSpec, rows: int, repeats: int = 3) -> dict:
    """`time_replica`, then its tensors' pages handed back (`release_freed_memory`)."""
    timed = time_replica(network, rows, repeats)
    release_freed_memory()
    return timed


def time_replica(network: NetworkSpec, rows: int, repeats: int = 3) -> dict:
    """Seconds of a replica's forward, backward and SGD step on `rows` samples, as
    `replica-step` runs it, on this worker's device: one warm-up, then the median of
    `repeats` synchronised rounds (emulated slowness included)."""
    profile = current_profile()
    generator = torch.Generator().manual_seed(0)
    first = network.conv[0]
    dtype = getattr(torch, network.dtype)
    model = build_network(network, fast_pool=True).to(profile.device)
    set_dropout(model, 0, 0)  # a step's masks, as training draws them
    sgd = make_sgd(model.parameters(), OptimizerSpec(lr=1e-6))
    x = torch.randn(rows, first.in_channels, first.in_height, first.in_width,
                    generator=generator, dtype=dtype).to(profile.device)
    y = torch.randint(0, network.classes, (rows,), generator=generator).to(profile.device)

    def one_round() -> None:
        sgd.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y, reduction="sum").backward()
        sgd.step(0)

    times = profile.time_rounds(one_round, repeats)
    return {"worker": profile.name, "seconds": float(np.median(times)), "rows": rows,
            "speed": profile.speed, "device": profile.device, "threads": profile.threads}


# Data parallel ---------------------------------------------------------------------------


def replica_step(run: RunState, op: StepOp, step: int, indices: np.ndarray,
                 clock: TaskClock) -> None:
    work: DataWork = run.work
    layout: DataLayout = run.layout
    start, stop = layout.rows()[run.me]
    with clock.op(REPLICA_STEP):
        work.optimizer.zero_grad(set_to_none=True)
        if stop > start or work.norms:  # no rows: still a party to batch norm's sums
            x, y = _batch_rows(run, indices[start:stop], step, clock)
            with ComputeSpans(clock) as spans, \
                    exchanging(work.norms, batch_norm_exchange(run, step, spans)):
                set_dropout(work.model, work.seed, step, slice(start, stop), run.batch)
                loss = F.cross_entropy(work.model(x), y, reduction="sum") / run.batch
                loss.backward()
            if stop > start:
                clock.receipt.loss = float(loss.detach())  # its part of the batch's loss
            run.emulate(clock, spans.seconds)
        hand_on_ranges(run, work.grads, work.optimizer, step, clock)


def grad_reduce(run: RunState, op: StepOp, step: int, indices: np.ndarray,
                clock: TaskClock) -> None:
    """Sum the range this worker owns over every worker (in worker order); hand it on."""
    grads: Gradients = run.work.grads
    assert grads.local is not None
    with clock.op(GRAD_REDUCE):
        parts = [grads.local if d == run.me
                 else run.mover.read(f"grads/{d}/{run.me}", step, clock)
                 for d in range(len(run.layout.workers))]
        with clock.phase("compute"):
            total = parts[0]
            for part in parts[1:]:
                total = total + part
        grads.own_sum = total
        grads.local = None  # its ranges are handed on and summed: free it before the gather
        run.mover.write(f"reduced/{run.me}", step, total, clock)


def grad_update(run: RunState, op: StepOp, step: int, indices: np.ndarray,
                clock: TaskClock) -> None:
    """Gather every summed range, then the SGD step (every replica the same)."""
    work = run.work
    grads: Gradients = work.grads
    with clock.op(GRAD_UPDATE):
        pieces = [grads.own_sum if e == run.me else run.mover.read(f"reduced/{e}", step, clock)
                  for e in range(len(run.layout.workers))]
        grads.own_sum = None  # held by `pieces` until the concatenation
        with clock.phase("compute") as phase:
            grads.assign(torch.cat(pieces))
            del pieces
            work.apply_reduced(run.layout, step)
            grads.local = None
        run.emulate(clock, phase.seconds)
        if work.check_replicas:
            clock.receipt.extra["replica_digest"] = grads.digest(synced_buffers(work.norms))


def hand_on_ranges(run: RunState, grads: Gradients, optimizer: WorkerSGD, step: int,
                   clock: TaskClock) -> None:
    """Write every other worker's owned range of this worker's gradient, keep its own
    range for the reduction (`grads.local`), then drop the parameters' gradients: the
    ranges hold what the reduction needs, and not both through it."""
    ranges = run.layout.owned(grads.size)
    for e, (a, b) in enumerate(ranges):
        if e != run.me:
            with clock.phase("compute"):
                part = grads.range(a, b)
            run.mover.write(f"grads/{run.me}/{e}", step, part, clock)
            del part
    with clock.phase("compute"):
        grads.local = grads.range(*ranges[run.me])
        optimizer.zero_grad(set_to_none=True)


def _batch_rows(run: RunState, rows: np.ndarray, step: int, clock: TaskClock
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The images (augmented as step `step` trains on them) and labels of sample
    indices `rows`, on the worker's device."""
    with clock.phase("dataset") as phase:
        images, labels = read_batch(run.paths.dataset, "train", rows,
                                    run.paths.dataset_identity)
        phase.nbytes = images.nbytes + labels.nbytes
        images = run.augmentation.apply(images, rows, step)
    device = run.profile.device
    return torch.from_numpy(images).to(device), torch.from_numpy(labels).to(device)


#: What `data` runs on a worker.
DATA_SIDE = WorkerSide(load_data, save_data, {REPLICA_STEP: replica_step,
                                              GRAD_REDUCE: grad_reduce,
                                              GRAD_UPDATE: grad_update})
