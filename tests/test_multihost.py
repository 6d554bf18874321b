"""Real hosts, simulated (docs/multihost.md): an external `dask scheduler` and two
`dask worker` processes, each in a network namespace of its own behind a shaped link,
all speaking TLS with self-signed certificates; a run connects from this machine's
side with `cluster.tls` and trains exactly as plain single-process PyTorch does.

The pure checks of `cluster.tls` (files named, certificates for the wrong scheme, the
messages a refused connection gives) need only `openssl`; the namespaced cluster also
needs what `cluster.link` needs (root, `ip`, `tc`, `sshd`, `sshfs`) and is skipped,
with the reason, without it.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
from dataclasses import dataclass

import dask
import numpy as np
import pytest
from distributed import Client

from pipeline.cluster import links
from pipeline.cluster.workers import live_workers
from pipeline.config.cluster_config import WorkerConfig
from pipeline.config.run_config import build_run_config
from pipeline.cluster.external_hosts import ClusterTls, ExternalHosts, external_hosts
from pipeline.run import run_training
from pipeline.config.schema import ConfigError
from pipeline.cluster.security import (TlsConfig, client_security, connection_problem, tls_flags,
                                       tls_problem)
from storage import checkpoints
from tests.conftest import ROOT
from tests.helpers import (assert_one_error_line, link_leftovers, max_relative_error,
                           replay_in_pytorch, run_main, tiny_config)

OPENSSL = shutil.which("openssl")
needs_openssl = pytest.mark.skipif(OPENSSL is None, reason="needs the openssl command "
                                   "(Debian: apt-get install -y openssl)")
PROBLEM = links.link_problem() or (None if OPENSSL else "needs openssl")
needs_hosts = pytest.mark.skipif(PROBLEM is not None, reason=f"namespaced hosts {PROBLEM}")
RATE = "1gbit"


def make_certificates(directory, names: list[str], ca: str = "ca") -> dict[str, str]:
    """A CA (`ca`.pem, `ca`.key) and, for each name, NAME.pem and NAME.key signed by it,
    made with the openssl commands docs/multihost.md gives; their paths by name."""
    os.makedirs(directory, exist_ok=True)
    paths = {}

    def openssl(*args: str) -> None:
        subprocess.run([OPENSSL, *args], check=True, capture_output=True, cwd=directory)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-days", "2", "-subj", f"/CN=hetcnn-{ca}",
            "-keyout", f"{ca}.key", "-out", f"{ca}.pem")
    paths[ca] = os.path.join(directory, f"{ca}.pem")
    for name in names:
        openssl("req", *ec, "-subj", f"/CN=hetcnn-{name}", "-keyout", f"{name}.key",
                "-out", f"{name}.csr")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey",
                f"{ca}.key", "-CAcreateserial", "-days", "2", "-out", f"{name}.pem")
        paths[name] = os.path.join(directory, f"{name}.pem")
        paths[f"{name}.key"] = os.path.join(directory, f"{name}.key")
    return paths


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    if OPENSSL is None:
        pytest.skip("needs the openssl command")
    directory = tmp_path_factory.mktemp("certs")
    made = make_certificates(directory, ["scheduler", "worker", "client"])
    made.update(make_certificates(directory, ["stranger"], ca="other-ca"))
    return made


def client_tls(certs: dict[str, str], name: str = "client") -> dict[str, str]:
    return {"cluster.tls.ca_file": certs["ca"], "cluster.tls.cert": certs[name],
            "cluster.tls.key": certs[f"{name}.key"]}


# cluster.tls, without a cluster ------------------------------------------------------


@needs_openssl
def test_tls_config_names_the_file_and_the_field(certificates, tmp_path):
    certs = certificates
    scheduler = {"cluster.scheduler": "tls://10.0.0.1:8786"}
    config = build_run_config({}, [f"{k}={v}" for k, v in {**scheduler,
                                                           **client_tls(certs)}.items()])
    assert config.cluster.tls.cert == certs["client"]
    security = client_security(config.cluster.tls)
    assert security.require_encryption and security.tls_client_key == certs["client.key"]
    assert client_security(None) is None
    combined = tmp_path / "client-and-key.pem"  # Dask's other form: the key after the cert
    combined.write_text(open(certs["client"]).read() + open(certs["client.key"]).read())
    assert TlsConfig(certs["ca"], str(combined)).key is None

    def refused(changes: dict[str, str]) -> str:
        with pytest.raises(ConfigError) as error:
            build_run_config({}, [f"{k}={v}" for k, v in changes.items()])
        return str(error.value)

    missing = str(tmp_path / "nope.pem")
    assert refused({**scheduler, **client_tls(certs), "cluster.tls.cert": missing}) == \
        f"cluster.tls.cert: {missing} does not exist"
    assert refused({**scheduler, **client_tls(certs), "cluster.tls.ca_file": str(tmp_path)}
                   ) == f"cluster.tls.ca_file: {tmp_path} is not a file"
    assert refused({**scheduler, "cluster.tls.cert": certs["client"]}) == \
        "cluster.tls.ca_file: required key is missing"
    assert refused({**scheduler, **client_tls(certs), "cluster.tls.ca_file": certs["client.key"]}
                   ).startswith("cluster.tls.ca_file: no CA certificate in PEM format in ")
    mismatched = refused({**scheduler, **client_tls(certs), "cluster.tls.key":
                          certs["stranger.key"]})
    assert mismatched.startswith("cluster.tls.key: cannot load a certificate and its private "
                                 f"key from {certs['client']} and {certs['stranger.key']}")
    assert refused({**client_tls(certs), "cluster.scheduler": "tcp://h:8786"}) == \
        "cluster.tls: certificates are for a tls:// scheduler, not tcp://h:8786"
    assert refused({**client_tls(certs), "cluster.link.rate": RATE}).startswith(
        "cluster.tls: certificates are for an external tls:// scheduler")


def test_tls_problems_and_refusals_read_as_one_line():
    tls = object.__new__(TlsConfig)  # a value only: no files are read here
    assert tls_problem(None, None) is None and tls_problem("tcp://h:1", None) is None
    assert tls_problem("tls://h:1", tls) is None
    assert tls_problem(None, tls).startswith("cluster.tls: certificates are for an external")
    assert tls_problem("h:1", tls) == \
        "cluster.tls: certificates are for a tls:// scheduler, not h:1"
    unset = {"distributed.comm.tls.ca-file": None, "distributed.comm.tls.client.cert": None}
    with dask.config.set(unset):
        assert tls_problem("tls://h:1", None).startswith(
            "cluster.tls: the scheduler tls://h:1 speaks TLS: give cluster.tls.ca_file")
    with dask.config.set({"distributed.comm.tls.ca-file": "ca.pem",
                          "distributed.comm.tls.client.cert": "client.pem"}):
        assert tls_problem("tls://h:1", None) is None  # Dask's own config gives the client its side
    reset = OSError("in <TCP (closed)  local=tcp://a:1 remote=tcp://h:1>: "
                    "ConnectionResetError: [Errno 104] Connection reset by peer")
    assert "if it serves TLS, name it tls://h:1 and give cluster.tls" in \
        connection_problem("tcp://h:1", reset)
    handshake = OSError("in <TLS (closed)  local=tls://a:1 remote=tls://h:1>: SSLError: "
                        "[SSL: TLSV1_ALERT_UNKNOWN_CA] tlsv1 alert unknown ca")
    assert connection_problem("tls://h:1", handshake).startswith(
        "the TLS handshake with the Dask scheduler at tls://h:1 failed (OSError: SSLError: "
        "[SSL: TLSV1_ALERT_UNKNOWN_CA]")
    assert connection_problem("tcp://h:1", TimeoutError()).startswith(
        "cannot reach the Dask scheduler at tcp://h:1 (TimeoutError)")
    refused = OSError("in <distributed.comm.tcp.TCPConnector object at 0x7f>: "
                      "ConnectionRefusedError: [Errno 111] Connection refused")
    assert connection_problem("tcp://h:1", refused).startswith(
        "cannot reach the Dask scheduler at tcp://h:1 (connection refused: nothing listens "
        "there)")
    # Dask's own config asking for encryption, and a tcp:// scheduler: one line, not
    # Dask's RuntimeError from the depths of the connect
    with dask.config.set({"distributed.comm.require-encryption": True}):
        assert tls_problem("tcp://h:1", None) == (
            "cluster.scheduler: Dask's config requires encryption (distributed.comm."
            "require-encryption), which tcp://h:1 cannot give: name the scheduler "
            "tls://h:1, or unset it for a tcp:// one")
        assert tls_problem("tls://h:1", tls) is None
    assert tls_flags("c", "p", "k") == ["--tls-ca-file", "c", "--tls-cert", "p", "--tls-key", "k"]


# Hosts in namespaces, over TLS (root) ---------------------------------------------------


def listening(namespace: str) -> set[str]:
    """The addresses something listens on (TCP) in a network namespace."""
    done = subprocess.run(["ip", "netns", "exec", namespace, "ss", "-Hltn"],
                          capture_output=True, text=True, check=True)
    return {line.split()[3].rsplit(":", 1)[0] for line in done.stdout.splitlines()}


@dataclass
class TlsHosts:
    cluster: ExternalHosts
    certs: dict[str, str]
    root: pathlib.Path  # mounted on the workers' hosts, with the dataset's folder
    dataset: str
    workers: dict[str, dict]  # the scheduler's worker table once both joined


@pytest.fixture(scope="module")
def tls_hosts(tmp_path_factory, tiny_dataset_factory, certificates):
    """`dask scheduler` on a host of its own and two `dask worker --resources CPU=1` on
    theirs (each a network namespace behind a `RATE` link), each with a certificate of
    its own; the workers reach the run's files over their links (sshfs)."""
    if PROBLEM:
        pytest.skip(f"namespaced hosts {PROBLEM}")
    dataset = tiny_dataset_factory("float64")
    root = tmp_path_factory.mktemp("multihost")
    c = certificates
    tls = ClusterTls(c["ca"], (c["scheduler"], c["scheduler.key"]),
                     (c["worker"], c["worker.key"]), (c["client"], c["client.key"]))
    workers = [WorkerConfig(name="w0"), WorkerConfig(name="w1")]
    with external_hosts(workers, RATE, [str(root), os.path.dirname(dataset)], str(root),
                        tls=tls, env={"PYTHONPATH": ROOT}) as cluster:
        security = client_security(tls.client_config())
        with Client(cluster.address, security=security, set_as_default=False) as client:
            table = live_workers(client)  # not scheduler_info(): its cache may be empty
        yield TlsHosts(cluster, c, root, dataset, table)
    assert link_leftovers(cluster.links.run_id) == []


@needs_hosts
def test_trains_over_tls_with_scheduler_and_workers_on_hosts_of_their_own(tls_hosts):
    h = tls_hosts
    assert sorted(info["name"] for info in h.workers.values()) == ["w0", "w1"]
    assert all(a.startswith("tls://") and info["resources"] == {"CPU": 1}
               for a, info in h.workers.items())
    config = tiny_config(h.root / "kernel", h.dataset,
                         **{"cluster.scheduler": h.cluster.address, "network.dtype": "float64",
                            "train.eval_samples": 0, "train.steps": 3}, **client_tls(h.certs))
    before = h.cluster.links.counters()
    result = run_training(config)
    after = h.cluster.links.counters()
    assert result.summary["split_workers"] == ["w0", "w1"]
    assert [len(layer) for layer in result.summary["kernel_split"]] == [2, 2]
    assert list(result.record.resource_tag.values) == ["CPU", "CPU"]
    trained = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
    expected, losses = replay_in_pytorch(config, h.dataset)
    assert max_relative_error(trained, expected) <= 1e-10
    np.testing.assert_allclose(result.record.loss.values, losses, rtol=1e-10, atol=0)
    for name in ("w0", "w1"):  # the worker's reads of slots and batches crossed its link
        worker = result.record.sel(worker=name)
        received = after[name][0] - before[name][0]
        assert received >= int(worker["read_bytes"].sum()) + int(worker["dataset_bytes"].sum())
    assert after["scheduler"][0] > before["scheduler"][0]  # the client's traffic, over TLS
    for host in h.cluster.links.hosts:  # on its host's address (and its own loopback) only
        assert listening(host.namespace) <= {host.address, "127.0.0.1"}, host


@needs_hosts
def test_a_client_without_the_right_certificates_is_refused_in_one_line(tls_hosts):
    h = tls_hosts
    base = [os.path.join(ROOT, "configs", "small.yaml"), "train.fresh=true",
            f"data.path={h.dataset}", "data.train_samples=512", "data.test_samples=128",
            "network.dtype=float64", "train.steps=2", "train.batch=16", "progress=false",
            "placement=even", "cluster.wait_timeout=5"]
    address = h.cluster.address
    location = address.removeprefix("tls://")
    plain = run_main("train", [*base, f"output={h.root}/tcp",
                               f"cluster.scheduler=tcp://{location}"])
    assert_one_error_line(*plain[:2], 1, f"the Dask scheduler at tcp://{location} closed the "
                          f"connection at once (CommClosedError); if it serves TLS, name it "
                          f"{address} and give cluster.tls")
    no_certs = run_main("train", [*base, f"output={h.root}/none", f"cluster.scheduler={address}"])
    assert_one_error_line(*no_certs[:2], 2, f"cluster.tls: the scheduler {address} speaks TLS")
    stranger = client_tls(h.certs, "stranger")  # signed by another CA than the cluster's
    wrong = run_main("train", [*base, f"output={h.root}/stranger", f"cluster.scheduler={address}",
                               *[f"{k}={v}" for k, v in stranger.items()]])
    assert_one_error_line(*wrong[:2], 1, f"the TLS handshake with the Dask scheduler at "
                          f"{address} failed")
