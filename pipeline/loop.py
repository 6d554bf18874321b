"""The training loop: submit steps ahead, collect each as it finishes, checkpoint.

The same loop drives every strategy (the distributed engine and the in-process
reference) and the model's calibration runs (pipeline/probe/runs.py), so what the
probe measures is what training does.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable, Iterator, Protocol

import numpy as np
from tqdm import tqdm

from pipeline.checkpointing import save_checkpoint
from pipeline.config import RunConfig
from pipeline.records import RunRecorder, StepResult
from pipeline.trace import ClientEvent
from tasks.memory import read_peak, reset_peak


class Trainer(Protocol):
    """What the training loop drives: the distributed engine or the reference."""

    devices: list[str]

    def start(self, from_step: int) -> None: ...
    def submit(self, step: int) -> None: ...
    def collect(self, step: int) -> StepResult: ...
    def checkpoint(self, done_steps: int) -> str | None: ...  # the attempt that staged it
    def show_waits(self, note: Callable[[str], None]) -> None: ...  # long waits, said
    def close(self) -> None: ...


def train_loop(config: RunConfig, trainer: Trainer, recorder: RunRecorder,
               client_events: list[ClientEvent], from_step: int, train_samples: int,
               stop_at_checkpoint: Callable[[int], bool] = lambda step: False) -> int:
    """Submit steps ahead (`train.inflight`), collect each as it finishes, checkpoint.

    A step's time runs from the previous step's completion to its own. No step is
    submitted past the next checkpoint: a checkpoint holds the state after exactly
    its step, and saving it is timed apart from every step. After each checkpoint
    before the last, `stop_at_checkpoint(step)` may end the loop there (nothing is
    in flight then). Returns the step reached.
    """
    bar = tqdm(total=config.train.steps, initial=from_step, unit="step",
               desc=f"{config.name} [{config.strategy}]", disable=not config.progress,
               file=sys.stderr, leave=False)
    with bar:  # closed (its line cleared) on every way out, so an error's line stands alone
        return _steps(config, trainer, recorder, client_events, from_step, train_samples,
                      stop_at_checkpoint, bar)


def _steps(config: RunConfig, trainer: Trainer, recorder: RunRecorder,
           client_events: list[ClientEvent], from_step: int, train_samples: int,
           stop_at_checkpoint: Callable[[int], bool], bar: tqdm) -> int:
    """`train_loop`'s steps, reporting to `bar`."""
    steps, ahead = config.train.steps, config.train.inflight
    # a long wait on a worker (a frozen one, before the stall limit) shows on the bar;
    # the next step's figures replace it
    trainer.show_waits(lambda note: bar.set_postfix_str(note, refresh=True))
    saves = sorted(s for s in config.checkpoint_steps() if s > from_step)
    submitted, last_save, last_end = from_step, from_step, time.perf_counter()
    for step in range(from_step, steps):
        next_save = next(s for s in saves if s > step)
        kind = reset_peak()  # the client's own peak over this step's submits and collect
        cpu_start = time.process_time()  # the client's CPU (and an embedded scheduler's)
        while submitted < min(step + ahead, next_save):
            with _client_event(client_events, f"submit step {submitted}"):
                trainer.submit(submitted)
            submitted += 1
        with _client_event(client_events, f"collect step {step}"):
            result = trainer.collect(step)
        now = time.perf_counter()
        recorder.add_step(result, now - last_end, read_peak("cpu", kind),
                          time.process_time() - cpu_start)
        last_end = now
        if not np.isfinite(result.loss):
            raise FloatingPointError(f"training diverged at step {step}: loss is {result.loss}")
        if step + 1 == next_save:
            with _client_event(client_events, f"checkpoint {step + 1}"):
                save_checkpoint(config, trainer, last_save, step + 1, train_samples)
            last_save = step + 1
            recorder.checkpoint_s += time.perf_counter() - now
            last_end = time.perf_counter()
            if step + 1 < steps and stop_at_checkpoint(step + 1):
                return step + 1
        bar.set_postfix(loss=f"{result.loss:.3f}",
                        step_s=f"{recorder.steps[step]['step_time']:.3f}")
        bar.update(1)
    return steps


@contextlib.contextmanager
def _client_event(events: list[ClientEvent], name: str) -> Iterator[None]:
    """Time a stretch of the client's work for the trace's client lane."""
    start = time.time()
    try:
        yield
    finally:
        events.append(ClientEvent(name, start, time.time()))
