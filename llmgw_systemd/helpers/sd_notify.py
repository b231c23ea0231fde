"""sd_notify(3) without libsystemd: one datagram to $NOTIFY_SOCKET, never failing."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence


def notify(message: str, fds: Sequence[int] = ()) -> bool:
    """Send one notification (READY=1, STATUS=..., WATCHDOG=1; with `fds`, FDSTORE=1
    and the descriptors) when systemd asked for them; whether it was sent, never an
    error."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            data = message.encode("utf-8", errors="replace")
            if fds:
                socket.send_fds(sock, [data], list(fds))
            else:
                sock.sendall(data)
    except OSError:
        return False
    return True


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec=), if systemd wants them."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None
