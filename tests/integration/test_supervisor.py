"""llmgw-supervisor on two nodes, each talking to its own node's systemd over D-Bus and
to its peer over HTTP: replica health transitions and group restarts."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from installed import BIN_DIR
from specs import free_port, two_node_replica
from systemd_harness import Nodes, UserManager, wait_until

pytestmark = pytest.mark.integration

SUPERVISOR = str(BIN_DIR / "llmgw-supervisor")
API_PORT = 9470
TARGET, ENGINE = "llmgw-rep.target", "llmgw-rep-engine.service"


class Supervisor:
    """llmgw-supervisor for one node: in that node's network namespace, on that node's
    user manager, its API on the node's address. Stopped by PID."""

    def __init__(self, manager: UserManager, node: str, spec: Path) -> None:
        assert manager.netns is not None
        self.manager, self.ns = manager, manager.netns
        self.log = manager.state / "supervisor.log"
        self.process = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.ns.name}", SUPERVISOR, "--user", "--node",
             node, "--listen", f"{self.ns.address}:{API_PORT}", "--state-dir",
             str(manager.state / "supervisor-state"), str(spec)],
            env=manager.env, stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL)
        wait_until(lambda: self.get("/v1/shards")[0] == 200, 20, f"the supervisor on {node}")

    def get(self, path: str) -> tuple[int, object]:
        proc = self.ns.exec("/usr/bin/python3", "-c", (
            "import urllib.request, urllib.error, sys\n"
            "try:\n"
            f"    r = urllib.request.urlopen('http://{self.ns.address}:{API_PORT}{path}', "
            "timeout=3)\n"
            "    print(r.status); print(r.read().decode())\n"
            "except urllib.error.HTTPError as e:\n"
            "    print(e.code); print(e.read().decode())\n"
            "except Exception as e:\n"
            "    print(0); print('null')\n"))
        status, _, body = proc.stdout.partition("\n")
        return int(status or 0), json.loads(body or "null")

    def replica(self) -> dict[str, object]:
        status, data = self.get("/v1/replicas/rep")
        assert status == 200 and isinstance(data, dict), (status, data)
        return data

    def wait_state(self, state: str, timeout: float = 60, restarts: int | None = None,
                   settled: bool = False) -> dict[str, object]:
        def check() -> dict[str, object] | None:
            data = self.replica()
            wanted = restarts is None or data["group_restarts"] == restarts
            wanted = wanted and (not settled or data["settled"] is True)
            return data if data["state"] == state and wanted else None

        return wait_until(check, timeout, f"replica state {state} on {self.ns.name}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


@pytest.fixture
def replica(two_nodes: Nodes, tmp_path: Path, request: pytest.FixtureRequest
            ) -> Iterator[tuple[Supervisor, Supervisor]]:
    """The stand-in replica on both nodes, with a supervisor on each; started."""
    budget = getattr(request, "param", 3)
    http, head = free_port(), free_port()
    spec = two_node_replica(tmp_path / "spec.yaml", name="rep",
                            leader=two_nodes.address("node-a"),
                            worker=two_nodes.address("node-b"), http=http, head=head,
                            pid_file=tmp_path / "head.pids", delay=2, burst=20, interval=900)
    spec.write_text(spec.read_text() + f"""\
    health: {{interval: 1, timeout: 1, stability: 2}}
    group_restart: {{delay: 1, max_delay: 4, budget: {budget}, window: 600}}
""")
    leader, worker = two_nodes["node-a"], two_nodes["node-b"]
    leader.render(spec, "node-a")
    worker.render(spec, "node-b")
    sups = [Supervisor(leader, "node-a", spec), Supervisor(worker, "node-b", spec)]
    try:
        worker.systemctl("start", TARGET)
        leader.systemctl("start", TARGET)
        yield sups[0], sups[1]
    finally:
        for sup in sups:
            sup.stop()
        for sup in sups:
            print(f"===== {sup.ns.name}: supervisor log")
            print(sup.log.read_text(errors="replace")[-4000:])


def main_pid(manager: UserManager) -> int:
    return int(manager.show(ENGINE, "MainPID")["MainPID"])


def test_ready_then_a_dead_worker_restarts_the_group(
        replica: tuple[Supervisor, Supervisor]) -> None:
    a, b = replica
    ready = a.wait_state("ready", settled=True)
    ranks = ready["ranks"]
    assert isinstance(ranks, list) and [r["state"] for r in ranks] == ["ready", "ready"]
    assert b.wait_state("ready", settled=True)["state"] == "ready"
    leader_pid = main_pid(a.manager)

    b.manager.kill_main(ENGINE)  # the worker rank dies

    seen = a.wait_state("degraded", 30)  # never ready while a rank is down
    assert "rank 1" in str(seen["reason"])
    wait_until(lambda: main_pid(a.manager) not in (0, leader_pid), 60,
               "the leader's shard to be restarted by its supervisor")
    a.wait_state("ready", 90, restarts=1)
    assert "restarting this node's shard" in a.log.read_text()
    assert "already restarted" in b.log.read_text()  # the worker restarted itself


@pytest.mark.parametrize("replica", [1], indirect=True)
def test_group_restart_budget_spent_leaves_the_replica_failed(
        replica: tuple[Supervisor, Supervisor]) -> None:
    a, b = replica
    a.wait_state("ready", settled=True)
    b.manager.kill_main(ENGINE)
    a.wait_state("ready", 90, restarts=1, settled=True)  # the one restart the budget allows
    leader_pid = main_pid(a.manager)

    b.manager.kill_main(ENGINE)

    failed = a.wait_state("failed", 30)
    assert "group restart budget spent" in str(failed["reason"])
    time.sleep(5)  # an observation window, not a timing assertion: nothing restarts
    assert main_pid(a.manager) == leader_pid
    again = a.replica()
    assert again["state"] == "failed" and again["group_restarts"] == 1


def test_leader_answering_with_a_worker_gone_is_never_ready(
        replica: tuple[Supervisor, Supervisor]) -> None:
    a, b = replica
    a.wait_state("ready")
    b.manager.systemctl("stop", TARGET)  # the leader still answers HTTP 200

    seen = a.wait_state("degraded", 30)
    assert "rank 1 on node-b: stopped" in str(seen["reason"])
    b.stop()  # and now its supervisor is gone too: unknown, still never ready
    unknown = a.wait_state("degraded", 30)
    wait_until(lambda: "unreachable" in str(a.replica()["reason"]), 30,
               "the peer to count as unreachable")
    states = {str(a.replica()["state"]) for _ in range(5)}
    assert "ready" not in states, (unknown, states)
