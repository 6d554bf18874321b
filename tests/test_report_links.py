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


def test_a_rate_not_every_strategy_was_measured_at_has_no_winner():
    """kernel at 20mbit pending (a sweep stopped there): data, the only one measured,
    read as the winner, and the section said "no flip" with the row missing."""
    from experiments.report.links import links_section
    from experiments.report.view import StoreView
    import xarray as xr

    frame = _frame()
    frame.loc[(frame["strategy"] == "kernel") & (frame["rate"] == "20mbit"), "step_time"] = \
        float("nan")
    two = link_winners(frame, "rate", ["workers"])
    two = two[two["workers"] == 2]
    assert list(two["measured_winner"]) == ["kernel", "data", ""]
    assert list(two["not_measured"]) == ["", "", "kernel"]
    ds = xr.Dataset({"status": (("strategy", "workers", "rate", "repeat"),
                                [[[[1]] * 3] * 2] * 2)},
                    coords={"strategy": ["kernel", "data"], "workers": [2, 3],
                            "rate": ["10gbit", "1gbit", "20mbit"], "repeat": [0]},
                    attrs={"axes": '{"rate": ["cluster.link.rate"]}'})
    lines = links_section(StoreView(ds), frame)
    assert "| 2 | 20mbit | - (kernel not measured) |" in "\n".join(lines), lines
    assert ("- workers 2, measured: kernel at 10gbit -> data at 1gbit (no winner at 20mbit: "
            "not every strategy measured)") in lines, lines
