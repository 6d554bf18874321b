"""Hosts behind shaped network links, on this machine.

One run's `LinkedHosts` is a bridge in the root network namespace (the client's
side) and one network namespace per worker (its "host"), joined to the bridge by a
veth pair whose two ends are both shaped with tbf at the worker's rate: tbf shapes
only what leaves an interface, so the bridge-side end limits what the worker
receives and the namespace-side end what it sends. Worker-to-worker traffic crosses
the sender's link and then the receiver's. The bridge has no uplink and the
namespaces no default route: nothing in them reaches beyond this machine.

Namespaces share the file system, so a file the worker opened directly would bypass
its link. The run's directories therefore reach a worker over sftp: a per-run sshd
listens on the bridge address only (its own host key, a per-run client key), and a
worker's process starts inside its namespace (and the private mount namespace
`ip netns exec` gives it, made private) after sshfs has mounted each directory at
its own absolute path, over an empty read-only tmpfs (`blind_command`), and told
which folders those are (`tasks.link_mounts`: each step checks they are still
mounted). Everything a worker reads or writes there crosses its link, or fails.

A mounted folder another run removes when empty (the /dev/shm workspace root:
removing a mount point of another mount namespace detaches that mount) is pinned
first (`LinkedHosts.pin`): a file of this run in it; it goes at the end, and the
folder with it if that leaves it empty.

A run writes what it created (namespaces, interfaces, processes, pins) to a record
under `pipeline.cluster.link_records.RECORDS`; `LinkedHosts.start` first removes the leftovers of runs whose owner
process is gone, so a killed run followed by a new one leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace

from pipeline.cluster.link_records import (descendants, kill_started, record_path, remove_leftovers,
                                           started_at, stop_processes, sweep_leftovers,
                                           write_record)
from storage.exchange_folders import make_folder
from tasks.link_mounts import LINK_MOUNTS

PIN_PREFIX = ".hetcnn-link-"  # a pin's name, before the run id (`LinkedHosts.pin`)
TOOLS = ("ip", "tc", "sshd", "sshfs", "ssh-keygen")
SSHD_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")
#: tc's rate units, in bits per second (a bare number is bit/s; "bps" is bytes/s)
RATE_UNITS = {"": 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
              "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40,
              "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
              "kibps": 8 * 2**10, "mibps": 8 * 2**20, "gibps": 8 * 2**30, "tibps": 8 * 2**40}
RATE = re.compile(r"(\d+(?:\.\d+)?)([a-z]*)")
#: sshfs options: no client-side caching, so a peer's marker or chunk is seen at once
SSHFS_OPTIONS = ("StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,cache=no,"
                 "attr_timeout=0,entry_timeout=0,negative_timeout=0,reconnect")


class LinkError(RuntimeError):
    """The shaped links cannot be built here (not root, a tool missing, a step failed)."""


# Pure helpers -------------------------------------------------------------------


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate ("100mbit", "1gbit", "12.5mbps"); ValueError if
    tc would not read it."""
    match = RATE.fullmatch(rate.strip().lower())
    if not match or match.group(2) not in RATE_UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"expected a tc rate such as '100mbit' or '1gbit', got {rate!r}")
    return float(match.group(1)) * RATE_UNITS[match.group(2)]


def burst_bytes(rate: str) -> int:
    """tbf's bucket: 5 ms at the rate, at least 32 KiB. Large enough to reach the rate
    (the brief's 256 KiB at 100mbit gave 95 Mbit/s), small enough that a slow link's
    bucket does not pass a step's bytes at full speed (256 KiB is 100 ms at 20mbit)."""
    return max(32 * 1024, int(rate_bits(rate) / 8 * 0.005))


def new_run_id() -> str:
    """Six hex digits: short enough that every interface name fits in 15 characters."""
    return uuid.uuid4().hex[:6]


def bridge_name(run_id: str) -> str:
    return f"hc{run_id}-br"


def namespace_name(run_id: str, index: int) -> str:
    return f"hc{run_id}-{index}"


def veth_names(run_id: str, index: int) -> tuple[str, str]:
    """(bridge side, namespace side) of worker `index`'s veth pair."""
    return f"hc{run_id}-{index}", f"hc{run_id}-{index}n"


def choose_subnet(run_id: str, used: list[str]) -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 overlapping none of the `used` interface addresses (CIDR text),
    starting from one the run id picks (so concurrent runs rarely try the same)."""
    taken = [ipaddress.ip_interface(text).network for text in used]
    start = int(hashlib.sha256(run_id.encode()).hexdigest()[:4], 16)
    for offset in range(1, 2**16):
        number = (start + offset) % 2**16
        subnet = ipaddress.ip_network(f"10.{number >> 8}.{number & 255}.0/24")
        if not any(subnet.overlaps(other) for other in taken if other.version == 4):
            return subnet
    raise LinkError("no free 10.x.y.0/24 subnet for the links")


def host_address(subnet: ipaddress.IPv4Network, index: int) -> str:
    """Worker `index`'s address; the bridge (the client's side) is .1."""
    return str(subnet.network_address + 2 + index)


def outermost(directories: list[str]) -> list[str]:
    """The absolute directories to mount: each once, none inside another in the list
    (a mount of the outer one already carries it)."""
    chosen: list[str] = []
    for path in sorted({os.path.abspath(d) for d in directories}, key=len):
        if not any(path == c or path.startswith(c.rstrip("/") + "/") for c in chosen):
            chosen.append(path)
    return chosen


def sshfs_command(bridge: str, port: int, key: str, directory: str) -> list[str]:
    """Mount the client's `directory` at the same path, through the link."""
    return ["sshfs", "-p", str(port), "-o", f"IdentityFile={key},{SSHFS_OPTIONS}",
            f"root@{bridge}:{directory}", directory]


#: Made private first, so no mount of the client's side propagates over the worker's
PRIVATE_MOUNTS = ["mount", "--make-rprivate", "/"]


def blind_command(directory: str) -> list[str]:
    """An empty read-only tmpfs at `directory`, under its sshfs mount.

    Namespaces share the file system: were the sshfs mount to go (its process
    ended, unmounted), the worker would find the client's own directory below it
    and go on reading and writing it without crossing its link, fast and wrong.
    With this floor under the mount, such a
    worker finds an empty read-only directory instead and its step fails. A folder
    removed on the client's side takes the mount and this floor with it, which
    `tasks.link_mounts.check_link_mounts` catches at the worker's next step.
    """
    return ["mount", "-t", "tmpfs", "-o", "ro,size=4k,mode=0555", "hetcnn-nolink", directory]


def in_namespace(namespace: str, mounts: list[list[str]], command: list[str],
                 environment: dict[str, str] | None = None) -> list[str]:
    """Run `command` in `namespace` once every mount command has succeeded (they share
    the private mount namespace `ip netns exec` makes, which no other process sees),
    with `environment` added to its own."""
    steps = [" ".join(_quote(part) for part in mount) for mount in mounts]
    steps += [f"export {name}={_quote(value)}" for name, value in (environment or {}).items()]
    script = " && ".join(steps + ['exec "$@"'])
    return ["ip", "netns", "exec", namespace, "sh", "-c", script, "sh", *command]


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def sshd_config(directory: str, address: str, port: int) -> str:
    """A sshd that serves sftp to the run's key only, on the bridge address only."""
    return "\n".join([
        f"Port {port}", f"ListenAddress {address}",
        f"HostKey {directory}/host_key", f"PidFile {directory}/sshd.pid",
        "PermitRootLogin prohibit-password", "PasswordAuthentication no",
        f"AuthorizedKeysFile {directory}/client_key.pub", "StrictModes no", "UsePAM no",
        "Subsystem sftp internal-sftp", "",
    ])


# Commands ---------------------------------------------------------------------------


def missing_tools() -> list[str]:
    """The programs `LinkedHosts` needs that this machine lacks."""
    return [tool for tool in TOOLS if _which(tool) is None]


def link_problem() -> str | None:
    """Why links cannot be built here (None if they can)."""
    if os.geteuid() != 0:
        return f"needs root (network namespaces and tc; running as uid {os.geteuid()})"
    if missing := missing_tools():
        return (f"needs {', '.join(missing)} (Debian: apt-get install -y iproute2 "
                "openssh-server sshfs)")
    return None


def _which(tool: str) -> str | None:
    path = os.pathsep.join([os.environ.get("PATH", ""), *SSHD_DIRS])
    return shutil.which(tool, path=path)


def _run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise LinkError(f"`{' '.join(command)}` failed: {done.stderr.strip()}")
    return done.stdout


def used_addresses() -> list[str]:
    """Every address (CIDR) on this machine's interfaces, from `ip -o addr`."""
    return [line.split()[3] for line in _run("ip", "-o", "addr").splitlines()
            if len(line.split()) > 3]


# The hosts ------------------------------------------------------------------------


@dataclass(frozen=True)
class Host:
    """One worker's host: its namespace, address and link."""

    name: str
    namespace: str
    address: str
    rate: str
    interface: str  # the bridge-side veth: tx is what the worker receives, rx what it sends


@dataclass
class LinkedHosts:
    """One run's bridge, namespaces, links, sshd and the processes started in them."""

    run_id: str
    subnet: ipaddress.IPv4Network
    hosts: list[Host]
    directory: str  # private: keys, sshd config and log
    port: int = 0
    processes: list[subprocess.Popen] = field(default_factory=list)
    # fsspec options of the run's S3 server, if it has one (pipeline/cluster/object_store.py)
    storage_options: dict[str, str] = field(default_factory=dict)
    pins: list[str] = field(default_factory=list)  # files that keep directories (`pin`)

    @property
    def bridge(self) -> str:
        return bridge_name(self.run_id)

    @property
    def bridge_address(self) -> str:
        return str(self.subnet.network_address + 1)

    @property
    def record(self) -> str:
        return record_path(self.run_id)

    @classmethod
    def start(cls, rates: dict[str, str]) -> "LinkedHosts":
        """Build one host per worker name, linked at its rate; leftovers go first."""
        problem = link_problem()
        if problem:
            raise LinkError(f"cluster.link {problem}")
        sweep_leftovers()
        run_id = new_run_id()
        subnet = choose_subnet(run_id, used_addresses())
        hosts = [Host(name, namespace_name(run_id, i), host_address(subnet, i), rate,
                      veth_names(run_id, i)[0]) for i, (name, rate) in enumerate(rates.items())]
        links = cls(run_id, subnet, hosts, tempfile.mkdtemp(prefix=f"hc{run_id}-"))
        try:
            links._write_record()
            links._build_network()
            links._start_sshd()
        except BaseException:
            links.close()
            raise
        return links

    def _build_network(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for index, host in enumerate(self.hosts):
            outer, inner = veth_names(self.run_id, index)
            _run("ip", "netns", "add", host.namespace)
            _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner,
                 "netns", host.namespace)
            _run("ip", "link", "set", outer, "master", self.bridge, "up")
            inside = ("ip", "netns", "exec", host.namespace)
            _run(*inside, "ip", "addr", "add", f"{host.address}/24", "dev", inner)
            _run(*inside, "ip", "link", "set", inner, "up")
            _run(*inside, "ip", "link", "set", "lo", "up")
        self._shape()

    def _shape(self) -> None:
        """Both ends of every host's veth pair shaped with tbf at its rate (module doc)."""
        for index, host in enumerate(self.hosts):
            inside = ("ip", "netns", "exec", host.namespace)
            for tc, interface in zip((("tc",), (*inside, "tc")), veth_names(self.run_id, index)):
                _run(*tc, "qdisc", "replace", "dev", interface, "root", "tbf", "rate", host.rate,
                     "burst", str(burst_bytes(host.rate)), "latency", "100ms")

    def set_rate(self, rate: str) -> None:
        """Every link shaped at `rate` from now on, workers and mounts kept (tests/test_links.py)."""
        self.hosts = [replace(host, rate=rate) for host in self.hosts]
        self._shape()

    def _start_sshd(self) -> None:
        d = self.directory
        for key in ("host_key", "client_key"):
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{d}/{key}")
        with socket.socket() as probe:  # a free port on the bridge address
            probe.bind((self.bridge_address, 0))
            self.port = probe.getsockname()[1]
        with open(f"{d}/sshd_config", "w", encoding="utf-8") as f:
            f.write(sshd_config(d, self.bridge_address, self.port))
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
        self.spawn([_which("sshd") or "sshd", "-D", "-f", f"{d}/sshd_config",
                    "-E", f"{d}/sshd.log"])
        self._wait_for_port(self.bridge_address, self.port)

    def _wait_for_port(self, address: str, port: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection((address, port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise LinkError(f"the links' sshd did not start (see {self.directory}"
                                    "/sshd.log)") from None
                time.sleep(0.05)

    def spawn(self, command: list[str], **options) -> subprocess.Popen:
        """Start a process this run owns (killed by `close`, or by the next run's sweep)."""
        process = subprocess.Popen(command, **options)
        self.processes.append(process)
        self._write_record()
        return process

    def command(self, host: Host, directories: list[str], command: list[str]) -> list[str]:
        """`command` run on `host`, with `directories` mounted from the client over sshfs
        at their own paths (created here first, as a mount point needs one)."""
        mounts, folders = [PRIVATE_MOUNTS], outermost(directories)
        for directory in folders:
            os.makedirs(directory, exist_ok=True)
            mounts.append(blind_command(directory))
            mounts.append(sshfs_command(self.bridge_address, self.port,
                                        f"{self.directory}/client_key", directory))
        return in_namespace(host.namespace, mounts, command,
                            {LINK_MOUNTS: os.pathsep.join(folders)} if folders else None)

    def pin(self, directory: str) -> None:
        """Keep `directory` (made if missing) while the links live: a file of this run in
        it (module doc); recorded first, so a SIGKILLed run's pin goes at the next start."""
        pin = os.path.join(directory, f"{PIN_PREFIX}{self.run_id}")
        self.pins.append(pin)
        self._write_record()
        # again if a run removed the empty folder between its making and the pin's
        make_folder(directory, lambda: open(pin, "w", encoding="utf-8").close())

    def counters(self) -> dict[str, tuple[int, int]]:
        """Bytes that crossed each worker's link so far: (to the worker, from it)."""
        found = {}
        for host in self.hosts:
            stats = f"/sys/class/net/{host.interface}/statistics"
            found[host.name] = tuple(int(open(f"{stats}/{k}_bytes").read()) for k in ("tx", "rx"))
        return found

    def _write_record(self) -> None:
        write_record(self.run_id, {
            "directory": self.directory, "namespaces": [h.namespace for h in self.hosts],
            "interfaces": [self.bridge] + [h.interface for h in self.hosts],
            "pids": [[p.pid, started_at(p.pid)] for p in self.processes], "pins": self.pins})

    def close(self) -> None:
        """Stop every process started, unmount, delete namespaces, veths and bridge.

        Workers stop first (5 s for all), while sshd still serves their mounts, then
        sshd. No wait is unbounded: a process whose mount's server stopped answering
        cannot finish exiting, even killed, until the leftovers go (the namespaces'
        sshfs processes end, failing every request waiting on their mounts).
        """
        children = descendants(self.processes[:1])  # sshd's sessions, one per mount
        stop_processes(self.processes[1:])
        stop_processes(self.processes[:1])
        with open(self.record, encoding="utf-8") as f:
            remove_leftovers(json.load(f))
        kill_started(children)
        for process in self.processes:  # reap them (freed once the mounts went)
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.remove(self.record)
        except FileNotFoundError:
            pass
