"""A cached probe is reused only on the machines it measured (pipeline/probe/machine.py):
pure, on small files in the formats /proc uses; the workers' own machines on real
workers are tests/test_worker_machines.py's."""

from __future__ import annotations

import socket

from pipeline.cluster.workers import ClusterWorker
from pipeline.probe import keys, machine
from pipeline.records.summary import machine_lines
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


def test_a_worker_on_another_machine_makes_another_key_and_one_on_this_keeps_it():
    """The workers' part of the key (`worker_identity`) holds each worker's machine, as
    it said it, where that is not the client's: a worker on the client's machine, or
    not asked, keeps the part keys had before workers were asked."""
    worker = ClusterWorker("tcp://10.0.0.7:4000", "slurm-0", "CPU", 1, 1.0)
    plain = [("slurm-0", 1, 1.0, "CPU")]
    assert keys.worker_identity([worker]) == plain
    assert keys.worker_identity([worker], {"slurm-0": machine.machine_identity()}) == plain
    node = "node17: AMD EPYC 9654, 96 cores, AVX512"
    assert keys.worker_identity([worker], {"slurm-0": node}) == [(*plain[0], node)]
    other = "node3: Intel(R) Xeon(R) Gold 6148, 40 cores, AVX512"
    assert len({keys.probe_key(NETWORK, 32, [4], keys.worker_identity([worker], said), "shm",
                               None)
                for said in ({}, {"slurm-0": node}, {"slurm-0": other})}) == 3


def test_the_closing_summary_names_each_machine_once_with_its_workers():
    node = "node17: AMD EPYC 9654, 96 cores, AVX512"
    login = "login1: Intel(R) Xeon(R) Gold 6148, 40 cores, AVX512"
    said = {"slurm-0": {"machine": node, "torch_threads": 4},
            "slurm-1": {"machine": node, "torch_threads": 4},
            "slurm-2": {"machine": login, "torch_threads": 1}}
    assert machine_lines(said) == [
        f"  machine     slurm-0, slurm-1: {node}; 4 torch threads each",
        f"  machine     slurm-2: {login}; 1 torch thread"]
    assert machine_lines({}) == []
