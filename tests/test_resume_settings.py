"""What a resume (`train.resume=true`) may change, and what it refuses.

A resume continues the run's weights and record: with another batch, learning rate,
seed or dataset it once trained on silently, its record saying the new batch for every
step and its medians blending both halves. Now `--check` and the run refuse it, one
line naming each setting with the checkpointed value and the new one; what does not
touch the arithmetic (steps, checkpoints, warm-up, evaluation, the strategy) may
change, and the record's `starts` says what each start ran.
"""

from __future__ import annotations

import json
import re

import numpy as np
import xarray as xr
import zarr

from pipeline.records.starts import left_out_steps, measured, placed_setup_unmeasured
from pipeline.run import run_training
from storage import checkpoints
from tests.helpers import run_main
from tests.test_integrity import main_lines, reference_config, write_config

#: Overrides a resume refuses, and what its line must say of them.
REFUSED = [
    (["train.batch=32"], ["train.batch=16 (now 32)"]),
    (["train.lr=0.1"], ["train.lr=0.05 (now 0.1)"]),
    (["train.momentum=0.5"], ["train.momentum=0.9 (now 0.5)"]),
    (["train.weight_decay=0"], ["train.weight_decay=0.001 (now 0.0)"]),
    (["train.nesterov=true"], ["train.nesterov=false (now true)"]),
    (["train.seed=1"], ["train.seed=0 (now 1)"]),
    (["train.lr_decay=step", "train.lr_milestones=[5]"],
     ["train.lr_decay=none (now step)", "train.lr_milestones=[] (now [5])"]),
    (["train.lr_warmup=2"], ["train.lr_warmup=0 (now 2)"]),
    (["data.train_samples=256"], ["data.train_samples=512 (now 256)"]),
    (["data.test_samples=64"], ["data.test_samples=128 (now 64)"]),
    (["data.augment=crop_flip"], ["data.augment=none (now crop_flip)",
                                  "data.augment_padding=null (now 4)"]),
    (["network.conv.0.kernels=8"], ["network.conv.0.kernels=10 (now 8)"]),
    (["network.dtype=float64"], ["network.dtype=float32 (now float64)"]),
    (["train.batch=32", "train.lr=0.1"], ["train.batch=16 (now 32)", "train.lr=0.05 (now 0.1)"]),
]


def test_a_resume_with_other_settings_is_refused_naming_each(tmp_path, tiny_dataset_factory,
                                                             capsys):
    dataset = tiny_dataset_factory("float32")
    config = reference_config(tmp_path, dataset, **{"train.steps": 4,
                                                   "train.checkpoint_every": 2})
    run_training(config)
    path = write_config(tmp_path, config)
    record = tmp_path / "run" / "record.zarr"
    before = xr.open_zarr(record).step.values.tolist()
    for overrides, named in REFUSED:
        for check in (["--check"], []):
            code, lines = main_lines(capsys, [path, "train.resume=true", "train.steps=6",
                                              *overrides, *check])
            assert code == 2 and len(lines) == 1, (overrides, check, lines)
            assert lines[0].startswith("error: train.resume: the checkpoints in "), lines
            for text in named:
                assert text in lines[0], (overrides, lines)
            assert "new `output`" in lines[0], lines
    assert xr.open_zarr(record).step.values.tolist() == before  # nothing trained
    # a store that recorded its settings before augmentation was one of them trained
    # without it
    group = zarr.open_group(config.checkpoint_path, mode="a")
    group.attrs["made_with"] = {key: value for key, value in group.attrs["made_with"].items()
                                if not key.startswith("data.augment")}
    code, lines = main_lines(capsys, [path, "train.resume=true", "data.augment=crop_flip",
                                      "--check"])
    assert code == 2 and "data.augment=none (now crop_flip)" in lines[0], lines
    # a store written before it recorded its settings: the run folder's config.yaml
    # says them
    del zarr.open_group(config.checkpoint_path, mode="a").attrs["made_with"]
    assert checkpoints.made_with(config.checkpoint_path) is None
    code, lines = main_lines(capsys, [path, "train.resume=true", "train.batch=32", "--check"])
    assert code == 2 and "train.batch=16 (now 32)" in lines[0], lines


def test_a_resume_may_change_what_leaves_the_arithmetic_alone(tmp_path, tiny_dataset_factory,
                                                              capsys):
    """More steps, other checkpoints, warm-up and evaluation, and settings the
    strategy does not use (`train.batch_norm` on a network without batch norm,
    `hybrid.*` outside `hybrid`, `data.augment_padding` without `data.augment`) resume; each start's entry says its strategy,
    placement and batch."""
    dataset = tiny_dataset_factory("float32")
    config = reference_config(tmp_path, dataset, **{"train.steps": 4,
                                                   "train.checkpoint_every": 2})
    run_training(config)
    code, lines = main_lines(capsys, [
        write_config(tmp_path, config), "train.resume=true", "train.steps=6",
        "train.checkpoint_every=3", "train.warmup_steps=2", "train.eval_samples=32",
        "train.batch_norm=local", "hybrid.scheme=b", "hybrid.dense_batch=worker",
        "hybrid.conv_lr_scaling=sqrt",
        "data.augment_padding=2",  # padding without augmentation changes nothing
        "train.lr_gamma=0.5", "train.lr_warmup_factor=0.5"])  # no step decay, no warm-up
    assert code == 0, lines
    record = xr.open_zarr(tmp_path / "run" / "record.zarr")
    assert record.step.values.tolist() == list(range(6))
    starts = json.loads(record.attrs["starts"])
    assert [(s["strategy"], s["placement"], s["batch"]) for s in starts] == [
        ("reference", "even", 16)] * 2


def test_a_cosine_schedule_fixes_the_runs_steps(tmp_path, tiny_dataset_factory, capsys):
    """`train.lr_decay: cosine` spreads its decay over `train.steps`: more steps would
    change the rates the checkpointed steps trained at, so a resume may not extend the
    run (it may finish it); a store that recorded no schedule trained at a constant rate."""
    dataset = tiny_dataset_factory("float32")
    config = reference_config(tmp_path, dataset, **{"train.steps": 4,
                                                   "train.checkpoint_every": 2,
                                                   "train.lr_decay": "cosine"})
    run_training(config)
    path = write_config(tmp_path, config)
    code, lines = main_lines(capsys, [path, "train.resume=true", "train.steps=6", "--check"])
    assert code == 2 and "train.steps=4 (now 6)" in lines[0], lines
    code, lines = main_lines(capsys, [path, "train.resume=true", "train.lr_gamma=0.5",
                                      "--check"])
    assert code == 0, lines
    made = zarr.open_group(config.checkpoint_path, mode="a")
    made.attrs["made_with"] = {key: value for key, value in made.attrs["made_with"].items()
                               if not key.startswith("train.lr_") and key != "train.steps"}
    code, lines = main_lines(capsys, [path, "train.resume=true", "--check"])
    assert code == 2 and "train.lr_decay=none (now cosine)" in lines[0], lines


def test_a_resume_on_another_setup_times_only_the_last_starts_steps(tmp_path,
                                                                    tiny_dataset_factory):
    """A resume may change the strategy or the workers, but the summary then gave one
    step-time median over both starts' steps under the last start's strategy (and its
    prediction error against that blend): `reference` steps timed as `single`'s. The
    timing figures now cover the steps of the starts set up like the last one, and the
    summary and its starts line say which steps they leave out."""
    dataset = tiny_dataset_factory("float32")
    config = reference_config(tmp_path, dataset, **{"train.steps": 4,
                                                   "train.checkpoint_every": 2,
                                                   "train.warmup_steps": 1})
    run_training(config)
    status, lines, out = run_main("train", [
        write_config(tmp_path, config), "train.resume=true", "train.steps=8",
        "strategy=single", "prediction=never"])
    assert status == 0, lines
    record = xr.open_zarr(tmp_path / "run" / "record.zarr").load()
    assert record.start.values.tolist() == [0] * 4 + [1] * 4
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["other_setup_steps_left_out"] == [0, 1, 2, 3]
    assert summary["warmup_steps_left_out"] == [4]
    assert summary["measured_steps"] == 3
    assert summary["step_time_median"] == float(np.median(record.step_time.values[5:]))
    # the strategy the last start ran on its own workers, not every start's
    labels = record.worker_label.values.tolist()  # both starts': the reference's too
    assert len(labels) == 2 and any(label.startswith("in-process") for label in labels)
    assert summary["workers"] == [label for label in labels
                                  if not label.startswith("in-process")]
    assert re.search(r"^run \S+: strategy single on (?!.*in-process)", out, re.M), out
    assert "the medians leave out steps 4 (each start's warm-up) and steps 0-3 (run with " \
           "another strategy, placement or workers than the last start's as placed, or " \
           "after a recovery or join)" in out, out


def test_the_steps_said_left_out_are_those_the_timing_figures_leave_out():
    """A recovery from checkpoint 0 (the only one under the default
    train.checkpoint_every: 0) re-places every step: the figures then fall back to all
    of them, but the summary listed them all as left out (other_setup_steps_left_out,
    the 're-placed' line) beside medians over every one. Each list now holds only
    steps the figures leave out; a later restore still leaves its steps out."""
    def record(restored: int) -> xr.Dataset:
        return xr.Dataset(coords={"step": np.arange(6), "start": ("step", np.zeros(6, int))},
                          attrs={"recoveries": json.dumps([{"restored_step": restored}])})
    for restored, kept, warm, others in ((0, range(6), [], []),
                                         (3, [1, 2], [0], [3, 4, 5])):
        assert measured(record(restored), 1).step.values.tolist() == list(kept)
        assert left_out_steps(record(restored), 1) == (warm, others)
        # and whether no step ran on the set-up placed, which the summary says
        assert placed_setup_unmeasured(record(restored)) is (restored == 0)
