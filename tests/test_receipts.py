"""The TaskClock that builds a task's receipt (tasks/receipts.py), driven directly."""

from __future__ import annotations

import pytest

from tasks.receipts import Receipt, TaskClock


def test_a_phase_left_open_by_a_stop_ends_after_its_op_without_an_error():
    """A stop signal (SIGINT, SIGTERM) raised inside contextlib's ``__exit__`` of a
    phase, before it resumes the phase's generator, leaves that phase suspended while
    its op closes; garbage collection closes it later. It used to find no op open
    then and print "'NoneType' object has no attribute 'phases'" after the run's
    stopped line (the reference strategy's steps run in the signalled process). The
    phase now ends into the op it began in."""
    clock = TaskClock(Receipt("step-3", "reference", 3, 0.0))
    with pytest.raises(KeyboardInterrupt):
        with clock.op("training-step"):
            left_open = clock.phase("compute")
            left_open.__enter__()
            raise KeyboardInterrupt  # as if raised before `__exit__` resumed the phase
    assert clock.current is None
    left_open.gen.close()  # what garbage collection does to the suspended generator
    (event,) = clock.receipt.events
    assert [phase.kind for phase in event.phases] == ["compute"]
    assert event.phases[0].end >= event.phases[0].start


def test_a_phase_outside_any_op_is_still_an_error():
    clock = TaskClock(Receipt("step-0", "w", 0, 0.0))
    with pytest.raises(AssertionError, match="a phase belongs to an op"):
        with clock.phase("read"):
            pass


def test_phases_belong_to_the_op_they_ran_in():
    clock = TaskClock(Receipt("step-0", "w", 0, 0.0))
    with clock.op("conv-forward", 0):
        with clock.phase("read", nbytes=8, slot="x"):
            pass
    with clock.op("conv-forward", 1):
        with clock.phase("compute"):
            pass
    assert [[p.kind for p in e.phases] for e in clock.receipt.events] == [["read"], ["compute"]]
    assert clock.receipt.nbytes("read", layer=0) == 8
