"""A change rolled across the nodes of a replica, one node at a time with
llmgw-render --apply, while the supervisors watch: it ends ready, every rank running
the new units (docs/generator.md, "Rolling a change across nodes")."""

from __future__ import annotations

from pathlib import Path

import pytest
from specs import free_port, two_node_replica
from supervisors import SupervisorProcess, stop_and_show
from systemd_harness import Nodes, UserManager, wait_until

pytestmark = pytest.mark.integration

API_PORT = 9470
ENGINE = "llmgw-rep-engine.service"


def engine_environ(manager: UserManager) -> dict[str, str]:
    """The environment of the engine process itself, not just of its unit file."""
    pid = int(manager.wait_state(ENGINE, "active", 60)["MainPID"])
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def test_a_change_applied_node_by_node_ends_ready_on_the_new_units(two_nodes: Nodes,
                                                                   tmp_path: Path) -> None:
    spec = two_node_replica(tmp_path / "spec.yaml", name="rep",
                            leader=two_nodes.address("node-a"),
                            worker=two_nodes.address("node-b"), http=free_port(),
                            head=free_port(), pid_file=tmp_path / "head.pids", delay=2,
                            burst=20, interval=900)
    base = spec.read_text() + """\
    health: {interval: 1, timeout: 1, stability: 2}
    group_restart: {delay: 1, max_delay: 4, budget: 6, window: 600}
"""
    spec.write_text(base)
    leader, worker = two_nodes["node-a"], two_nodes["node-b"]
    # first the worker, which waits for the leader's head; each node applies on its own
    assert worker.apply(spec, "node-b", "--start").stdout == "replica rep: started (new)\n"
    assert leader.apply(spec, "node-a", "--start").stdout == "replica rep: started (new)\n"
    sups: list[SupervisorProcess] = []
    try:
        for manager, node in ((leader, "node-a"), (worker, "node-b")):
            assert manager.netns is not None
            sups.append(SupervisorProcess(manager, node, spec,
                                          listen=f"{manager.netns.address}:{API_PORT}"))
        a, b = sups
        a.wait_state("rep", "ready", 90, settled=True)
        old = {node: int(m.show(ENGINE, "MainPID")["MainPID"])
               for node, m in (("node-a", leader), ("node-b", worker))}

        spec.write_text(base + "    env: {ROLLOUT: second}\n")
        for manager, node in ((leader, "node-a"), (worker, "node-b")):
            out = manager.apply(spec, node).stdout
            assert out.startswith("replica rep: restarted (changed: "), out
            assert engine_environ(manager).get("ROLLOUT") == "second"

        ready = a.wait_state("rep", "ready", 120, settled=True)
        assert [r["state"] for r in ready["ranks"]] == ["ready", "ready"]
        b.wait_state("rep", "ready", 60, settled=True)
        for manager, node in ((leader, "node-a"), (worker, "node-b")):
            assert engine_environ(manager).get("ROLLOUT") == "second", node
            assert int(manager.show(ENGINE, "MainPID")["MainPID"]) != old[node]
            assert manager.show(ENGINE, "NeedDaemonReload")["NeedDaemonReload"] == "no"
        wait_until(lambda: a.replica("rep")["state"] == "ready", 10, "ready to hold")
    finally:
        stop_and_show(sups)
