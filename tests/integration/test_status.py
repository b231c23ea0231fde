"""`llmgw-systemd status`: shard health read from a real systemd over D-Bus."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from installed import BIN_DIR
from specs import free_port, one_node_shard
from systemd_harness import UserManager, wait_until

pytestmark = pytest.mark.integration

STATUS = str(BIN_DIR / "llmgw-systemd")


def status(manager: UserManager, spec: Path, *extra: str) -> tuple[int, list[dict[str, object]]]:
    proc = subprocess.run([STATUS, "status", "--user", "--node", "node", "--spec", str(spec),
                           "--json", *extra], capture_output=True, text=True,
                          env=manager.env, timeout=60, check=False)
    assert proc.returncode in (0, 3), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def wait_status(manager: UserManager, spec: Path, state: str
                ) -> tuple[int, list[dict[str, object]]]:
    def check() -> tuple[int, list[dict[str, object]]] | None:
        code, rows = status(manager, spec)
        return (code, rows) if rows[0]["state"] == state else None

    return wait_until(check, 30, f"status to say {state}")


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

    # burst=1: the first death uses the whole budget
    one_node.kill_main("llmgw-shard-engine.service")
    code, rows = wait_status(one_node, spec, "failed")
    assert code == 3
    assert "restart budget used up" in str(rows[0]["reason"])

    table = subprocess.run([STATUS, "status", "--user", "--node", "node", "--spec", str(spec)],
                           capture_output=True, text=True, env=one_node.env, timeout=60,
                           check=False)
    assert table.returncode == 3
    header, row = table.stdout.splitlines()
    assert header.split() == ["REPLICA", "RANK", "NODE", "STATE", "REASON"]
    assert row.split()[:4] == ["shard", "0/1", "node", "failed"]


def test_status_of_an_unknown_replica_is_bad_input(one_node: UserManager, tmp_path: Path
                                                    ) -> None:
    spec = one_node_shard(tmp_path / "spec.yaml", name="shard", http=free_port(),
                          head=free_port(), pid_file=tmp_path / "pids")
    proc = subprocess.run([STATUS, "status", "--user", "--node", "node", "--spec", str(spec),
                           "nope"], capture_output=True, text=True, env=one_node.env,
                          timeout=60, check=False)
    assert proc.returncode == 2
    assert "replica 'nope' has no shard on node 'node'" in proc.stderr
