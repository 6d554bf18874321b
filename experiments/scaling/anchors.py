"""Sanity anchors of predict-only sweeps: what the model says of set-ups that were
published, beside what was published.

- Krizhevsky (arXiv:1404.5997, table 1): the hybrid on 2, 4 and 8 K20 GPUs
  (`pipeline.costmodel.krizhevsky`, where the set-up is described).
- A single A100 training ResNet-50 at batch 256 in TF32: about 1,400 images/s
  (NVIDIA's published figure), against the `a100` preset
  (:mod:`experiments.scaling.hardware`).

Why in the report: a map of where strategies win is only as good as the rates
behind it; the anchors say how far the presets are from machines that were
measured, and a test holds the A100 one within `ANCHOR_BAND`.
"""

from __future__ import annotations

from dataclasses import dataclass

from experiments.scaling.config import build_point, network_of
from experiments.scaling.hardware import device_spec
from pipeline.costmodel import krizhevsky_k20_setup, krizhevsky_speedups, predict
from pipeline.costmodel.krizhevsky import PUBLISHED_SINGLE_STEP, PUBLISHED_SPEEDUPS

__all__ = ["Anchor", "a100_resnet50", "krizhevsky_anchors", "anchor_lines", "ANCHOR_BAND",
           "ANCHOR_PRESETS", "anchor_records"]

#: NVIDIA's published single-A100 ResNet-50 training rate in TF32, images/s.
A100_RESNET50_IMAGES = 1400.0
#: The presets the anchors stand on (stock, whatever a sweep sets).
ANCHOR_PRESETS = ("a100", "k20")
#: The factor within which a preset's prediction must land of its anchor.
ANCHOR_BAND = 2.0


@dataclass(frozen=True)
class Anchor:
    """One published figure and the model's prediction of it."""

    what: str
    published: float
    predicted: float
    units: str

    @property
    def ratio(self) -> float:
        return self.predicted / self.published


def a100_resnet50(batch: int = 256) -> Anchor:
    """`single` on one `a100`-preset device training ResNet-50 (3x224x224, 1000
    classes), in images per second."""
    point = build_point({"strategy": "single", "network": {"preset": "resnet50"},
                         "train": {"batch": batch}, "hardware": {"device": "a100"}})
    device = device_spec(point.hardware, "a100")
    step = predict("single", network_of(point.network), batch, device).step_time
    return Anchor(f"one A100 (`a100` preset), ResNet-50, batch {batch}, TF32",
                  A100_RESNET50_IMAGES, batch / step, "images/s")


def krizhevsky_anchors() -> list[Anchor]:
    """One K20's step, and the hybrid's speedup on K20 GPUs over one, as published
    (the step: 98.05 h over 90 epochs) and predicted."""
    setup = krizhevsky_k20_setup()
    one = predict("single", setup.network, setup.per_gpu_batch, setup.gpu).step_time
    anchors = [Anchor(f"Krizhevsky's AlexNet, one K20 GPU, batch {setup.per_gpu_batch}",
                      PUBLISHED_SINGLE_STEP, one, "s a step")]
    for dense_batch in ("worker", "full"):
        predicted = krizhevsky_speedups((2, 4, 8), dense_batch=dense_batch)
        for gpus, speedup in predicted.items():
            anchors.append(Anchor(f"Krizhevsky's hybrid, {gpus} K20 GPUs, dense batch "
                                  f"{dense_batch}", PUBLISHED_SPEEDUPS[(gpus, dense_batch)],
                                  speedup, "x speedup"))
    return anchors


def anchor_records() -> list[dict[str, object]]:
    """The anchors as the sweep's store keeps them (its `anchors` attribute): the model
    of the sweep's code, beside its predictions, whenever the report is written."""
    return [vars(anchor) for anchor in [a100_resnet50(), *krizhevsky_anchors()]]


def anchor_lines(records: list[dict] | None = None) -> list[str]:
    """report.md's anchors section: a table of published against predicted (`records`
    as a store keeps them; None: this code's)."""
    lines = ["| set-up | published | predicted | predicted / published |",
             "|---|--:|--:|--:|"]
    anchors = [Anchor(**record) for record in records] if records is not None else \
        [a100_resnet50(), *krizhevsky_anchors()]
    for anchor in anchors:
        lines.append(f"| {anchor.what} | {anchor.published:.4g} {anchor.units} | "
                     f"{anchor.predicted:.4g} {anchor.units} | {anchor.ratio:.2f} |")
    return lines
