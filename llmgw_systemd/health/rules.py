"""Health rules (pure): unit states and probe results -> shard and replica health.

A shard is stopped, starting (including waiting for its rendezvous), ready, degraded or
failed, always with a reason a person can act on. The serving rank is ready when all
its units are active and its HTTP health endpoint answers; a non-serving rank is ready
when all its units have stayed active for a stability window, and its own /health is
never asked (SGLang's non-zero ranks answer a dummy one). A replica is ready only when
every rank is; a rank nobody could report on (an unreachable peer) is unknown, which
makes the replica degraded, never ready (docs/design.md §5).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from llmgw_systemd.health.unit_state import UnitState

# The health of a shard, a rank or a replica: a closed vocabulary, also on the wire
# (/v1/shards) and in the metrics' labels. `draining` and `drained` are a replica's only
# (health/drain.py): a rank's report says its drain in fields of their own.
State = Literal["stopped", "starting", "ready", "degraded", "failed", "unknown",
                "draining", "drained"]
STOPPED: Final = "stopped"
STARTING: Final = "starting"
READY: Final = "ready"
DEGRADED: Final = "degraded"
FAILED: Final = "failed"
UNKNOWN: Final = "unknown"
DRAINING: Final = "draining"
DRAINED: Final = "drained"
# what a rank can be: the vocabulary of a shard report on the wire
RANK_STATES: tuple[State, ...] = (STOPPED, STARTING, READY, DEGRADED, FAILED, UNKNOWN)
STATES: tuple[State, ...] = (*RANK_STATES, DRAINING, DRAINED)
# Where a gateway should send new requests: a ready replica (busy included) only.
ROUTABLE_STATES: tuple[State, ...] = (READY,)
# A checked spelling -> its State (a lookup, so the type needs no cast).
STATE_BY_NAME: dict[str, State] = {s: s for s in STATES}


# How a probe that timed out begins its detail (gather/probes.py): a generation check
# that timed out may have waited behind real work; one that failed otherwise did not.
NO_ANSWER = "no answer within"


@dataclass(frozen=True)
class Probe:
    """The last HTTP health probe of a serving rank."""

    ok: bool
    detail: str  # "HTTP 200 in 12 ms", "connection refused", "no answer within 2 s"


@dataclass(frozen=True)
class Health:
    """A state and why."""

    state: State
    reason: str


@dataclass(frozen=True)
class RankReport:
    """One rank's health as its own node's supervisor sees it (or UNKNOWN)."""

    rank: int
    node: str
    state: State
    reason: str
    # why this rank's node drains the replica (a planned stop there, an operator's
    # request), or None; and, from the serving rank's node, whether it is drained
    draining: str | None = None
    drained: bool = False


def _seconds(usec: int) -> str:
    return f"{usec / 1e6:.0f} s"


def shard_health(target: UnitState, members: Sequence[UnitState], *, serving: bool,
                 probe: Probe | None, now_usec: int, stability_usec: int,
                 was_ready: bool = False) -> Health:
    """Health of this node's shard of a replica.

    now_usec is systemd's monotonic clock (the one its timestamps use); was_ready says
    the serving rank answered its probe since its units last started, so a probe that
    fails now means degraded rather than still starting."""
    for unit in (target, *members):
        if unit.load_state != "loaded":
            return Health(FAILED, f"{unit.name} is {unit.load_state}: render the spec for "
                          "this node and run systemctl daemon-reload")
    for unit in members:
        if unit.active_state == "failed":
            why = f"{unit.name} failed ({unit.result or unit.sub_state})"
            if unit.result == "start-limit-hit":
                why += ": restart budget used up; systemctl reset-failed to try again"
            elif unit.status_text:
                why += f": {unit.status_text}"
            return Health(FAILED, why)
    for unit in members:
        # a death is a failure from its first moment, not once its leftovers are gone or
        # it started again: the other nodes restart their shards on it at once (issue 42)
        if unit.died:
            how = unit.result if unit.result not in ("", "success") else "exited"
            then = (f"restarting (restart {unit.n_restarts + 1})"
                    if unit.sub_state == "auto-restart" else "stopping what is left")
            return Health(FAILED, f"{unit.name} died ({how}); {then}")
    if all(u.is_down for u in members):
        if target.is_down:
            return Health(STOPPED, "stopped")
        return Health(DEGRADED, "every unit is down while the target is active")
    for unit in members:
        if unit.active_state == "activating":
            return Health(STARTING, unit.status_text or f"{unit.name} is starting "
                          f"({unit.sub_state})")
    for unit in members:
        if unit.active_state == "deactivating":
            return Health(DEGRADED, f"{unit.name} is stopping")
    down = [u.name for u in members if not u.is_active]
    if down:
        return Health(DEGRADED, f"{', '.join(down)} down")
    up_since = max(u.active_enter_usec for u in members)
    if serving:
        if probe is None:
            return Health(STARTING, "waiting for the first health probe")
        if probe.ok:
            return Health(READY, f"health endpoint answered: {probe.detail}")
        if was_ready:
            return Health(DEGRADED, f"health endpoint stopped answering: {probe.detail}")
        return Health(STARTING, f"health endpoint not answering yet: {probe.detail}")
    up_for = max(0, now_usec - up_since)
    if up_for >= stability_usec:
        return Health(READY, f"all units up for {_seconds(up_for)}")
    return Health(STARTING, f"up for {_seconds(up_for)} of the {_seconds(stability_usec)} "
                  "stability window")


def replica_health(ranks: Sequence[RankReport], n_ranks: int) -> Health:
    """A replica's health from one report per rank (missing ranks count as unknown)."""
    by_rank = {r.rank: r for r in ranks}
    reports = [by_rank.get(k, RankReport(k, "?", UNKNOWN, "no report")) for k in
               range(n_ranks)]

    def which(state: State) -> list[RankReport]:
        return [r for r in reports if r.state == state]

    def describe(rs: list[RankReport]) -> str:
        return "; ".join(f"rank {r.rank} on {r.node}: {r.reason}" for r in rs)

    if which(FAILED):
        return Health(FAILED, describe(which(FAILED)))
    if all(r.state == READY for r in reports):
        return Health(READY, f"all {n_ranks} ranks ready")
    if all(r.state == STOPPED for r in reports):
        return Health(STOPPED, "stopped")
    for state in (UNKNOWN, DEGRADED):
        if which(state):
            return Health(DEGRADED, describe(which(state)))
    if which(STOPPED):
        return Health(DEGRADED, describe(which(STOPPED)))
    return Health(STARTING, describe(which(STARTING)))
