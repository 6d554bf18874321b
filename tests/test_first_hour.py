"""A new user's surface: what `--help` and the configuration reference say of the
keys a first run needs, the line that says how a run was placed, and record attributes that are
JSON encoded once."""

from __future__ import annotations

import json
import os

import pytest

from pipeline.cluster.worker_setup import register_setup
from pipeline.cluster.workers import find_workers
from pipeline.records.summary import format_summary, left_out_lines, placement_line
from pipeline.run import run_training
from pipeline.train import main
from tests.helpers import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_help_names_the_run_s_name_and_output(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "name=NAME" in text and "at most 100 letters" in text
    assert "output=DIR" in text and "runs/<name>" in text


def test_the_configuration_reference_has_name_and_output():
    """The table the README links for every key (docs/configuration.md)."""
    page = open(os.path.join(ROOT, "docs", "configuration.md"), encoding="utf-8").read()
    table = page.split("## The run config", 1)[1].split("\n\n", 2)[1]
    keys = {line.split("|")[1].strip() for line in table.splitlines() if line.startswith("|")}
    assert {"`name`", "`output`", "`progress`"} <= keys


def test_the_placement_line_says_each_worker_s_share_and_why():
    kernel = placement_line("calibrated", {"kernel_split": [[16, 16], [40, 24]]},
                            ["cpu-0", "cpu-1"], "cpu-0",
                            {"chosen": "minmax", "predicted_step_time": 0.0512,
                             "memory": {"units_moved": 2}})
    # the prediction is the split's chosen, not the one moved to: said so
    assert kernel == ("placed: kernels per conv layer: cpu-0 16+40, cpu-1 16+24 (master "
                      "cpu-0); predicted 0.0512 s/step of the calibrated shards' compute "
                      "alone for the split before the move; by measured speeds (placement: "
                      "calibrated), the minmax split, then 2 unit(s) moved to fit memory")
    model = placement_line("model", {"kernel_split": [[16, 16]]}, ["a", "b"], "a",
                           {"chosen": "minmax", "predicted_step_time": 0.0071})
    assert ("predicted 0.0071 s/step at one step per task, without the client's share of "
            "the cores; by the performance model" in model)
    data = placement_line("even", {"batch_split": [32, 32]}, ["a", "b"], "a", {})
    assert data == "placed: samples of each batch: a 32, b 32 (master a); by an even split"


def test_a_worker_left_out_to_fit_memory_is_said_so():
    """cpu-1's 100 MB held none of the kernels the even split gave it: the line said it
    was left out for being "1.0x slower" than cpu-0, beside the even split's prediction."""
    choice = {"chosen": "even", "workers": ["cpu-0", "cpu-1"], "predicted_step_time": 0.0144,
              "split": [[16, 16], [32, 32]],
              "alternatives": {"even": {"split": [[16, 16], [32, 32]],
                                        "predicted_step_time": 0.0144},
                               "single:cpu-0": {"split": [[32, 0], [64, 0]],
                                                "predicted_step_time": 0.0221},
                               "single:cpu-1": {"split": [[0, 32], [0, 64]],
                                                "predicted_step_time": 0.0221}},
              "memory": {"capacity": [4e9, 1e8], "units_moved": 12, "margin": 0.15,
                         "split_before": [[16, 16], [32, 32]]}}
    (line,) = left_out_lines("calibrated", ["cpu-1"], choice, {}, "kernel")
    assert line == ("worker cpu-1 left out: its memory (100 MB) holds none of the kernels the "
                    "calibrated placement gave it: they were moved to the other workers to "
                    "fit memory (its capacity, 15% of each peak kept free: "
                    "cluster.memory_margin)")
    del choice["memory"]["margin"]  # a record from before the margin
    (line,) = left_out_lines("calibrated", ["cpu-1"], choice, {}, "kernel")
    assert line.endswith("to fit memory (its capacity)")


#: The least summary `format_summary` prints.
BARE_SUMMARY = {"step_time_median": 0.01, "measured_steps": 3, "step_time_p25": 0.01,
                "step_time_p75": 0.01, "step_time_min": 0.01, "step_time_max": 0.01,
                "throughput": 1.0, "compute_time_median": 0.0, "storage_time_median": 0.0,
                "master_time_median": 0.0, "wait_time_median": 0.0, "bytes_per_step": 0.0,
                "final_loss": 1.0, "client_cpu_per_step": 0.001, "client_core_share": 0.1}


def test_the_closing_prediction_says_what_it_prices_beside_the_placement_s():
    """The placement line's figure is the split's step at one step per task without
    the client's share; the closing one's adds both, and says so."""
    summary = {**BARE_SUMMARY, "predicted_step_time": 0.0062, "prediction_error": -0.4,
               "task_steps_median": 4.0, "predicted_breakdown": {"contention": 0.0002}}
    assert ("predicted   0.0062 s/step by the model at 4 steps per task, the client's share "
            "of the cores included (-40% against the median)"
            in format_summary("x", "kernel", summary, ["a"]))
    alone = {**summary, "task_steps_median": 1.0, "predicted_breakdown": {"contention": 0.0}}
    assert ("0.0062 s/step by the model at 1 step per task (-40%"
            in format_summary("x", "kernel", alone, ["a"]))


def test_the_header_names_the_workers_a_recovery_or_a_join_left_the_run_on():
    """Placed on a, b, c; c lost (back to checkpoint 4), then d joined at 8: the run
    ended on a, b, d, which the header says beside the placed set."""
    lost = {"lost_at_step": 6, "restored_step": 4, "lost_workers": ["c"],
            "workers": ["a", "b"], "replayed_steps": 2, "seconds": 1.0}
    joined = {"at_step": 8, "joined_workers": ["d"], "workers": ["a", "b", "d"]}
    placed = ["a", "b", "c"]
    header = format_summary("x", "kernel", BARE_SUMMARY, placed).splitlines()[0]
    assert header == "run x: strategy kernel on a, b, c"
    header = format_summary("x", "kernel", {**BARE_SUMMARY, "recoveries": [lost]},
                            placed).splitlines()[0]
    assert header == "run x: strategy kernel on a, b, c; ended on a, b (below)"
    both = {**BARE_SUMMARY, "recoveries": [lost], "joins": [joined]}
    assert format_summary("x", "kernel", both, placed).splitlines()[0].endswith(
        "; ended on a, b, d (below)")
    # A loss at the checkpoint a join came at restores that checkpoint: the later event.
    at_the_join = {**lost, "restored_step": 8, "workers": ["a", "d"]}
    assert format_summary("x", "kernel", {**both, "recoveries": [at_the_join]},
                          placed).splitlines()[0].endswith("; ended on a, d (below)")


def test_the_client_line_names_an_embedded_scheduler_only_where_there_is_one():
    embedded = format_summary("x", "kernel", BARE_SUMMARY, ["a"])
    assert "(10% of a core: the client and an embedded scheduler)" in embedded
    external = format_summary("x", "kernel", BARE_SUMMARY, ["a"], embedded_scheduler=False)
    assert "(10% of a core: the client)" in external


def test_a_run_whose_every_step_was_placed_again_says_so_and_compares_no_prediction():
    """A recovery from checkpoint 0 placed every step again, on fewer workers: the
    medians are of those steps (not a warm-up's fallback), and the prediction, of the
    set-up placed, is given but not held against them."""
    note = "no measured step ran on the set-up it prices: a recovery placed every step again"
    closing = format_summary("x", "kernel", {
        **BARE_SUMMARY, "placed_setup_unmeasured": True, "warmup_included": False,
        "predicted_step_time": 0.0062, "prediction_note": note}, ["a"])
    assert ("over 3 measured steps (IQR 0.010-0.010 s, range 0.010-0.010 s); every one ran "
            "after a recovery placed the work again on other workers than placed (below)"
            in closing), closing
    assert (f"  predicted   0.0062 s/step by the model at 1 step per task, not compared: {note}"
            in closing.splitlines()), closing
    assert "against the median" not in closing and "warm-up included" not in closing


def test_a_run_without_a_prediction_says_why_in_its_closing_summary():
    note = "no probe of this cluster is cached: set prediction: auto to probe it once"
    closing = format_summary("x", "kernel", {**BARE_SUMMARY, "predicted_step_time": None,
                                             "prediction_note": note}, ["a"])
    assert f"  predicted   none: {note}" in closing.splitlines()


@pytest.mark.parametrize("progress", [True, False])
def test_a_run_prints_its_placement_and_records_its_prediction_once_encoded(
        tmp_path, three_worker_cluster, tiny_dataset_factory, capsys, progress):
    """On the shared cluster's three CPU workers, even split; `progress=false`
    silences the line. The record's `prediction` attribute is one JSON object."""
    client, cluster = three_worker_cluster
    config = tiny_config(tmp_path, tiny_dataset_factory("float32"), progress=str(progress),
                         prediction="never", **{"train.steps": 2})
    config.cluster.workers = cluster.workers
    register_setup(client, config.cluster)
    result = run_training(config, client=client, offered=find_workers(client, config.cluster))
    err = capsys.readouterr().err
    line = ("tiny: placed: kernels per conv layer: cpu-0 4+4, cpu-1 4+4, cpu-2 2+4 "
            "(master cpu-0); by an even split")
    assert (line in err.splitlines()) == progress, err
    prediction = json.loads(result.record.attrs["prediction"])
    assert prediction == {"predicted_step_time": None, "prediction_note": "prediction: never"}
    closing = format_summary("tiny", "kernel", result.summary, ["cpu-0", "cpu-1", "cpu-2"])
    labels = {line.split()[0] for line in closing.splitlines()[1:]}
    assert "exchange" in labels and "workspace" not in labels  # one name for the traffic
    assert "compute" in closing and ", exchange " in closing


def test_the_workspace_traffic_is_called_exchange_in_tables_and_plots():
    import pandas as pd
    from experiments.report.breakdown import BREAKDOWN
    from experiments.sweep.summary import format_table
    assert {key: label for key, label, _ in BREAKDOWN}["storage_time"] == "exchange"
    table = pd.DataFrame([{"strategy": "kernel", "runs": "1/1", "step_time": 0.05,
                           "compute_time": 0.03, "storage_time": 0.01,
                           "predicted_step_time": float("nan"), "failure": ""}])
    header = format_table(table).splitlines()[0].split()
    assert "exchange" in header and "storage" not in header
