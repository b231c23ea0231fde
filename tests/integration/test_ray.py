"""vLLM on Ray across two nodes with the real Ray from PyPI; only `vllm` itself is a
stand-in (tests/standins/fake_vllm.py). The origin note's behaviours: the worker runs
only the Ray join, the leader a Ray head then the server; a worker started first still
joins; the replica answers once every worker has joined; a dead raylet takes its shard
down and it rejoins; stopping the leader leaves no Ray process and frees the port."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
from specs import free_port, write
from systemd_harness import STANDINS, Nodes, UserManager, pid_alive, port_is_free, wait_until

pytestmark = pytest.mark.integration

TARGET = "llmgw-llm.target"
HEAD, ENGINE = "llmgw-llm-ray-head.service", "llmgw-llm-engine.service"
RAY_PORT = 6379  # each node is its own network namespace


def engine_prefix(root: Path) -> Path:
    """An 'installation' holding the real ray and the vllm stand-in."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "ray").symlink_to(Path(sys.executable).parent / "ray")
    vllm = bin_dir / "vllm"
    vllm.write_text(f"#!{sys.executable}\nimport runpy\n"
                    f"runpy.run_path({str(STANDINS / 'fake_vllm.py')!r}, run_name='__main__')\n")
    vllm.chmod(0o755)
    return root


def get(nodes: Nodes, node: str, port: int, path: str) -> tuple[int, str]:
    ns = nodes[node].netns
    assert ns is not None
    proc = ns.exec("/usr/bin/python3", "-c", (
        "import urllib.request, sys\n"
        "try:\n"
        f"    r = urllib.request.urlopen('http://{ns.address}:{port}{path}', timeout=3)\n"
        "    print(r.status); print(r.read().decode())\n"
        "except Exception as e:\n"
        "    print(0); print(e)\n"))
    status, _, body = proc.stdout.partition("\n")
    return int(status or 0), body.strip()


def ray_processes(manager: UserManager) -> list[int]:
    """PIDs of any Ray process under this node's manager."""
    from systemd_harness import cgroup_pids

    found = []
    for pid in cgroup_pids(manager.name):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if (b"ray" in cmdline and b"gcs_server" in cmdline) or b"raylet" in cmdline or (
                b"ray" in cmdline and b"start" in cmdline):
            found.append(pid)
    return found


def raylet_pid(manager: UserManager, unit: str) -> int:
    for pid in manager.unit_pids(unit):
        try:
            if b"raylet" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]:
                return pid
        except OSError:
            continue
    raise AssertionError(f"no raylet in {unit}")


def test_vllm_on_ray_across_two_nodes(two_nodes: Nodes, tmp_path: Path) -> None:
    leader, worker = two_nodes["node-a"], two_nodes["node-b"]
    http = free_port()
    prefix = engine_prefix(tmp_path / "engine")
    spec = write(tmp_path / "spec.yaml", f"""\
replicas:
  - name: llm
    engine: vllm
    launch_mode: ray
    model: stand-in/llama
    port: {http}
    tensor_parallel_size: 1
    pipeline_parallel_size: 2
    rendezvous_port: {RAY_PORT}
    rendezvous_timeout: 180
    virtualenv: {prefix}
    restart: {{delay: 2, burst: 10, interval: 900}}
    # small Ray nodes for a 2-core test machine; a worker notices a lost head in 5 s
    ray_args: [--num-cpus=1, --object-store-memory=100000000]
    ray_head_args: [--include-dashboard=false]
    env: {{RAY_gcs_rpc_server_reconnect_timeout_s: "5"}}
    nodes:
      - {{name: node-a, address: {two_nodes.address("node-a")}}}
      - {{name: node-b, address: {two_nodes.address("node-b")}}}
""")
    leader.render(spec, "node-a")
    worker.render(spec, "node-b")
    assert not (worker.unit_dir / HEAD).exists()  # a worker runs only the Ray join

    # 1. The worker goes first: it waits for the head, and joins once the leader is up.
    worker.systemctl("start", TARGET)
    worker.wait_state(ENGINE, "activating", 30, sub="start-pre")
    leader.systemctl("start", TARGET)
    leader.wait_state(HEAD, "active", 60)
    worker.wait_state(ENGINE, "active", 120)

    # 2. The replica answers only once both Ray nodes are in.
    wait_until(lambda: get(two_nodes, "node-a", http, "/health")[0] == 200, 180,
               "the stand-in server to answer /health")
    status, body = get(two_nodes, "node-a", http, "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "stand-in/llama"
    assert json.loads(get(two_nodes, "node-a", http, "/stand-in/nodes")[1])["alive"] == 2

    # 3. The worker's raylet dies: its shard goes down, comes back, and rejoins.
    first_join = int(worker.show(ENGINE, "MainPID")["MainPID"])
    raylet = raylet_pid(worker, ENGINE)
    os.kill(raylet, signal.SIGKILL)
    wait_until(lambda: int(worker.show(ENGINE, "MainPID")["MainPID"]) not in (0, first_join)
               and worker.state_of(ENGINE)[0] == "active", 120, "the worker to rejoin")
    assert not pid_alive(first_join) and not pid_alive(raylet)
    wait_until(lambda: json.loads(get(two_nodes, "node-a", http, "/stand-in/nodes")[1] or
                                  "{}").get("alive") == 2, 120, "Ray to count the worker again")

    # 4. Stopping the leader's target leaves no Ray process and frees the Ray port.
    leader.systemctl("stop", TARGET)
    for unit in (HEAD, ENGINE):
        info = leader.show(unit, "ActiveState", "Result")
        assert info == {"ActiveState": "inactive", "Result": "success"}, (unit, info)
    assert ray_processes(leader) == []
    assert port_is_free(RAY_PORT, netns=leader.netns.name if leader.netns else None)

    # 5. Starting again works, on the same port, and the worker finds the new head.
    leader.systemctl("start", TARGET)
    leader.wait_state(HEAD, "active", 60)
    wait_until(lambda: get(two_nodes, "node-a", http, "/health")[0] == 200, 240,
               "the replica to answer again")
    assert json.loads(get(two_nodes, "node-a", http, "/stand-in/nodes")[1])["alive"] == 2


def test_a_worker_stopped_while_it_joins_ends_stopped_not_failed(one_node: UserManager,
                                                                  tmp_path: Path) -> None:
    """`ray start` joining a head that accepts TCP but never answers (blocked in Ray's
    GCS client) ignores SIGTERM: measured, still running 30 s after it. Its unit's
    llmgw-stop-group --main-first SIGKILLs the group inside the stop, so the unit ends
    inactive instead of failed (Result=timeout), which would start the restart unit."""
    import subprocess

    head_port = free_port()
    hanging = subprocess.Popen(["/usr/bin/python3", str(STANDINS / "hanging_server.py"),
                                "127.0.0.1", str(head_port)])
    try:
        spec = write(tmp_path / "spec.yaml", f"""\
replicas:
  - name: llm
    engine: vllm
    model: /m
    virtualenv: {engine_prefix(tmp_path / "prefix")}
    rendezvous_port: {head_port}
    stop_timeout: 15
    drain: {{delay: 2, timeout: 5}}
    ray_auth: disabled
    restart: {{delay: 1, burst: 5, interval: 120}}
    nodes:
      - {{name: leader, address: 127.0.0.1}}
      - {{name: node, address: 127.0.0.2}}
""")
        one_node.render(spec, "node")
        one_node.systemctl("start", TARGET)
        wait_until(lambda: "Local node IP" in (one_node.log_dir / f"{ENGINE}.log").read_text(
            errors="replace") if (one_node.log_dir / f"{ENGINE}.log").exists() else None,
            30, "ray start to be joining")
        pids = one_node.unit_pids(ENGINE)
        assert pids
        one_node.systemctl("stop", TARGET)
        info = one_node.show(ENGINE, "ActiveState", "Result")
        assert info == {"ActiveState": "inactive", "Result": "success"}, one_node.dump()
        assert not [p for p in pids if pid_alive(p)]
        assert one_node.state_of("llmgw-llm-restart.service")[0] == "inactive"
        # the drain step (a planned stop, no supervisor: its delay, 2 s) came first, out
        # of the same grace, so SIGKILL follows 8 s after SIGTERM
        log = (one_node.log_dir / f"{ENGINE}.log").read_text(errors="replace")
        assert "no supervisor answered" in log
        assert "still running 8 s after SIGTERM; sending SIGKILL" in log
    finally:
        hanging.kill()
        hanging.wait(timeout=10)
