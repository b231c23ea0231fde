"""What the three programs' command lines share: the options every command has, and how
a command runs as an entry point (its errors become one line and an exit status: 0 done,
2 bad input, 1 anything else). With programs/render.py, programs/systemd.py and
programs/supervisor.py, the only place that imports click."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click

from llmgw_systemd import __version__
from llmgw_systemd.errors import BadInput, LlmgwError


def _print_version(ctx: click.Context, value: bool) -> None:
    # click.version_option would import locale (~1.5 ms) on every run
    if value:
        click.echo(f"{ctx.find_root().info_name or 'llmgw-systemd'} {__version__}")
        ctx.exit()


def _fail(prog: str, exc: LlmgwError) -> NoReturn:
    click.echo(f"{prog}: error: {exc}", err=True)
    sys.exit(2 if isinstance(exc, BadInput) else 1)


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


def call(prog: str, command: Callable[..., int | None], *args: Any, **options: Any) -> None:
    """Run a command of commands/; its LlmgwError becomes one line and an exit status."""
    try:
        code = command(*args, **options)
    except LlmgwError as exc:
        _fail(prog, exc)
    if code:
        sys.exit(code)


def run(cli: click.Command, prog: str) -> None:
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
