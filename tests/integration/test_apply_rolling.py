"""A change rolled across the nodes of a replica, one node at a time with
llmgw-render --apply, while the supervisors watch: the first node's apply stages it (both
supervisors say so, the replica keeps serving), the last node's apply restarts the
replica once, as a group, and waits until it is routable again; every rank ends on the
new units (docs/generator.md, "Rolling a change"). Then --no-wait on one node mixes two
versions, which never count as ready, until the other node applies."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import rolling
from rolling import Starts
from specs import free_port, two_node_replica
from supervisors import LLMGW_SYSTEMD, SupervisorProcess, stop_and_show
from systemd_harness import Nodes, UserManager, wait_until

from llmgw_systemd.spec.names import DIGEST_VAR

pytestmark = pytest.mark.integration

API_PORT = 9470
ENGINE = "llmgw-rep-engine.service"


def engine_environ(manager: UserManager) -> dict[str, str]:
    return rolling.engine_environ(manager, ENGINE)


def test_a_change_applied_node_by_node_stages_then_restarts_once(two_nodes: Nodes,
                                                                  tmp_path: Path) -> None:
    spec = two_node_replica(tmp_path / "spec.yaml", name="rep",
                            leader=two_nodes.address("node-a"),
                            worker=two_nodes.address("node-b"), http=free_port(),
                            head=free_port(), pid_file=tmp_path / "head.pids", delay=2,
                            burst=20, interval=900)
    base = spec.read_text() + """\
    health: {interval: 1, timeout: 1, stability: 2}
    group_restart: {delay: 1, max_delay: 4, budget: 6, window: 600}
    drain: {delay: 1, timeout: 5}
"""
    spec.write_text(base)
    leader, worker = two_nodes["node-a"], two_nodes["node-b"]
    # first the worker, which waits for the leader's head; each node applies on its own
    assert worker.apply(spec, "node-b", "--start").stdout == "replica rep: started (new)\n"
    assert leader.apply(spec, "node-a", "--start").stdout == "replica rep: started (new)\n"
    sups: list[SupervisorProcess] = []
    sampler: Starts | None = None
    try:
        for manager, node in ((leader, "node-a"), (worker, "node-b")):
            assert manager.netns is not None
            sups.append(SupervisorProcess(manager, node, spec,
                                          listen=f"{manager.netns.address}:{API_PORT}"))
        a, b = sups
        a.wait_state("rep", "ready", 90, settled=True)
        b.wait_state("rep", "ready", 60, settled=True)
        old = {node: engine_environ(m)[DIGEST_VAR]
               for node, m in (("node-a", leader), ("node-b", worker))}
        sampler = Starts({"node-a": leader, "node-b": worker}, ENGINE).__enter__()

        # the leader's node applies first: staged, nothing restarted, still serving
        spec.write_text(base + "    env: {ROLLOUT: second}\n")
        staged = leader.apply(spec, "node-a")
        assert staged.stdout.startswith("replica rep: staged (changed: "), staged.stdout
        assert staged.stdout.rstrip().endswith("(not yet: rank 1 on node-b))"), staged.stdout
        new = digest_of_unit(leader)
        assert new != old["node-a"] and f"version {new[:8]} " in staged.stdout
        for sup in (a, b):
            says_staged(sup)
            assert sup.replica("rep")["state"] == "ready"
        assert engine_environ(leader).get("ROLLOUT") is None  # still the old process
        # and the operator's status says so, from systemd alone and across the nodes
        was = old["node-a"][:8]
        local = status(leader, spec, "node-a")
        assert local.returncode == 0, local.stdout + local.stderr
        assert (f"replica rep: staged on this node: its engine runs {was}, its units carry "
                f"{new[:8]}") in local.stdout, local.stdout
        cluster = status(leader, spec, "node-a", "--cluster")
        assert (f"replica rep: staged: 1 of 2 nodes (rank 0 on node-a runs {was}, its units "
                f"carry {new[:8]}; ") in cluster.stdout, cluster.stdout + cluster.stderr

        # a supervisor restarted mid-roll says the same: it is derived, not remembered
        a.stop()
        a.start()
        a.wait_state("rep", "ready", 60)
        says_staged(a)
        # and node-b's has heard from it again (its fetcher backs off while node-a's
        # supervisor is down): an apply asked before that restarts at once, versions unknown
        says_staged(b)

        # the worker's node applies last: one group restart, and the apply waits for it
        last = worker.apply(spec, "node-b")
        assert last.stdout.startswith("replica rep: restarted (changed: "), last.stdout
        assert f"every rank carries version {new[:8]}: it restarts as a group" in last.stdout
        assert "replica rep: routable again after " in last.stderr, last.stderr
        # it returned only once the replica was routable, every rank on the new version
        for sup in (b, a):
            view = sup.replica("rep")
            assert view["routable"], (sup.node, view)
            assert view.get("staged", "") == "", view
        sampler.__exit__()
        seen = sampler.invocations()
        # the worker's rank restarted first, and waited at its rendezvous until rank 0 had
        # restarted onto the new version, rather than join the rank 0 about to go
        log = (worker.log_dir / ENGINE).with_suffix(".service.log").read_text()
        assert (f"rep: rank 0 on node-a still runs version {old['node-a'][:8]}, and its "
                f"units carry {new[:8]}: waiting for it to start on it") in log, log
        for manager, node in ((leader, "node-a"), (worker, "node-b")):
            environ = engine_environ(manager)
            assert (environ.get("ROLLOUT"), environ[DIGEST_VAR]) == ("second", new), node
            assert manager.show(ENGINE, "NeedDaemonReload")["NeedDaemonReload"] == "no"
            # one restart per engine for the whole roll: the old invocation, then the new
            assert len(seen[node]) == 2, (node, seen[node])

        # the roll is done: applying again anywhere does nothing
        for manager, node in ((leader, "node-a"), (worker, "node-b")):
            assert manager.apply(spec, node).stdout == "replica rep: nothing to do\n"

        # --no-wait on the leader alone, as before rolling: rank 0 restarts onto a third
        # version, rank 1 comes back on its old units, and the two never count as ready
        spec.write_text(base + "    env: {ROLLOUT: third}\n")
        hasty = leader.apply(spec, "node-a", "--no-wait").stdout
        assert hasty.startswith("replica rep: restarted (changed: "), hasty
        assert "--no-wait: restarted at once, whatever the other ranks carry" in hasty
        for sup in (a, b):
            sup.wait_state("rep", "degraded", 60,
                           reason="ranks run different versions of the spec")
        # the worker's apply ends it: every rank on the third version, ready
        last = worker.apply(spec, "node-b")
        assert "replica rep: routable again after " in last.stderr, last.stderr
        assert engine_environ(worker).get("ROLLOUT") == "third"
        assert engine_environ(leader).get("ROLLOUT") == "third"
        a.wait_state("rep", "ready", 30)
    finally:
        if sampler is not None:
            sampler.__exit__()
        stop_and_show(sups)


def status(manager: UserManager, spec: Path, node: str, *extra: str
           ) -> subprocess.CompletedProcess[str]:
    """`llmgw-systemd status` as an operator on the node runs it, in its namespace."""
    assert manager.netns is not None
    return subprocess.run(["ip", "netns", "exec", manager.netns.name, LLMGW_SYSTEMD, "status",
                           "--user", "--node", node, "--spec", str(spec), *extra],
                          capture_output=True, text=True, env=manager.env, timeout=60,
                          check=False, stdin=subprocess.DEVNULL)


def says_staged(sup: SupervisorProcess) -> None:
    wait_until(lambda: sup.replica("rep").get("staged") == "staged: 1 of 2 nodes", 30,
               f"{sup.node}'s supervisor to say staged")


def digest_of_unit(manager: UserManager) -> str:
    environment = manager.show(ENGINE, "Environment")["Environment"].split()
    return next(v.split("=", 1)[1] for v in environment if v.startswith(f"{DIGEST_VAR}="))
