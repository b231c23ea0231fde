"""The supervisor's settings and their defaults: one home, read by the daemon and by the
command line (its options' defaults), so light enough for every CLI start."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmgw_systemd.spec.endpoint import SUPERVISOR_LOCAL, SUPERVISOR_PORT

if TYPE_CHECKING:
    from llmgw_systemd.gather.tls import TlsFiles


@dataclass(frozen=True)
class SupervisorConfig:
    specs: tuple[str, ...]
    node: str
    state_dir: str
    # a folder a reboot empties (systemd's RuntimeDirectory=): the evidence kept for the
    # next start goes there when there is one, else into state_dir
    runtime_dir: str | None = None
    user: bool = False
    listen_host: str = SUPERVISOR_LOCAL.host
    listen_port: int = SUPERVISOR_PORT
    local: tuple[str, int] | None = None  # an extra plain-HTTP listener on loopback
    peer_port: int = SUPERVISOR_PORT
    tls: TlsFiles | None = None
    reconcile_interval: float = 5.0  # the slow timer; signals trigger sooner
    peer_wait: float = 2.0  # long-poll: a peer answers at least this often
    peer_timeout: float = 2.0  # beyond the wait: connect, TLS, headers and body
    # a peer whose supervisor refuses connections (restarting) keeps its last answer
    # this long while this node's rank is ready (docs/supervisor.md): a restart of a
    # loaded node's supervisor, with its first answer, takes a few seconds
    peer_grace: float = 20.0
    peer_max_bytes: int = 1 << 20
    dbus_timeout: float = 5.0
    # this node's last read of its units stands this long while systemd does not answer,
    # and only while their main processes run (judge.held_read): a manager reloading
    # beside engines restarting on a loaded node missed several 5 s call timeouts
    systemd_grace: float = 30.0
    max_connections: int = 4096

    @property
    def evidence_dir(self) -> str:
        """Where a clean stop keeps its evidence for the next start (saved_evidence)."""
        return self.runtime_dir or self.state_dir
