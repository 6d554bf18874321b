"""A cached probe is reused only on the machine it measured (pipeline/probe/machine.py):
pure, on small files in the formats /proc uses."""

from __future__ import annotations

import socket

from pipeline.probe import keys, machine
from tasks.specs import ConvLayerSpec, NetworkSpec

NETWORK = NetworkSpec((ConvLayerSpec(3, 8, 5, 2, 2, 32, 32),), (), 10, "float32")


def test_the_cpu_model_is_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\n"
                       "model name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu avx512f\n\n"
                       "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Processor\n")
    assert machine.cpu_model(str(cpuinfo)) == "Intel(R) Xeon(R) Processor"
    # without the file (or the line), what the platform knows: never empty
    assert machine.cpu_model(str(tmp_path / "none"))


def test_gpu_models_come_from_the_nvidia_driver_without_cuda(tmp_path):
    for index, model in enumerate(["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"]):
        folder = tmp_path / f"0000:0{index}:00.0"
        folder.mkdir()
        (folder / "information").write_text(f"Model: \t\t {model}\nIRQ:   \t\t 42\n")
    pattern = str(tmp_path / "*" / "information")
    assert machine.gpu_models(pattern) == ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"]
    assert machine.gpu_models(str(tmp_path / "nothing" / "*")) == []


def test_the_identity_names_the_host_cpu_cores_and_instruction_set():
    identity = machine.machine_identity()
    assert identity.startswith(f"{socket.gethostname()}: {machine.cpu_model()}, ")
    assert f"{machine.usable_cores()} cores" in identity


def test_a_probe_of_another_cpu_under_the_same_name_is_not_reused(monkeypatch):
    """The key changes with the CPU (or cores), not only with the host name."""
    def key() -> str:
        return keys.probe_key(NETWORK, 32, [4], [("cpu-0", 1, 1.0, "CPU")], "shm", None)

    monkeypatch.setattr(keys, "machine_identity", lambda: "vm: AMD EPYC 7B13, 2 cores, AVX2")
    amd = key()
    assert key() == amd  # the same machine: the same key
    monkeypatch.setattr(keys, "machine_identity",
                        lambda: "vm: Intel(R) Xeon(R) Processor, 2 cores, AVX512")
    intel = key()
    monkeypatch.setattr(keys, "machine_identity",
                        lambda: "vm: Intel(R) Xeon(R) Processor, 4 cores, AVX512")
    assert len({amd, intel, key()}) == 3
