"""The memory model's conv workspace measured on this machine
(pipeline/records/conv_workspace.py): the arithmetic that turns readings into the
constant, and a real measurement in a fresh process, kept in the per-machine cache."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pipeline.costmodel import marques_cifar
from pipeline.costmodel.kernel_memory import kernel_footprint
from pipeline.costmodel.memory import DEFAULT_CONSTANTS
from pipeline.records import memory as records_memory
from pipeline.records.conv_workspace import (SHAPES, ConvReading, ConvShape,
                                             cpu_signature, measure_conv_workspace,
                                             workspace_factor)


def test_the_factor_pools_every_pass_scratch_over_what_the_model_scales_it_by():
    # a forward that copied its output once (1 MB over 1 MB), a backward that held
    # half its gradients (1 MB over 2 MB); a second layer with twice the bytes
    readings = [ConvReading(1e6, 1e6, 1e6, 2e6), ConvReading(2e6, 2e6, 1e6, 4e6)]
    assert workspace_factor(readings) == pytest.approx(5e6 / 9e6)
    # a reading below zero (the kernel handed a page back during the pass) is none
    assert workspace_factor([ConvReading(-3e5, 1e6, 1e6, 1e6)]) == pytest.approx(0.5)
    assert workspace_factor([]) == 0.0  # nothing read: the fitted constant stays


def test_a_shapes_bytes_are_its_float32_output_and_input():
    shape = ConvShape(batch=2, channels=3, kernels=4, size=8, window=5, padding=2)
    assert shape.output_bytes() == 2 * 4 * 8 * 8 * 4  # padding 2 keeps 8x8
    assert shape.input_bytes() == 2 * 3 * 8 * 8 * 4
    assert ConvShape(1, 1, 1, 8, 3, 0).output_bytes() == 6 * 6 * 4


def test_this_machines_workspace_is_measured_once_and_kept_by_cpu(monkeypatch, tmp_path):
    """A fresh process's convs give a plausible factor (oneDNN copies a conv's output
    and more: about 1.2-1.3 on the Intel host), kept in the cache under this CPU and
    read back, not measured again; ``$CNN_MEMORY_RUNTIME=fitted`` keeps the constant."""
    assert max(s.output_bytes() for s in SHAPES) <= 4 << 20  # each pass a few milliseconds
    cache = tmp_path / "memory.json"
    monkeypatch.setenv("CNN_MEMORY_CACHE", str(cache))
    monkeypatch.delenv("CNN_MEMORY_RUNTIME", raising=False)
    records_memory.memory_conv_workspace.cache_clear()
    try:
        factor = records_memory.memory_conv_workspace()
        assert 0.3 < factor < 4.0
        keys = [json.loads(key) for key in json.loads(cache.read_text())]
        assert any("conv_workspace" in key and cpu_signature() in key for key in keys)

        def measure_again() -> float:
            raise AssertionError("measured again")
        monkeypatch.setattr(records_memory, "measure_conv_workspace", measure_again)
        records_memory.memory_conv_workspace.cache_clear()
        assert records_memory.memory_conv_workspace() == factor

        monkeypatch.setenv("CNN_MEMORY_RUNTIME", "fitted")
        records_memory.memory_conv_workspace.cache_clear()
        assert records_memory.memory_conv_workspace() == 0.0
    finally:
        records_memory.memory_conv_workspace.cache_clear()


def test_a_measurement_that_cannot_run_gives_none(monkeypatch):
    """A measuring process that cannot start (here: no such interpreter) gives 0, which
    leaves the constant's figure, rather than an error in the caller's run."""
    monkeypatch.setattr("sys.executable", "/nonexistent/python")
    assert measure_conv_workspace() == 0.0


def test_the_measured_workspace_is_a_cpu_devices_and_a_gpus_stays_assumed():
    """The factor measured here is oneDNN's: it scales a CPU device's scratch, and a GPU
    device (cuDNN) keeps its own assumed figure."""
    paper = marques_cifar()
    more = dataclasses.replace(DEFAULT_CONSTANTS,
                               conv_workspace=2 * DEFAULT_CONSTANTS.conv_workspace)

    def workspace(constants, gpu: bool) -> float:
        return kernel_footprint(paper, 32, constants=constants, gpu=[gpu]).parts[0]["workspace"]
    assert workspace(more, gpu=False) > workspace(DEFAULT_CONSTANTS, gpu=False)
    assert workspace(more, gpu=True) == workspace(DEFAULT_CONSTANTS, gpu=True) > 0
