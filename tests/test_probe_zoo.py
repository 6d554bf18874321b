"""The probe on the zoo: its records come back whole, it times every layer of a graph
network on a real cluster (shards, replica trunks, the dense head, the client's share
of the cores) and in this process (``strategy: reference``).

The cluster test probes resnet20 at width 0.25 on two of the shared cluster's workers
(tests/conftest.py, tag PROBE) with a quantum of 2 channels, so that every layer splits
over both; its checks are on completeness and sanity, not on accuracy.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, replace

import psutil
import pytest

import pipeline.probe.cluster as cluster_probe
import pipeline.probe.reference as reference
import pipeline.probe.rounds as rounds
import pipeline.probe.runs as runs
from pipeline.cluster.worker_setup import register_setup
from pipeline.cluster.workers import find_workers
from pipeline.placement.ties import check_tied
from pipeline.probe import cached_probe, costmodel_network, find_cached_probe, probe_master
from pipeline.probe.cache import cached_master_probe
from pipeline.probe.keys import optimizer_key
from pipeline.probe.client_share import burner_code, median_share, pair_share, step_spans
from pipeline.probe.tables import network_spec_from_dict
from tasks.receipts import Receipt
from tasks.specs import OptimizerSpec
from tasks.zoo import PRESETS, build_preset
from tests.helpers import shared_workers
from tests.test_costmodel_zoo import zoo_network


def _spec(preset: str, width: float):
    small = preset in ("resnet20", "marques")
    size, classes = (32, 10) if small else (224, 1000)
    return build_preset(preset, (3, size, size), classes, "float32", width, 0.5)


@pytest.mark.parametrize("preset", PRESETS)
def test_a_zoo_probe_record_round_trips_to_the_same_spec_and_costmodel_network(preset):
    spec = _spec(preset, 0.25)
    record = json.loads(json.dumps(asdict(spec)))  # as the probe's cache keeps it
    back = network_spec_from_dict(record)
    assert back == spec
    assert costmodel_network(back) == zoo_network(preset, 0.25)


def test_the_probes_plans_keep_every_tied_group_on_one_split():
    spec = _spec("resnet50", 1 / 16)
    plans = runs.plans_for(spec, 8, [2] * len(spec.conv), 2)
    assert len(plans) >= 2
    for plan in plans:
        check_tied(spec, plan.counts)


def test_every_worker_is_timed_on_every_layer_of_a_narrow_network():
    """resnet20 at width 1/4 has layers of one channel quantum (4 kernels): the even
    split over 2 workers leaves the second without them, so its rotation gives them to
    it; every worker's plans then cover every layer (the calibrated split and `auto`
    read each worker's table of each layer)."""
    spec = _spec("resnet20", 0.25)
    plans = runs.plans_for(spec, 8, [4] * len(spec.conv), 2, budget_s=0.0)
    for worker in range(2):
        held = {l for plan in plans if plan.workers == 2
                for l, row in enumerate(plan.counts) if row[worker]}
        assert held == set(range(len(spec.conv)))
    for plan in plans:
        check_tied(spec, plan.counts)


def _receipt(worker: str, step: int, start: float, end: float) -> Receipt:
    return Receipt("run-ops", worker, step, start, end)


def test_a_steps_span_runs_from_its_first_op_to_its_last_over_every_worker():
    receipts = [_receipt("a", 1, 10.0, 10.2), _receipt("b", 1, 10.05, 10.3),
                _receipt("a", 2, 10.3, 10.5), _receipt("b", 2, 10.31, 10.45)]
    assert step_spans(receipts) == pytest.approx([0.3, 0.2])


def test_the_share_is_the_median_pair_clipped_and_none_without_a_measurement():
    # a burner of 0.2 core made a 0.100 s step 0.110 s: 0.010 of its 0.022 s landed
    assert pair_share(0.100, 0.110, 0.2) == pytest.approx(0.010 / 0.022)
    assert pair_share(0.100, 0.110, 0.0) is None and pair_share(0.0, 0.110, 0.2) is None
    assert median_share([0.2, None, 0.4, 0.9]) == pytest.approx(0.4)
    assert median_share([-0.3, -0.1]) == 0.0 and median_share([0.9, 1.0, 1.05]) == 1.0
    # a burner that slowed the step by more than its own CPU measured no share
    assert median_share([1.5, 2.0]) is None and median_share([1.03, 1.0, 0.81, 1.3]) is None
    assert median_share([None]) is None and median_share([]) is None
    # figures a loaded machine gave (a quick sweep's probe at load 7 on 2 cores): noise
    assert median_share([3.89, -0.91, 0.32, 1.93]) is None


def test_the_reference_probe_steps_with_the_runs_sgd(tmp_path, monkeypatch):
    """One cached reference probe per kind of SGD (momentum, weight decay, Nesterov: the
    passes of its update), each timed with that SGD; the learning rate is not one."""
    monkeypatch.setenv("CNN_PROBE_CACHE", str(tmp_path / "probes"))
    stepped: list[OptimizerSpec] = []
    real = reference.torch_sgd
    monkeypatch.setattr(reference, "torch_sgd",
                        lambda params, spec: stepped.append(spec) or real(params, spec))
    spec = _spec("resnet20", 0.25)
    plain = OptimizerSpec(lr=0.1, momentum=0.0, weight_decay=0.0)
    default = cached_master_probe(spec, 8, 1)
    without = cached_master_probe(spec, 8, 1, optimizer=plain)
    assert without.key != default.key
    assert stepped == [reference.DEFAULT_OPTIMIZER, plain]
    assert cached_master_probe(spec, 8, 1, optimizer=replace(plain, lr=0.01)).key == without.key
    assert cached_master_probe(spec, 8, 1, optimizer=OptimizerSpec(lr=0.2)).key == default.key
    assert len(stepped) == 2  # both cached: neither timed again
    assert optimizer_key(OptimizerSpec(lr=1.0)) == ""


def test_the_reference_probe_times_every_layer_of_a_graph_network():
    spec = _spec("resnet20", 0.25)
    master = probe_master(spec, 8, 1)
    assert [t.layer for t in master.timings] == list(range(len(spec.conv)))
    for t in master.timings:
        assert t.forward_s > 0 and t.backward_s > 0, t
    assert master.dense_s > 0


@pytest.fixture
def probe_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CNN_PROBE_CACHE", str(tmp_path / "probes"))
    return tmp_path / "probes"


def test_a_probe_of_resnet20_on_two_workers_times_every_layer(shared_cluster, probe_cache,
                                                              monkeypatch):
    # seconds, not a minute: one round of the even plans and the replicas' (the probe's
    # robustness is tests/test_probe_robust.py's, the share's tests/test_prediction.py's)
    monkeypatch.setattr(cluster_probe, "share_plans", lambda *args: [])
    monkeypatch.setattr(runs, "ROUNDS", 1)
    monkeypatch.setattr(runs, "REPLICA_ROUNDS", 1)
    monkeypatch.setattr(rounds, "RETIMES", 0)
    monkeypatch.setattr(cluster_probe, "plans_for",
                        lambda *args: runs.plans_for(*args, budget_s=0.0))
    client, cluster = shared_workers(shared_cluster, "PROBE")
    register_setup(client, cluster)
    offered = find_workers(client, cluster)
    spec = _spec("resnet20", 0.25)
    probe = cached_probe(client, offered, spec, 8, [2] * len(spec.conv))
    assert probe.network_spec() == spec
    names = [conv.name for conv in costmodel_network(spec).conv]
    for active in (1, 2):
        for device in probe.device_specs(active):
            assert sorted(device.layer_tables) == sorted(names), (active, device.name)
    for worker in probe.workers:
        assert worker.trunk is not None and worker.trunk.forward_s > 0
    assert probe.master.dense_s > 0
    assert find_cached_probe(probe.key) == probe  # its JSON record comes back whole


def test_a_burner_ends_with_the_probe_that_started_it():
    """A probe SIGKILLed while it measures the share leaves no spinning process."""
    code = burner_code(-1)  # the parent's own pid in place of -1, without torch's import
    parent = subprocess.Popen(
        [sys.executable, "-c", "import os, subprocess, sys, time\n"
         f"code = {code!r}.replace('== -1', f'== {{os.getpid()}}')\n"
         "child = subprocess.Popen([sys.executable, '-c', code])\n"
         "print(child.pid, flush=True)\ntime.sleep(60)\n"], stdout=subprocess.PIPE, text=True)
    burner = psutil.Process(int(parent.stdout.readline()))
    assert burner.is_running() and burner.status() != psutil.STATUS_ZOMBIE
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if not burner.is_running() or burner.status() == psutil.STATUS_ZOMBIE:
            return
        time.sleep(0.05)
    burner.kill()
    pytest.fail("the burner outlived the probe that started it")
