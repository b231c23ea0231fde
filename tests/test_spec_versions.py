"""Spec versions across the ranks of a replica, table-driven (health/versions.py): what is
staged, when ranks cannot serve together, which rank restarts to join the others; and
what the judge makes of them."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_judge import NOW, POLICY, PROBE_OK, WORKER, peer, shard, units

from llmgw_systemd.health.evidence import LocalEvidence, PeerEvidence
from llmgw_systemd.health.judge import Memory, judge
from llmgw_systemd.health.rules import DEGRADED, READY, STOPPED, State
from llmgw_systemd.health.versions import (
    RankVersion,
    leader_behind,
    mixed,
    must_rejoin,
    staged_line,
)

OLD, NEW, NEWER = "1" * 16, "2" * 16, "3" * 16


def ranks(*pairs: tuple[str, str]) -> tuple[RankVersion, ...]:
    return tuple(RankVersion(k, f"n{k}", loaded, running)
                 for k, (loaded, running) in enumerate(pairs))


@pytest.mark.parametrize(("what", "versions", "staged", "apart", "rejoin"), [
    ("one version everywhere", ranks((OLD, OLD), (OLD, OLD)), "", False, [False, False]),
    ("the first node applied: staged there", ranks((NEW, OLD), (OLD, OLD)),
     "staged: 1 of 2 nodes", False, [False, False]),
    ("every node applied (or the generator reloaded): waits for one restart",
     ranks((NEW, OLD), (NEW, OLD)), "staged: 2 of 2 nodes", False, [False, False]),
    ("the last node restarted: the other one joins it", ranks((NEW, OLD), (NEW, NEW)),
     "staged: 1 of 2 nodes", True, [True, False]),
    ("a staged rank died and came back new while the other has not applied",
     ranks((NEW, NEW), (OLD, OLD)), "", True, [False, False]),
    ("the spec changed again mid-roll: a rank staged for the older change does not join "
     "a newer one it has not applied", ranks((NEW, OLD), (NEWER, NEWER)),
     "staged: 1 of 2 nodes", True, [False, False]),
    ("a peer of an earlier version says nothing: nothing known, nothing mixed",
     ranks((NEW, OLD), ("", "")), "staged: 1 of 2 nodes", False, [False, False]),
    ("not running: nothing to restart", ranks((NEW, ""), (NEW, NEW)), "", False,
     [False, False]),
])
def test_versions(what: str, versions: tuple[RankVersion, ...], staged: str, apart: bool,
                  rejoin: list[bool]) -> None:
    assert staged_line(versions) == staged, what
    assert bool(mixed(versions)) == apart, what
    assert [bool(must_rejoin(versions, v.rank)) for v in versions] == rejoin, what


@pytest.mark.parametrize(("what", "versions", "digest", "waits"), [
    # the worker's node applied last: its rank starts on NEW while rank 0 runs OLD with
    # NEW loaded; rank 0 is about to restart (must_rejoin): joining it now would break
    ("rank 0 staged for this version", ranks((NEW, OLD), (NEW, NEW)), NEW, True),
    ("rank 0 runs this version", ranks((NEW, NEW), (NEW, "")), NEW, False),
    ("rank 0 not running (restarting): the port wait does the rest",
     ranks((NEW, ""), (NEW, NEW)), NEW, False),
    # rank 0's node has not applied (--no-wait, or a generator reload here first): it will
    # not restart by itself, so waiting would only run out the rendezvous timeout
    ("rank 0 not staged for this version", ranks((OLD, OLD), (NEW, NEW)), NEW, False),
    ("rank 0 staged for a newer version", ranks((NEWER, OLD), (NEW, NEW)), NEW, False),
    ("rank 0 of an earlier release: nothing known", ranks(("", ""), (NEW, NEW)), NEW, False),
    ("units without a digest here", ranks((NEW, OLD), ("", "")), "", False),
])
def test_a_rank_waits_for_rank_0_that_is_about_to_restart(
        what: str, versions: tuple[RankVersion, ...], digest: str, waits: bool) -> None:
    reason = leader_behind(versions, digest)
    assert bool(reason) == waits, what
    if waits:
        assert reason == ("rank 0 on n0 still runs version 11111111, and its units carry "
                          "22222222: waiting for it to start on it")


def versioned(loaded: str, running: str, active: str = "active", sub: str = "running"
              ) -> LocalEvidence:
    local = units(active, sub)
    engine = replace(local.members[-1], spec_digest=loaded)
    return replace(local, members=(engine,), running_digest=running)


def peer_at(rank: int, node: str, loaded: str, running: str, state: State = READY
            ) -> dict[str, PeerEvidence]:
    return {node: peer(node, replace(shard(rank, node, state), loaded_digest=loaded,
                                     running_digest=running))}


def test_staged_everywhere_serves_on_and_says_so() -> None:
    """The units changed and were reloaded on every node (the generator's path): the
    running group is one version, it stays in rotation, and every report says staged."""
    verdict = judge(POLICY, Memory(), local=versioned(NEW, OLD), probe=PROBE_OK,
                    peers=peer_at(1, "b", NEW, OLD), now=NOW)
    assert verdict.health.state == READY and verdict.routable
    assert verdict.staged == "staged: 2 of 2 nodes" and not verdict.actions


def test_a_staged_rank_restarts_to_join_the_rank_that_runs_its_new_version() -> None:
    memory = Memory(failing_since=NOW - 10)  # noticed a while ago: past the group delay
    verdict = judge(WORKER, memory, local=versioned(NEW, OLD), probe=None,
                    peers=peer_at(0, "a", NEW, NEW), now=NOW)
    assert verdict.health.state == DEGRADED and not verdict.routable
    assert "different versions of the spec" in verdict.health.reason or \
        "must start again to join it" in verdict.health.reason, verdict.health
    assert len(verdict.actions) == 1
    assert "must start again to join it" in verdict.actions[0].reason


def test_mixed_versions_are_never_in_rotation_and_the_unapplied_rank_waits() -> None:
    """Rank 0 runs the new version (its staged engine died and came back on its new
    units); rank 1 has not applied: not ready, and rank 1 has nothing to join."""
    verdict = judge(WORKER, Memory(failing_since=NOW - 10), local=versioned(OLD, OLD),
                    probe=None, peers=peer_at(0, "a", NEW, NEW), now=NOW)
    assert verdict.health.state == DEGRADED and not verdict.routable
    assert "ranks run different versions of the spec: rank 0 on a 22222222, rank 1 on b " \
        "11111111" in verdict.health.reason
    assert not verdict.actions


def test_a_stopped_replica_stays_stopped_whatever_its_versions() -> None:
    verdict = judge(POLICY, Memory(), local=versioned(NEW, "", "inactive", "dead"),
                    probe=None, peers=peer_at(1, "b", NEW, "", STOPPED), now=NOW)
    assert verdict.health.state == STOPPED and not verdict.actions
