"""TLS: the credentials of the clusters a run starts, the client's certificates for an
external Dask cluster, and what a refusal means.

Every cluster a run starts itself (embedded, or behind shaped links) speaks mutual TLS
with credentials made for it (`run_security`), so that no other user of the machine
can submit work to its workers.

Dask's TLS is mutual: the scheduler and every worker present a certificate, and so
does the client; each side accepts only a peer whose certificate the configured CA
signed (Dask turns hostname checks off: clusters are addressed by IP). A run gets its
side from `cluster.tls` ({ca_file, cert, key}), or, without it, from Dask's own
config (`distributed.comm.tls.ca-file`, `distributed.comm.tls.client.cert/key`).

The mistakes this catches before or while connecting, each as one line naming what to
change: certificates that do not load, certificates for a tcp:// scheduler, a tls://
scheduler with no certificates at all (Dask's own message is a TypeError about an
`ssl_context`), a tcp:// client at a TLS scheduler (which resets the connection at
once), and a handshake either side refused. docs/multihost.md shows the whole set-up.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass

import dask
from distributed import Security

from pipeline.config.schema import FieldError, described


@dataclass
class TlsConfig:
    """The client's side of a `tls://` scheduler: the CA that signed the scheduler's and
    workers' certificates, and the client's own certificate and key (PEM files)."""

    ca_file: str = described(doc="the CA certificate (PEM) that signed the scheduler's and "
                             "workers' certificates")
    cert: str = described(doc="the client's certificate (PEM)")
    key: str | None = described(None, "the client's private key (null: it follows the "
                                "certificate in `cert`)")

    def __post_init__(self) -> None:
        for name in ("ca_file", "cert", "key"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise FieldError(name, f"{path} does not exist" if not os.path.lexists(path)
                                 else f"{path} is not a file")
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        try:
            context.load_verify_locations(self.ca_file)
        except ssl.SSLError as error:
            raise FieldError("ca_file", f"no CA certificate in PEM format in {self.ca_file} "
                             f"({error.reason or error})") from None
        try:
            context.load_cert_chain(self.cert, self.key)
        except ssl.SSLError as error:
            field = "key" if self.key else "cert"
            raise FieldError(field, f"cannot load a certificate and its private key from "
                             f"{self.cert}{' and ' + self.key if self.key else ''} "
                             f"({error.reason or error})") from None


def scheme(address: str) -> str:
    """An address's protocol, `tcp` when it names none (as Dask reads it)."""
    return address.split("://", 1)[0] if "://" in address else "tcp"


def dask_tls_configured() -> bool:
    """Whether Dask's own config gives the client a CA and a certificate."""
    return bool(dask.config.get("distributed.comm.tls.ca-file", None)
                and dask.config.get("distributed.comm.tls.client.cert", None))


def tls_problem(address: str | None, tls: TlsConfig | None) -> str | None:
    """What is wrong with connecting to `address` (None: no external scheduler) with
    `tls`, as a line naming the field; None if nothing is."""
    if address is None:
        if tls is not None:
            return ("cluster.tls: certificates are for an external tls:// scheduler, and "
                    "none is named (cluster.scheduler or DASK_SCHEDULER_ADDRESS)")
        return None
    if tls is not None and scheme(address) != "tls":
        return f"cluster.tls: certificates are for a tls:// scheduler, not {address}"
    if scheme(address) != "tls" and dask.config.get("distributed.comm.require-encryption",
                                                    False):
        return (f"cluster.scheduler: Dask's config requires encryption (distributed.comm."
                f"require-encryption), which {address} cannot give: name the scheduler "
                f"tls://{address.split('://')[-1]}, or unset it for a tcp:// one")
    if scheme(address) == "tls" and tls is None and not dask_tls_configured():
        return (f"cluster.tls: the scheduler {address} speaks TLS: give cluster.tls.ca_file, "
                "cluster.tls.cert and cluster.tls.key (or Dask's distributed.comm.tls "
                "config), see docs/multihost.md")
    return None


def client_security(tls: TlsConfig | None) -> Security | None:
    """The client's `Security` for `tls`; None leaves Dask to its config (tcp, or
    `distributed.comm.tls.*`)."""
    if tls is None:
        return None
    return Security(require_encryption=True, tls_ca_file=tls.ca_file,
                    tls_client_cert=tls.cert, tls_client_key=tls.key)


def run_security() -> Security:
    """Credentials made for one cluster that a run starts (embedded or linked): a fresh
    self-signed key and certificate, held in memory, that the scheduler, every nanny
    and worker, and the client both present and require (mutual TLS). Another user of
    the machine can reach the cluster's loopback ports, but holds no certificate the
    cluster trusts: the handshake refuses it before any message is read."""
    return Security.temporary()


def write_credentials(security: Security, folder: str) -> TlsConfig:
    """`security`'s CA, certificate and key as PEM files in `folder` (a folder of this
    user's that others cannot enter, e.g. from `tempfile.mkdtemp`), each readable by
    this user only: for processes that take their credentials from files, such as a
    `dask worker` command (never the key itself on a command line)."""
    files = {"ca_file": ("ca.pem", security.tls_ca_file),
             "cert": ("cert.pem", security.tls_client_cert),
             "key": ("key.pem", security.tls_client_key)}
    paths = {}
    for field, (name, contents) in files.items():
        paths[field] = os.path.join(folder, name)
        descriptor = os.open(paths[field], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w", encoding="ascii") as handle:
            handle.write(contents)
    return TlsConfig(**paths)


def tls_flags(ca_file: str, cert: str, key: str) -> list[str]:
    """The flags of `dask scheduler` and `dask worker` that give them their side."""
    return ["--tls-ca-file", ca_file, "--tls-cert", cert, "--tls-key", key]


#: How `pipeline.cluster.connect.check_handshake` says that a tls:// address was
#: answered in plain text (a tcp:// scheduler speaks first, before TLS could begin).
PLAIN_PEER = "it sent plain text where TLS's handshake was due"


def connection_problem(address: str, error: BaseException) -> str:
    """One line for a failed connection to the scheduler at `address`."""
    kind = type(error).__name__
    text = str(error).split(">: ", 1)[-1]  # Dask's comm errors start "in <TLS ...>: "
    if scheme(address) == "tls" and PLAIN_PEER in text:
        return (f"the Dask scheduler at {address} does not speak TLS ({text}); if it serves "
                f"plain TCP, name it tcp://{address.split('://')[-1]} without cluster.tls")
    if scheme(address) == "tls" and ("SSL" in text or "TLS" in text or "certificate" in text):
        return (f"the TLS handshake with the Dask scheduler at {address} failed ({kind}: "
                f"{text}); cluster.tls's CA must have signed the scheduler's certificate, "
                "and the scheduler's CA the client's")
    if scheme(address) == "tcp" and "reset" in text.lower():
        return (f"the Dask scheduler at {address} closed the connection at once ({kind}); if "
                f"it serves TLS, name it tls://{address.split('://')[-1]} and give "
                "cluster.tls (docs/multihost.md)")
    if "refused" in text.lower():
        kind = "connection refused: nothing listens there"
    return (f"cannot reach the Dask scheduler at {address} ({kind}); is `dask scheduler` "
            "running there?")
