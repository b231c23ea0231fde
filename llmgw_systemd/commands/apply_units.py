"""`llmgw-render --apply`: systemd made to follow the rendered units (rollout.decide says
what to restart, in which order, waiting for what). commands/render.py imports this for
--apply alone."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from llmgw_systemd import __version__
from llmgw_systemd.apply.rollout import (
    RUNNING_STATES,
    SupervisorSeen,
    SystemctlShow,
    Versions,
    behind_ranks,
    decide,
    group_files,
    not_back_yet,
)
from llmgw_systemd.apply.systemctl import running_digest, systemctl, unit_path, unit_states
from llmgw_systemd.commands.common import say, warn
from llmgw_systemd.commands.render import generator_notes
from llmgw_systemd.errors import LlmgwError, NotBackError, PeerError, UsageError
from llmgw_systemd.gather.wire import ReplicaAnswer, decode, parse_replica, wire_reader
from llmgw_systemd.helpers.local_api import get_replica
from llmgw_systemd.spec.endpoint import SUPERVISOR_LOCAL
from llmgw_systemd.spec.model import Replica
from llmgw_systemd.units.install import apply_locked, locked, survey, unified_diff
from llmgw_systemd.units.plan import SUPERVISOR_UNIT, ShardPlan, ready_within

SUPERVISOR_ASK_TIMEOUT = 3.0  # seconds for this node's supervisor to answer an apply
WAIT_POLL = 1.0  # seconds between looks while an apply waits for a replica


def check_target(directory: str, user_manager: bool) -> None:
    """--apply writes where the manager reads units, or it would restart the old ones."""
    searched = unit_path(user_manager)
    if os.path.realpath(directory) not in {os.path.realpath(p) for p in searched}:
        raise UsageError("--output", f"--apply needs a folder the "
                         f"{'user' if user_manager else 'system'} manager reads units from; "
                         f"'{directory}' is not one of {', '.join(searched)}")


def render_and_apply(directory: str, rendered: dict[str, str], plans: tuple[ShardPlan, ...],
                      user_manager: bool, *, dry_run: bool, start_new: bool,
                      generator_too: bool, replicas: dict[str, Replica], wait: bool) -> None:
    """Write and make systemd follow, as rollout.decide says, under the directory's
    lock so two applies never interleave. Stops at the first failing step."""
    with locked(directory):
        result = survey(directory, rendered)
        for note in (*result.notes, *(generator_notes(rendered, user_manager)
                                      if generator_too else ())):
            warn(f"note: {note}")
        groups = group_files([(c.name, c.action, c.old) for c in result.changes], plans)
        states = unit_states(user_manager, [u for g in groups for u in g.existing])
        seen = _supervisor_seen(plans, user_manager) if wait else SupervisorSeen()
        versions = _versions(plans, replicas, states, seen)
        rollout = decide(groups, states, files_dirty=result.dirty, start_new=start_new,
                         versions=versions, wait=wait, supervisor=seen)
        if rollout.refused:
            raise LlmgwError(rollout.refused)
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
                                   notice=step.notice, unreached=seen.unreached)
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


def _supervisor_seen(plans: Sequence[ShardPlan], user_manager: bool) -> SupervisorSeen:
    """Whether this node's supervisor can be asked (one question, about the first
    replica: an answer, a 404 included, says it listens), and if not, whether its unit
    is active all the same (listening on the node's address only, say)."""
    if not plans:
        return SupervisorSeen()
    try:
        _ask_supervisor(plans[0].replica)
    except PeerError as exc:
        if exc.kind == "http-status":
            return SupervisorSeen()
        state = unit_states(user_manager, [SUPERVISOR_UNIT]).get(SUPERVISOR_UNIT)
        return SupervisorSeen(str(exc), state is not None and state.active in RUNNING_STATES,
                              str(SUPERVISOR_LOCAL))
    return SupervisorSeen()


def _versions(plans: Sequence[ShardPlan], replicas: dict[str, Replica],
              states: dict[str, SystemctlShow], seen: SupervisorSeen
              ) -> dict[str, Versions]:
    """Per replica of this node, its spec versions as an apply can know them: what its
    engine here started with (its own environment), and which other ranks' units do not
    carry the new version yet (this node's supervisor's view)."""
    out = {}
    for plan in plans:
        engine = states.get(plan.services[-1].name)
        running = running_digest(engine.main_pid) if engine is not None else ""
        behind: tuple[str, ...] | None = ()
        why = ""
        if plan.ranks > 1 and seen.unreached:
            behind, why = None, f"this node's supervisor: {seen.unreached}"
        elif plan.ranks > 1:
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
    where = f"this node's supervisor at {SUPERVISOR_LOCAL}"
    body = get_replica(str(SUPERVISOR_LOCAL), replica, SUPERVISOR_ASK_TIMEOUT,
                       f"llmgw-render/{__version__}")
    return parse_replica(wire_reader(where), decode(where, body))


def _wait_routable(name: str, digest: str, within: int, user_manager: bool,
                   units: tuple[str, ...], *, notice: int, unreached: str) -> None:
    """Until the replica is routable again on its supervisor's cluster-wide view, every
    rank running `digest`, and then `notice` seconds more, so that the gateways have it
    back in rotation before anything else goes out; without a supervisor (unreached:
    how asking it failed before the restart), or one that does not watch the replica,
    until its units here are active."""
    warn(f"replica {name}: waiting up to {within} s for it to be routable again")
    supervised = not unreached
    if unreached:
        warn(f"note: cannot wait for replica {name} to be routable: no supervisor on this "
             f"node says ({unreached}); waiting for its units to be active instead")
    started = time.monotonic()
    ends = started + within
    last = "no answer yet"
    while True:
        if supervised:
            try:
                view = _ask_supervisor(name)
            except PeerError as exc:
                if exc.kind == "http-status":
                    supervised = False
                    warn(f"note: cannot wait for replica {name} to be routable: this "
                         f"node's supervisor does not watch it ({exc}); waiting for its "
                         "units to be active instead")
                    continue
                # it answered before the restart: it is restarting, or its node is
                # busy; only its answer counts, within the bound
                last = str(exc)
            else:
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
