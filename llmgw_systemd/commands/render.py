"""`llmgw-render`: a spec -> this node's units in a folder (with --apply, systemd made to
follow them: commands/apply_units.py)."""

from __future__ import annotations

import os
import shutil
import sys

from llmgw_systemd.commands.common import (
    SYSTEM_UNIT_DIR,
    default_user_dir,
    say,
    this_node,
    warn,
)
from llmgw_systemd.errors import LlmgwError, NoShard, UsageError
from llmgw_systemd.spec.files import read_documents
from llmgw_systemd.spec.replicas import build_spec
from llmgw_systemd.units.header import is_generated
from llmgw_systemd.units.install import (
    CREATE,
    KEEP,
    REMOVE,
    UPDATE,
    Survey,
    apply,
    survey,
    unified_diff,
)
from llmgw_systemd.units.plan import Manager, plan_node
from llmgw_systemd.units.render import render_shards

WAIT_FOR_PORT = "llmgw-wait-for-port"


def render(specs: tuple[str, ...], *, node: str | None, output: str | None, dry_run: bool,
           user_manager: bool, allow_empty: bool, apply_: bool, start_new: bool,
           no_wait: bool) -> None:
    """Render replica SPEC files (or folders of *.yaml) into systemd units for one node."""
    if start_new and not apply_:
        raise UsageError("--start", "starts new replicas as part of --apply; add --apply")
    if no_wait and not apply_:
        raise UsageError("--no-wait", "is part of --apply; add --apply")
    node_name = this_node(node)
    if not node_name:
        raise UsageError("--node", "this machine has no host name; pass --node NAME")
    directory = output or (default_user_dir() if user_manager else SYSTEM_UNIT_DIR)
    spec = build_spec(read_documents(specs))
    manager = Manager(user=user_manager, wait_for_port=find_helper())
    try:
        plans = plan_node(spec, node_name, manager, allow_empty=allow_empty)
    except NoShard as exc:
        raise UsageError("--node", f"{exc}; pass --node NAME, or --allow-empty to remove "
                         "this node's units") from None
    rendered = render_shards(plans)
    for plan in plans:
        for note in plan.notes:
            warn(f"note: {note}")
    if apply_:
        # Imported by --apply alone: what it needs (systemctl's processes, the local
        # supervisor's HTTP) costs a plain render's start 4-20 ms (bench/render.py).
        from llmgw_systemd.commands import apply_units

        apply_units.check_target(directory, user_manager)
        apply_units.render_and_apply(directory, rendered, plans, user_manager,
                                     dry_run=dry_run, start_new=start_new,
                                     generator_too=output is None,
                                     replicas={r.name: r for r in spec.replicas},
                                     wait=not no_wait)
        return
    result = survey(directory, rendered)
    notes = (*result.notes, *(generator_notes(rendered, user_manager)
                              if output is None else ()))
    for note in notes:
        warn(f"note: {note}")
    if dry_run:
        say(unified_diff(result.changes, directory), end="")
        say(_summary(result, directory, would=True))
        return
    apply(directory, result.changes)
    verbs = {CREATE: "created", UPDATE: "updated", REMOVE: "removed"}
    lines = [f"{verbs[c.action]} {os.path.join(directory, c.name)}"
             for c in result.changes if c.action != KEEP]
    say("\n".join([*lines, _summary(result, directory, would=False)]))
    if result.dirty:
        flag = " --user" if user_manager else ""
        say(f"next: systemctl{flag} daemon-reload, then restart what changed "
            f"(or run again with --apply)")


def find_helper() -> str:
    """llmgw-wait-for-port beside this very llmgw-render (same install), else on PATH."""
    beside = os.path.join(os.path.dirname(os.path.abspath(sys.argv[0])), WAIT_FOR_PORT)
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which(WAIT_FOR_PORT)
    if found:
        return os.path.abspath(found)
    raise LlmgwError(f"cannot find {WAIT_FOR_PORT} beside {sys.argv[0]} or on PATH; "
                     "is llmgw-systemd installed?")


def generator_notes(rendered: dict[str, str], user_manager: bool) -> list[str]:
    """Replicas the generator also makes units for: ours take precedence (systemd's
    search order), and the generator skips them from the next daemon-reload on."""
    if user_manager:
        runtime = os.environ.get("XDG_RUNTIME_DIR", "")
        if not runtime.startswith("/"):
            return []
        folder = os.path.join(runtime, "systemd", "generator")
    else:
        folder = "/run/systemd/generator"
    notes = []
    for name in sorted(n for n in rendered if n.endswith(".target")):
        try:
            with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                head = f.read(4096)
        except OSError:
            continue
        if is_generated(head):
            notes.append(f"{name} is also made by llmgw-systemd-generator from its spec "
                         f"folder; the units written here take precedence, and the generator "
                         "skips this replica from the next daemon-reload on. Keep each "
                         "replica in one place (docs/generator.md).")
    return notes


def _summary(result: Survey, directory: str, *, would: bool) -> str:
    if not result.dirty:
        return f"nothing to do: {result.count(KEEP)} units in {directory} are up to date"
    prefix = "would have: " if would else ""
    return (f"{prefix}{result.count(CREATE)} created, {result.count(UPDATE)} updated, "
            f"{result.count(REMOVE)} removed, {result.count(KEEP)} unchanged in {directory}")


