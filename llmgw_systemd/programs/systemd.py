"""`llmgw-systemd`'s command line (status, drain, resume): its options, the work in
commands/. Needs the supervisor's dependencies (D-Bus): cli.py's entry point says what
to install when they are missing."""

from __future__ import annotations

from typing import Any

import click

from llmgw_systemd.commands import drain, status
from llmgw_systemd.commands.common import DEFAULT_SPECS, DEFAULT_STATE_DIR, DEFAULT_TLS_DIR
from llmgw_systemd.commands.status import WATCH_INTERVAL
from llmgw_systemd.programs.options import (
    NODE_OPTION,
    USER_OPTION,
    VERSION_OPTION,
    F,
    call,
    run,
    tls_options,
)
from llmgw_systemd.spec.endpoint import SUPERVISOR_LOCAL, SUPERVISOR_PORT


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@VERSION_OPTION
def systemd_group() -> None:
    """Operate llmgw-systemd shards on this node."""


@systemd_group.command("status")
@click.argument("name", required=False)
@click.option("--spec", "specs", multiple=True, metavar="PATH",
              help=f"Spec file or folder (repeatable) [default: {DEFAULT_SPECS[0]}].")
@NODE_OPTION
@USER_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--cluster", is_flag=True,
              help="Every rank of these replicas, the other nodes' as their own supervisors "
                   "report them.")
@click.option("--peer-port", type=click.IntRange(1, 65535), default=SUPERVISOR_PORT,
              show_default=True,
              metavar="PORT", help="With --cluster: the port the supervisors listen on.")
@click.option("--peer-timeout", type=click.FloatRange(0.1, 120), default=3.0,
              show_default=True, metavar="SECONDS",
              help="With --cluster: bound on each supervisor's answer.")
@tls_options("With --cluster: ", f"node.crt, node.key, ca.crt in {DEFAULT_TLS_DIR} when "
             "there")
@click.option("--watch", is_flag=True,
              help="Keep the table on the screen, redrawn in place when it changes, until "
                   "Ctrl-C (exit 0).")
@click.option("--interval", type=click.FloatRange(0.2, 3600), default=WATCH_INTERVAL,
              show_default=True, metavar="SECONDS", help="With --watch: between looks.")
def status_command(name: str | None, **options: Any) -> None:
    """Health of this node's shards, straight from systemd (no supervisor needed); with
    --cluster, of every rank of their replicas.

    Exit 0 when every shard (or rank) shown is ready, 3 when one is not, 2 on bad input,
    1 when systemd cannot be reached."""
    call("llmgw-systemd status", status.status, name, **options)


DRAIN_OPTIONS = (
    click.argument("name", required=False),
    click.option("--node", "all_on_node", is_flag=True,
                 help="Every replica with a shard on this node (before hardware work)."),
    click.option("--spec", "specs", multiple=True, metavar="PATH",
                 help=f"Spec file or folder (repeatable) [default: {DEFAULT_SPECS[0]}]."),
    click.option("--node-name", "node", metavar="NAME",
                 help="This node's name, as the spec's nodes[].name says it [default: this "
                      "machine's host name]."),
    USER_OPTION,
    click.option("--state-dir", metavar="DIR",
                 help="The supervisor's state directory, where drain requests are kept "
                      f"[default: {DEFAULT_STATE_DIR}].")
)


def drain_options(function: F) -> F:
    for option in reversed(DRAIN_OPTIONS):
        function = option(function)
    return function


@systemd_group.command("drain")
@drain_options
@click.option("--reason", default="", metavar="TEXT", help="Why, for the API and the logs.")
@click.option("--wait", is_flag=True,
              help="Return once the local supervisor says the replica is drained (nothing "
                   "in flight on its serving rank).")
@click.option("--timeout", type=click.FloatRange(1, 86400), metavar="SECONDS",
              help="With --wait: give up after this long [default: drain.delay + "
                   "drain.timeout + 30].")
@click.option("--supervisor", default=str(SUPERVISOR_LOCAL), show_default=True,
              metavar="HOST:PORT", help="With --wait: the local supervisor's plain listener.")
def drain_command(name: str | None, **options: Any) -> None:
    """Take replica NAME (or, with --node, every replica with a shard on this node) out of
    rotation on all its nodes, without stopping anything, until `llmgw-systemd resume`.
    The request is kept in the supervisor's state directory: it survives a restart of the
    supervisor and of the node.

    Exit 0 once asked (with --wait: once drained), 2 on bad input, 1 when the request
    cannot be written or (with --wait) the replica was not drained in time."""
    call("llmgw-systemd drain", drain.drain, name, **options)


@systemd_group.command("resume")
@drain_options
def resume_command(name: str | None, **options: Any) -> None:
    """Put replica NAME (or, with --node, what `drain --node` took out) back into rotation:
    withdraw this node's drain request. Exit 0 done, 2 on bad input, 1 when the request
    cannot be removed."""
    call("llmgw-systemd resume", drain.resume, name, **options)


def main() -> None:
    run(cli=systemd_group, prog="llmgw-systemd")
