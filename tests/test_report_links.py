"""The link-rate part of the report: winners per rate and where they flip (pure)."""

from __future__ import annotations

import math

import pandas as pd

from experiments.report.links import flips, link_winners


def _frame() -> pd.DataFrame:
    """kernel moves more bytes than data: data wins on slow links, kernel on fast ones;
    the model agrees except at 1gbit, and has no figure for kernel at 20mbit."""
    rows = []
    measured = {("kernel", "10gbit"): 0.10, ("data", "10gbit"): 0.12,
                ("kernel", "1gbit"): 0.20, ("data", "1gbit"): 0.15,
                ("kernel", "20mbit"): 3.00, ("data", "20mbit"): 0.90}
    predicted = {("kernel", "10gbit"): 0.11, ("data", "10gbit"): 0.13,
                 ("kernel", "1gbit"): 0.14, ("data", "1gbit"): 0.15,
                 ("kernel", "20mbit"): float("nan"), ("data", "20mbit"): 0.99}
    for workers in (2, 3):
        for (strategy, rate), seconds in measured.items():
            rows.append({"strategy": strategy, "rate": rate, "workers": workers,
                         "step_time": seconds * workers / 2,
                         "predicted_step_time": predicted[strategy, rate] * workers / 2})
    return pd.DataFrame(rows)


def test_winners_per_rate_from_fast_to_slow():
    winners = link_winners(_frame(), "rate", ["workers"])
    two = winners[winners["workers"] == 2]
    assert list(two["rate"]) == ["10gbit", "1gbit", "20mbit"]
    assert list(two["measured_winner"]) == ["kernel", "data", "data"]
    assert list(two["predicted_winner"]) == ["kernel", "kernel", "data"]
    assert list(two["agree"]) == [True, False, True]
    # 1gbit: kernel predicted 0.14 against 0.20 measured, the worst of the two
    assert math.isclose(two["worst_error"].iloc[1], 0.3)
    assert math.isclose(two["worst_error"].iloc[2], 0.1)  # kernel has no prediction there
    # the runner-up's measured step over the winner's: data 0.12 / kernel 0.10 at 10gbit
    assert [round(m, 6) for m in two["measured_margin"]] == [0.2, round(0.2 / 0.15 - 1, 6),
                                                            round(3.0 / 0.9 - 1, 6)]


def test_flips_name_the_rates_between_which_the_winner_changes():
    winners = link_winners(_frame(), "rate", ["workers"])
    two = winners[winners["workers"] == 2]
    assert flips(two, "measured_winner") == [("10gbit", "kernel", "1gbit", "data")]
    assert flips(two, "predicted_winner") == [("1gbit", "kernel", "20mbit", "data")]
    assert flips(two[two["rate"] != "10gbit"], "measured_winner") == []
