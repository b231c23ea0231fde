"""`llmgw-systemd status`: shard health read from a real systemd over D-Bus."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from installed import BIN_DIR
from specs import free_port, one_node_shard
from systemd_harness import Nodes, UserManager, wait_until

pytestmark = pytest.mark.integration

STATUS = str(BIN_DIR / "llmgw-systemd")


def status(manager: UserManager, spec: Path, *extra: str) -> tuple[int, list[dict[str, object]]]:
    proc = subprocess.run([STATUS, "status", "--user", "--node", "node", "--spec", str(spec),
                           "--json", *extra], capture_output=True, text=True,
                          env=manager.env, timeout=60, check=False)
    assert proc.returncode in (0, 3), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def wait_status(manager: UserManager, spec: Path, state: str, reason: str = ""
                ) -> tuple[int, list[dict[str, object]]]:
    def check() -> tuple[int, list[dict[str, object]]] | None:
        code, rows = status(manager, spec)
        ok = rows[0]["state"] == state and reason in str(rows[0]["reason"])
        return (code, rows) if ok else None

    return wait_until(check, 30, f"status to say {state} ({reason})")


def test_status_follows_a_shard_from_stopped_to_ready_to_failed(
        one_node: UserManager, tmp_path: Path) -> None:
    http, head = free_port(), free_port()
    spec = one_node_shard(tmp_path / "spec.yaml", name="shard", http=http, head=head,
                          pid_file=tmp_path / "pids", delay=1, burst=1, interval=60)
    one_node.render(spec, "node")

    code, rows = status(one_node, spec)
    assert code == 3
    assert [(r["replica"], r["rank"], r["state"]) for r in rows] == [("shard", 0, "stopped")]

    one_node.systemctl("start", "llmgw-shard.target")
    code, rows = wait_status(one_node, spec, "ready")
    assert code == 0
    assert str(rows[0]["reason"]).startswith("health endpoint answered: HTTP 200")

    # burst=1: the first death uses the whole budget (failed from the death on, then for
    # good once the start limit is hit)
    one_node.kill_main("llmgw-shard-engine.service")
    code, rows = wait_status(one_node, spec, "failed", "restart budget used up")
    assert code == 3

    table = subprocess.run([STATUS, "status", "--user", "--node", "node", "--spec", str(spec)],
                           capture_output=True, text=True, env=one_node.env, timeout=60,
                           check=False)
    assert table.returncode == 3
    header, row = table.stdout.splitlines()
    assert header.split() == ["REPLICA", "RANK", "NODE", "HTTP", "STATE", "REASON"]
    assert row.split()[:5] == ["shard", "0/1", "node", f":{http}", "failed"]


def test_status_of_an_unknown_replica_is_bad_input(one_node: UserManager, tmp_path: Path
                                                    ) -> None:
    spec = one_node_shard(tmp_path / "spec.yaml", name="shard", http=free_port(),
                          head=free_port(), pid_file=tmp_path / "pids")
    proc = subprocess.run([STATUS, "status", "--user", "--node", "node", "--spec", str(spec),
                           "nope"], capture_output=True, text=True, env=one_node.env,
                          timeout=60, check=False)
    assert proc.returncode == 2
    assert "replica 'nope' has no shard on node 'node'" in proc.stderr


def cluster_status(manager: UserManager, node: str, spec: Path, *extra: str
                   ) -> tuple[int, list[dict[str, object]], str]:
    """status --cluster run on that node (inside its network namespace), as JSON and as
    the table."""
    assert manager.netns is not None
    base = ["ip", "netns", "exec", manager.netns.name, STATUS, "status", "--cluster",
            "--user", "--node", node, "--spec", str(spec), "--peer-timeout", "2", *extra]
    as_json = subprocess.run([*base, "--json"], capture_output=True, text=True,
                             env=manager.env, timeout=60, check=False)
    table = subprocess.run(base, capture_output=True, text=True, env=manager.env,
                           timeout=60, check=False)
    assert as_json.returncode in (0, 3), as_json.stderr
    assert table.returncode == as_json.returncode, table.stderr
    return as_json.returncode, json.loads(as_json.stdout), table.stdout


def test_status_cluster_shows_every_rank_from_any_node_and_a_peer_down(
        two_nodes: Nodes, tmp_path: Path) -> None:
    from specs import two_node_replica
    from supervisors import SupervisorProcess

    spec = two_node_replica(tmp_path / "spec.yaml", name="rep",
                            leader=two_nodes.address("node-a"),
                            worker=two_nodes.address("node-b"), http=free_port(),
                            head=free_port(), pid_file=tmp_path / "head.pids")
    spec.write_text(spec.read_text() + "    health: {interval: 1, timeout: 1, stability: 2}\n")
    leader, worker = two_nodes["node-a"], two_nodes["node-b"]
    leader.render(spec, "node-a")
    worker.render(spec, "node-b")
    worker.systemctl("start", "llmgw-rep.target")
    leader.systemctl("start", "llmgw-rep.target")
    sups = []
    try:
        for manager, node in ((leader, "node-a"), (worker, "node-b")):
            assert manager.netns is not None
            sups.append(SupervisorProcess(manager, node, spec,
                                          listen=f"{manager.netns.address}:9470"))
        sups[0].wait_state("rep", "ready", 60, settled=True)
        for manager, node in ((leader, "node-a"), (worker, "node-b")):

            def all_ready(m: UserManager = manager, n: str = node
                          ) -> tuple[int, list[dict[str, object]], str] | None:
                seen = cluster_status(m, n, spec)
                return seen if seen[0] == 0 else None

            code, rows, table = wait_until(all_ready, 30, f"every rank ready, from {node}")
            assert [(r["rank"], r["node"], r["state"]) for r in rows] == [
                (0, "node-a", "ready"), (1, "node-b", "ready")]
            sources = {r["node"]: r["source"] for r in rows}
            other = "node-b" if node == "node-a" else "node-a"
            assert sources == {node: "systemd", other: f"supervisor on {other} (plain HTTP)"}
            assert table.splitlines()[0].split() == ["REPLICA", "RANK", "NODE", "HTTP",
                                                     "STATE", "SOURCE", "REASON"]

        sups[1].stop()  # node-b's supervisor down: its rank is unknown, and says why
        code, rows, table = cluster_status(leader, "node-a", spec)
        assert code == 3
        assert rows[0]["state"] == "ready"
        assert rows[1]["state"] == "unknown"
        assert str(rows[1]["reason"]).startswith(
            f"its supervisor at {two_nodes.address('node-b')}:9470 did not answer: ")
        assert "unknown" in table.splitlines()[2]
    finally:
        for sup in sups:
            sup.stop()


def test_status_watch_redraws_on_a_change_and_ends_on_ctrl_c(
        one_node: UserManager, tmp_path: Path) -> None:
    """`status --watch` in a real terminal (tmux): the table drawn in place, drawn again
    when the shard stops, and Ctrl-C ends it with status 0."""
    tmux = shutil.which("tmux")
    assert tmux, "tmux not found: scripts/setup --test installs it"
    spec = one_node_shard(tmp_path / "spec.yaml", name="shard", http=free_port(),
                          head=free_port(), pid_file=tmp_path / "pids")
    one_node.render(spec, "node")
    one_node.systemctl("start", "llmgw-shard.target")
    socket = str(tmp_path / "tmux.sock")  # a tmux server of this test's own

    def tmux_run(*args: str) -> str:
        return subprocess.run([tmux, "-S", socket, *args], capture_output=True, text=True,
                              env=one_node.env, timeout=30, check=True).stdout

    def screen() -> str:
        return tmux_run("capture-pane", "-p", "-t", "watch")

    def screen_with(text: str) -> str | None:
        shown = screen()
        return shown if text in shown else None

    command = shlex.join([STATUS, "status", "--user", "--node", "node", "--spec", str(spec),
                          "--watch", "--interval", "0.3"])
    tmux_run("new-session", "-d", "-s", "watch", "-x", "160", "-y", "40",
             f"{command}; echo EXIT=$?; sleep 600")
    try:
        wait_until(lambda: " ready " in screen(), 60, "the watch to show the shard ready")
        one_node.systemctl("stop", "llmgw-shard.target")
        drawn = wait_until(lambda: screen_with(" stopped "), 60,
                           "the watch to redraw the shard stopped")
        # in place: the screen holds one table, the new one
        assert drawn.count("REPLICA") == 1 and " ready " not in drawn, drawn
        tmux_run("send-keys", "-t", "watch", "C-c")
        ended = wait_until(lambda: screen_with("EXIT="), 30, "the watch to end on Ctrl-C")
        assert "EXIT=0" in ended, ended
        assert "Traceback" not in ended, ended
    finally:
        subprocess.run([tmux, "-S", socket, "kill-server"], capture_output=True, timeout=30,
                       check=False)
