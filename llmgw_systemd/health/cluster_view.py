"""`llmgw-systemd status --cluster`: every rank of this node's replicas in one table, this
node's from systemd, each peer's from that node's own supervisor (pure; the CLI fetches).

A peer's row is that supervisor's judgement of its own rank. What it says is shown only
when the answer came from the node the spec names (over TLS: its certificate names it);
otherwise the rank is `unknown`, with why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from llmgw_systemd.health.evidence import PeerShard
from llmgw_systemd.health.rules import READY, UNKNOWN, State
from llmgw_systemd.health.versions import RankVersion, staged_line
from llmgw_systemd.spec.model import Replica
from llmgw_systemd.spec.names import DIGEST_SHOWN as SHOWN


@dataclass(frozen=True)
class PeerView:
    """What one node's supervisor answered, or why it did not."""

    node: str  # the node it says it is
    shards: tuple[PeerShard, ...] = ()
    authenticated: bool = False  # over TLS, its certificate names the node we dialed
    tls: bool = False
    error: str = ""  # non-empty: no answer


@dataclass(frozen=True)
class Row:
    replica: str
    rank: int
    ranks: int
    node: str
    state: State
    reason: str
    source: str  # "systemd" (this node) or whose supervisor said it
    http: int | None = None  # the HTTP port this rank serves, None when it serves none


def cluster_rows(replicas: Sequence[Replica], node: str,
                 local: Mapping[str, tuple[State, str]], peers: Mapping[str, PeerView],
                 address: Mapping[str, str]) -> list[Row]:
    """local: replica -> (state, reason) of this node's rank; peers: node name -> its
    supervisor's answer; address: node name -> where it was asked."""
    rows = []
    for replica in replicas:
        n = len(replica.nodes)
        http = replica.http
        for rank, member in enumerate(replica.nodes):
            serves = http.port_of(rank) if http is not None else None
            if member.name == node:
                state, reason = local.get(replica.name, (UNKNOWN, "not read"))
                rows.append(Row(replica.name, rank, n, member.name, state, reason, "systemd",
                                serves))
                continue
            state, reason, source = _peer_rank(replica.name, rank, member.name,
                                               peers.get(member.name),
                                               address.get(member.name, member.address))
            rows.append(Row(replica.name, rank, n, member.name, state, reason, source,
                            serves))
    return rows


def staged_lines(replicas: Sequence[Replica], node: str, local: Mapping[str, RankVersion],
                 peers: Mapping[str, PeerView]) -> list[str]:
    """One line per replica that waits for the one restart of a roll: `staged: N of M
    nodes`, and which ranks are staged. local: replica -> this node's rank's versions;
    a peer's versions count only from an answer whose rows count (as _peer_rank)."""
    lines = []
    for replica in replicas:
        versions = []
        for rank, member in enumerate(replica.nodes):
            if member.name == node:
                versions.append(local.get(replica.name, RankVersion(rank, node)))
                continue
            view = peers.get(member.name)
            believed = (view is not None and not view.error and view.node == member.name
                        and (view.authenticated or not view.tls))
            shard = next((s for s in view.shards if s.replica == replica.name
                          and s.rank == rank), None) if believed and view else None
            versions.append(RankVersion(rank, member.name, shard.loaded_digest,
                                        shard.running_digest) if shard is not None
                            else RankVersion(rank, member.name))
        line = staged_line(versions)
        if line:
            lines.append(f"replica {replica.name}: {line} (" + ", ".join(
                f"rank {v.rank} on {v.node} runs {v.running[:SHOWN]}, its units carry "
                f"{v.loaded[:SHOWN]}" for v in versions if v.staged)
                + "; it restarts once when the last of its nodes applies)")
    return lines


def _peer_rank(replica: str, rank: int, node: str, view: PeerView | None, where: str
               ) -> tuple[State, str, str]:
    source = f"supervisor on {node}"
    if view is None:
        return UNKNOWN, "not asked", source
    if view.error:
        return UNKNOWN, f"its supervisor at {where} did not answer: {view.error}", source
    if view.tls and not view.authenticated:
        return UNKNOWN, (f"the supervisor at {where} has no certificate naming {node}; "
                         "its answer is not believed"), source
    if view.node != node:
        return UNKNOWN, (f"the supervisor at {where} says it is node '{view.node}', not "
                         f"'{node}'"), source
    source += " (TLS)" if view.tls else " (plain HTTP)"
    for shard in view.shards:
        if shard.replica == replica and shard.rank == rank:
            return shard.state, shard.reason, source
    return UNKNOWN, f"{node}'s supervisor reports no rank {rank} of this replica", source


def all_ready(rows: Sequence[Row]) -> bool:
    return all(r.state == READY for r in rows)
