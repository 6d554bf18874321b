"""Whether a text is a Dask scheduler address, checked before anything connects.

Dask takes any string as an address and fails only when it tries to connect (after
its whole connect timeout, with a traceback from inside the client); checking the
form first turns a typo into one line naming the field.
"""

from __future__ import annotations

from distributed.comm import registry
from distributed.comm.addressing import parse_address, parse_host_port

EXAMPLE = "tcp://HOST:8786"


def address_problem(address: str) -> str | None:
    """What is wrong with `address` as a scheduler address, or None if its form is fine.

    Accepts ``SCHEME://HOST:PORT`` for every comm backend Dask has (tcp, tls, ws,
    wss, ucx), ``HOST:PORT`` (tcp), and ``inproc://NAME``. Reachability is not
    checked here: that is the cluster's business, at connect time.
    """
    scheme, location = parse_address(address, strict=False)
    if scheme not in registry.backends:
        return (f"{address!r}: unknown protocol {scheme!r} (expected one of "
                f"{', '.join(sorted(registry.backends))}, e.g. {EXAMPLE})")
    if scheme == "inproc":
        return None if location else f"{address!r}: expected inproc://NAME"
    try:
        host, port = parse_host_port(location)
    except ValueError:
        return f"{address!r} is not a scheduler address (expected {EXAMPLE})"
    if not host or not 0 < port < 65536:
        return f"{address!r} is not a scheduler address (expected {EXAMPLE})"
    return None
