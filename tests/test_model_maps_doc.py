"""docs/model.md's "Where each strategy wins" quotes the model's own figures: the
activations kernel parallelism exchanges, the batch below which it could beat data
parallelism, one A100's AlexNet step and the all-reduce beside it, and the cells the
paragraphs name (where kernel overtakes data, what fits 80 GB GPUs at batch 4096).

Why: a researcher quotes these sentences in a paper; they must say what the model
computes. Arithmetic only, on the scaling sweep's own points (`build_point`).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from experiments.scaling.config import build_point, network_of
from experiments.scaling.run import assess_point
from pipeline.costmodel import DeviceSpec, LinkSpec, predict
from pipeline.costmodel.prediction import Options

ROOT = Path(__file__).resolve().parent.parent
NETWORKS = ("alexnet", "vgg16", "resnet50")
LINK = LinkSpec.from_bandwidth(12.5e9)  # 100 Gb/s, no latency: bytes alone
FREE = DeviceSpec(flops=1e30, mem_bw=1e30)  # compute costs nothing: traffic alone


def section() -> str:
    text = (ROOT / "docs" / "model.md").read_text(encoding="utf-8")
    return " ".join(text.split("## Where each strategy wins", 1)[1].split("\n## ", 1)[0]
                    .split())


def quoted(pattern: str) -> list[float]:
    found = re.search(pattern, section())
    assert found, f"docs/model.md no longer says {pattern!r}"
    return [float(group) for group in found.groups()]


def network(preset: str):
    return network_of(build_point({"network": {"preset": preset}}).network)


def gathered(preset: str) -> float:
    """Conv outputs per image that another layer reads, each output once."""
    net = network(preset)
    return sum(net.conv[s].output_elements(1) for s in
               {net.source(l) for l in range(len(net.conv)) if net.source(l) >= 0})


def crossover(preset: str, devices: int = 16) -> float:
    """The batch at which kernel's traffic equals data's all-reduce, compute free."""
    net = network(preset)
    data = predict("data", net, devices, [FREE] * devices, LINK, options=Options()).step_time
    one, two = (predict("kernel", net, b, [FREE] * devices, LINK).step_time for b in (1, 2))
    return data / (two - one)


def step(strategy: str, preset: str, batch: int, devices: int, device: str,
         gbps: float) -> tuple[dict, str]:
    return assess_point(build_point({
        "strategy": strategy, "network": {"preset": preset}, "train": {"batch": batch},
        "hardware": {"devices": devices, "device": device,
                     "link": {"gbps": gbps, "latency_us": 5}},
        "options": {"overlap": True}}))


def test_the_activations_kernel_parallelism_exchanges_are_the_models():
    for preset, said in zip(NETWORKS, quoted(r"AlexNet ([\d.]+) M, VGG-16 ([\d.]+) M, "
                                             r"ResNet-50 ([\d.]+) M\. Against")):
        assert said * 1e6 == pytest.approx(gathered(preset), rel=0.05), preset


def test_the_batch_below_which_kernel_could_win_is_the_models_crossover():
    """Forward the shares of every layer input, backward the partial gradients, and its
    own output written: about 3 B A a device against data's 2 W, not B A."""
    said = quoted(r"about (\d+) samples for AlexNet, (\d+) for VGG-16, (\d+) for ResNet-50")
    for preset, batch in zip(NETWORKS, said):
        model = crossover(preset)
        assert 1 / 1.3 < batch / model < 1.3, (preset, batch, model)
        net = network(preset)
        assert 2 * net.params() / (3 * gathered(preset)) == pytest.approx(batch, rel=0.15)


def test_one_a100s_alexnet_step_and_the_all_reduce_beside_it():
    one_ms, allreduce_ms = quoted(r"One A100 trains AlexNet's 256 samples in (\d+) ms; "
                                  r"the all-reduce over 4 devices at 100 Gb/s alone takes "
                                  r"(\d+) ms")
    figures, _ = step("single", "alexnet", 256, 1, "a100", 100)
    assert one_ms == pytest.approx(1e3 * figures["predicted_step_time"], abs=0.5)
    ring = 2 * 3 / 4 * network("alexnet").params() * 4 / 12.5e9
    assert allreduce_ms == pytest.approx(1e3 * ring, abs=0.5)


def test_the_one_cell_where_kernel_overtakes_data_and_one_device_beats_both():
    times = {s: step(s, "alexnet", 4096, 4096, "h100", 400)[0]["predicted_step_time"]
             for s in ("kernel", "data")}
    assert "AlexNet at batch 4096 on 4096 H100s at 400 Gb/s" in section()
    assert times["kernel"] < times["data"]
    assert step("single", "alexnet", 4096, 1, "h100", 400)[0]["predicted_step_time"] < \
        times["kernel"]


@pytest.mark.parametrize("preset, devices, fits", [
    ("vgg16", 1, False), ("vgg16", 4, True), ("resnet50", 4, False), ("resnet50", 16, True)])
def test_what_fits_80_gb_gpus_at_batch_4096(preset, devices, fits):
    """The memory paragraph: neither fits one GPU, ResNet-50 not four; `data` holds
    VGG-16 from 4 GPUs and ResNet-50 from 16."""
    assert 'ResNet-50 fits one 80 GB GPU under any strategy, nor does ResNet-50 fit four' \
        in section()
    figures, why = step("data", preset, 4096, devices, "a100", 100)
    assert (figures["memory_fits"] == 1.0) is fits and (why == "") is fits


def test_the_bound_against_collectives_that_overlap_sends_and_receives():
    """Kernel's slots priced as an all-gather and a reduce-scatter (2 (P-1)/P B A, as
    data's ring is priced) would cross data's all-reduce at B = W/A."""
    said = quoted(r"the bound would be `W/A`, about (\d+), (\d+) and (\d+)")
    for preset, batch in zip(NETWORKS, said):
        assert network(preset).params() / gathered(preset) == pytest.approx(batch, rel=0.1)
