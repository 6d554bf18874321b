"""Uneven steps in the model: devices whose compute time varies from step to step
wait, at every exchange, for the expected later of their clocks (Clark's maximum of
normals, costmodel/timeline.py), with each device's spread measured by the probe
against its peers (`relative_spreads`)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from pipeline.costmodel import DaskOverhead, DeviceSpec, LinkSpec, Options, predict
from pipeline.costmodel.builders import conv_net
from pipeline.costmodel.timeline import Timeline, expected_max, later_of
from pipeline.probe.readings import relative_spreads
from pipeline.probe.results import cluster_probe_from_dict
from pipeline.probe.runs import PlanRun, ProbePlan, ReplicaPlan
from tasks.layout import CONV_BACKWARD, CONV_FORWARD
from tasks.replica_layout import TRUNK_FORWARD
from tasks.receipts import OpEvent, Phase, Receipt
from tests.test_probe_robust import _probe


def test_the_later_of_two_certain_times_is_the_later_one():
    assert expected_max(2.0, 0.0, 3.0, 0.0) == (3.0, 0.0)
    assert expected_max(3.0, 0.0, 2.0, 0.0) == (3.0, 0.0)


@pytest.mark.parametrize("mean_b, sigma_a, sigma_b", [(1.0, 0.1, 0.1), (1.05, 0.1, 0.03),
                                                      (0.9, 0.02, 0.2), (1.5, 0.1, 0.1)])
def test_the_expected_later_time_matches_sampling(mean_b, sigma_a, sigma_b):
    mean, variance = expected_max(1.0, sigma_a ** 2, mean_b, sigma_b ** 2)
    draws = np.random.default_rng(0).normal([1.0, mean_b], [sigma_a, sigma_b], (400_000, 2))
    later = draws.max(axis=1)
    assert mean == pytest.approx(later.mean(), abs=1e-3)
    assert variance == pytest.approx(later.var(), rel=0.02)
    assert mean >= max(1.0, mean_b)  # never earlier than the later expected time


def test_two_equal_uneven_devices_meeting_wait_a_known_amount():
    """Two devices compute 1 s with spread 0.1 and one reads the other's slot: E[max]
    of two equal normals is the mean plus sigma / sqrt(pi)."""
    link = LinkSpec.from_bandwidth(1e12)
    steady_tl, uneven_tl = (Timeline([link, link], None, DaskOverhead(), spread=spread)
                            for spread in ((), (0.1, 0.1)))
    for tl in (steady_tl, uneven_tl):
        for d in (0, 1):
            tl.run(d, "compute", 1.0)
        tl.write(1, "slot", 0.0)
        tl.read(0, [("slot", 0.0)])
    assert steady_tl.clock[0] == pytest.approx(1.0)
    assert uneven_tl.clock[0] == pytest.approx(1.0 + 0.1 / math.sqrt(math.pi))
    assert uneven_tl.segments[0][-1].kind == "wait"


def test_devices_that_just_met_do_not_wait_again_for_the_same_spread():
    """Two devices compute 1 s (spread 0.1) and swap slots, then swap again with nothing
    in between: the second swap waits for nothing new (their clocks now share what
    varied); taken as independent, the second would wait again, and more each step."""
    link = LinkSpec.from_bandwidth(1e12)
    tl = Timeline([link, link], None, DaskOverhead(), spread=(0.1, 0.1))
    for d in (0, 1):
        tl.run(d, "compute", 1.0)
    for round_ in ("first", "second"):
        for d in (0, 1):
            tl.write(d, f"{round_}/{d}", 0.0)
        for d in (0, 1):
            tl.read(d, [(f"{round_}/{1 - d}", 0.0)])
        if round_ == "first":
            met = list(tl.clock)
            assert met[0] == pytest.approx(1.0 + 0.1 / math.sqrt(math.pi))
    assert tl.clock == pytest.approx(met, rel=1e-6)
    # a step later each has varied apart by one more second of compute: the same wait
    for d in (0, 1):
        tl.run(d, "compute", 1.0)
        tl.write(d, f"third/{d}", 0.0)
    tl.read(0, [("third/1", 0.0)])
    assert tl.clock[0] == pytest.approx(met[0] + 1.0 + 0.1 / math.sqrt(math.pi), rel=1e-3)


def test_the_later_of_correlated_times_matches_sampling():
    """a = x + y, b = x + z with x shared: only y - z decides which is later."""
    mean, noise = later_of(1.0, {1: 0.3, 2: 0.1}, 1.05, {1: 0.3, 3: 0.05}, fresh=9)
    draws = np.random.default_rng(0).normal(0.0, 1.0, (400_000, 3))
    a = 1.0 + 0.3 * draws[:, 0] + 0.1 * draws[:, 1]
    b = 1.05 + 0.3 * draws[:, 0] + 0.05 * draws[:, 2]
    later = np.maximum(a, b)
    assert mean == pytest.approx(later.mean(), abs=1e-3)
    assert sum(c * c for c in noise.values()) == pytest.approx(later.var(), rel=0.02)
    assert noise[1] == pytest.approx(0.3)  # the shared deviation is carried whole


def _kernel(spread: float, timeline: str = "fast"):
    net = conv_net([8, 16], image=16, hidden=[], name="tiny")
    device = DeviceSpec(flops=2e10, name="cpu", spread=spread)
    return predict("kernel", net, 64, [device] * 3, LinkSpec.from_bandwidth(1e10),
                   options=Options(timeline=timeline,
                                   overhead=DaskOverhead(task=1e-3, sync=2e-4)))


def test_an_uneven_kernel_step_takes_longer_and_the_waits_are_overhead():
    steady, uneven = _kernel(0.0), _kernel(0.2)
    assert uneven.step_time > steady.step_time * 1.02
    assert uneven.breakdown["overhead"] > steady.breakdown["overhead"]
    assert uneven.breakdown["compute"] == steady.breakdown["compute"]  # the means unchanged
    # the fast timeline keeps no variances: with a spread the op-by-op one runs
    assert uneven.step_time == _kernel(0.2, "reference").step_time


def _receipt(worker: str, step: int, seconds: dict[tuple[str, int], float]) -> Receipt:
    events = [OpEvent(op, layer, 0.0, t, [Phase("compute", 0.0, t)])
              for (op, layer), t in seconds.items()]
    return Receipt("t", worker, step, 0.0, 1.0, events)


def test_a_drift_that_moves_every_worker_alike_is_no_spread():
    """Both workers 1.5x slower at odd steps: drift, which costs no wait."""
    plan = ProbePlan([[4, 4]])
    receipts = [_receipt(w, s, {(CONV_FORWARD, 0): base * (1.5 if s % 2 else 1.0)})
                for s in range(8) for w, base in (("a", 0.01), ("b", 0.02))]
    assert relative_spreads([PlanRun(plan, ["a", "b"], receipts)]) == \
        {"a": {2: pytest.approx(0.0)}, "b": {2: pytest.approx(0.0)}}


def test_a_workers_own_jitter_is_its_spread_and_alone_there_is_none():
    """Worker b's op takes 0.8x or 1.2x its median at random steps, a's never moves:
    the residuals against their mean give b its jitter's spread (a, the other end of
    the same differences, as much: two workers cannot tell whose it was)."""
    draws = np.random.default_rng(1).normal(1.0, 0.1, 400)
    receipts = [_receipt(w, s, {(CONV_BACKWARD, 1): 0.05 * (draws[s] if w == "b" else 1.0)})
                for s in range(400) for w in ("a", "b")]
    both = relative_spreads([PlanRun(ProbePlan([[4, 4]]), ["a", "b"], receipts)])
    # for 2 workers the residual is half the difference, scaled back by sqrt(2):
    # sigma(b) / sqrt(2) = 0.071 each
    assert both["b"][2] == pytest.approx(0.1 / math.sqrt(2), rel=0.15)
    assert both["a"][2] == pytest.approx(both["b"][2])
    alone = [r for r in receipts if r.worker == "a"]
    assert relative_spreads([PlanRun(ProbePlan([[8]]), ["a"], alone)]) == {}


def test_a_replica_trunk_is_read_stretch_by_stretch_between_its_meetings():
    """A trunk op meeting its peer 15 times a step (synchronised batch norm): worker b's
    16 stretches each take 0.8-1.2x their median at random, independently. Each
    stretch's jitter is the spread the timeline gives each stretch; the whole op's
    would be a quarter of it."""
    draws = np.random.default_rng(2).normal(1.0, 0.1, (200, 16))

    def trunk(worker: str, step: int) -> Receipt:
        phases = []
        for index in range(16):
            t = 0.004 * (draws[step, index] if worker == "b" else 1.0)
            phases += [Phase("compute", 0.0, t)] + ([Phase("wait", 0.0, 0.001)]
                                                    if index < 15 else [])
        return Receipt("t", worker, step, 0.0, 1.0,
                       [OpEvent(TRUNK_FORWARD, -1, 0.0, 0.1, phases)])

    receipts = [trunk(w, s) for s in range(200) for w in ("a", "b")]
    spreads = relative_spreads([PlanRun(ReplicaPlan([8, 8]), ["a", "b"], receipts)])
    assert spreads["b"][2] == pytest.approx(0.1 / math.sqrt(2), rel=0.15)


def test_the_probes_devices_take_the_spread_with_as_many_workers_running():
    probe = _probe({"cpu-0": [], "cpu-1": []})
    probe.workers[0].spread.update({2: 0.12, 3: 0.2})
    assert [d.spread for d in probe.device_specs(2)] == [0.12, 0.0]
    assert probe.device_specs(1)[0].spread == 0.0  # alone: none measured, none waited for
    again = cluster_probe_from_dict(json.loads(json.dumps(dataclasses.asdict(probe))))
    assert again.workers[0].spread == {2: 0.12, 3: 0.2}  # through the JSON cache

