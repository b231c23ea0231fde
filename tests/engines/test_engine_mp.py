"""The engine tier, across two nodes: the real vLLM on its own multiprocessing backend,
tensor parallel over two network namespaces (`--headless` on rank 1), each node with its
own systemd (docs/engines.md). A stop in the middle of start-up (rank 0 waiting for its
peer, rank 1 retrying the master port) ends inactive, not failed. What a serving group
survives (a killed rank, a lone rank 0 stop, freezes, cuts) is in test_engine_stall.py,
on one replica that serves every scenario."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from realengine import (
    ENGINE_ARGS,
    MODEL,
    QUICK_STOP,
    VENV,
    assert_engines,
    env_yaml,
    manager_pids,
)
from specs import free_port, write
from systemd_harness import Nodes, UserManager, port_is_free

pytestmark = [pytest.mark.integration, pytest.mark.engines]

TARGET, ENGINE = "llmgw-tiny.target", "llmgw-tiny-engine.service"
API_PORT = 9470


def spec_text(http: int, master: int) -> str:
    return f"""\
replicas:
  - name: tiny
    engine: vllm
    launch_mode: mp
    model: {MODEL}
    virtualenv: {VENV}
    tensor_parallel_size: 2
    port: {http}
    rendezvous_port: {master}
    distributed_timeout: 60
    stop_timeout: 15
    drain: {{delay: 2, timeout: 5}}
    env: {env_yaml()}
    args: {ENGINE_ARGS}
    restart: {{delay: 2, burst: 10, interval: 900}}
    health: {{interval: 1, timeout: 2, stability: 5, generation: {{interval: 1, timeout: 5}}}}
    group_restart: {{delay: 1, max_delay: 8, budget: 5, window: 900}}
    nodes:
      - {{name: node-a, address: 192.0.2.1, interface: eth0}}
      - {{name: node-b, address: 192.0.2.2, interface: eth0}}
"""


@pytest.fixture
def mp_replica(two_nodes: Nodes, tmp_path: Path
               ) -> Iterator[tuple[UserManager, UserManager, str, int, Path]]:
    assert_engines()
    http, master = free_port(), free_port()
    spec = write(tmp_path / "spec.yaml", spec_text(http, master))
    leader, worker = two_nodes["node-a"], two_nodes["node-b"]
    leader.render(spec, "node-a")
    worker.render(spec, "node-b")
    yield leader, worker, f"http://192.0.2.1:{http}", master, spec


def main_pid(manager: UserManager) -> int:
    return int(manager.show(ENGINE, "MainPID")["MainPID"])


def assert_stopped(managers: tuple[UserManager, ...], master: int) -> None:
    for manager in managers:
        info = manager.show(ENGINE, "ActiveState", "Result")
        assert info == {"ActiveState": "inactive", "Result": "success"}, (manager.name, info)
        assert manager.state_of(TARGET)[0] == "inactive"
        assert not manager_pids(manager), f"{manager.name}: processes left behind"
    netns = managers[0].netns
    assert netns is not None
    assert port_is_free(master, "192.0.2.1", netns=netns.name)


def test_mp_stop_during_start_up(
        mp_replica: tuple[UserManager, UserManager, str, int, Path]) -> None:
    """Rank 0 alone waits for its peer, blocked where it ignores SIGTERM; rank 1 alone
    retries the master port. Both stops end inactive, not failed, and leave nothing."""
    leader, worker, _, master, _ = mp_replica
    leader.systemctl("start", TARGET)
    leader.wait_state(ENGINE, "active", 30)
    time.sleep(12)  # inside the wait for rank 1 (its distributed timeout is 60 s)
    stopping = time.monotonic()
    leader.systemctl("stop", TARGET)
    print(f"figure: rank 0 stopped at its rendezvous in {time.monotonic() - stopping:.1f} s")
    # it ignores SIGTERM there and never served: SIGKILL after the short grace, not 25 s
    assert QUICK_STOP in (leader.log_dir / f"{ENGINE}.log").read_text(errors="replace")
    worker.systemctl("start", TARGET)
    worker.wait_state(ENGINE, "active", 30)
    time.sleep(12)  # inside its retries of the master port
    stopping = time.monotonic()
    worker.systemctl("stop", TARGET)
    print(f"figure: rank 1 stopped in its retries in {time.monotonic() - stopping:.1f} s")
    assert_stopped((leader, worker), master)
