"""What `llmgw-render --apply` does to the running system, decided from the file changes
and the units' state (pure; docs/generator.md, "Applying a change").

Order matters, and is always the same:

1. stop what loses its unit file: every unit of a removed replica, and the members a
   changed replica drops, so no process ever runs without its unit file; a removed
   replica also frees its GPUs before anything new starts;
2. disable removed replicas (their .wants links would dangle);
3. write the files, then daemon-reload;
4. enable replicas whose spec says enable: true;
5. restart the targets of changed replicas that run (PartOf= carries the restart to
   every member), one at a time, each followed by a wait until the replica is routable
   again on its supervisor's view; then start new ones that are enabled or asked for
   (--start).

An unchanged replica is left alone, unless systemd still holds an older version of its
units (NeedDaemonReload), or its engine runs an older version than its units carry
(staged): then it counts as changed.

A replica that spans nodes restarts once per change, as a group, when the last of its
nodes applies (docs/generator.md, "Rolling a change"): until then an apply *stages* it
(files written and reloaded, nothing restarted). Which node is last comes from the
versions the other ranks' units carry, as this node's supervisor reports them; with no
supervisor to ask, an apply restarts at once, as before.

An apply that would restart a replica and wait for it, but cannot reach a supervisor
that is there (its unit is active on this node, or the replica spans nodes, which needs
one), does nothing at all (`Rollout.refused`): waiting on the units' state alone restarted
the next node's replicas while this one was still out of rotation (issue 37). A
supervisor that answers that it does not watch the replica (HTTP 404) is no such case.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from llmgw_systemd.spec.names import DIGEST_SHOWN as SHOWN
from llmgw_systemd.units.header import replica_of
from llmgw_systemd.units.plan import ShardPlan

# What a step does: a systemctl verb, or the writing of the files.
Verb = Literal["stop", "reset-failed", "disable", "write", "daemon-reload", "enable",
               "restart", "wait", "start"]
# A replica runs when its target or one of its members is in one of these states.
RUNNING_STATES = frozenset({"active", "activating", "reloading"})
# Members still up (even on their way down) when their file is about to go.
UP_STATES = RUNNING_STATES | {"deactivating"}
ENABLED_STATES = frozenset({"enabled", "enabled-runtime"})
CHANGED_NAMES_SHOWN = 3


@dataclass(frozen=True)
class ReplicaFiles:
    """One replica's unit files on this node: what writing them changes."""

    name: str
    target: str
    created: tuple[str, ...] = ()
    updated: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    enable: bool = False  # the spec's enable: (a removed replica has none)

    @property
    def units(self) -> tuple[str, ...]:
        return (*self.created, *self.updated, *self.removed, *self.kept)

    @property
    def existing(self) -> tuple[str, ...]:
        """The units systemd may know already (their files are on disk now)."""
        return (*self.updated, *self.removed, *self.kept)

    @property
    def is_new(self) -> bool:
        return not self.existing

    @property
    def is_removed(self) -> bool:
        return not (self.created or self.updated or self.kept)

    @property
    def changed(self) -> tuple[str, ...]:
        return (*self.created, *self.updated, *self.removed)


@dataclass(frozen=True)
class SystemctlShow:
    """What systemd says of one unit (systemctl show)."""

    active: str = "inactive"  # ActiveState
    masked: bool = False  # LoadState=masked: the admin's veto
    need_reload: bool = False  # NeedDaemonReload: its file changed since systemd read it
    file_state: str = ""  # UnitFileState: enabled, disabled, ... ("" when not found)
    main_pid: int = 0


@dataclass(frozen=True)
class Versions:
    """What an apply knows of one replica's spec versions (health/versions.py)."""

    digest: str  # what its units on this node carry once written
    ranks: int = 1
    running: str = ""  # what this node's engine started with ("": not running, not known)
    # the other ranks whose units do not carry `digest` yet ("rank 1 on node-b"); None
    # when not known (no supervisor answered: unknown_why says why)
    behind: tuple[str, ...] | None = ()
    unknown_why: str = ""
    ready_within: int = 0  # seconds to wait for it to be routable after a restart
    # seconds it is left routable before the apply goes on: the gateways take it back
    # into rotation (its drain delay: how long they take to notice a change either way)
    notice: int = 0


@dataclass(frozen=True)
class Step:
    """One systemctl call (or the writing of the files, or a wait)."""

    verb: Verb
    units: tuple[str, ...] = ()
    # a wait: for this replica to be routable again, every rank on this digest
    replica: str = ""
    digest: str = ""
    within: int = 0
    notice: int = 0


@dataclass(frozen=True)
class Outcome:
    """One replica's line: what was done to it (done) or would be (planned)."""

    replica: str
    done: str
    planned: str
    detail: str = ""

    def line(self, *, dry_run: bool) -> str:
        verb = self.planned if dry_run else self.done
        return f"replica {self.replica}: {verb}{f' ({self.detail})' if self.detail else ''}"


@dataclass(frozen=True)
class Rollout:
    steps: tuple[Step, ...]
    outcomes: tuple[Outcome, ...]
    refused: str = ""  # why nothing may be done at all ("": go on)


@dataclass(frozen=True)
class SupervisorSeen:
    """This node's supervisor as an apply found it."""

    unreached: str = ""  # how asking it failed (no connection, no answer); "": it answered
    running: bool = False  # its unit is active on this node's manager
    address: str = ""  # where it was asked (HOST:PORT)


NOTHING = ("nothing to do", "nothing to do")


def group_files(files: Sequence[tuple[str, str, str | None]], plans: Sequence[ShardPlan]
                ) -> list[ReplicaFiles]:
    """Per replica, its files' fates. files: (unit file name, action, old text) from the
    survey, action one of create, update, remove, keep. A file about to be removed
    belongs to the replica its header names; one whose header is unreadable counts as a
    replica of its own name, so it is still stopped before it goes."""
    owner = {name: plan.replica for plan in plans
             for name in (plan.target.name, plan.restart.name, plan.relaunch.name,
                          *(u.name for u in plan.services))}
    targets = {plan.replica: (plan.target.name, plan.enable) for plan in plans}
    by_replica: dict[str, dict[str, list[str]]] = {}
    for name, action, old in files:
        replica = owner.get(name) or (replica_of(old) if old is not None else None) or name
        by_replica.setdefault(replica, {}).setdefault(action, []).append(name)
    out = []
    for replica, actions in sorted(by_replica.items()):
        fates = {a: tuple(sorted(actions.get(a, ()))) for a in ("create", "update", "remove",
                                                                 "keep")}
        names = sorted(n for group in fates.values() for n in group)
        target, enable = targets.get(replica, (f"llmgw-{replica}.target", False))
        if target not in names:  # a file whose header is unreadable: it stands alone
            target = names[0]
        out.append(ReplicaFiles(name=replica, target=target, enable=enable,
                                created=fates["create"], updated=fates["update"],
                                removed=fates["remove"], kept=fates["keep"]))
    return out


def decide(replicas: Sequence[ReplicaFiles], states: Mapping[str, SystemctlShow], *,
           files_dirty: bool, start_new: bool,
           versions: Mapping[str, Versions] | None = None, wait: bool = True,
           supervisor: SupervisorSeen = SupervisorSeen()) -> Rollout:
    """The steps and per-replica lines for one apply. states: every existing unit's
    state (a unit missing from it counts as inactive and unknown to systemd); versions:
    per replica, what is known of its spec versions; wait=False (--no-wait) is the
    behaviour before staging: every changed replica restarts at once, nothing waited
    for; supervisor: whether this node's supervisor could be asked."""
    known = versions or {}
    blind: list[str] = []  # replicas whose wait could not ask a supervisor that is there
    def state(unit: str) -> SystemctlShow:
        return states.get(unit, SystemctlShow())

    stops: list[str] = []
    resets: list[str] = []
    disables: list[str] = []
    enables: list[str] = []
    restarts: list[Step] = []
    starts: list[str] = []
    outcomes: list[Outcome] = []
    stale_any = False
    for replica in replicas:
        running = (state(replica.target).active in RUNNING_STATES
                   or any(state(u).active in RUNNING_STATES for u in replica.existing
                          if u != replica.target))
        stale = any(state(u).need_reload for u in replica.existing)
        stale_any = stale_any or stale
        if replica.is_removed:
            up = [u for u in replica.removed if state(u).active in UP_STATES]
            stops.extend(_target_first(replica.target, up))
            # a failed unit would linger as "not-found failed" once its file is gone
            resets.extend(u for u in replica.removed if state(u).active == "failed")
            if state(replica.target).file_state in ENABLED_STATES:
                disables.append(replica.target)
            count = f"{len(replica.removed)} unit files removed"
            outcomes.append(Outcome(replica.name, "stopped", "would stop", count) if up else
                            Outcome(replica.name, "removed", "would remove",
                                    f"was not running; {count}"))
            continue
        stops.extend(u for u in replica.removed if state(u).active in UP_STATES)
        resets.extend(u for u in replica.removed if state(u).active == "failed")
        if state(replica.target).masked:
            outcomes.append(Outcome(replica.name, "left alone", "would leave alone",
                                    f"{replica.target} is masked"))
            continue
        enabling = replica.enable and state(replica.target).file_state not in ENABLED_STATES
        if enabling:
            enables.append(replica.target)
        also = " and enabled" if enabling else ""
        also_planned = " and enable" if enabling else ""
        if replica.is_new:
            if replica.enable or start_new:
                starts.append(replica.target)
                outcomes.append(Outcome(replica.name, f"started{also}",
                                        f"would start{also_planned}", "new"))
            else:
                outcomes.append(Outcome(
                    replica.name, "installed", "would install",
                    f"new; not started, as enable is false: pass --start, or systemctl "
                    f"start {replica.target}"))
            continue
        version = known.get(replica.name)
        behind_here = (version is not None and running and bool(version.running)
                       and version.running != version.digest)
        if not replica.changed and not stale and not behind_here:
            outcomes.append(Outcome(replica.name, *(
                ("enabled", "would enable") if enabling else NOTHING)))
            continue
        detail = _changed_detail(replica) if replica.changed else (
            "its files changed since systemd last read them") if stale else (
            f"its engine runs version {version.running[:SHOWN]}, its units carry "
            f"{version.digest[:SHOWN]}" if version is not None else "")
        if running:
            staged = _staged(version) if wait else ""
            if staged:
                outcomes.append(Outcome(replica.name, f"staged{also}",
                                        f"would stage{also_planned}", f"{detail}; {staged}"))
                continue
            detail += _restart_note(version, wait=wait)
            restarts.append(Step("restart", (replica.target,)))
            if wait and supervisor.unreached and (supervisor.running or (
                    version is not None and version.ranks > 1)):
                blind.append(replica.name)
            if wait and version is not None:
                restarts.append(Step("wait", (replica.target,), replica=replica.name,
                                     digest=version.digest, within=version.ready_within,
                                     notice=version.notice))
                detail += (f"; then waits up to {version.ready_within} s for it to be "
                           "routable again")
            outcomes.append(Outcome(replica.name, f"restarted{also}",
                                    f"would restart{also_planned}", detail))
        else:
            outcomes.append(Outcome(replica.name, f"updated{also}",
                                    f"would update{also_planned}",
                                    f"{detail}; not running, so left stopped"))
    steps = [Step("stop", tuple(stops))] if stops else []
    if resets:
        steps.append(Step("reset-failed", tuple(resets)))
    if disables:
        steps.append(Step("disable", tuple(disables)))
    if files_dirty:
        steps.append(Step("write"))
    if files_dirty or stale_any:
        steps.append(Step("daemon-reload"))
    if enables:
        steps.append(Step("enable", tuple(enables)))
    steps.extend(restarts)
    steps.extend(Step("start", (t,)) for t in starts)
    if blind:
        return Rollout((), tuple(outcomes), refused=_blind(blind, supervisor))
    return Rollout(tuple(steps), tuple(outcomes))


def _blind(replicas: Sequence[str], supervisor: SupervisorSeen) -> str:
    there = ("its unit is active" if supervisor.running
             else "a replica spanning nodes needs it")
    return (f"replica {', '.join(replicas)} would restart, but this node's supervisor, "
            f"which is there ({there}), cannot be asked whether it is routable again: "
            f"{supervisor.unreached}. Nothing was done. Give the supervisor a loopback "
            f"listener (--local={supervisor.address} in LLMGW_SUPERVISOR_ARGS, "
            f"/etc/default/llmgw-supervisor), or pass --no-wait to restart without "
            f"waiting")


def behind_ranks(others: Sequence[tuple[int, str, str]], digest: str
                 ) -> tuple[tuple[str, ...] | None, str]:
    """Which other ranks' units do not carry `digest` yet, from (rank, node, loaded
    digest) as this node's supervisor reports them; None, and why, when some rank's
    version is not known (a supervisor of an earlier release, a node not heard from):
    then nobody can tell which node is last, and the apply restarts at once."""
    unknown = [f"rank {rank} on {node}" for rank, node, loaded in others if not loaded]
    if unknown:
        return None, f"{', '.join(unknown)}: no version reported"
    return tuple(f"rank {rank} on {node}" for rank, node, loaded in others
                 if loaded != digest), ""


def not_back_yet(state: str, reason: str, routable: bool,
                 ranks: Sequence[tuple[int, str, str]], digest: str) -> str:
    """Why a restarted replica does not count as back yet ("": it does), from its
    supervisor's view: routable, and every rank running `digest` (ranks: rank, node,
    running digest). A rank that reports no version (a supervisor of an earlier release)
    is judged by the replica's state alone."""
    behind = [f"rank {rank} on {node}" for rank, node, running in ranks
              if running not in ("", digest)]
    if routable and not behind:
        return ""
    if behind and state == "ready":
        return f"{', '.join(behind)} not yet on version {digest[:SHOWN]}"
    return f"{state}: {reason}"


def _staged(version: Versions | None) -> str:
    """Why a changed, running replica that spans nodes is only staged here ("": it
    restarts now): some other rank's units do not carry the new version yet."""
    if version is None or version.ranks < 2 or not version.behind:
        return ""
    return (f"written and reloaded, nothing restarted: it restarts once, as a group, when "
            f"the last of its nodes applies version {version.digest[:SHOWN]} (not yet: "
            f"{', '.join(version.behind)})")


def _restart_note(version: Versions | None, *, wait: bool) -> str:
    if version is None or version.ranks < 2:
        return ""
    if not wait:
        return "; --no-wait: restarted at once, whatever the other ranks carry"
    if version.behind is None:
        return (f"; the other ranks' versions are not known ({version.unknown_why}): "
                "restarted at once")
    return f"; every rank carries version {version.digest[:SHOWN]}: it restarts as a group"


def _target_first(target: str, units: list[str]) -> list[str]:
    # One stop job for the target carries PartOf= to the members; naming them too
    # stops a member that runs on its own, outside the target.
    return sorted(units, key=lambda u: u != target)


def _changed_detail(replica: ReplicaFiles) -> str:
    names = sorted(replica.changed)
    shown = ", ".join(names[:CHANGED_NAMES_SHOWN])
    more = f" and {len(names) - CHANGED_NAMES_SHOWN} more" if len(
        names) > CHANGED_NAMES_SHOWN else ""
    return f"changed: {shown}{more}"
