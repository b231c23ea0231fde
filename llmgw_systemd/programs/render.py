"""`llmgw-render`'s command line: its options, the work in commands/render.py. What this
imports is what rendering (and --apply) needs and no more: node provisioning and the
generator's slow path run it, on machines without the supervisor's dependencies."""

from __future__ import annotations

from typing import Any

import click

from llmgw_systemd.commands import render
from llmgw_systemd.commands.common import SYSTEM_UNIT_DIR
from llmgw_systemd.programs.options import NODE_OPTION, USER_OPTION, VERSION_OPTION, call, run


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
    call("llmgw-render", render.render, specs, **options)


def main() -> None:
    run(cli=render_command, prog="llmgw-render")
