"""The zoo's yardstick: a torchvision model (tests/torchvision_models.py) holding a
run's weights, with dropout masks a replay can draw again.

The project's networks are its own modules (tasks/network.py); a test that compares
a run with "plain PyTorch" takes the independent transcription of torchvision's
models instead, loaded strictly from the run's checkpoint, so that the names, the
shapes and the arithmetic are all checked against torchvision's definitions.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tasks.network import SeededDropout, to_torch
from tests import torchvision_models

#: The dense layer each preset's first dropout feeds (AlexNet: before its first
#: dense layer; VGG: before its second).
FIRST_DROPOUT_LAYER = {"alexnet": 0, "vgg11": 1, "vgg16": 1, "vgg11_bn": 1, "vgg16_bn": 1}


def torchvision_model(preset: str, classes: int, width: float, dropout: float,
                      dtype: str = "float32") -> nn.Module:
    """torchvision's `preset` with this project's seeded dropout in place of
    nn.Dropout (so `tasks.network.set_dropout` points it at a step)."""
    layer = iter(range(FIRST_DROPOUT_LAYER.get(preset, 0), 99))
    model = torchvision_models.build(preset, classes, width, dropout,
                                     dropout_module=lambda p: SeededDropout(p, next(layer)))
    return model.to(getattr(torch, dtype))


def load_torchvision(preset: str, classes: int, width: float, dropout: float,
                     state: dict[str, np.ndarray], dtype: str = "float32") -> nn.Module:
    """`torchvision_model` holding a checkpoint's arrays, loaded strictly."""
    model = torchvision_model(preset, classes, width, dropout, dtype)
    model.load_state_dict(to_torch(state), strict=True)
    return model
