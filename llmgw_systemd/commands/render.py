"""`llmgw-render`: a spec -> this node's units in a folder; with --apply, systemd made to
follow them (rollout.decide says what to restart, in which order, waiting for what)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from llmgw_systemd import __version__
from llmgw_systemd.apply.rollout import (
    SystemctlShow,
    Versions,
    behind_ranks,
    decide,
    group_files,
    not_back_yet,
)
from llmgw_systemd.apply.systemctl import running_digest, systemctl, unit_path, unit_states
from llmgw_systemd.commands.common import (
    SYSTEM_UNIT_DIR,
    default_user_dir,
    say,
    this_node,
    warn,
)
from llmgw_systemd.errors import LlmgwError, NoShard, NotBackError, PeerError, UsageError
from llmgw_systemd.spec.endpoint import SUPERVISOR_LOCAL
from llmgw_systemd.spec.files import read_documents
from llmgw_systemd.spec.model import Replica
from llmgw_systemd.spec.replicas import build_spec
from llmgw_systemd.units.header import is_generated
from llmgw_systemd.units.install import (
    CREATE,
    KEEP,
    REMOVE,
    UPDATE,
    Survey,
    apply,
    apply_locked,
    locked,
    survey,
    unified_diff,
)
from llmgw_systemd.units.plan import Manager, ShardPlan, plan_node, ready_within
from llmgw_systemd.units.render import render_shards

if TYPE_CHECKING:
    from llmgw_systemd.gather.wire import ReplicaAnswer

WAIT_FOR_PORT = "llmgw-wait-for-port"
SUPERVISOR_ASK_TIMEOUT = 3.0  # seconds for this node's supervisor to answer an apply
WAIT_POLL = 1.0  # seconds between looks while an apply waits for a replica


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
        _check_apply_target(directory, user_manager)
        _render_and_apply(directory, rendered, plans, user_manager, dry_run=dry_run,
                          start_new=start_new, generator_too=output is None,
                          replicas={r.name: r for r in spec.replicas}, wait=not no_wait)
        return
    result = survey(directory, rendered)
    notes = (*result.notes, *(_generator_notes(rendered, user_manager)
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


def _check_apply_target(directory: str, user_manager: bool) -> None:
    """--apply writes where the manager reads units, or it would restart the old ones."""
    searched = unit_path(user_manager)
    if os.path.realpath(directory) not in {os.path.realpath(p) for p in searched}:
        raise UsageError("--output", f"--apply needs a folder the "
                         f"{'user' if user_manager else 'system'} manager reads units from; "
                         f"'{directory}' is not one of {', '.join(searched)}")


def _render_and_apply(directory: str, rendered: dict[str, str], plans: tuple[ShardPlan, ...],
                      user_manager: bool, *, dry_run: bool, start_new: bool,
                      generator_too: bool, replicas: dict[str, Replica], wait: bool) -> None:
    """Write and make systemd follow, as rollout.decide says, under the directory's
    lock so two applies never interleave. Stops at the first failing step."""
    with locked(directory):
        result = survey(directory, rendered)
        for note in (*result.notes, *(_generator_notes(rendered, user_manager)
                                      if generator_too else ())):
            warn(f"note: {note}")
        groups = group_files([(c.name, c.action, c.old) for c in result.changes], plans)
        states = unit_states(user_manager, [u for g in groups for u in g.existing])
        versions = _versions(plans, replicas, states)
        rollout = decide(groups, states, files_dirty=result.dirty, start_new=start_new,
                         versions=versions, wait=wait)
        if dry_run:
            say(unified_diff(result.changes, directory), end="")
            say("\n".join(o.line(dry_run=True) for o in rollout.outcomes))
            return
        done: list[str] = []
        for step in rollout.steps:
            try:
                if step.verb == "write":
                    apply_locked(directory, result.changes)
                elif step.verb == "wait":
                    plan = next(p for p in plans if p.replica == step.replica)
                    _wait_routable(step.replica, step.digest, step.within, user_manager,
                                   (plan.target.name, *(s.name for s in plan.services)),
                                   notice=step.notice)
                else:
                    systemctl(user_manager, step.verb,
                              *(("--", *step.units) if step.units else ()))
            except LlmgwError as exc:
                already = f" (done before it: {'; '.join(done)})" if done else ""
                raise LlmgwError(f"{exc}{already}; nothing after it was done") from None
            done.append(f"wrote {directory}" if step.verb == "write" else
                        f"{step.replica} routable again" if step.verb == "wait" else
                        " ".join((step.verb, *step.units)))
    say("\n".join(o.line(dry_run=False) for o in rollout.outcomes))


def _versions(plans: Sequence[ShardPlan], replicas: dict[str, Replica],
              states: dict[str, SystemctlShow]) -> dict[str, Versions]:
    """Per replica of this node, its spec versions as an apply can know them: what its
    engine here started with (its own environment), and which other ranks' units do not
    carry the new version yet (this node's supervisor's view)."""
    out = {}
    for plan in plans:
        engine = states.get(plan.services[-1].name)
        running = running_digest(engine.main_pid) if engine is not None else ""
        behind: tuple[str, ...] | None = ()
        why = ""
        if plan.ranks > 1:
            try:
                view = _ask_supervisor(plan.replica)
            except PeerError as exc:
                behind, why = None, f"this node's supervisor: {exc}"
            else:
                behind, why = behind_ranks([(r.rank, r.node, r.loaded_digest)
                                            for r in view.ranks if r.rank != plan.rank],
                                           plan.spec_digest)
        replica = replicas[plan.replica]
        out[plan.replica] = Versions(plan.spec_digest, plan.ranks, running, behind, why,
                                     ready_within(replica), replica.drain.delay)
    return out


def _ask_supervisor(replica: str) -> ReplicaAnswer:
    """This node's supervisor's view of `replica`; PeerError when it does not say."""
    # Imported here, by the multi-node --apply alone: http.client costs a plain render
    # 15 ms of its start (bench/render.py).
    from llmgw_systemd.gather.wire import decode, parse_replica, wire_reader
    from llmgw_systemd.helpers.local_api import get_replica

    where = f"this node's supervisor at {SUPERVISOR_LOCAL}"
    body = get_replica(str(SUPERVISOR_LOCAL), replica, SUPERVISOR_ASK_TIMEOUT,
                       f"llmgw-render/{__version__}")
    return parse_replica(wire_reader(where), decode(where, body))


def _wait_routable(name: str, digest: str, within: int, user_manager: bool,
                   units: tuple[str, ...], *, notice: int) -> None:
    """Until the replica is routable again on its supervisor's cluster-wide view, every
    rank running `digest`, and then `notice` seconds more, so that the gateways have it
    back in rotation before anything else goes out; without a supervisor, until its
    units here are active."""


    warn(f"replica {name}: waiting up to {within} s for it to be routable again")
    started = time.monotonic()
    ends = started + within
    last = "no answer yet"
    supervised = True
    while True:
        if supervised:
            try:
                view = _ask_supervisor(name)
            except PeerError as exc:
                supervised = False
                warn(f"note: cannot wait for replica {name} to be routable: this "
                     f"node's supervisor does not say ({exc}); waiting for its units "
                     "to be active instead")
                continue
            last = not_back_yet(view.state, view.reason, view.routable,
                                [(r.rank, r.node, r.running_digest) for r in view.ranks],
                                digest)
            if not last:
                break
        else:
            states = unit_states(user_manager, list(units))
            down = [u for u in units if states.get(u) is None or states[u].active != "active"]
            if not down:
                break
            last = f"not active: {', '.join(down)}"
        if time.monotonic() >= ends:
            raise NotBackError(f"replica {name} was not routable again within {within} s "
                               f"of its restart ({last})")
        time.sleep(WAIT_POLL)
    if not supervised:
        warn(f"replica {name}: its units here are active after "
             f"{time.monotonic() - started:.0f} s")
        return
    warn(f"replica {name}: routable again after {time.monotonic() - started:.0f} s; "
         f"{notice} s more for the gateways to take it back into rotation")
    time.sleep(notice)


def _generator_notes(rendered: dict[str, str], user_manager: bool) -> list[str]:
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


