"""Which version of its replica's spec each rank runs, and what a change waits for (pure;
docs/generator.md, "Rolling a change").

A version is the digest every member unit of a rank carries (units/plan.py,
spec_digest), the same on every node for one spec entry. A rank has two:

- *loaded*: the digest its units carry now, as systemd holds them (the engine unit's
  Environment=): what its next start runs;
- *running*: the digest its engine started with, which its supervisor records at the
  first sight of each start (a daemon-reload changes the first, never the second).

A rank whose two differ is *staged*: its new units are written and reloaded, and it
waits for the replica's one group restart. Ranks running different versions never
serve together: the replica is not ready, and a staged rank whose new version is what
another rank already runs restarts to join it. A rank > 0 that starts on a new version
while rank 0 still runs the old one (the last node to apply was a worker's) waits at its
rendezvous until rank 0 has restarted onto it (`leader_behind`), so that no rank joins a
rank 0 that is about to go: every rank restarts once per change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmgw_systemd.spec.names import DIGEST_SHOWN as SHOWN


@dataclass(frozen=True)
class RankVersion:
    """One rank's versions ("" where not known: a peer of an earlier version, a rank
    not running, a supervisor that never saw the start)."""

    rank: int
    node: str
    loaded: str = ""
    running: str = ""

    @property
    def staged(self) -> bool:
        return bool(self.loaded and self.running and self.loaded != self.running)


def staged_line(versions: Sequence[RankVersion]) -> str:
    """`staged: N of M nodes` while some rank waits for the group restart, else ""."""
    staged = sum(1 for v in versions if v.staged)
    return f"staged: {staged} of {len(versions)} nodes" if staged else ""


def mixed(versions: Sequence[RankVersion]) -> str:
    """Why the ranks cannot serve together ("" when they can): they run different
    versions of the spec."""
    running = {v.running for v in versions if v.running}
    if len(running) < 2:
        return ""
    return "ranks run different versions of the spec: " + ", ".join(
        f"rank {v.rank} on {v.node} {v.running[:SHOWN]}" for v in versions if v.running)


def must_rejoin(versions: Sequence[RankVersion], rank: int) -> str:
    """Why this rank must start again on its new units ("" when it need not): it is
    staged, and another rank already runs the version its units now carry (that rank
    restarted first: the last node to apply, or a staged rank that died and came back)."""
    mine = next((v for v in versions if v.rank == rank), None)
    if mine is None or not mine.staged:
        return ""
    ahead = [v for v in versions if v.rank != rank and v.running == mine.loaded]
    if not ahead:
        return ""
    first = ahead[0]
    return (f"rank {first.rank} on {first.node} runs version {mine.loaded[:SHOWN]}, the one "
            f"this rank's units carry (it runs {mine.running[:SHOWN]}); this rank must start "
            "again to join it")



def leader_behind(versions: Sequence[RankVersion], digest: str) -> str:
    """Why a rank > 0 about to start on `digest` waits before it joins rank 0 ("": it
    need not): rank 0's units carry `digest`, but its engine still runs an older version,
    so rank 0 is about to restart to join this rank (must_rejoin) and would break it."""
    leader = next((v for v in versions if v.rank == 0), None)
    if (leader is None or not digest or not leader.running or leader.running == digest
            or leader.loaded != digest):
        return ""
    return (f"rank 0 on {leader.node} still runs version {leader.running[:SHOWN]}, and its "
            f"units carry {digest[:SHOWN]}: waiting for it to start on it")
