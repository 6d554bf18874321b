"""The strategies benchmarks' run order, the median's interval and the verdicts on
the targets (benchmarks/engine_speedup.py), and the side-by-side's ratios
(benchmarks/side_by_side.py): pure helpers, no runs."""

from __future__ import annotations

import random

from benchmarks.core_pairs import summary as core_pairs_summary
from benchmarks.engine_speedup import (TARGETS, median_interval, ratio_report, run_order,
                                       target_lines)
from benchmarks.side_by_side import NO_EXCHANGE, ratios


def test_repeats_alternate_the_order_so_a_drift_favours_no_run():
    names = ["a", "b", "c"]
    assert [run_order(names, r) for r in range(3)] == [names, ["c", "b", "a"], names]


def test_the_medians_interval_is_the_binomial_order_statistics():
    values = [float(v) for v in range(1, 16)]  # 15 values: x(4) and x(12), 96.5 %
    assert median_interval(values) == (4.0, 12.0)
    assert median_interval(list(reversed(values))) == (4.0, 12.0)
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0)  # too few: the range
    assert median_interval([float(v) for v in range(1, 31)]) == (10.0, 21.0)  # n = 30


def test_the_medians_interval_covers_the_median_as_often_as_it_says():
    rng = random.Random(0)
    trials, covered = 2000, 0
    for _ in range(trials):
        low, high = median_interval([rng.expovariate(1.0) for _ in range(15)])
        covered += low <= 0.6931471805599453 <= high  # the exponential's median, ln 2
    assert 0.95 <= covered / trials <= 0.985  # 96.5 % for 15 values


def test_each_target_gets_its_verdict_from_the_median_and_its_interval():
    reports = [ratio_report("single step time / reference 1 thread", [1.0, 1.0, 1.0],
                            [1.0, 1.0, 1.0]),                         # 1.0 in every repeat
               ratio_report("kernel speedup over reference 1 thread", [1.7, 1.5, 1.65],
                            [1.0, 1.0, 1.0]),                         # median 1.65, min 1.5
               ratio_report("data step time / DDP-gloo's", [1.1, 1.2, 1.05], [1.0] * 3)]
    lines = target_lines(TARGETS["small"], reports)
    assert len(lines) == 3  # targets without a report are left out
    assert lines[0].endswith("<= 1.05: 1.000 (interval 1.000-1.000): holds, and so does the "
                             "median's interval")
    assert lines[1].endswith(">= 1.6: 1.650 (interval 1.500-1.700): holds at the median; its "
                             "interval crosses the bound")
    assert lines[2].endswith("<= 1.0: 1.100 (interval 1.050-1.200): misses")


def test_many_rounds_narrow_the_interval_inside_the_bound():
    rng = random.Random(1)
    ratios = [0.93 + rng.uniform(-0.2, 0.2) for _ in range(40)]  # single rounds cross 1.0
    report = ratio_report("data step time / DDP-gloo's", ratios, [1.0] * 40)
    assert report["max"] > 1.0 and report["high"] < 1.0
    assert target_lines(TARGETS["small"], [report])[0].endswith("holds, and so does the "
                                                                "median's interval")


def test_the_side_by_side_reports_ddp_and_data_against_the_no_exchange_floor():
    """With DDP's ranks run without the allreduce, DDP and `data` are each also set
    against that floor, round by round; without that contender, no such ratio."""
    times = {"ddp-gloo-2": [5.0, 6.0, 4.0], NO_EXCHANGE: [4.0, 6.0, 4.4],
             "data": [4.4, 5.4, 4.0]}
    by_name = {r["ratio"]: r for r in ratios(times, one_worker=False)}
    assert by_name["ddp-gloo-2 step time / replicas without exchange"]["median"] == 1.0
    assert by_name["ddp-gloo-2 step time / replicas without exchange"]["max"] == 1.25
    assert by_name["data step time / replicas without exchange"]["median"] == 4.0 / 4.4
    assert by_name["data step time / DDP-gloo's"]["median"] == 0.9
    del times[NO_EXCHANGE]
    assert not any("without exchange" in r["ratio"] for r in ratios(times, one_worker=False))


def test_core_pairs_counts_the_trials_where_two_loops_shared_the_cores():
    alone, pair = [0.2, 0.2, 0.2, 0.25, 0.2], [0.2, 0.204, 0.26, 0.245, 0.3]
    line = core_pairs_summary(alone, pair)
    assert "alone: median 200.0 ms (range 200.0-250.0)" in line
    assert "pair: median 245.0 ms (range 200.0-300.0)" in line
    assert "median 1.02" in line and "range 0.98-1.50" in line
    assert "2 of 5 at 1.15 or more" in line
    assert "0 of 2" in core_pairs_summary([0.2, 0.2], [0.2, 0.22])
