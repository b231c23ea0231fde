"""The supervisor's events into the journal with their fields (health/events.py), over
journald's native protocol, when its stderr goes to the journal (systemd sets
$JOURNAL_STREAM to that stream's device and inode, systemd.exec(5)); otherwise, and
whenever the socket cannot take one at once (journald gone, stopped or behind, or a
datagram over the socket's size), the event's line on stderr as every other line.

A datagram carries `KEY=value` lines; a value holding a newline goes as the key, a
newline, its length (64-bit little-endian) and the bytes (the native protocol). journald
adds what it knows itself (_PID, _SYSTEMD_UNIT, ...), so `journalctl -u
llmgw-supervisor` still finds every event."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct
import threading
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
                # never blocking: a journald that is stopped or behind fills its queue,
                # and the supervisor's one loop must not wait on it (the line instead)
                self._sock = socket.socket(
                    socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
                    | socket.SOCK_NONBLOCK)
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
            except OSError:
                # journald restarting or behind, or a record over the socket's size
                pass
        self._line(event.message)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


PENDING_LIMIT = 256 * 1024  # bytes of lines kept while stderr does not take them


class Lines:
    """Lines to stderr that never block the supervisor: under systemd stderr is a stream
    socket to journald, and a journald that is stopped or behind would otherwise stop
    every thread that logs (and with them the API the gateways route by). What the socket
    does not take at once waits, up to PENDING_LIMIT bytes, and goes with the next line
    or flush(); past that, lines are counted and the count said when it takes them again.
    stderr that is not a socket (a terminal, a file) is written plainly."""

    def __init__(self, fd: int = 2, limit: int = PENDING_LIMIT) -> None:
        self._fd, self._limit = fd, limit
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._opened = False  # stderr looked at, on the first line (no I/O at import)
        self._pending = bytearray()
        self._dropped = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    def write(self, line: str) -> None:
        data = (line.replace("\n", " ") + "\n").encode("utf-8", "replace")
        with self._lock:
            self._open()
            if self._sock is None:
                with contextlib.suppress(OSError):
                    os.write(self._fd, data)  # a terminal or a file: as print would
                return
            self._drain(self._sock)
            if len(self._pending) + len(data) > self._limit:
                self._dropped += 1
            else:
                self._pending += data
            self._drain(self._sock)

    def flush(self) -> None:
        """Send what waits, if the socket takes it now."""
        with self._lock:
            if self._sock is not None:
                self._drain(self._sock)

    def _open(self) -> None:
        if self._opened:
            return
        self._opened = True
        try:
            if stat.S_ISSOCK(os.fstat(self._fd).st_mode):
                self._sock = socket.socket(fileno=os.dup(self._fd))
        except OSError:
            self._sock = None

    def _drain(self, sock: socket.socket) -> None:
        while True:
            if not self._pending and self._dropped:
                self._pending += (f"{IDENTIFIER}: {self._dropped} lines left out: "
                                  "stderr (the journal) was not taking them\n").encode()
                self._dropped = 0
            if not self._pending:
                return
            try:
                sent = sock.send(self._pending, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            except BlockingIOError:
                return
            except OSError:  # the journal's end closed: nothing will take them
                self._dropped, self._pending = 0, bytearray()
                return
            del self._pending[:sent]


STDERR = Lines()  # the supervisor's lines (daemon.log); stderr is looked at on first use
