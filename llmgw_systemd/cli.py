"""Command-line entry points: options parsed here, the work done in commands/ (one
module per command). The only module that imports click, and the only place that turns
errors into exit statuses: 0 done, 2 bad input, 1 anything else (status: 3 not ready)."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click

from llmgw_systemd import __version__
from llmgw_systemd.commands import drain, render, status, supervisor
from llmgw_systemd.commands.common import DEFAULT_SPECS, DEFAULT_TLS_DIR, SYSTEM_UNIT_DIR
from llmgw_systemd.commands.status import WATCH_INTERVAL
from llmgw_systemd.errors import BadInput, LlmgwError
from llmgw_systemd.spec.endpoint import SUPERVISOR_LOCAL, SUPERVISOR_PORT
from llmgw_systemd.supervisor.config import SupervisorConfig


def _print_version(ctx: click.Context, value: bool) -> None:
    # click.version_option would import locale (~1.5 ms) on every run
    if value:
        click.echo(f"{ctx.find_root().info_name or 'llmgw-systemd'} {__version__}")
        ctx.exit()


def _fail(prog: str, exc: LlmgwError) -> NoReturn:
    click.echo(f"{prog}: error: {exc}", err=True)
    sys.exit(2 if isinstance(exc, BadInput) else 1)


# Options every command shares, defined once.
VERSION_OPTION = click.option("--version", is_flag=True, is_eager=True, expose_value=False,
                              callback=lambda ctx, _param, value: _print_version(ctx, value),
                              help="Show the version and exit.")
NODE_OPTION = click.option("--node", metavar="NAME",
                           help="This node's name, as the spec's nodes[].name says it "
                                "[default: this machine's host name].")
USER_OPTION = click.option("--user", "user_manager", is_flag=True,
                           help="Work with the per-user manager (systemctl --user) "
                                "instead of the system one, as the tests do.")


F = TypeVar("F", bound=Callable[..., Any])


def tls_options(when: str, defaults: str) -> Callable[[F], F]:
    """--tls-cert, --tls-key, --tls-ca: the same three files wherever a command speaks
    TLS to the supervisors; only where their defaults come from differs."""
    def decorate(function: F) -> F:
        for flag, what in (("--tls-ca", "the cluster CA's certificate (PEM) [default for "
                                        f"all three: {defaults}; none: plain HTTP]"),
                           ("--tls-key", "this node's private key (PEM)"),
                           ("--tls-cert", "this node's certificate (PEM)")):
            text = f"{when}{what}" if when else what[0].upper() + what[1:]
            function = click.option(flag, metavar="FILE", help=f"{text}.")(function)
        return function
    return decorate


def _call(prog: str, command: Callable[..., int | None], *args: Any,
          **options: Any) -> None:
    """Run a command of commands/; its LlmgwError becomes one line and an exit status."""
    try:
        code = command(*args, **options)
    except LlmgwError as exc:
        _fail(prog, exc)
    if code:
        sys.exit(code)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("specs", nargs=-1, required=True, metavar="SPEC...")
@NODE_OPTION
@click.option("--output", metavar="DIR",
              help=f"Unit directory [default: {SYSTEM_UNIT_DIR}, or the user unit directory "
                   "with --user].")
@click.option("--dry-run", is_flag=True,
              help="Print what would be created, changed and removed (and, with --apply, "
                   "restarted, started and stopped); change nothing.")
@USER_OPTION
@click.option("--allow-empty", is_flag=True,
              help="Accept a node that has no shard (its old units are then removed).")
@click.option("--apply", "apply_", is_flag=True,
              help="Then make systemd follow: stop removed replicas before their files go, "
                   "daemon-reload, restart running replicas whose units changed, start new "
                   "ones that are enabled; leave the rest alone.")
@click.option("--start", "start_new", is_flag=True,
              help="With --apply: start new replicas even when their spec does not say "
                   "enable: true.")
@click.option("--no-wait", is_flag=True,
              help="With --apply: the behaviour before rolling: restart every changed "
                   "replica at once, even one whose other nodes have not applied, and wait "
                   "for none to come back.")
@VERSION_OPTION
def render_command(specs: tuple[str, ...], **options: Any) -> None:
    """Render replica SPEC files (or folders of *.yaml) into systemd units for one node."""
    _call("llmgw-render", render.render, specs, **options)


def render_main() -> None:
    _run(cli=render_command, prog="llmgw-render")


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
    _call("llmgw-systemd status", status.status, name, **options)


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
                      "[default: /var/lib/llmgw-supervisor].")
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
    _call("llmgw-systemd drain", drain.drain, name, **options)


@systemd_group.command("resume")
@drain_options
def resume_command(name: str | None, **options: Any) -> None:
    """Put replica NAME (or, with --node, what `drain --node` took out) back into rotation:
    withdraw this node's drain request. Exit 0 done, 2 on bad input, 1 when the request
    cannot be removed."""
    _call("llmgw-systemd resume", drain.resume, name, **options)


def systemd_main() -> None:
    _run(cli=systemd_group, prog="llmgw-systemd")


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
                   "/var/lib/llmgw-supervisor].")
@click.option("--dbus-timeout", type=click.FloatRange(0.1, 120),
              default=SupervisorConfig.dbus_timeout,
              show_default=True, metavar="SECONDS",
              help="Bound on every D-Bus call, connecting included.")
@click.option("--peer-timeout", type=click.FloatRange(0.1, 120),
              default=SupervisorConfig.peer_timeout,
              show_default=True, metavar="SECONDS",
              help="Bound on a peer fetch beyond its long-poll wait (connect, TLS, body).")
@VERSION_OPTION
def supervisor_command(specs: tuple[str, ...], **options: Any) -> None:
    """Watch this node's shards through systemd, judge replica health with the peer
    supervisors, restart replicas as a group, and serve the result as JSON and metrics."""
    _call("llmgw-supervisor", supervisor.supervise, specs, **options)


def supervisor_main() -> None:
    _run(cli=supervisor_command, prog="llmgw-supervisor")


def _run(cli: click.Command, prog: str) -> None:
    """Run a click command as an entry point: usage errors come back to us as one line in
    our own format rather than click's three-line usage block (standalone_mode=False)."""
    # A short-lived process whose garbage is freed by reference counting; the cyclic
    # collector would only re-scan the spec's YAML node tree again and again (a third
    # of the run time for large specs). The daemon turns it back on.
    gc.disable()
    try:
        cli.main(prog_name=prog, standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as exc:
        click.echo(f"{prog}: error: {exc.format_message()} (see {prog} --help)", err=True)
        sys.exit(exc.exit_code)
