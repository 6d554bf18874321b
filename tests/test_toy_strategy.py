"""A strategy defined in this file alone trains, sweeps and predicts end to end.

The toy ("every worker trains its own replica on its slice of the batch, nothing
crosses workers") is not a method worth running: it shows that a new strategy is
one `Strategy` subclass, one layout, one `WorkerSide` and a `register` call, with
no project file touched. The run, the sweep and the model reach it only through
the registry. Its arithmetic is checked like every strategy's: the first worker's
replica (the one the checkpoints keep) equals plain PyTorch SGD on that worker's
rows of every batch.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Sequence

import cloudpickle
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import xarray as xr
import yaml
from torch import nn

from experiments.sweep import cli as sweep_cli
from experiments.sweep.store_layout import DONE
from pipeline.costmodel import (DeviceSpec, LinkSpec, Network, Options, Prediction, StoreSpec,
                                predict)
from pipeline.placement.split import Placement, split_even
from pipeline.run import run_training
from pipeline.config.schema import ConfigError
from pipeline.strategies import STRATEGIES, Strategy, register
from storage import checkpoints
from storage.datasets import read_batch
from tasks.layout import StepOp
from tasks.network import build_network
from tasks.optim import make_sgd, momentum_of, restore_momentum, weights_of
from tasks.run_state import WorkerSide
from tests.helpers import (max_relative_error, plain_pytorch_sequential, scheduler_args,
                           tiny_config)

# Workers import this module's functions by value: they need not find this file.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

TOY_STEP = "toy-step"


@dataclass(frozen=True)
class ToyLayout:
    """Every worker its own replica and `shares[d]` rows of each batch; no slots."""

    workers: tuple[str, ...]
    shares: tuple[int, ...]
    master: int = 0  # reports its replica's loss

    def ops(self, worker: int) -> list[StepOp]:
        return [StepOp(TOY_STEP)]

    def slots(self, network, batch: int) -> list:
        return []  # nothing crosses workers

    def checkpoint_chunks(self, network, chunks: dict[str, int]) -> dict[str, int]:
        return {}  # the first worker writes the whole network: a chunk per tensor


@dataclass
class ToyWork:
    model: nn.Sequential
    optimizer: torch.optim.SGD


def toy_load(layout: ToyLayout, me: int, network, checkpoint_path: str, step: int,
             arithmetic, device: str) -> ToyWork:
    model = build_network(network)
    weights = checkpoints.read_tensors(checkpoint_path, step, "weights")
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    optimizer = make_sgd(model.parameters(), arithmetic.optimizer)
    restore_momentum(optimizer, dict(model.named_parameters()),
                     checkpoints.read_tensors(checkpoint_path, step, "momentum"))
    return ToyWork(model.to(device), optimizer)


def toy_save(work: ToyWork, me: int, checkpoint_path: str, step: int) -> None:
    if me != 0:
        return
    named = dict(work.model.named_parameters())
    for kind, tensors in (("weights", weights_of(named)),
                          ("momentum", momentum_of(work.optimizer, named))):
        for key, value in tensors.items():
            checkpoints.write_slice(checkpoint_path, step, kind, key, 0, value)


def toy_step(run, op: StepOp, step: int, indices: np.ndarray, clock) -> None:
    start = sum(run.layout.shares[:run.me])
    rows = indices[start:start + run.layout.shares[run.me]]
    with clock.op(TOY_STEP):
        with clock.phase("dataset"):
            images, labels = read_batch(run.paths.dataset, "train", rows)
        with clock.phase("compute"):
            run.work.optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(run.work.model(torch.from_numpy(images)),
                                   torch.from_numpy(labels))
            loss.backward()
            run.work.optimizer.step(step)
        if run.me == run.layout.master:
            clock.receipt.loss = float(loss.detach())


class ToyStrategy(Strategy):
    name = "toy"
    placements = ("even",)
    split_key = "batch_split"
    worker_side = WorkerSide(toy_load, toy_save, {TOY_STEP: toy_step})

    def plan(self, client, config, network, slots, run_id):
        shares = split_even(config.train.batch, len(slots), 1)
        layout = ToyLayout(tuple(w.name for w in slots), tuple(shares))
        return self.make_plan(config, list(slots), layout, Placement("even", [shares]))

    def split_of(self, layout: ToyLayout, placement: Placement) -> dict:
        return {"batch_split": list(layout.shares)}

    def model(self, network: Network, batch: int, devices: Sequence[DeviceSpec],
              link: LinkSpec, store: StoreSpec | None, options: Options) -> Prediction:
        """One device's step on its share of the batch: nothing else happens."""
        return predict("single", network, math.ceil(batch / len(devices)), devices[0])


@pytest.fixture
def toy():
    strategy = register(ToyStrategy())
    yield strategy
    del STRATEGIES[strategy.name]


def replay_first_worker(config, dataset: str, share: int) -> tuple[dict, list[float]]:
    """Plain PyTorch SGD on the first `share` rows of every batch of the run."""
    model = plain_pytorch_sequential([c.kernels for c in config.network.conv],
                                     config.network.classes, torch.float32)
    initial = checkpoints.read_tensors(config.checkpoint_path, 0)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in initial.items()})
    t = config.train
    optimizer = torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum,
                                weight_decay=t.weight_decay)
    losses = []
    for rows in checkpoints.read_sample_indices(config.checkpoint_path)[:t.steps]:
        images, labels = read_batch(dataset, "train", rows[:share])
        optimizer.zero_grad()
        loss = F.cross_entropy(model(torch.from_numpy(images)), torch.from_numpy(labels))
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}, losses


def test_a_strategy_from_a_test_file_trains_exactly(tmp_path, toy, three_worker_cluster,
                                                    tiny_dataset_factory):
    client, cluster = three_worker_cluster
    dataset = tiny_dataset_factory("float32")
    config = tiny_config(tmp_path, dataset, strategy="toy", **{"cluster.use_workers": 3})
    config.cluster.workers = cluster.workers
    result = run_training(config, client=client)
    assert result.summary["strategy"] == "toy"
    assert result.summary["batch_split"] == [6, 5, 5]
    assert result.record.sizes["worker"] == 3
    assert float(result.record.workspace_bytes.sum()) == 0  # nothing crossed workers
    expected, losses = replay_first_worker(config, dataset, 6)
    trained = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
    assert max_relative_error(trained, expected) <= 1e-4
    assert max_relative_error(checkpoints.read_tensors(config.checkpoint_path, 0),
                              expected) > 1e-3  # training moved the weights
    np.testing.assert_allclose(result.record.loss.values, losses, rtol=1e-4)


def test_a_strategy_from_a_test_file_is_swept_and_predicted(tmp_path, toy, monkeypatch,
                                                            three_worker_cluster,
                                                            tiny_dataset_factory):
    monkeypatch.setenv("CNN_PREDICT_PROBE", "never")  # no probe of the cluster: too slow
    client, _cluster = three_worker_cluster
    dataset = tiny_dataset_factory("float32")
    measured = {"name": "toysweep", "output": str(tmp_path / "toy.zarr"),
                "base": {"strategy": "toy", "placement": "even",
                         "network": {"conv": [{"kernels": 8}, {"kernels": 8}]},
                         "data": {"path": dataset, "train_samples": 512, "test_samples": 128},
                         "train": {"batch": 16, "eval_samples": 0, "checkpoint_every": 0}},
                "measure": {"warmup_steps": 1, "steps": 2},
                "axes": {"cluster.workers": [1, 2]}}
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(measured))
    assert sweep_cli.main([str(path), *scheduler_args(client, str(tmp_path))]) == 0
    ds = xr.open_zarr(tmp_path / "toy.zarr")
    assert (ds.status == DONE).all()
    assert (ds.step_time > 0).all() and (ds.bytes_moved == 0).all()

    # The model's side: a scaling sweep predicts it next to a project strategy.
    scaling = {"name": "toyscale", "mode": "scaling", "output": str(tmp_path / "scale.zarr"),
               "base": {"network": {"conv": [{"kernels": 16}, {"kernels": 32}]},
                        "train": {"batch": 64},
                        "hardware": {"devices": 1, "device": "cpu",
                                     "link": {"gbps": 10, "latency_us": 5}}},
               "axes": {"strategy": ["single", "toy"], "hardware.devices": [1, 4]}}
    path = tmp_path / "scale.yaml"
    path.write_text(yaml.safe_dump(scaling))
    assert sweep_cli.main([str(path)]) == 0
    ds = xr.open_zarr(tmp_path / "scale.zarr")
    toy_time = ds.predicted_step_time.sel(strategy="toy").squeeze()
    single = ds.predicted_step_time.sel(strategy="single", devices=1).squeeze()
    assert float(toy_time.sel(devices=1)) == pytest.approx(float(single))
    assert float(toy_time.sel(devices=4)) < float(single) / 2  # a quarter of the batch each


def test_an_unknown_strategy_is_named_with_those_that_exist(tmp_path, toy,
                                                            tiny_dataset_factory):
    config = tiny_config(tmp_path, tiny_dataset_factory("float32"), strategy="toys")
    with pytest.raises(ConfigError, match="strategy: 'toys' is not a strategy.*'toy'"):
        run_training(config)


def test_the_toy_refuses_a_placement_it_does_not_take(tmp_path, toy, tiny_dataset_factory):
    config = tiny_config(tmp_path, tiny_dataset_factory("float32"), strategy="toy",
                         placement="calibrated")
    with pytest.raises(ConfigError, match="placement: 'calibrated' is not for strategy 'toy'"):
        run_training(config)

