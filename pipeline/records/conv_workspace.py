"""The convolution library's scratch on this machine: the memory model's
`conv_workspace` (pipeline/costmodel/memory.py), measured once per machine.

Why measured and not a constant: a float32 conv on the CPU runs in oneDNN, which picks
its kernels and blocked layouts by the instruction set. Where it runs a direct
kernel (AVX-512, AVX2) it reorders the layer's input (beyond a few channels) and its
output to and from a blocked layout, a copy of each; its backward reorders the
output gradient and writes the input gradient blocked; without them (SSE4.1) it runs
gemm kernels with a scratch of their own. So what a conv holds beyond its tensors
follows the CPU: on the Intel host with oneDNN held to AVX2 the first layer's
backward took 1.15x its gradients, with AVX-512 1.38x, with SSE4.1 0.27x.

How: in a fresh process (`python -m pipeline.records.conv_workspace`, one torch
thread, as a worker's default), for each of `SHAPES` (layers of the project's
networks, scaled down), one forward and backward first (oneDNN makes its primitives
and JIT-compiles their code: those stay for the process's life, the runtime's part),
then each pass `REPEATS` times on a heap handed back to the kernel (``malloc_trim``),
between a reset of the resident high-water mark (tasks/memory.py) and its reading:
what the pass raised the resident size by, less the tensors it returned, the median
of those, is its scratch (`ConvReading`). `workspace_factor` turns the readings into
the model's constant: the forward's scratch over the conv outputs, the backward's over
the output and input gradients, all shapes and both passes pooled, as the model
applies one factor to both. About 0.4 s of CPU beyond torch's import, kept with the
other figures measured per machine (pipeline/records/memory.py's cache), keyed by the
CPU too (`cpu_signature`).
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from tasks.memory import PER_STRETCH, current_rss, read_peak, reset_peak

__all__ = ["ConvShape", "ConvReading", "SHAPES", "workspace_factor", "cpu_signature",
           "read_shapes", "measure_conv_workspace"]

#: Longest the measuring process may take before the measurement gives up (fitted constant).
MEASURE_TIMEOUT_S = 120
#: Readings of each pass, of which the median counts (`read_shapes`).
REPEATS = 3
#: Bytes per element of the measured convs (float32: the networks' dtype and oneDNN's).
FLOAT32_BYTES = 4


@dataclass(frozen=True)
class ConvShape:
    """A conv layer measured: `batch` images of `channels` x `size` x `size`, `kernels`
    kernels of `window` x `window`, `padding` each side, stride 1."""

    batch: int
    channels: int
    kernels: int
    size: int
    window: int
    padding: int

    def output_bytes(self) -> int:
        side = self.size + 2 * self.padding - self.window + 1
        return self.batch * self.kernels * side * side * FLOAT32_BYTES

    def input_bytes(self) -> int:
        return self.batch * self.channels * self.size * self.size * FLOAT32_BYTES


#: Layers of the project's networks at batches that keep each pass to a few
#: milliseconds and each output at 2-4 MB (the resident size is read to a few hundred
#: KB): the paper family's first layer (3 channels: oneDNN reads its input as it is)
#: and its second, a layer with three times the kernels of its input's channels (as
#: the paper network's second), and 3x3 layers as ResNet-20's and VGG's.
SHAPES = (ConvShape(32, 3, 32, 32, 5, 2), ConvShape(32, 32, 64, 16, 5, 2),
          ConvShape(16, 32, 96, 16, 5, 2), ConvShape(32, 16, 16, 32, 3, 1),
          ConvShape(64, 64, 64, 8, 3, 1), ConvShape(64, 64, 128, 8, 3, 1))


@dataclass(frozen=True)
class ConvReading:
    """What one conv's passes raised a process's resident size by, beyond the tensors
    each returned (bytes), and what the model sets that against: the output for the
    forward, the output gradient and the input gradient for the backward."""

    forward_scratch: float
    output_bytes: float
    backward_scratch: float
    gradient_bytes: float


def workspace_factor(readings: list[ConvReading]) -> float:
    """The model's `conv_workspace` from the readings: the scratch of every pass over
    the bytes the model scales it by (`ConvReading`), pooled; a scratch read below zero
    (the kernel handed a page back mid-pass) counts as none. 0 where nothing was read."""
    scratch = sum(max(0.0, r.forward_scratch) + max(0.0, r.backward_scratch)
                  for r in readings)
    scale = sum(r.output_bytes + r.gradient_bytes for r in readings)
    return scratch / scale if scale > 0 else 0.0


def cpu_signature() -> str:
    """What oneDNN's choice of kernels follows: the CPU's model and whether it has
    AVX-512 and AVX2 (a cache shared by several machines keeps one figure each)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    isa = [name for name in ("avx512f", "avx2") if name in flags]
    return " ".join([model, *isa])


def read_shapes(shapes: tuple[ConvShape, ...] = SHAPES) -> list[ConvReading]:
    """Each shape's `ConvReading`, measured in this process (module doc): each pass's
    scratch the median of `REPEATS` (a pass that can serve itself from a page an
    earlier allocation of its own freed reads less). Meant for a fresh process: it
    resets the process's resident high-water mark. None where the mark cannot be reset
    (no /proc, another OS)."""
    torch.set_num_threads(1)
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; none elsewhere

    def scratch(run: Callable[[], tuple[torch.Tensor, ...]]) -> float:
        """What one pass raised the resident size by, beyond the tensors it returned."""
        readings = []
        for _ in range(REPEATS):
            if trim is not None:  # the heap's free pages handed back: the pass's own show
                trim(0)
            kind, before = reset_peak(), current_rss()
            if kind != PER_STRETCH:
                raise OSError("the resident high-water mark cannot be reset here")
            returned = run()
            peak = read_peak(kind=kind).rss
            readings.append(peak - before - sum(t.numel() for t in returned) * FLOAT32_BYTES)
            del returned
        return statistics.median(readings)

    readings = []
    generator = torch.Generator().manual_seed(0)
    for shape in shapes:
        x = torch.randn(shape.batch, shape.channels, shape.size, shape.size, generator=generator)
        weight = torch.randn(shape.kernels, shape.channels, shape.window, shape.window,
                             generator=generator)
        bias = torch.randn(shape.kernels, generator=generator)
        padding = [shape.padding, shape.padding]

        def forward() -> tuple[torch.Tensor, ...]:
            return (F.conv2d(x, weight, bias, padding=shape.padding),)

        grad_z = torch.randn_like(forward()[0])

        def backward() -> tuple[torch.Tensor, ...]:  # as tasks/graph_shard.py's conv_backward
            return torch.ops.aten.convolution_backward(
                grad_z, x, weight, [shape.kernels], [1, 1], padding, [1, 1], False, [0, 0],
                1, (True, True, True))

        backward()  # oneDNN's primitives made, their code compiled: the runtime's part
        readings.append(ConvReading(scratch(forward), shape.output_bytes(), scratch(backward),
                                    shape.output_bytes() + shape.input_bytes()))
    return readings


def measure_conv_workspace() -> float:
    """This machine's `conv_workspace` (`workspace_factor` of a fresh process's
    `read_shapes`); 0 where it cannot be measured."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    try:
        done = subprocess.run([sys.executable, "-m", "pipeline.records.conv_workspace"],
                              capture_output=True, text=True, timeout=MEASURE_TIMEOUT_S,
                              env=env, check=True)
        readings = [ConvReading(**r) for r in json.loads(done.stdout.strip().splitlines()[-1])]
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, TypeError):
        return 0.0
    return workspace_factor(readings)


if __name__ == "__main__":
    print(json.dumps([asdict(r) for r in read_shapes()]), flush=True)
