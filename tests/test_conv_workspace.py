"""The memory model's conv workspace measured on this machine
(pipeline/records/conv_workspace.py): the arithmetic that turns readings into the
constant, and a real measurement in a fresh process."""

from __future__ import annotations

import pytest

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


def test_this_machines_workspace_is_measured_in_a_fresh_process():
    """A fresh process's convs give a plausible factor: oneDNN copies a conv's output
    and more (about 1.2-1.3 on the Intel host)."""
    assert max(s.output_bytes() for s in SHAPES) <= 4 << 20  # each pass a few milliseconds
    assert 0.3 < measure_conv_workspace() < 4.0
    assert cpu_signature()


def test_a_measurement_that_cannot_run_gives_none(monkeypatch):
    """A measuring process that cannot start (here: no such interpreter) gives 0, which
    leaves the constant's figure, rather than an error in the caller's run."""
    monkeypatch.setattr("sys.executable", "/nonexistent/python")
    assert measure_conv_workspace() == 0.0
