"""The one exception tree. Every error raised on purpose is one of these; only the entry
points (cli.py, and the helpers' main()) turn them into exit statuses.

    LlmgwError                 exit 1: something outside the input went wrong
    ├── BadInput               exit 2: a malformed spec, value or argument
    │   ├── SpecError          a spec value: file, line, key path, what was expected
    │   ├── NoShard            the node has no shard in the spec
    │   ├── UsageError         a command-line argument
    │   └── UnsafeValue        a value no unit file can hold as it is
    ├── InstallError           writing or pruning the unit folder
    ├── SystemctlError         a systemctl step of --apply
    ├── NotBackError           a replica --apply restarted was not routable again in time
    ├── BusError               systemd over D-Bus: unreachable, or a call refused
    ├── PeerError              a fetch from a peer supervisor (its kind says how)
    ├── TlsError               the TLS files: missing, unreadable, not fitting together
    └── StateError             the supervisor's state directory
"""

from __future__ import annotations

import re
from typing import Literal, NoReturn


def unreachable(value: NoReturn) -> NoReturn:
    """The end of an exhaustive match over a closed vocabulary (a Literal type): mypy
    fails here if a value was left unhandled; at run time it never is."""
    raise AssertionError(f"unhandled value {value!r}")


class LlmgwError(Exception):
    """Base of every error raised on purpose; entry points exit 1 on it."""


class BadInput(LlmgwError):
    """Malformed spec, value or argument; entry points exit 2 on it."""


class SpecError(BadInput):
    """A spec value is wrong: names the file, line, key path and what was expected."""

    def __init__(self, file: str, line: int | None, path: str, message: str) -> None:
        self.file = file
        self.line = line
        self.path = path
        self.message = message
        super().__init__(self.render())

    def render(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


class NoShard(BadInput):
    """The node has no shard in the spec (the CLI says which option to pass)."""

    def __init__(self, node: str, known: list[str]) -> None:
        self.node, self.known = node, known
        super().__init__(f"node '{node}' is not in any replica (nodes in the spec: "
                         f"{', '.join(known) or 'none'})")


class UsageError(BadInput):
    """A command-line argument is wrong."""

    def __init__(self, option: str, message: str) -> None:
        self.option = option
        super().__init__(f"{option}: {message}")


class UnsafeValue(BadInput):
    """A value cannot be written into a unit file without changing its meaning."""


class InstallError(LlmgwError):
    """Writing or pruning the unit directory failed."""


class NotBackError(LlmgwError):
    """A replica that llmgw-render --apply restarted was not routable again in time;
    nothing after it was restarted."""


class SystemctlError(LlmgwError):
    """A systemctl step of llmgw-render --apply failed; nothing after it was done."""


class BusError(LlmgwError):
    """systemd could not be reached over D-Bus, or refused a call."""


# How a peer fetch failed, for counting (llmgw_peer_fetch_failures{kind}).
PeerFailure = Literal["connect", "timeout", "tls", "http-status", "redirect", "too-large",
                      "malformed", "closed"]
PEER_FAILURES: tuple[PeerFailure, ...] = ("connect", "timeout", "tls", "http-status",
                                          "redirect", "too-large", "malformed", "closed")
MAX_PEER_MESSAGE = 400  # the daemon logs a peer error as it is: keep one line short
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


class PeerError(LlmgwError):
    """A fetch from a peer supervisor failed; `kind` says how. The message may quote what
    the peer sent, so it is made one short line with control characters escaped."""

    def __init__(self, kind: PeerFailure, message: str, *, refused: bool = False) -> None:
        if kind not in PEER_FAILURES:
            raise ValueError(f"unknown PeerError kind {kind!r}")
        self.kind = kind
        # the node's kernel answered and nothing listened (a connection refused, or reset
        # before any answer): the node is up, its supervisor is not (restarting); a
        # timeout says nothing of it
        self.refused = refused
        self.message = one_line(message)
        super().__init__(self.message)


def one_line(text: str, limit: int = MAX_PEER_MESSAGE) -> str:
    """Text fit for one log line: control characters escaped, at most `limit` long."""
    text = _CONTROL_RE.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


class TlsError(LlmgwError):
    """The TLS files are missing, unreadable, malformed or do not fit together."""


class StateError(LlmgwError):
    """The supervisor's state directory cannot be read or written."""
