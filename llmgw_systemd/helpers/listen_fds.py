"""Listening sockets that outlive the process: sd_listen_fds(3) and systemd's file
descriptor store (FDSTORE=1), without libsystemd.

The supervisor binds its API once and hands the socket to systemd's store; a restart
(`systemctl restart`, a package upgrade's try-restart, Restart=on-failure) gets it back
as an inherited descriptor, so clients connecting meanwhile wait in the socket's backlog
instead of being refused (docs/supervisor.md, "A restart no gateway notices").

`parse_listen_fds` and `adopt` decide; the rest reads the environment and the sockets.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from llmgw_systemd.helpers.sd_notify import notify

# sd_listen_fds(3): inherited descriptors start here.
LISTEN_FDS_START = 3
_ENVIRONMENT = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


@dataclass(frozen=True)
class Inherited:
    """One inherited descriptor: its number, its FDNAME, and what it is (None when it is
    not a listening TCP socket)."""
    fd: int
    name: str
    address: tuple[int, str, int] | None = None  # (family, host, port)


@dataclass(frozen=True)
class Adoption:
    """Which inherited socket each listener takes over, and which descriptors are left
    over: closed, and removed from the store (a changed --listen, an unknown name)."""
    use: Mapping[str, int]
    drop: tuple[Inherited, ...]


def parse_listen_fds(environ: Mapping[str, str], pid: int) -> tuple[tuple[int, str], ...]:
    """The (fd, name) pairs systemd passed this process, as sd_listen_fds_with_names(3)
    reads them: none unless LISTEN_PID is this process; names default to "unknown"."""
    if environ.get("LISTEN_PID", "") != str(pid):
        return ()
    try:
        count = int(environ.get("LISTEN_FDS", ""))
    except ValueError:
        return ()
    if not 0 < count <= 1024:
        return ()
    names = environ.get("LISTEN_FDNAMES", "").split(":") if "LISTEN_FDNAMES" in environ else []
    if len(names) != count:
        names = ["unknown"] * count
    return tuple((LISTEN_FDS_START + i, name) for i, name in enumerate(names))


def adopt(wanted: Mapping[str, tuple[int, str, int]],
          inherited: Sequence[Inherited]) -> Adoption:
    """A listener takes the inherited socket of its own name only when that socket is a
    listening TCP socket on the very address it is configured for; everything else is
    dropped, so a changed address binds anew and a stale socket never lingers."""
    use: dict[str, int] = {}
    drop: list[Inherited] = []
    for item in inherited:
        if (item.name in wanted and item.name not in use and item.address is not None
                and item.address == wanted[item.name]):
            use[item.name] = item.fd
        else:
            drop.append(item)
    return Adoption(use, tuple(drop))


# -- the shell: the environment, the descriptors, the notify socket -------------------------


def listening_address(sock: socket.socket) -> tuple[int, str, int] | None:
    """(family, host, port) of a listening TCP socket; None for anything else."""
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) != socket.SOCK_STREAM:
            return None
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return None
        name = sock.getsockname()
    except OSError:
        return None
    return (int(sock.family), str(name[0]), int(name[1]))


def wanted_address(host: str, port: int) -> tuple[int, str, int] | None:
    """What a socket bound to host:port says it is (None when unresolvable or port 0)."""
    if port == 0:
        return None  # "any free port": never the same socket as before
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE | socket.AI_NUMERICHOST)
    except (OSError, UnicodeError):
        return None
    family, _, _, _, sockaddr = infos[0]
    return (int(family), str(sockaddr[0]), int(sockaddr[1]))


def inherited_sockets() -> list[tuple[Inherited, socket.socket | None]]:
    """Take what systemd passed (once: the environment is cleared, so nothing we start
    inherits it), each descriptor wrapped, close-on-exec and non-blocking."""
    pairs = parse_listen_fds(os.environ, os.getpid())
    for key in _ENVIRONMENT:
        os.environ.pop(key, None)
    out: list[tuple[Inherited, socket.socket | None]] = []
    for fd, name in pairs:
        try:
            os.set_inheritable(fd, False)
            sock = socket.socket(fileno=fd)
        except OSError:
            out.append((Inherited(fd, name), None))
            continue
        sock.setblocking(False)
        out.append((Inherited(fd, name, listening_address(sock)), sock))
    return out


def close_inherited(item: Inherited, sock: socket.socket | None) -> None:
    if sock is not None:
        sock.close()
    else:
        with contextlib.suppress(OSError):
            os.close(item.fd)


def store(name: str, sock: socket.socket) -> bool:
    """Hand a copy of the socket to systemd's store under `name` (FileDescriptorStoreMax=
    must allow it); False when there is no service manager to keep it."""
    return notify(f"FDSTORE=1\nFDNAME={name}", [sock.fileno()])


def unstore(name: str) -> bool:
    """Ask systemd to close what its store holds under `name`."""
    return notify(f"FDSTOREREMOVE=1\nFDNAME={name}")
