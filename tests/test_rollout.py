"""llmgw-render --apply's decisions, as tables: which units it stops, disables, enables,
restarts and starts, in which order, and the line it prints per replica."""

from __future__ import annotations

import pytest

from llmgw_systemd.apply.rollout import (
    ReplicaFiles,
    Step,
    SupervisorSeen,
    SystemctlShow,
    Versions,
    behind_ranks,
    decide,
    group_files,
    not_back_yet,
)
from llmgw_systemd.apply.systemctl import parse_show
from llmgw_systemd.spec.document import parse
from llmgw_systemd.spec.replicas import build_spec
from llmgw_systemd.units.plan import Manager, plan_node

T, E, R = "llmgw-a.target", "llmgw-a-engine.service", "llmgw-a-restart.service"
ALL = (E, R, T)
ON = SystemctlShow(active="active", file_state="enabled")
ACTIVATING = SystemctlShow(active="activating")
OFF = SystemctlShow()


def files(kind: str, enable: bool = False) -> ReplicaFiles:
    return {
        "new": ReplicaFiles("a", T, created=ALL, enable=enable),
        "changed": ReplicaFiles("a", T, updated=(E,), kept=(R, T), enable=enable),
        "same": ReplicaFiles("a", T, kept=ALL, enable=enable),
        "removed": ReplicaFiles("a", T, removed=ALL),
        "drops-sidecar": ReplicaFiles("a", T, updated=(E, T), kept=(R,),
                                      removed=("llmgw-a-head.service",), enable=enable),
    }[kind]


@pytest.mark.parametrize(("kind", "states", "start", "steps", "line"), [
    # a changed replica that runs: written, reloaded, restarted through its target
    ("changed", {T: ON, E: ON}, False,
     [Step("write"), Step("daemon-reload"), Step("restart", (T,))],
     "replica a: restarted (changed: llmgw-a-engine.service)"),
    # activating counts as running (an engine waiting for its rendezvous)
    ("changed", {T: OFF, E: ACTIVATING}, False,
     [Step("write"), Step("daemon-reload"), Step("restart", (T,))],
     "replica a: restarted (changed: llmgw-a-engine.service)"),
    # stopped by its admin: updated, and left stopped
    ("changed", {}, False, [Step("write"), Step("daemon-reload")],
     "replica a: updated (changed: llmgw-a-engine.service; not running, so left stopped)"),
    ("same", {T: ON, E: ON}, False, [], "replica a: nothing to do"),
    # files written earlier without a reload: systemd runs an older version
    ("same", {T: ON, E: SystemctlShow(active="active", need_reload=True)}, False,
     [Step("daemon-reload"), Step("restart", (T,))],
     "replica a: restarted (its files changed since systemd last read them)"),
    ("new", {}, False, [Step("write"), Step("daemon-reload")],
     "replica a: installed (new; not started, as enable is false: pass --start, or "
     "systemctl start llmgw-a.target)"),
    ("new", {}, True, [Step("write"), Step("daemon-reload"), Step("start", (T,))],
     "replica a: started (new)"),
    # stopped before its files go, disabled so no .wants link dangles
    ("removed", {T: ON, E: ON, R: OFF}, False,
     [Step("stop", (T, E)), Step("disable", (T,)), Step("write"), Step("daemon-reload")],
     "replica a: stopped (3 unit files removed)"),
    ("removed", {E: SystemctlShow(active="failed")}, False,
     [Step("reset-failed", (E,)), Step("write"), Step("daemon-reload")],
     "replica a: removed (was not running; 3 unit files removed)"),
    # a restart pending in the restart unit is stopped too, or it would start the target
    ("removed", {R: ACTIVATING}, False, [Step("stop", (R,)), Step("write"),
                                         Step("daemon-reload")],
     "replica a: stopped (3 unit files removed)"),
    # the sidecar it no longer has is stopped before its file goes, then a restart
    ("drops-sidecar", {T: ON, E: ON, "llmgw-a-head.service": ON}, False,
     [Step("stop", ("llmgw-a-head.service",)), Step("write"), Step("daemon-reload"),
      Step("restart", (T,))],
     "replica a: restarted (changed: llmgw-a-engine.service, llmgw-a-head.service, "
     "llmgw-a.target)"),
    ("changed", {T: SystemctlShow(masked=True)}, False, [Step("write"), Step("daemon-reload")],
     "replica a: left alone (llmgw-a.target is masked)"),
])
def test_decide(kind: str, states: dict[str, SystemctlShow], start: bool, steps: list[Step],
                line: str) -> None:
    replica = files(kind)
    rollout = decide([replica], states, files_dirty=bool(replica.changed), start_new=start)
    assert list(rollout.steps) == steps
    assert [o.line(dry_run=False) for o in rollout.outcomes] == [line]


@pytest.mark.parametrize(("kind", "states", "steps", "line"), [
    ("new", {}, [Step("write"), Step("daemon-reload"), Step("enable", (T,)),
                 Step("start", (T,))], "replica a: started and enabled (new)"),
    ("same", {T: SystemctlShow(active="active", file_state="disabled")},
     [Step("enable", (T,))], "replica a: enabled"),
    ("same", {T: ON}, [], "replica a: nothing to do"),
    ("changed", {T: ON}, [Step("write"), Step("daemon-reload"), Step("restart", (T,))],
     "replica a: restarted (changed: llmgw-a-engine.service)"),
])
def test_enable_true_enables_and_starts(kind: str, states: dict[str, SystemctlShow],
                                        steps: list[Step], line: str) -> None:
    replica = files(kind, enable=True)
    rollout = decide([replica], states, files_dirty=bool(replica.changed), start_new=False)
    assert list(rollout.steps) == steps
    assert [o.line(dry_run=False) for o in rollout.outcomes] == [line]


def test_order_across_replicas_stops_first_and_starts_last() -> None:
    gone = ReplicaFiles("old", "llmgw-old.target", removed=("llmgw-old.target",))
    new = ReplicaFiles("new", "llmgw-new.target", created=("llmgw-new.target",), enable=True)
    changed = ReplicaFiles("a", T, updated=(E,), kept=(R, T))
    same = ReplicaFiles("b", "llmgw-b.target", kept=("llmgw-b.target",))
    rollout = decide([changed, gone, new, same],
                     {T: ON, "llmgw-old.target": ON, "llmgw-b.target": ON},
                     files_dirty=True, start_new=False)
    assert [s.verb for s in rollout.steps] == ["stop", "disable", "write", "daemon-reload",
                                               "enable", "restart", "start"]
    assert [o.line(dry_run=True) for o in rollout.outcomes] == [
        "replica a: would restart (changed: llmgw-a-engine.service)",
        "replica old: would stop (1 unit files removed)",
        "replica new: would start and enable (new)",
        "replica b: nothing to do"]


NEW, OLD = "a1" * 8, "b2" * 8  # spec digests: what the units carry now, what ran before
WAIT = Step("wait", (T,), replica="a", digest=NEW, within=90, notice=5)


def two_ranks(behind: tuple[str, ...] | None, running: str = OLD, why: str = "") -> Versions:
    return Versions(NEW, ranks=2, running=running, behind=behind, unknown_why=why,
                    ready_within=90, notice=5)


@pytest.mark.parametrize(("kind", "version", "wait", "steps", "line"), [
    # another rank's units still carry the old version: staged, nothing restarted
    ("changed", two_ranks(("rank 1 on node-b",)), True,
     [Step("write"), Step("daemon-reload")],
     "replica a: staged (changed: llmgw-a-engine.service; written and reloaded, nothing "
     "restarted: it restarts once, as a group, when the last of its nodes applies version "
     "a1a1a1a1 (not yet: rank 1 on node-b))"),
    # the last node to apply: one group restart, then a wait for it to be routable
    ("changed", two_ranks(()), True,
     [Step("write"), Step("daemon-reload"), Step("restart", (T,)), WAIT],
     "replica a: restarted (changed: llmgw-a-engine.service; every rank carries version "
     "a1a1a1a1: it restarts as a group; then waits up to 90 s for it to be routable again)"),
    # unchanged files, but the engine here still runs the old version (it was staged, and
    # the last node's restart did not happen, or this is a re-run): restarted now
    ("same", two_ranks(()), True, [Step("restart", (T,)), WAIT],
     "replica a: restarted (its engine runs version b2b2b2b2, its units carry a1a1a1a1; "
     "every rank carries version a1a1a1a1: it restarts as a group; then waits up to 90 s "
     "for it to be routable again)"),
    # the engine runs what its units carry: a re-run does nothing
    ("same", two_ranks((), running=NEW), True, [], "replica a: nothing to do"),
    # a rank's version not known (an earlier release's supervisor reports none): nobody
    # can tell which node is last; restarts at once, as before staging
    ("changed", two_ranks(None, why="rank 1 on node-b: no version reported"), True,
     [Step("write"), Step("daemon-reload"), Step("restart", (T,)), WAIT],
     "replica a: restarted (changed: llmgw-a-engine.service; the other ranks' versions are "
     "not known (rank 1 on node-b: no version reported): restarted at once; then waits up "
     "to 90 s for it to be routable again)"),
    # --no-wait: the behaviour before staging
    ("changed", two_ranks(("rank 1 on node-b",)), False,
     [Step("write"), Step("daemon-reload"), Step("restart", (T,))],
     "replica a: restarted (changed: llmgw-a-engine.service; --no-wait: restarted at once, "
     "whatever the other ranks carry)"),
    # one node: no other rank to wait for, a wait for it to come back
    ("changed", Versions(NEW, running=OLD, ready_within=90, notice=5), True,
     [Step("write"), Step("daemon-reload"), Step("restart", (T,)), WAIT],
     "replica a: restarted (changed: llmgw-a-engine.service; then waits up to 90 s for it "
     "to be routable again)"),
])
def test_staging_and_waiting(kind: str, version: Versions, wait: bool, steps: list[Step],
                             line: str) -> None:
    replica = files(kind)
    rollout = decide([replica], {T: ON, E: ON}, files_dirty=bool(replica.changed),
                     start_new=False, versions={"a": version}, wait=wait)
    assert list(rollout.steps) == steps
    assert [o.line(dry_run=False) for o in rollout.outcomes] == [line]


@pytest.mark.parametrize(("others", "behind", "why"), [
    ([(1, "node-b", OLD)], ("rank 1 on node-b",), ""),  # not applied there yet: stage
    ([(1, "node-b", NEW)], (), ""),  # this node is the last: restart
    ([(1, "node-b", NEW), (2, "node-c", OLD)], ("rank 2 on node-c",), ""),
    # a supervisor of an earlier release (or a rank not heard from) reports no version:
    # nobody could tell which node is last, so nothing may wait for it
    ([(1, "node-b", ""), (2, "node-c", OLD)], None, "rank 1 on node-b: no version reported"),
    ([], (), ""),
])
def test_which_ranks_are_behind(others: list[tuple[int, str, str]],
                                behind: tuple[str, ...] | None, why: str) -> None:
    assert behind_ranks(others, NEW) == (behind, why)


@pytest.mark.parametrize(("state", "routable", "running", "why"), [
    ("ready", True, [NEW, NEW], ""),  # back: the wait ends
    ("busy", True, [NEW, NEW], ""),
    # routable, but a rank still on the old version: not back (a view before the rejoin)
    ("ready", True, [NEW, OLD], "rank 1 on node-b not yet on version a1a1a1a1"),
    ("starting", False, [NEW, ""], "starting: rank 1 on node-b waits for its rendezvous"),
    ("degraded", False, [NEW, OLD], "degraded: rank 1 on node-b waits for its rendezvous"),
    # a rank that reports no version (an earlier release): the replica's state decides
    ("ready", True, [NEW, ""], ""),
])
def test_when_a_restarted_replica_is_back(state: str, routable: bool, running: list[str],
                                          why: str) -> None:
    ranks = [(k, ("node-a", "node-b")[k], digest) for k, digest in enumerate(running)]
    assert not_back_yet(state, "rank 1 on node-b waits for its rendezvous", routable, ranks,
                        NEW) == why


LOCAL = "127.0.0.1:9470"
UNREACHED = f"the supervisor at {LOCAL}: Connection refused"
ONE_NODE = Versions(NEW, running=OLD, ready_within=90, notice=5)


@pytest.mark.parametrize(("what", "version", "seen", "wait", "refused"), [
    ("its unit is active but it cannot be asked (it listens on the node's address only)",
     ONE_NODE, SupervisorSeen(UNREACHED, True, LOCAL), True, "its unit is active"),
    ("a replica spanning nodes, and no supervisor to ask",
     two_ranks(None, why=f"this node's supervisor: {UNREACHED}"),
     SupervisorSeen(UNREACHED, False, LOCAL), True, "a replica spanning nodes needs it"),
    ("--no-wait: restarted, nothing waited for", ONE_NODE,
     SupervisorSeen(UNREACHED, True, LOCAL), False, ""),
    ("one node and no supervisor at all: the units' state is waited for", ONE_NODE,
     SupervisorSeen(UNREACHED, False, LOCAL), True, ""),
    ("it answered", ONE_NODE, SupervisorSeen(), True, ""),
])
def test_an_apply_that_cannot_ask_a_supervisor_that_is_there_does_nothing(
        what: str, version: Versions, seen: SupervisorSeen, wait: bool, refused: str) -> None:
    rollout = decide([files("changed")], {T: ON, E: ON}, files_dirty=True, start_new=False,
                     versions={"a": version}, wait=wait, supervisor=seen)
    if refused:
        assert rollout.steps == ()
        assert refused in rollout.refused
        assert UNREACHED in rollout.refused and "--no-wait" in rollout.refused
        assert "--local=127.0.0.1:9470" in rollout.refused
    else:
        assert rollout.refused == ""
        assert Step("restart", (T,)) in rollout.steps


def test_an_unreached_supervisor_refuses_nothing_that_only_writes() -> None:
    """A replica that is not running is only updated: nothing to wait for."""
    rollout = decide([files("changed")], {}, files_dirty=True, start_new=False,
                     versions={"a": ONE_NODE}, supervisor=SupervisorSeen(UNREACHED, True, LOCAL))
    assert rollout.refused == ""
    assert list(rollout.steps) == [Step("write"), Step("daemon-reload")]


def test_stopped_replica_is_updated_not_staged() -> None:
    rollout = decide([files("changed")], {}, files_dirty=True, start_new=False,
                     versions={"a": two_ranks(("rank 1 on node-b",), running="")})
    assert list(rollout.steps) == [Step("write"), Step("daemon-reload")]
    assert [o.line(dry_run=True) for o in rollout.outcomes] == [
        "replica a: would update (changed: llmgw-a-engine.service; not running, so left "
        "stopped)"]


def test_changed_replicas_restart_one_at_a_time_each_waited_for() -> None:
    other = ReplicaFiles("b", "llmgw-b.target", updated=("llmgw-b-engine.service",))
    rollout = decide([files("changed"), other], {T: ON, "llmgw-b.target": ON},
                     files_dirty=True, start_new=False,
                     versions={"a": Versions(NEW, ready_within=90),
                               "b": Versions(NEW, ready_within=30)})
    assert [(s.verb, s.units) for s in rollout.steps[2:]] == [
        ("restart", (T,)), ("wait", (T,)), ("restart", ("llmgw-b.target",)),
        ("wait", ("llmgw-b.target",))]


SPEC = """\
replicas:
  - name: a
    engine: command
    port: 9000
    nodes: [{name: n1, address: 127.0.0.1}]
    ranks:
      - commands:
          - {name: head, argv: [/usr/bin/sleep, infinity]}
          - argv: [/usr/bin/sleep, infinity]
"""
OLD_B = ("# llmgw-systemd: generated unit (marker v1)\n# Written by llmgw-render\n# Local\n"
         "# Source: /odd, replica x, node y/spec.yaml, replica b, node n1, rank 0 of 1\n")


def test_group_files_by_plan_and_by_the_header_of_removed_files() -> None:
    plans = plan_node(build_spec([parse(SPEC.encode(), "s.yaml")]), "n1",
                      Manager(user=True, wait_for_port="/w"))
    groups = group_files([
        ("llmgw-a.target", "keep", "..."), ("llmgw-a-head.service", "create", None),
        ("llmgw-a-engine.service", "update", "..."), ("llmgw-a-restart.service", "keep", ""),
        ("llmgw-b.target", "remove", OLD_B), ("llmgw-b-x-engine.service", "remove", OLD_B),
        ("llmgw-c-engine.service", "remove", "no header"),
    ], plans)
    assert groups == [
        ReplicaFiles("a", "llmgw-a.target", created=("llmgw-a-head.service",),
                     updated=("llmgw-a-engine.service",),
                     kept=("llmgw-a-restart.service", "llmgw-a.target")),
        ReplicaFiles("b", "llmgw-b.target",
                     removed=("llmgw-b-x-engine.service", "llmgw-b.target")),
        ReplicaFiles("llmgw-c-engine.service", "llmgw-c-engine.service",
                     removed=("llmgw-c-engine.service",)),
    ]


def test_parse_show() -> None:
    text = ("Id=llmgw-a.target\nLoadState=loaded\nActiveState=active\nNeedDaemonReload=no\n"
            "UnitFileState=enabled\n\nId=llmgw-b.target\nLoadState=masked\n"
            "ActiveState=inactive\nNeedDaemonReload=yes\nUnitFileState=masked\n\n"
            "Id=llmgw-c.target\nLoadState=not-found\nActiveState=inactive\n"
            "NeedDaemonReload=no\nUnitFileState=\n")
    assert parse_show(text) == {
        "llmgw-a.target": SystemctlShow("active", False, False, "enabled"),
        "llmgw-b.target": SystemctlShow("inactive", True, True, "masked"),
        "llmgw-c.target": SystemctlShow("inactive", False, False, ""),
    }
