"""The zoo's networks against torchvision's definitions, and the network config.

Names and shapes against the table written from torchvision's source
(tests/data/torchvision_keys.json); the arithmetic of a training step against the
independent transcription (tests/torchvision_models.py) holding the same weights.
"""

from __future__ import annotations

import json
import pathlib
import re
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

from pipeline.config.run_config import build_run_config, load_run_config
from pipeline.config.schema import ConfigError
from pipeline.run import run_training
from tasks.network import build_network, checkpoint_shapes, initial_state, set_dropout, to_arrays
from tasks.zoo import PRESETS, build_preset, scaled
from tests.zoo_replay import load_torchvision

KEYS = json.loads((pathlib.Path(__file__).parent / "data" / "torchvision_keys.json").read_text())
ROOT = pathlib.Path(__file__).resolve().parent.parent
TORCHVISION = [p for p in PRESETS if p != "marques"]
#: A size each preset trains at here in a second: (image side, width)
TEST_SIZE = {"alexnet": (64, 1 / 16), "vgg11": (32, 1 / 16), "vgg16": (32, 1 / 16),
             "vgg11_bn": (32, 1 / 16), "vgg16_bn": (32, 1 / 16), "resnet18": (32, 1 / 16),
             "resnet50": (32, 1 / 32), "resnet20": (32, 0.5)}


@pytest.mark.parametrize("preset", TORCHVISION)
def test_checkpoint_names_and_shapes_are_torchvisions(preset):
    side = 32 if preset == "resnet20" else 224
    network = build_preset(preset, (3, side, side), 1000, "float32")
    ours = {key: list(shape) for key, shape in checkpoint_shapes(network).items()}
    theirs = {key: shape or [1] for key, shape in KEYS[preset]}  # the counter: one row
    assert ours == theirs


def test_shapes_alone_initialise_nothing(monkeypatch):
    """`checkpoint_shapes` builds the network on the meta device, which holds no values:
    torchvision's initialisation there would only import torch's compiler (1 s and
    76 MB in the client of every run)."""
    def refuse(*args, **kwargs):
        raise AssertionError("initialised a network that holds no values")
    monkeypatch.setattr(torch.nn.init, "kaiming_normal_", refuse)
    network = build_preset("resnet20", (3, 32, 32), 10, "float32")
    assert checkpoint_shapes(network)["conv1.weight"] == (16, 3, 3, 3)
    with pytest.raises(AssertionError, match="no values"):  # a real network is initialised
        initial_state(network, seed=0)


@pytest.mark.parametrize("preset", TORCHVISION)
def test_a_training_step_equals_torchvisions_on_the_same_weights(preset):
    """float64, train mode, dropout 0.5 where the network has it: two SGD steps of
    ours and of torchvision's (loaded strictly from our initial state) agree on the
    loss, every weight and every batch-norm statistic."""
    side, width = TEST_SIZE[preset]
    network = build_preset(preset, (3, side, side), 10, "float64", width, 0.5)
    state = initial_state(network, seed=3)
    ours = build_network(network)
    ours.load_state_dict(load_torchvision(preset, 10, width, 0.5, state, "float64")
                         .state_dict())
    theirs = load_torchvision(preset, 10, width, 0.5, state, "float64")
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(6, 3, side, side, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 10, (6,), generator=generator)
    losses = {}
    for name, model in (("ours", ours), ("theirs", theirs)):
        sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        losses[name] = []
        for step in range(2):
            set_dropout(model, 7, step)
            sgd.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            loss.backward()
            sgd.step()
            losses[name].append(float(loss.detach()))
    np.testing.assert_allclose(losses["ours"], losses["theirs"], rtol=1e-12)
    after = to_arrays(theirs.state_dict(), "float64")
    for key, value in to_arrays(ours.state_dict(), "float64").items():
        np.testing.assert_allclose(value, after[key], rtol=1e-10, atol=1e-13, err_msg=key)


def test_dropout_draws_the_same_mask_for_a_step_and_another_for_the_next():
    network = build_preset("vgg11", (3, 32, 32), 10, "float64", 1 / 16, 0.5)
    model = build_network(network)
    features = torch.ones(4, network.flat_features, dtype=torch.float64)
    set_dropout(model, 1, 5)
    first, again = model.head(features), model.head(features)
    set_dropout(model, 1, 6)
    assert torch.equal(first, again) and not torch.equal(first, model.head(features))
    set_dropout(model, 1, 5, rows=slice(1, 3), batch=4)  # a replica's rows of the batch
    torch.testing.assert_close(model.head(features[1:3]), first[1:3], rtol=1e-12, atol=0)


def test_width_rounds_half_up_and_never_to_zero():
    assert [scaled(n, w) for n, w in [(3, 0.5), (5, 0.5), (64, 1 / 128), (16, 0.25)]] == \
        [2, 3, 1, 4]


def _config(tmp_path, network: dict, *overrides: str):
    data = {"name": "zoo", "output": str(tmp_path / "run"), "network": network}
    return build_run_config(data, list(overrides))


def test_a_preset_on_the_command_line_replaces_the_files_network(tmp_path):
    config = load_run_config("configs/small.yaml", ["network.preset=resnet20",
                                                    "network.width=0.25"])
    network = config.network_spec((3, 32, 32))
    assert network.preset == "resnet20" and network.conv[0].name == "conv1"
    assert network.conv[0].kernels == 4  # 16 x 0.25
    # the last word: a preset after overrides of the layers replaces them too
    again = load_run_config("configs/small.yaml", ["network.conv.0.kernels=8",
                                                   "network.preset=resnet20"])
    assert again.network_spec((3, 32, 32)).conv[0].kernels == 16


def test_a_network_of_your_own_is_named_as_a_sequential_of_its_modules():
    network = load_run_config("configs/custom_resnet.yaml").network_spec((3, 32, 32))
    keys = list(checkpoint_shapes(network))
    assert keys[:3] == ["0.weight", "1.weight", "1.bias"]
    assert "5.downsample.0.weight" in keys and "11.weight" in keys
    assert network.tied_groups()[0] == [0, 2, 4]  # the stem and the first stage's blocks


def test_the_readmes_checkpoint_snippet_loads_a_run_made_with_overrides(tmp_path,
                                                                       tiny_dataset_factory):
    """README's "load one into plain PyTorch", run as written (paths moved to
    `tmp_path`) on a run of configs/resnet20.yaml whose command line scaled it
    (network.width=0.25): the config it reads must be the one the run ran, overrides
    included, or the checkpoint does not fit the network it builds."""
    out = tmp_path / "runs" / "resnet20"
    run_training(load_run_config(str(ROOT / "configs" / "resnet20.yaml"), [
        "network.width=0.25", "strategy=reference", "train.batch=4", "train.eval_samples=0",
        f"output={out}", f"data.path={tiny_dataset_factory('float32')}",
        "data.train_samples=512", "data.test_samples=128", "progress=false",
        "prediction=never"]))
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    snippet = readme.split("load one into plain PyTorch:\n\n", 1)[1].split("\n\n", 1)[0]
    code = textwrap.dedent(snippet).replace("runs/resnet20", str(out))
    assert "load_model(" in code
    scope: dict = {}
    exec(code, scope)  # noqa: S102 (the README's own lines)
    convs = [m for m in scope["model"].modules() if isinstance(m, nn.Conv2d)]
    assert convs[0].out_channels == 4  # resnet20's stem of 16, at width 0.25


def test_a_network_of_your_own_loads_into_its_sequential_whatever_its_dropout(tmp_path):
    """docs/networks.md: the keys are the Sequential's without its nn.Dropout modules
    (conv, ReLU, max-pool, Flatten, Linear, ReLU, Linear), dropout or not."""
    plain = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(4 * 16 * 16, 6), nn.ReLU(), nn.Linear(6, 10))
    for dropout in (0.0, 0.5):
        network = _config(tmp_path, {"layers": [{"conv": 4}, {"pool": "max"}], "hidden": [6]},
                          f"network.dropout={dropout}").network_spec((3, 32, 32))
        assert network.dense_dropout(1) == dropout
        state = initial_state(network, 0)
        plain.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})  # strict


@pytest.mark.parametrize("network,overrides,message", [
    ({"preset": "resnet19"}, [], "network.preset: expected one of"),
    ({"layers": [{"conv": 8, "pool": "max"}]}, [], "network.layers.0.conv: each layer is one"),
    ({"layers": [{"block": "basic"}]}, [], "network.layers.0.planes: a block needs"),
    ({"preset": "alexnet"}, [], "network.preset: alexnet does not fit images of 32x32 (the "
                                "max pool of window 3 after conv layer features.10: its input is only 1x1"),
    ({"conv": [{"kernels": 4}]}, ["network.width=0"], "network.width: expected"),
    ({"layers": [{"conv": 8, "planes": 4}]}, [],
     "network.layers.0.planes: a conv layer has no planes (it is a field of block)"),
    ({"layers": [{"block": "basic", "planes": 4, "size": 5}]}, [],
     "network.layers.0.size: a block layer has no size"),
    ({"layers": []}, [], "network.layers: at least one conv layer or block is needed"),
    ({"preset": "resnet20"}, ["network.conv.0.kernels=8"],
     "network.conv.0.kernels: network.preset resnet20 gives the layers"),
    ({"conv": [{"kernels": 4}]}, ["network.preset=resnet20", "network.hidden.0=8"],
     "network.hidden.0: network.preset resnet20 gives the layers"),
    ({"layers": [{"conv": 4, "size": 3, "stride": 8}, {"conv": 4, "size": 5, "padding": 0}]},
     [], "(network.layers.1: conv layer 2: its input is only 4x4, too small for a 5x5 kernel"),
    ({"layers": [{"conv": 4}, {"pool": "max", "size": 3, "padding": 2}]}, [],
     "network.layers.1.padding: a pooling's padding is at most half its size (3 // 2 = 1)"),
    ({"layers": [{"conv": 4}, {"pool": "avg", "padding": 2}]}, [],
     "network.layers.1.padding: a pooling's padding is at most half its size (2 // 2 = 1)"),
    ({"layers": [{"conv": 4}, {"pool": "adaptive_avg", "size": 2, "stride": 2}]}, [],
     "network.layers.1.stride: an adaptive_avg pool has no stride"),
    ({"layers": [{"block": "basic", "planes": 3}]}, [],  # nor this: a shortcut of the images
     "network.layers.0.block: a basic block of 3 output channels and stride 1 on the images' "
     "3 channels would add the images themselves as its shortcut, which no strategy holds: "
     "put a conv layer before it"),
    ({"layers": [{"block": "basic", "planes": 6}]}, ["network.width=0.5"],
     "network.layers.0.block: a basic block of 3 output channels"),
    ({"layers": [{"pool": "max"}, {"conv": 4}]}, [],  # not a matter of the images' size
     "network.layers.0.pool: a pooling follows a conv layer or block, and this is the first"),
])
def test_a_bad_network_is_one_line_naming_the_field(tmp_path, network, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _config(tmp_path, network, *overrides).network_spec((3, 32, 32))


def test_a_replica_is_timed_with_its_dropout_drawn_as_a_step_draws_it():
    """`placement: calibrated` times a `data` replica in training mode: a network with
    dropout needs its masks pointed at a step first."""
    from tasks.data_ops import time_replica
    network = build_preset("vgg11", (3, 32, 32), 10, "float32", 1 / 16, 0.5)
    assert time_replica(network, 4, repeats=1)["seconds"] > 0
