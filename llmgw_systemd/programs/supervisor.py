"""`llmgw-supervisor`'s command line: its options, the daemon's start in
commands/supervisor.py. Needs the supervisor's dependencies: cli.py's entry point says
what to install when they are missing."""

from __future__ import annotations

from typing import Any

import click

from llmgw_systemd.commands import supervisor
from llmgw_systemd.commands.common import DEFAULT_STATE_DIR
from llmgw_systemd.programs.options import (
    NODE_OPTION,
    USER_OPTION,
    VERSION_OPTION,
    call,
    run,
    tls_options,
)
from llmgw_systemd.spec.endpoint import SUPERVISOR_LOCAL
from llmgw_systemd.supervisor.config import SupervisorConfig


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("specs", nargs=-1, metavar="[SPEC]...")
@NODE_OPTION
@USER_OPTION
@click.option("--listen", default=str(SUPERVISOR_LOCAL), show_default=True, metavar="ADDR:PORT",
              help="Where the API listens (TLS when configured); the node's address to "
                   "serve its peers; IPv6 as [ADDR]:PORT.")
@click.option("--local", "local", metavar="ADDR:PORT",
              help="An extra plain-HTTP listener for tools on this node; loopback only.")
@click.option("--peer-port", type=click.IntRange(1, 65535), metavar="PORT",
              help="The port peer supervisors listen on [default: --listen's port].")
@tls_options("", "tls_node.crt, tls_node.key, tls_ca.crt (or the names without tls_) in "
             "$CREDENTIALS_DIRECTORY")
@click.option("--state-dir", metavar="DIR",
              help="Where group restarts are recorded [default: $STATE_DIRECTORY, else "
                   f"{DEFAULT_STATE_DIR}].")
@click.option("--dbus-timeout", type=click.FloatRange(0.1, 120),
              default=SupervisorConfig.dbus_timeout,
              show_default=True, metavar="SECONDS",
              help="Bound on every D-Bus call, connecting included.")
@click.option("--peer-timeout", type=click.FloatRange(0.1, 120),
              default=SupervisorConfig.peer_timeout,
              show_default=True, metavar="SECONDS",
              help="Bound on a peer fetch beyond its long-poll wait (connect, TLS, body).")
@click.option("--peer-grace", type=click.FloatRange(0, 600),
              default=SupervisorConfig.peer_grace,
              show_default=True, metavar="SECONDS",
              help="How long a peer's last answer stands while its node refuses "
                   "connections (its supervisor restarting) and this node's rank is ready; "
                   "0: not at all.")
@click.option("--systemd-grace", type=click.FloatRange(0, 600),
              default=SupervisorConfig.systemd_grace,
              show_default=True, metavar="SECONDS",
              help="How long this node's last read of its units stands while systemd does "
                   "not answer, as long as their main processes run; nothing is restarted "
                   "meanwhile; 0: not at all.")
@VERSION_OPTION
def supervisor_command(specs: tuple[str, ...], **options: Any) -> None:
    """Watch this node's shards through systemd, judge replica health with the peer
    supervisors, restart replicas as a group, and serve the result as JSON and metrics."""
    call("llmgw-supervisor", supervisor.supervise, specs, **options)


def main() -> None:
    run(cli=supervisor_command, prog="llmgw-supervisor")
