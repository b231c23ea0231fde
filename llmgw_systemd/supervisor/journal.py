"""The supervisor's events into the journal with their fields (health/events.py), over
journald's native protocol, when its stderr goes to the journal (systemd sets
$JOURNAL_STREAM to that stream's device and inode, systemd.exec(5)); otherwise, and
whenever the socket cannot take one, the event's line on stderr as every other line.

A datagram carries `KEY=value` lines; a value holding a newline goes as the key, a
newline, its length (64-bit little-endian) and the bytes (the native protocol). journald
adds what it knows itself (_PID, _SYSTEMD_UNIT, ...), so `journalctl -u
llmgw-supervisor` still finds every event."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable, Mapping, Sequence

from llmgw_systemd.health.events import Event

JOURNAL_SOCKET = "/run/systemd/journal/socket"
IDENTIFIER = "llmgw-supervisor"


def encode(fields: Sequence[tuple[str, str]]) -> bytes:
    """One native-protocol datagram of these fields."""
    out = bytearray()
    for key, value in fields:
        data = value.encode("utf-8", "replace")
        if b"\n" in data:
            out += key.encode("ascii") + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += key.encode("ascii") + b"=" + data + b"\n"
    return bytes(out)


def under_journald(env: Mapping[str, str], stderr_fd: int = 2) -> bool:
    """Whether stderr is the journal stream systemd connected (not a redirect since)."""
    stream = env.get("JOURNAL_STREAM", "")
    device, _, inode = stream.partition(":")
    try:
        st = os.fstat(stderr_fd)
        return (int(device), int(inode)) == (st.st_dev, st.st_ino)
    except (OSError, ValueError):
        return False


class Journal:
    """Where events go: journald's socket when stderr is the journal, else `line`."""

    def __init__(self, line: Callable[[str], None], *, env: Mapping[str, str] = os.environ,
                 path: str = JOURNAL_SOCKET) -> None:
        self._line = line
        self._path = path
        self._sock: socket.socket | None = None
        if under_journald(env) and os.path.exists(path):
            try:
                self._sock = socket.socket(socket.AF_UNIX,
                                           socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            except OSError:
                self._sock = None

    @property
    def native(self) -> bool:
        return self._sock is not None

    def send(self, event: Event) -> None:
        if self._sock is not None:
            fields = (*event.fields(), ("SYSLOG_IDENTIFIER", IDENTIFIER))
            try:
                self._sock.sendto(encode(fields), self._path)
                return
            except OSError:  # journald restarting, or a record over its size: say it plainly
                pass
        self._line(event.message)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

