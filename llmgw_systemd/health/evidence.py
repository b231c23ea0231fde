"""What the supervisor gathered about a replica, as plain data (pure; no I/O, no clock).

Every piece of evidence says where it came from and which shard generation it was taken
for, and carries the time it was taken, so the rules in `judge` can refuse what is
stale or belongs to an earlier start (docs/supervisor.md, "Evidence"). A generation is
the engine unit's systemd InvocationID: it changes on every start of the shard, and is ""
while the engine has never been started.

Times are seconds on CLOCK_MONOTONIC, the clock systemd stamps units with.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmgw_systemd.health.rules import State
from llmgw_systemd.health.unit_state import UnitState


@dataclass(frozen=True)
class LocalEvidence:
    """This node's shard as one bulk read of systemd saw it (target first)."""

    target: UnitState
    members: tuple[UnitState, ...]  # sidecars, then the engine
    read_at: float
    # the spec version the engine started with (its supervisor's record of this start,
    # versions.py); "" when not running or never seen starting
    running_digest: str = ""

    @property
    def generation(self) -> str:
        return self.members[-1].invocation_id if self.members else ""

    @property
    def loaded_digest(self) -> str:
        """The spec version the engine's unit carries now (its next start runs it)."""
        return self.members[-1].spec_digest if self.members else ""

    @property
    def engine_since(self) -> float | None:
        """Since when the engine (the last member) is active, in monotonic seconds; None
        while it is not."""
        if not self.members or self.members[-1].active_state != "active":
            return None
        return self.members[-1].active_enter_usec / 1e6


@dataclass(frozen=True)
class ProbeEvidence:
    """One HTTP health probe of this node's serving rank."""

    ok: bool
    detail: str  # "HTTP 200 in 4 ms", "connection refused", "no answer within 2 s"
    generation: str  # the shard generation when the probe started
    taken_at: float  # when it started: a result is never newer than its request


@dataclass(frozen=True)
class PeerShard:
    """One shard as a peer supervisor reported it."""

    replica: str
    rank: int
    node: str
    state: State
    reason: str
    generation: str  # opaque: a systemd InvocationID in hex, or "" when none
    serving: bool = False  # whether that rank serves HTTP
    # seconds its engine had run in this generation when the peer answered (None: not
    # running, or a peer too old to say): when a leader started, on this node's clock
    up_for: int | None = None
    draining: str | None = None  # why that node drains the replica (health/drain.py)
    drained: bool = False  # the serving rank's node: nothing in flight any more
    # its spec versions (versions.py): what its units carry, what its engine started with
    loaded_digest: str = ""
    running_digest: str = ""


@dataclass(frozen=True)
class PeerEvidence:
    """The last thing heard from the supervisor of one node: its reports, or why not.

    `source` is the node we dialed (by its spec address); `authenticated` says TLS proved
    the answer came from that node (its certificate, signed by the cluster CA, names it)."""

    source: str
    received_at: float
    authenticated: bool
    shards: tuple[PeerShard, ...] = ()
    error: str = ""  # non-empty: the fetch failed; shards is then empty
    # the fetch failed, but the node answered (a connection refused): it is up and its
    # supervisor is not listening, as while that supervisor restarts
    refused: bool = False
    # with an error: the last answer that came through (None: none since this
    # supervisor started, nor saved before it); judge.held_over
    last: PeerEvidence | None = None


def carried_over(probe: ProbeEvidence, started_at: float, grace: float
                 ) -> ProbeEvidence | None:
    """A probe the last supervisor saved, as this one starts at `started_at`: taken at most
    `grace` seconds before (a restart, not a supervisor that stayed down), it counts as
    if taken at the start, so a restart slower than the probe's freshness does not turn
    a serving replica down before the first own probe (which starts at once) has
    answered; older, it does not count at all. Its generation still has to match."""
    if not started_at - grace <= probe.taken_at <= started_at:
        return None
    return replace(probe, taken_at=started_at)


def same_news(before: PeerEvidence | None, after: PeerEvidence) -> bool:
    """Whether `after` tells nothing `before` did not: the same source, outcome and
    authentication, the same shards but for how long their engines have run (that grows
    with every answer, while when each started, `received_at - up_for`, stays). Such an
    answer only makes the evidence fresher; the judge needs it at its next turn, not at
    once."""
    if before is None or (before.source, before.authenticated, before.error,
                          before.refused) != \
            (after.source, after.authenticated, after.error, after.refused):
        return False
    if len(before.shards) != len(after.shards):
        return False
    return all(replace(a, up_for=None) == replace(b, up_for=None)
               for a, b in zip(before.shards, after.shards))
