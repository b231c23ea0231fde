"""What the supervisor tells the journal, as events with fields (pure): each kind has a
stable MESSAGE_ID (systemd's convention: `journalctl MESSAGE_ID=...` finds every one,
and the catalog, packaging/journal/llmgw-systemd.catalog, explains it for `journalctl
-x`), and each event names its replica, this node's rank and node, and the state and
reason where it has them, so `journalctl REPLICA=llama-70b` is a replica's history.

The kinds: a replica's state changed; a group restart of this node's shard (a rank died,
or this node's shard had restarted already); a stall restart (the serving rank stalled);
a drain started, finished or was cut short; a peer's report ignored."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from llmgw_systemd.health.drain import CUT_SHORT, STARTED, DrainEvent
from llmgw_systemd.health.judge import STALL, Verdict

STATE_CHANGED: Final = "state-changed"
GROUP_RESTART: Final = "group-restart"
STALL_RESTART: Final = "stall-restart"
DRAIN_STARTED: Final = "drain-started"
DRAIN_FINISHED: Final = "drain-finished"
DRAIN_CUT_SHORT: Final = "drain-cut-short"
REPORT_IGNORED: Final = "report-ignored"

# kind -> (MESSAGE_ID, syslog priority: 6 info, 5 notice, 4 warning, 3 error). The IDs
# were drawn once at random (systemd-id128 new) and never change: alerts, saved
# searches and the catalog name them.
KINDS: Final[dict[str, tuple[str, int]]] = {
    STATE_CHANGED: ("4f7c2a1e9b3d4c6f8a0e5d2b7c9f1a36", 5),
    GROUP_RESTART: ("b2e6d8f04a1c4e7b9d3f6a8c0e2b4d71", 4),
    STALL_RESTART: ("c83a5f1d7e2b49a6b0d4e8f2a6c1d953", 4),
    DRAIN_STARTED: ("1d9e4b7a2c6f4085a3e1b9d7f5c2e840", 6),
    DRAIN_FINISHED: ("6a0c3e8f1b5d4a27c9e2f4b6d8a0c1e5", 6),
    DRAIN_CUT_SHORT: ("e5b1d7a3c9f24e68b0a4c2e6f8d1b379", 4),
    REPORT_IGNORED: ("9f2d6b0e4a8c4d13a7f1e5c9b3d7a260", 4),
}


@dataclass(frozen=True)
class Event:
    """One journal entry: its kind, its line of text and its fields."""

    kind: str
    message: str
    replica: str
    node: str  # the node the event is about (this node; for an ignored report, the peer)
    rank: int | None = None
    state: str = ""
    reason: str = ""

    @property
    def message_id(self) -> str:
        return KINDS[self.kind][0]

    @property
    def priority(self) -> int:
        return KINDS[self.kind][1]

    def fields(self) -> tuple[tuple[str, str], ...]:
        """The journal fields, MESSAGE first; empty ones left out."""
        out = [("MESSAGE", self.message), ("MESSAGE_ID", self.message_id),
               ("PRIORITY", str(self.priority)), ("LLMGW_EVENT", self.kind),
               ("REPLICA", self.replica), ("NODE", self.node)]
        if self.rank is not None:
            out.append(("RANK", str(self.rank)))
        out += [(k, v) for k, v in (("STATE", self.state), ("REASON", self.reason)) if v]
        return tuple(out)


def replica_events(replica: str, rank: int, node: str, before: Verdict | None,
                   after: Verdict, drains: Sequence[DrainEvent]) -> tuple[Event, ...]:
    """What one judgement of a replica tells the journal: its state when it changed (or
    is first known), a group or stall restart when one was counted, its drains. The
    judgement's notes about a restart are the restart's message."""
    out: list[Event] = []
    health = after.health
    if before is None or before.health.state != health.state:
        out.append(Event(STATE_CHANGED, f"{replica}: {health.state}: {health.reason}",
                         replica, node, rank, health.state, health.reason))
    if restart_notes(before, after):
        stall = any(a.cause == STALL for a in after.actions)
        message = "; ".join(after.notes) or f"{replica}: group restart"
        out.append(Event(STALL_RESTART if stall else GROUP_RESTART, message, replica, node,
                         rank, health.state,
                         after.actions[0].reason if after.actions else health.reason))
    for drain in drains:
        if drain.kind == STARTED:
            out.append(Event(DRAIN_STARTED, f"{replica}: draining: {health.reason}", replica,
                             node, rank, health.state, health.reason))
        else:
            kind = DRAIN_CUT_SHORT if drain.kind == CUT_SHORT else DRAIN_FINISHED
            reason = after.drain.reason if after.drain is not None else ""
            out.append(Event(kind, f"{replica}: drained after {drain.seconds:.1f} s: {reason}",
                             replica, node, rank, health.state, reason))
    return tuple(out)


def restart_notes(before: Verdict | None, after: Verdict) -> bool:
    """Whether this judgement counted a group restart (its notes are then the restart's
    message, said by its event)."""
    return bool(after.actions) or (before is not None and bool(after.memory.restarts)
                                   and after.memory.restarts[-1:] != before.memory.restarts[-1:])


def ignored_event(replica: str, peer: str, line: str) -> Event:
    """A peer's report about `replica` that does not count (health/judge.refused)."""
    return Event(REPORT_IGNORED, f"{replica}: ignored a report: {line}", replica, peer,
                 reason=line)
