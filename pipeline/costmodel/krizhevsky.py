"""Krizhevsky's "one weird trick" on K20 GPUs, as a check of the hybrid model.

Published (arXiv:1404.5997, table 1; AlexNet, conv batch 128 per GPU):
98.05 h on one GPU; with dense batch 128 (weights updated after each of the
``K`` dense sub-steps) 50.90 h, 26.78 h, 15.91 h on 2, 4, 8 GPUs, i.e.
1.93x, 3.66x, 6.16x; with dense batch ``128 K``: 1.95x, 3.74x, 6.25x.

Hardware parameters and where they come from:

- Tesla K20: 3.52 TFLOP/s fp32 peak, 208 GB/s (NVIDIA datasheet).
- Conv efficiency 0.38: the paper's own single-GPU time.  98.05 h for the
  roughly 90 epochs of AlexNet-style ImageNet training (our assumption:
  the paper does not restate the epoch count next to the table) is
  0.39 s per 128-image step, about 1.4 TFLOP/s sustained, 38-40 % of peak,
  in line with hand-written Kepler conv kernels of the time (cuda-convnet2
  reached about a third to half of peak).
- Dense efficiency 0.70: cuBLAS SGEMM on Kepler for large matrices.
- Memory efficiency 0.75 of 208 GB/s (streaming kernels, ECC on).
- PCIe 2.0 x16 between GPUs: 6 GB/s effective (of 8 GB/s), 10 us per
  transfer (copy launch and synchronisation).
- Scheme (b) broadcasts and gradient reductions are *linear*: the owning
  GPU copies its activations to each peer in turn and receives every peer's
  partial gradient in turn, all through its one x16 link; a tree would need
  peer GPUs to forward data, which cuda-convnet2 does not do.  This is the
  term that makes 8 GPUs fall to about 77 % efficiency.
- Conv weight gradients: ring allreduce (each worker sums ``1/K`` of the
  gradient and sends it back), after the backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .devices import DeviceSpec, LinkSpec
from .builders import alexnet
from .network import Network
from .prediction import Options
from .strategies import predict

__all__ = ["KrizhevskySetup", "krizhevsky_k20_setup", "krizhevsky_speedups", "PUBLISHED_SPEEDUPS"]

#: (gpus, dense batch) -> published speedup over one GPU.
PUBLISHED_SPEEDUPS: dict[tuple[int, str], float] = {
    (2, "worker"): 98.05 / 50.90,
    (4, "worker"): 98.05 / 26.78,
    (8, "worker"): 98.05 / 15.91,
    (2, "full"): 98.05 / 50.24,
    (4, "full"): 98.05 / 26.20,
    (8, "full"): 98.05 / 15.68,
}

#: Single-GPU step implied by 98.05 h over 90 epochs of 1,281,167 images.
PUBLISHED_SINGLE_STEP = 98.05 * 3600 / (90 * 1_281_167 / 128)


@dataclass(frozen=True)
class KrizhevskySetup:
    """Network, GPU, PCIe link and hybrid options of the K20 experiment."""

    network: Network
    gpu: DeviceSpec
    link: LinkSpec
    options: Options
    per_gpu_batch: int = 128
    published: dict[tuple[int, str], float] = field(default_factory=lambda: dict(PUBLISHED_SPEEDUPS))


def krizhevsky_k20_setup(
    conv_efficiency: float = 0.38,
    dense_efficiency: float = 0.70,
    pcie_bandwidth: float = 6e9,
    pcie_latency: float = 10e-6,
) -> KrizhevskySetup:
    """The K20 / PCIe configuration described in the module docstring."""
    gpu = DeviceSpec(
        flops=3.52e12, mem_bw=208e9, bytes_per_elem=4,
        conv_efficiency=conv_efficiency, dense_efficiency=dense_efficiency,
        mem_efficiency=0.75, name="Tesla K20",
    )
    link = LinkSpec.from_bandwidth(pcie_bandwidth, latency=pcie_latency)
    opts = Options(scheme="b", dense_batch="worker", broadcast="linear", overlap_dense=True, allreduce="ring")
    return KrizhevskySetup(alexnet(), gpu, link, opts)


def krizhevsky_speedups(
    gpus: tuple[int, ...] = (2, 4, 8),
    dense_batch: str = "worker",
    setup: KrizhevskySetup | None = None,
) -> dict[int, float]:
    """Predicted hybrid speedups over one K20 at conv batch 128 per GPU.

    The single-GPU reference trains 128 images per step; ``K`` GPUs train
    ``128 K``, so the speedup in epoch time is ``K * T(1) / T(K)``.
    """
    st = setup or krizhevsky_k20_setup()
    b = st.per_gpu_batch
    one = predict("single", st.network, b, st.gpu).step_time
    out = {}
    for k in gpus:
        t = predict("hybrid", st.network, b * k, [st.gpu] * k, st.link, options=st.options, dense_batch=dense_batch)
        out[k] = k * one / t.step_time
    return out
