"""A real one-node Slurm for tests: munged, slurmctld and slurmd started on this machine
with a private key, socket, configuration, ports and state in one folder (nothing in
/etc is read or changed), and stopped again.

Needs root (slurmd runs jobs as their user) and Debian's `slurm-wlm` and `munge`
(`.ci/run` installs them). The daemons' own ports are fresh ones, on loopback only:
`CommunicationParameters=NoCtldInAddrAny,NoInAddrAny` binds slurmctld, slurmd (and
an `srun`) to the address the machine's host name resolves to instead of 0.0.0.0,
so the node is that name where it resolves to a loopback address; where it does
not, the daemons run in a UTS namespace of their own named `localhost`. munged
listens on a unix socket only, in a folder only root can enter (mode 0700, with the
key); only holders of that key can talk to the daemons. `SLURM_CONF` points the
batch commands (`sbatch`, `squeue`, `scancel`) at this Slurm.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field

import psutil

#: Job slots (CPUs) of the test node: the module's two jobs, a test's own two, and room.
CPU_SLOTS = 8
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo")


def slurm_missing() -> str | None:
    """Why a real Slurm cannot be started here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root: slurmd runs each job as its user"
    missing = [name for name in DAEMONS if shutil.which(name) is None
               and not os.path.exists(f"/usr/sbin/{name}")]
    if missing:
        return (f"needs Slurm and munge ({', '.join(missing)} missing): "
                "apt-get install -y slurm-wlm munge")
    return None


def job_workers(folder: str) -> list[psutil.Process]:
    """The `dask worker` processes whose command line names `folder` (their credential
    files are in it)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        line = " ".join(process.info["cmdline"] or [])
        if folder in line and "dask_worker" in line:
            found.append(process)
    return found


def loopback_node() -> tuple[str, str, list[str]]:
    """(node name, its address, the command prefix the daemons run under) such that
    the daemons' host name resolves to that loopback address, as `NoInAddrAny` binds
    to what it resolves to: this machine's own name where it does (127.0.0.1 or
    Debian's 127.0.1.1), else `localhost` in a UTS namespace of the daemons' own."""
    name = socket.gethostname()
    with contextlib.suppress(OSError):
        address = socket.getaddrinfo(name, None, socket.AF_INET)[0][4][0]
        if ipaddress.ip_address(address).is_loopback:
            return name.split(".")[0], address, []
    return "localhost", "127.0.0.1", ["unshare", "--uts", "sh", "-c",
                                      'hostname localhost && exec "$0" "$@"']


def listening(pids: list[int]) -> dict[str, list[str]]:
    """What the processes `pids` can be reached on, by process name: `ip:port` of each
    TCP socket they listen on and of each bound UDP one, and each unix socket's path
    with its folder's mode (`path (700)`), each once: a connection a unix server has
    accepted (a Slurm daemon asking munged for a credential) carries the server's path
    too, so one path can show up more than once while a client is connected."""
    found: dict[str, set[str]] = {}
    for pid in pids:
        process = psutil.Process(pid)
        for conn in process.net_connections("all"):
            if conn.family == socket.AF_UNIX:
                where = (f"{conn.laddr} ({os.stat(os.path.dirname(conn.laddr)).st_mode & 0o777:o})"
                         if conn.laddr else "")
            elif conn.status == psutil.CONN_LISTEN or (conn.type == socket.SOCK_DGRAM
                                                       and conn.laddr):
                where = f"{conn.laddr.ip}:{conn.laddr.port}"
            else:
                continue
            if where:
                found.setdefault(process.name(), set()).add(where)
    return {name: sorted(places) for name, places in found.items()}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def slurm_conf(folder: str, host: str, address: str, cpus: int) -> str:
    """slurm.conf of a one-node cluster in `folder` (docs/multihost.md, "Trying Slurm
    on one machine"): no cgroups, root as Slurm's user, the node `host` at the
    loopback `address`, the daemons bound to it, and `cpus` slots on it whatever the
    machine has (`config_overrides`), so that the module's jobs and a test's own fit
    at once on a 2-core machine."""
    return "\n".join([
        "ClusterName=hetcnntest", f"SlurmctldHost={host}({address})",
        "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny",
        f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={folder}/munge/socket", "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core", "JobAcctGatherType=jobacct_gather/none",
        f"StateSaveLocation={folder}/state", f"SlurmdSpoolDir={folder}/spool",
        f"SlurmctldPidFile={folder}/slurmctld.pid", f"SlurmdPidFile={folder}/slurmd.pid",
        f"SlurmctldLogFile={folder}/slurmctld.log", f"SlurmdLogFile={folder}/slurmd.log",
        "ReturnToService=2", "MpiDefault=none", "KillWait=5", "MinJobAge=2",
        "SlurmdParameters=config_overrides",
        f"NodeName={host} NodeAddr={address} CPUs={cpus} RealMemory=8000 State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP", ""])


@dataclass
class LocalSlurm:
    """The daemons of one test Slurm; `environment` points batch commands at it."""

    folder: str
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def environment(self) -> dict[str, str]:
        return {"SLURM_CONF": os.path.join(self.folder, "slurm.conf")}

    def command(self, *args: str) -> str:
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=20,
                              env={**os.environ, **self.environment}, check=True)
        return done.stdout

    def jobs(self, folder: str = "") -> list[str]:
        """`squeue`'s lines (job id, name, state, error log) of every job it still
        lists whose error log is in `folder` (a run's jobqueue directory; "": all)."""
        listed = self.command("squeue", "-h", "-O", "JobID: ,Name: ,State: ,StdErr:")
        return [" ".join(line.split()) for line in listed.splitlines()
                if line.strip() and folder in line]

    def start(self) -> None:
        host, address, prefix = loopback_node()
        for name in ("munge", "state", "spool"):
            os.makedirs(os.path.join(self.folder, name), mode=0o700)
        key = os.path.join(self.folder, "munge", "munge.key")
        with open(key, "wb") as handle:
            handle.write(os.urandom(128))
        os.chmod(key, 0o400)
        conf = os.path.join(self.folder, "slurm.conf")
        with open(conf, "w", encoding="ascii") as handle:
            handle.write(slurm_conf(self.folder, host, address, CPU_SLOTS))
        munge = os.path.join(self.folder, "munge")
        self._spawn("munged", "-F", "-f", f"--key-file={key}", f"--socket={munge}/socket",
                    f"--pid-file={munge}/pid", f"--log-file={munge}/log",
                    f"--seed-file={munge}/seed")
        self._wait(lambda: os.path.exists(f"{munge}/socket"), "munged")
        self._spawn(*prefix, "slurmctld", "-D", "-f", conf)
        self._spawn(*prefix, "slurmd", "-D", "-f", conf, "-N", host)
        self._wait(lambda: "idle" in self.command("sinfo", "-h", "-o", "%t"), "slurmd")

    def _spawn(self, *command: str) -> None:
        name = next(word for word in command if word in DAEMONS)
        log = open(os.path.join(self.folder, f"{name}.out"), "w", encoding="utf-8")
        with log:
            self.processes.append(subprocess.Popen(
                list(command), stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, **self.environment}))

    def _wait(self, ready, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if ready():
                    return
            except subprocess.CalledProcessError:
                pass
            for process in self.processes:
                if process.poll() is not None:
                    raise RuntimeError(f"{process.args[0]} exited ({process.returncode}): "
                                       f"see {self.folder}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not ready after {timeout:g} s: see {self.folder}")
            time.sleep(0.1)

    def wait_empty(self, timeout: float = 30.0) -> list[str]:
        """Wait until `squeue` lists no job (a cancelled one lingers while it completes);
        returns what it still lists after `timeout`."""
        deadline = time.monotonic() + timeout
        while (listed := self.jobs()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return listed

    def left_behind(self, folder: str, timeout: float = 10.0) -> list[str]:
        """Jobs `squeue` still lists and worker processes whose command line names
        `folder` (a run's jobqueue directory), once `timeout` has passed or none is."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.jobs(folder) + [" ".join(p.cmdline())[:120]
                                         for p in job_workers(folder)]
            if not found or time.monotonic() > deadline:
                return found
            time.sleep(0.2)

    def stop(self, folders: str) -> None:
        """Cancel every job, kill the workers of jobs whose folder is in `folders` that
        outlived them, then stop the daemons (slurmd first), each by its pid."""
        try:
            if self.processes and all(p.poll() is None for p in self.processes):
                self.command("scancel", "--full", "-u", "root")
                self.wait_empty(15)
        finally:
            for process in job_workers(folders):
                with contextlib.suppress(psutil.Error):
                    process.kill()
            for process in reversed(self.processes):
                if process.poll() is None:
                    process.terminate()
            for process in reversed(self.processes):
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
