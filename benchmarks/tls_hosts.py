"""What TLS costs a run on an external cluster: the same run over tcp:// and tls://.

An external `dask scheduler` and two `dask worker --resources CPU=1`, each on a host
of its own behind a shaped link (pipeline/cluster/external_hosts.py, as docs/multihost.md
starts them on real machines), once speaking tcp and once TLS with self-signed
certificates; `configs/small.yaml` (kernel, placement even) runs on each in turn,
`--repeats` times alternately, and the median step time (warm-up excluded) of each
protocol is printed. Needs root, ip, tc, sshd, sshfs and openssl.

    python -m benchmarks.tls_hosts [--rate 1gbit] [--steps 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from statistics import median

from pipeline.config.cluster_config import WorkerConfig
from pipeline.config.run_config import load_run_config
from pipeline.cluster.external_hosts import ClusterTls, external_hosts
from pipeline.engine.dataset import prepare_dataset
from pipeline.run import run_training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def certificates(directory: str) -> ClusterTls:
    """A CA and one certificate per role, as docs/multihost.md makes them."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory)

    openssl("req", "-x509", *ec, "-days", "2", "-subj", "/CN=bench-ca", "-keyout", "ca.key",
            "-out", "ca.pem")
    pairs = {}
    for role in ("scheduler", "worker", "client"):
        openssl("req", *ec, "-subj", f"/CN={role}", "-keyout", f"{role}.key", "-out",
                f"{role}.csr")
        openssl("x509", "-req", "-in", f"{role}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "2", "-out", f"{role}.pem")
        pairs[role] = (f"{directory}/{role}.pem", f"{directory}/{role}.key")
    return ClusterTls(f"{directory}/ca.pem", **pairs)


def one_run(work: str, rate: str, steps: int, tls: ClusterTls | None, label: str) -> float:
    """The median step time of one run of the small config on a fresh external cluster."""
    output = os.path.join(work, label)
    overrides = [f"output={output}", "placement=even", f"train.steps={steps}",
                 "train.checkpoint_every=0", "train.eval_samples=0", "progress=false",
                 "train.fresh=true"]
    base = load_run_config(os.path.join(ROOT, "configs", "small.yaml"), overrides)
    prepare_dataset(base)
    directories = [work, os.path.dirname(os.path.abspath(base.dataset_path))]
    workers = [WorkerConfig(name="w0"), WorkerConfig(name="w1")]
    with external_hosts(workers, rate, directories, work, tls=tls,
                        env={"PYTHONPATH": ROOT}) as cluster:
        extra = [f"cluster.scheduler={cluster.address}"]
        if tls:
            extra += [f"cluster.tls.ca_file={tls.ca_file}", f"cluster.tls.cert={tls.client[0]}",
                      f"cluster.tls.key={tls.client[1]}"]
        config = load_run_config(os.path.join(ROOT, "configs", "small.yaml"), overrides + extra)
        result = run_training(config)
    return float(median(result.record.step_time.values[config.train.warmup_steps:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"tcp": [], "tls": []}
    with tempfile.TemporaryDirectory(prefix="tls-bench-", dir=os.path.join(ROOT, "runs")
                                     if os.path.isdir(os.path.join(ROOT, "runs")) else None
                                     ) as work:
        tls = certificates(work)
        for repeat in range(args.repeats):
            for protocol in ("tcp", "tls"):
                step = one_run(work, args.rate, args.steps, tls if protocol == "tls" else None,
                               f"{protocol}-{repeat}")
                times[protocol].append(step)
                print(f"repeat {repeat} {protocol}: median step {step:.3f} s", flush=True)
    tcp, tls_time = median(times["tcp"]), median(times["tls"])
    print(f"links {args.rate}, {args.steps} steps, {args.repeats} repeats: median step "
          f"tcp {tcp:.3f} s, tls {tls_time:.3f} s, tls/tcp {tls_time / tcp:.3f}")


if __name__ == "__main__":
    main()
