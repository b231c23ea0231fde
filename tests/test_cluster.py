"""`status --cluster`'s rows, as a table: this node's rank from systemd, each peer's from
its own supervisor, and `unknown` (with why) whenever that answer cannot be believed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmgw_systemd.health.cluster_view import (
    PeerView,
    Row,
    all_ready,
    cluster_rows,
    staged_lines,
)
from llmgw_systemd.health.evidence import PeerShard
from llmgw_systemd.health.rules import State
from llmgw_systemd.health.versions import RankVersion
from llmgw_systemd.spec.document import parse
from llmgw_systemd.spec.replicas import build_spec

SPEC = """\
replicas:
  - name: rep
    engine: vllm
    model: /m
    nodes: [{name: a, address: 10.0.0.1}, {name: b, address: 10.0.0.2}]
"""
REPLICAS = build_spec([parse(SPEC.encode(), "s.yaml")]).replicas
B_READY = PeerShard("rep", 1, "b", "ready", "up 40 s", "abc")
WHERE = {"b": "10.0.0.2:9470"}


@pytest.mark.parametrize(("view", "state", "reason", "source"), [
    (PeerView("b", (B_READY,), tls=False), "ready", "up 40 s", "supervisor on b (plain HTTP)"),
    (PeerView("b", (B_READY,), authenticated=True, tls=True), "ready", "up 40 s",
     "supervisor on b (TLS)"),
    (PeerView("b", (B_READY,), authenticated=False, tls=True), "unknown",
     "the supervisor at 10.0.0.2:9470 has no certificate naming b; its answer is not "
     "believed", "supervisor on b"),
    (PeerView("b", error="connection refused"), "unknown",
     "its supervisor at 10.0.0.2:9470 did not answer: connection refused", "supervisor on b"),
    (PeerView("c", (B_READY,)), "unknown",
     "the supervisor at 10.0.0.2:9470 says it is node 'c', not 'b'", "supervisor on b"),
    (PeerView("b", (PeerShard("rep", 0, "b", "ready", "", ""),)), "unknown",
     "b's supervisor reports no rank 1 of this replica", "supervisor on b (plain HTTP)"),
    (None, "unknown", "not asked", "supervisor on b"),
])
def test_peer_rows(view: PeerView | None, state: State, reason: str, source: str) -> None:
    rows = cluster_rows(REPLICAS, "a", {"rep": ("ready", "serving")},
                        {"b": view} if view else {}, WHERE)
    # rank 0 serves HTTP on vLLM's port; rank 1 serves none
    assert rows == [Row("rep", 0, 2, "a", "ready", "serving", "systemd", 8000),
                    Row("rep", 1, 2, "b", state, reason, source)]
    assert all_ready(rows) is (state == "ready")


def test_from_the_other_node_the_roles_swap() -> None:
    rows = cluster_rows(REPLICAS, "b", {"rep": ("degraded", "waiting")},
                        {"a": PeerView("a", (PeerShard("rep", 0, "a", "ready", "", ""),))},
                        {"a": "10.0.0.1:9470"})
    assert [(r.node, r.state, r.source) for r in rows] == [
        ("a", "ready", "supervisor on a (plain HTTP)"), ("b", "degraded", "systemd")]


OLD, NEW = "1" * 16, "2" * 16


@pytest.mark.parametrize(("mine", "peer", "lines"), [
    # this node applied first: staged here, the peer still on the old version
    (RankVersion(0, "a", NEW, OLD), PeerView("b", (replace(B_READY, loaded_digest=OLD,
                                                           running_digest=OLD),)),
     ["replica rep: staged: 1 of 2 nodes (rank 0 on a runs 11111111, its units carry "
      "22222222; it restarts once when the last of its nodes applies)"]),
    # both staged (the generator reloaded both nodes)
    (RankVersion(0, "a", NEW, OLD), PeerView("b", (replace(B_READY, loaded_digest=NEW,
                                                           running_digest=OLD),)),
     ["replica rep: staged: 2 of 2 nodes (rank 0 on a runs 11111111, its units carry "
      "22222222, rank 1 on b runs 11111111, its units carry 22222222; it restarts once "
      "when the last of its nodes applies)"]),
    # one version everywhere: nothing to say
    (RankVersion(0, "a", NEW, NEW), PeerView("b", (replace(B_READY, loaded_digest=NEW,
                                                           running_digest=NEW),)), []),
    # a peer whose answer is not believed says nothing of its versions
    (RankVersion(0, "a", NEW, NEW), PeerView("b", (replace(B_READY, loaded_digest=NEW,
                                                           running_digest=OLD),),
                                             authenticated=False, tls=True), []),
])
def test_staged_lines(mine: RankVersion, peer: PeerView, lines: list[str]) -> None:
    assert staged_lines(REPLICAS, "a", {"rep": mine}, {"b": peer}) == lines


def test_every_serving_rank_says_its_port() -> None:
    """A data-parallel replica in hybrid mode serves on every node: each row says so."""
    text = SPEC.replace("    model: /m\n", "    model: /m\n    launch_mode: mp\n"
                        "    data_parallel_size: 2\n    data_parallel_lb: hybrid\n")
    replicas = build_spec([parse(text.encode(), "s.yaml")]).replicas
    rows = cluster_rows(replicas, "a", {"rep": ("ready", "serving")},
                        {"b": PeerView("b", (B_READY,))}, WHERE)
    assert [(r.rank, r.http) for r in rows] == [(0, 8000), (1, 8000)]
