"""Workspace accesses in the model's timeline: their spread from access to access
(`StoreSpec.spread`, measured by the probe as `access_spreads`) adds to the clocks'
variances as compute's does, and every read checks its slot's ready marker, whether
it waited for the slot or found it written (`DaskOverhead.check`; a reader that waited
notices the marker `DaskOverhead.sync` after the write)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from pipeline.costmodel import DaskOverhead, DeviceSpec, LinkSpec, Options, StoreSpec, predict
from pipeline.costmodel.builders import conv_net
from pipeline.costmodel.timeline import Timeline
from pipeline.probe.readings import access_spreads, store_fit
from pipeline.probe.results import cluster_probe_from_dict
from pipeline.probe.runs import PlanRun, ProbePlan
from tasks.layout import CONV_FORWARD
from tasks.receipts import OpEvent, Phase, Receipt
from tests.test_probe_robust import _probe

LINK = LinkSpec.from_bandwidth(1e12)
FITS = {"read": (1e-3, 1e8), "write": (2e-3, 1e8)}


def _store(spread: float = 0.0) -> StoreSpec:
    return StoreSpec(write_bw=math.inf, read_bw=math.inf, write_chunk=1.0, read_chunk=0.0,
                     spread=spread)


def test_two_devices_writing_unevenly_meet_later_than_their_mean():
    """Each device spends 1 s writing (one access, spread 0.1) and one reads the other's
    slot: they meet at E[max] of two equal normals, the mean plus sigma / sqrt(pi)."""
    clocks = []
    for spread in (0.0, 0.1):
        tl = Timeline([LINK, LINK], _store(spread), DaskOverhead())
        for d in (0, 1):
            tl.write(d, f"slot{d}", 0.0)
        tl.read(0, [("slot1", 0.0)])
        clocks.append(tl.clock[0])
    assert clocks[0] == pytest.approx(1.0)
    assert clocks[1] == pytest.approx(1.0 + 0.1 / math.sqrt(math.pi))


def test_a_read_checks_its_marker_whether_or_not_it_waited():
    """A read of a slot written long before still pays one check (`sync`); a read that
    waited for its slot sees it `sync` after the write. Both are the read's I/O."""
    tl = Timeline([LINK, LINK], None, DaskOverhead(sync=0.01))
    tl.write(1, "early", 0.0)
    tl.run(0, "compute", 5.0)
    tl.read(0, [("early", 0.0)])
    assert tl.clock[0] == pytest.approx(5.01)
    assert [s.kind for s in tl.segments[0]] == ["compute", "io"]
    tl.run(1, "compute", 10.0)
    tl.write(1, "late", 0.0)
    tl.read(0, [("late", 0.0)])
    assert tl.clock[0] == pytest.approx(10.01)
    assert [s.kind for s in tl.segments[0]][-2:] == ["wait", "io"]


def test_a_look_at_a_written_slot_is_shorter_than_noticing_one():
    """With the look measured apart (`check`), a read of a slot written before pays
    the look alone; a read that waited still reads `sync` after the write, the wait
    (for the writer's write, not later) followed by the look."""
    tl = Timeline([LINK, LINK], None, DaskOverhead(sync=0.01, check=0.002))
    tl.write(1, "early", 0.0)
    tl.run(0, "compute", 5.0)
    tl.read(0, [("early", 0.0)])
    assert tl.clock[0] == pytest.approx(5.002)
    tl.run(1, "compute", 10.0)
    tl.write(1, "late", 0.0)
    tl.read(0, [("late", 0.0)])
    assert tl.clock[0] == pytest.approx(10.01)
    wait, look = tl.segments[0][-2:]
    assert (wait.kind, wait.waited_for, wait.end) == ("wait", (1, 10.0), pytest.approx(10.008))
    assert look.kind == "io" and look.end - look.start == pytest.approx(0.002)
    assert DaskOverhead(sync=0.01).marker_check == 0.01  # unmeasured: as long as noticing
    assert DaskOverhead(sync=0.001, check=0.002).notice_lag == 0.0


def test_the_probe_reads_a_look_at_a_written_slot_apart_from_noticing_one():
    """A wait that began after its slot's write ended is a look (`check_s`); one that
    the write ended inside is noticing (`sync_s`, from the write's end)."""
    from pipeline.probe.dask_readings import check_s, sync_s

    def receipt(worker: str, phases: list[Phase]) -> Receipt:
        return Receipt("t", worker, 0, 0.0, 1.0, [OpEvent(CONV_FORWARD, 0, 0.0, 1.0, phases)])
    writer = receipt("w1", [Phase("write", 0.10, 0.20, 8, "act/1/0"),
                            Phase("write", 0.50, 0.60, 8, "act/1/1")])
    reader = receipt("w0", [Phase("wait", 0.30, 0.302, 0, "act/1/0"),  # written: a look
                            Phase("wait", 0.40, 0.605, 0, "act/1/1")])  # waited: noticed
    run = PlanRun(ProbePlan([[1, 1]]), ["w0", "w1"], [writer, reader])
    assert check_s([run]) == pytest.approx(0.002)
    assert sync_s([run]) == pytest.approx(0.005)
    alone = PlanRun(ProbePlan([[1, 1]]), ["w0", "w1"], [writer])
    assert check_s([alone]) is None


def _kernel(store_spread: float, timeline: str = "fast"):
    net = conv_net([8, 16], image=16, hidden=[], name="tiny")
    store = StoreSpec(write_bw=1e8, read_bw=1e8, read_chunk=2e-3, write_chunk=3e-3,
                      spread=store_spread)
    return predict("kernel", net, 64, [DeviceSpec(flops=2e10, name="cpu")] * 3,
                   LinkSpec.from_bandwidth(1e10), store,
                   options=Options(timeline=timeline, overhead=DaskOverhead(sync=5e-4)))


def test_uneven_accesses_lengthen_a_kernel_step_and_take_the_reference_timeline():
    steady, uneven = _kernel(0.0), _kernel(0.3)
    assert uneven.step_time > steady.step_time * 1.01
    assert uneven.breakdown["compute"] == steady.breakdown["compute"]
    # the fast timeline keeps no variances: with an access spread the op-by-op one runs
    assert uneven.step_time == _kernel(0.3, "reference").step_time
    assert steady.step_time == pytest.approx(_kernel(0.0, "reference").step_time, rel=1e-9)


def _access_run(workers: int, seconds: list[list[float]]) -> PlanRun:
    """A run whose step ``s`` made reads of 1 MB taking ``seconds[s]`` each."""
    receipts = [Receipt("t", "a", step, 0.0, 1.0, [OpEvent(
        CONV_FORWARD, 0, 0.0, 1.0,
        [Phase("read", 0.0, t, 1_000_000, f"act/0/{i}") for i, t in enumerate(times)])])
        for step, times in enumerate(seconds)]
    return PlanRun(ProbePlan([[1] * workers]), [f"w{i}" for i in range(workers)], receipts)


def _sized_run(accesses: list[tuple[int, float]]) -> PlanRun:
    """A run of one step whose writes are ``(bytes, seconds)`` each."""
    phases = [Phase("write", 0.0, t, n, f"act/0/{i}") for i, (n, t) in enumerate(accesses)]
    receipt = Receipt("t", "a", 0, 0.0, 1.0, [OpEvent(CONV_FORWARD, 0, 0.0, 1.0, phases)])
    return PlanRun(ProbePlan([[1, 1]]), ["w0", "w1"], [receipt])


def test_a_few_preempted_accesses_do_not_set_the_stores_constants():
    """Writes of 100 us + bytes at 5 GB/s, 60 at each of four sizes, jittered by 5 %;
    three of the largest preempted for 15 ms, as on a busy host: the fit still gives
    the typical access (a plain least squares: 40 us and 0.47 GB/s)."""
    jitter = np.random.default_rng(0).normal(1.0, 0.05, 240)
    sizes = [1_000, 10_000, 100_000, 400_000]
    accesses = [(n, (100e-6 + n / 5e9) * jitter[i * 60 + k]) for i, n in enumerate(sizes)
                for k in range(60)]
    accesses[-3:] = [(400_000, 15e-3)] * 3
    latency, bandwidth = store_fit([_sized_run(accesses)], "write")
    assert latency == pytest.approx(100e-6, rel=0.1)
    assert bandwidth == pytest.approx(5e9, rel=0.1)
    assert store_fit([_sized_run(accesses)], "read") == (0.0, math.inf)  # none made


def test_an_access_spread_is_measured_against_its_own_steps_accesses():
    """Reads that each step makes alike (a step 2x slower than the last: drift) have no
    spread; reads jittered by a normal of 0.2 about the fit have about 0.2."""
    fitted = FITS["read"][0] + 1_000_000 / FITS["read"][1]
    drifting = _access_run(2, [[fitted * (1 + s % 2)] * 10 for s in range(6)])
    assert access_spreads([drifting], FITS) == {2: pytest.approx(0.0)}
    draws = np.random.default_rng(2).normal(1.0, 0.2, (40, 25))
    jittered = _access_run(3, [list(fitted * row) for row in draws])
    spreads = access_spreads([drifting, jittered], FITS)
    assert spreads[3] == pytest.approx(0.2, rel=0.15)
    assert spreads[2] == pytest.approx(0.0)
    assert access_spreads([_access_run(2, [[fitted] * 3])], FITS) == {}  # too few to say


def test_the_probes_store_takes_the_spread_with_as_many_workers_running():
    probe = _probe({"cpu-0": [], "cpu-1": [], "cpu-2": []})
    probe.store.spread.update({2: 0.1, 3: 0.25})
    assert probe.store_spec(2).spread == 0.1
    assert probe.store_spec().spread == 0.25  # all three
    assert probe.store_spec(1).spread == 0.0  # alone: no access measured
    again = cluster_probe_from_dict(json.loads(json.dumps(dataclasses.asdict(probe))))
    assert again.store.spread == {2: 0.1, 3: 0.25}  # through the JSON cache
