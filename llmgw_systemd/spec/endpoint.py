"""TCP endpoints HOST:PORT, shared by the spec and llmgw-wait-for-port (pure, light:
the wait tool imports it on every shard start)."""

from __future__ import annotations

import functools
import ipaddress
import re
from dataclasses import dataclass

HOSTNAME_LABEL_RE = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)\Z")
# The supervisor's API port: where it listens, where peers dial it, and (on loopback,
# plain HTTP) where the units' drain step asks it (docs/supervisor.md, "Drain").
SUPERVISOR_PORT = 9470


@dataclass(frozen=True)
class Endpoint:
    """A TCP address: host name or IP, and port."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


# The supervisor's plain listener on loopback (its default, or --local beside TLS)
SUPERVISOR_LOCAL = Endpoint("127.0.0.1", SUPERVISOR_PORT)


def parse_endpoint(text: str) -> Endpoint | str:
    """'host:port' or '[v6]:port' -> Endpoint; a str is the error message."""
    expected = f"expected HOST:PORT (IPv6 as [ADDR]:PORT); got '{text}'"
    if text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
        if not sep or not is_ip(host, 6):
            return expected
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or ":" in host or not is_host(host):
            return expected
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        return f"expected a port from 1 to 65535 after the host; got '{text}'"
    return Endpoint(host, int(port_text))


@functools.lru_cache(maxsize=4096)
def is_ip(text: str, version: int | None = None) -> bool:
    # cached: a fleet's specs name the same few node addresses in replica after replica
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        return False
    return version is None or addr.version == version


def is_host(text: str) -> bool:
    if is_ip(text):
        return True
    if len(text) > 253 or text.replace(".", "").isdigit():
        return False
    return all(HOSTNAME_LABEL_RE.match(label) for label in text.rstrip(".").split("."))


WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1"}  # noqa: S104 - a bind address, not a target


def local_address(bind_host: str) -> str:
    """Where to reach, from its own node, a server bound to bind_host."""
    return WILDCARDS.get(bind_host, bind_host)
