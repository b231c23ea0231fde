"""Across two nodes (network namespaces, each with its own systemd): start order and the
rendezvous wait (docs/design.md §1, behaviours 1 and 3)."""

from __future__ import annotations

from pathlib import Path

import pytest
from specs import free_port, two_node_replica, write
from systemd_harness import Nodes, wait_until

pytestmark = pytest.mark.integration

TARGET, ENGINE = "llmgw-rep.target", "llmgw-rep-engine.service"


def http_ok(nodes: Nodes, node: str, port: int) -> bool:
    ns = nodes[node].netns
    assert ns is not None
    proc = ns.exec("/usr/bin/python3", "-c", (
        "import urllib.request, sys\n"
        f"r = urllib.request.urlopen('http://{ns.address}:{port}/health', timeout=2)\n"
        "sys.exit(0 if r.status == 200 else 1)"))
    return proc.returncode == 0


def test_worker_started_first_waits_for_the_leader(two_nodes: Nodes, tmp_path: Path) -> None:
    leader, worker = two_nodes["node-a"], two_nodes["node-b"]
    http, head = free_port(), free_port()
    spec = two_node_replica(tmp_path / "spec.yaml", name="rep", leader=two_nodes.address("node-a"),
                            worker=two_nodes.address("node-b"), http=http, head=head,
                            pid_file=tmp_path / "head.pids")
    leader.render(spec, "node-a")
    worker.render(spec, "node-b")

    worker.systemctl("start", TARGET)  # returns at once; the rank waits in the background
    waiting = worker.wait_state(ENGINE, "activating", 20, sub="start-pre")
    wait_until(lambda: "Waiting for 192.0.2.1:" in worker.show(ENGINE, "StatusText")[
        "StatusText"], 10, "the worker to say what it waits for")
    status = worker.show(ENGINE, "StatusText")["StatusText"]
    assert status.startswith(f"Waiting for 192.0.2.1:{head} to accept connections ("), status
    assert waiting["NRestarts"] == "0"
    assert leader.state_of(TARGET)[0] == "inactive"

    leader.systemctl("start", TARGET)  # the leader starts at once: nothing to wait for

    leader.wait_state("llmgw-rep-head.service", "active", 20)
    leader.wait_state(ENGINE, "active", 20)
    worker.wait_state(ENGINE, "active", 30)  # proceeds as soon as the head listens
    assert worker.show(ENGINE, "NRestarts")["NRestarts"] == "0"
    assert worker.show(ENGINE, "StatusText")["StatusText"] == ""
    wait_until(lambda: http_ok(two_nodes, "node-a", http), 20, "the leader to serve HTTP")
    log = (worker.log_dir / f"{ENGINE}.log").read_text()
    assert f"joined 192.0.2.1:{head}" in log


def test_missing_rendezvous_fails_after_its_own_timeout_then_retries(
        two_nodes: Nodes, tmp_path: Path) -> None:
    worker = two_nodes["node-b"]
    head = free_port()
    spec = write(tmp_path / "spec.yaml", f"""\
replicas:
  - name: rep
    engine: command
    serving_rank: null
    rendezvous_timeout: 3
    restart: {{delay: 2, burst: 20, interval: 600}}
    nodes:
      - {{name: node-a, address: 192.0.2.1}}
      - {{name: node-b, address: 192.0.2.2}}
    ranks:
      - commands: [{{argv: [/usr/bin/sleep, infinity]}}]
      - commands:
          - argv: [/usr/bin/python3, -c, "print('must not run')"]
            wait_for: ["192.0.2.1:{head}"]
""")
    worker.render(spec, "node-b")
    assert worker.show(ENGINE, "TimeoutStartUSec")["TimeoutStartUSec"] == "33s"

    worker.systemctl("start", TARGET)

    info = worker.wait_state(ENGINE, "activating", 30, sub="auto-restart")
    # It gave up by its own deadline (exit-code), not by systemd's TimeoutStartSec
    # (which would say 'timeout'), says why, and the command itself never ran.
    assert info["Result"] == "exit-code"
    assert info["StatusText"].startswith(
        f"llmgw-wait-for-port: gave up after 3 s waiting for 192.0.2.1:{head} to accept "
        "connections"), info["StatusText"]
    assert info["MainPID"] == "0"
    wait_until(lambda: int(worker.show(ENGINE, "NRestarts")["NRestarts"]) >= 2, 30,
               "a second try under the restart policy")
    log = worker.log_dir / f"{ENGINE}.log"
    assert not log.exists() or "must not run" not in log.read_text()
