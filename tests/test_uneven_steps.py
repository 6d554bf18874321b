"""Uneven steps in the model: devices whose compute time varies from step to step
wait, at every exchange, for the expected later of their clocks (Clark's maximum of
normals, costmodel/timeline.py), with each device's spread taken from the probe's
quartiles (`compute_spread`)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from pipeline.costmodel import DaskOverhead, DeviceSpec, LinkSpec, Options, predict
from pipeline.costmodel.network import conv_net
from pipeline.costmodel.timeline import Timeline, expected_max
from pipeline.probe.results import IQR_SIGMAS, ShardTiming, TrunkTiming, compute_spread
from tests.test_probe_robust import _probe

MS = 1e-3


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


def _timing(layer: int, kernels: int, active: int, total: float, low: float, high: float
            ) -> ShardTiming:
    return ShardTiming(layer, kernels, active, total / 2, total / 2, low_s=low, high_s=high)


def test_a_workers_spread_is_the_median_of_its_timings_quartile_ranges():
    sigma = 0.2 * IQR_SIGMAS  # quartiles 0.2 * 1.349 apart on a 1 s total: spread 0.2
    timings = [_timing(0, 4, 2, 1.0, 1.0 - sigma / 2, 1.0 + sigma / 2),
               _timing(0, 8, 2, 2.0, 2.0 - sigma, 2.0 + sigma),
               _timing(0, 12, 2, 1.0, 0.5, 1.5)]  # an outlier: the median ignores it
    assert compute_spread(timings) == pytest.approx(0.2)
    assert compute_spread([_timing(0, 4, 2, 1.0, 0.0, 0.0)]) == 0.0  # no quartiles kept
    trunk = TrunkTiming(64, 2, 0.5, 0.5, low_s=0.9, high_s=0.9 + 0.1 * IQR_SIGMAS)
    assert compute_spread([trunk]) == pytest.approx(0.1)


def test_the_probes_devices_take_the_spread_of_timings_with_as_many_workers_running():
    sigma = IQR_SIGMAS * MS
    probe = _probe({"cpu-0": [_timing(0, 16, 2, 10 * MS, 9 * MS, 9 * MS + sigma),  # 0.1
                              _timing(0, 32, 1, 10 * MS, 9 * MS, 9 * MS + 3 * sigma)],  # 0.3
                    "cpu-1": [_timing(0, 16, 2, 10 * MS, 0.0, 0.0)]})
    two = probe.device_specs(2)
    assert [d.spread for d in two] == [pytest.approx(0.1), 0.0]
    alone = dataclasses.replace(probe, workers=probe.workers[:1])
    assert alone.device_specs(1)[0].spread == pytest.approx(0.3)


def test_a_band_edge_keeps_the_spread_of_the_middle():
    sigma = IQR_SIGMAS * MS
    probe = _probe({"cpu-0": [_timing(0, 16, 2, 10 * MS, 9 * MS, 9 * MS + 2 * sigma)],
                    "cpu-1": [_timing(0, 16, 2, 10 * MS, 9.5 * MS, 9.5 * MS + sigma)]})
    middle = [d.spread for d in probe.device_specs(2)]
    assert middle == [pytest.approx(0.2), pytest.approx(0.1)]
    for bound in ("low", "high"):
        assert [d.spread for d in probe.at(bound).device_specs(2)] == \
            [pytest.approx(s) for s in middle]
