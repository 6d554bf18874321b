"""The strategies benchmark's run order and its verdicts on issue 21's targets
(benchmarks/engine_speedup.py): pure helpers, no runs."""

from __future__ import annotations

from benchmarks.engine_speedup import ratio_report, run_order, target_lines


def test_repeats_alternate_the_order_so_a_drift_favours_no_run():
    names = ["a", "b", "c"]
    assert [run_order(names, r) for r in range(3)] == [names, ["c", "b", "a"], names]


def test_each_target_gets_its_verdict_from_the_median_and_the_spread():
    reports = [ratio_report("single step time / reference 1 thread", [1.0, 1.0, 1.0],
                            [1.0, 1.0, 1.0]),                         # 1.0 in every repeat
               ratio_report("kernel speedup over reference 1 thread", [1.7, 1.5, 1.65],
                            [1.0, 1.0, 1.0]),                         # median 1.65, min 1.5
               ratio_report("data step time / DDP-gloo's", [1.1, 1.2, 1.05], [1.0] * 3)]
    lines = target_lines("small", reports)
    assert len(lines) == 3  # targets without a report are left out
    assert lines[0].endswith("<= 1.05: 1.000 (1.000-1.000): holds in every repeat")
    assert lines[1].endswith(">= 1.6: 1.650 (1.500-1.700): holds at the median; the spread "
                             "crosses it")
    assert lines[2].endswith("<= 1.0: 1.100 (1.050-1.200): misses")
