"""`llmgw-supervisor`: its options checked (every TLS file read now, not at the first
peer; the state folder writable), then the daemon (supervisor/daemon.py) until a signal."""

from __future__ import annotations

import gc
import os
import signal

from llmgw_systemd.commands.common import DEFAULT_SPECS, default_state_dir, this_node
from llmgw_systemd.errors import LlmgwError, TlsError, UsageError
from llmgw_systemd.gather.tls import client_context, find_tls_files, server_context
from llmgw_systemd.spec.endpoint import is_ip, parse_endpoint
from llmgw_systemd.supervisor.config import SupervisorConfig
from llmgw_systemd.supervisor.daemon import is_loopback, serve
from llmgw_systemd.supervisor.state_file import check_writable


def supervise(specs: tuple[str, ...], *, node: str | None, user_manager: bool, listen: str,
              local: str | None, peer_port: int | None, tls_cert: str | None,
              tls_key: str | None, tls_ca: str | None, state_dir: str | None,
              dbus_timeout: float, peer_timeout: float, peer_grace: float,
              systemd_grace: float) -> None:
    """Serve until SIGTERM or SIGINT."""
    gc.enable()  # a long-running daemon: the CLI's entry point turned it off
    host, port = _endpoint("--listen", listen)
    extra = _endpoint("--local", local) if local else None
    if extra is not None and not is_loopback(extra[0]):
        raise UsageError("--local", f"plain HTTP listens on loopback only; got '{local}'")
    try:
        tls = find_tls_files(tls_cert, tls_key, tls_ca,
                             credentials_dir=os.environ.get("CREDENTIALS_DIRECTORY"))
        if tls is not None:
            server_context(tls)
            client_context(tls)
    except TlsError as exc:
        raise UsageError("--tls-cert/--tls-key/--tls-ca", str(exc)) from None
    directory = state_dir or default_state_dir(user_manager)
    check_writable(directory)
    config = SupervisorConfig(
        specs=specs or DEFAULT_SPECS, node=this_node(node), state_dir=directory,
        runtime_dir=os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0] or None,
        user=user_manager, listen_host=host, listen_port=port, local=extra,
        peer_port=peer_port or port, tls=tls, dbus_timeout=dbus_timeout,
        peer_timeout=peer_timeout, peer_grace=peer_grace, systemd_grace=systemd_grace)
    try:
        serve(config, (signal.SIGTERM, signal.SIGINT))
    except OSError as exc:
        raise LlmgwError(f"cannot listen: {exc.strerror or exc}") from None


def _endpoint(option: str, text: str) -> tuple[str, int]:
    endpoint = parse_endpoint(text)
    if isinstance(endpoint, str):
        raise UsageError(option, endpoint)
    if not is_ip(endpoint.host):
        raise UsageError(option, f"expected an IP address to listen on; got '{endpoint.host}'")
    return endpoint.host, endpoint.port
