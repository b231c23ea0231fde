"""The engine tier, across two nodes: the real vLLM on Ray, tensor parallel over two
network namespaces, each with its own systemd (docs/engines.md). A stop in the middle of
start-up leaves every unit inactive, no process of either node and the rendezvous port
free. What a serving Ray replica survives (a lost raylet, a frozen worker node, a cut) is
in test_engine_stall.py, on one replica that serves every scenario."""

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
    complete,
    env_yaml,
    manager_pids,
    ray_pids,
)
from specs import free_port, write
from systemd_harness import Nodes, UserManager, port_is_free

pytestmark = [pytest.mark.integration, pytest.mark.engines]

TARGET = "llmgw-tiny.target"
ENGINE, HEAD = "llmgw-tiny-engine.service", "llmgw-tiny-ray-head.service"
API_PORT = 9470


def spec_text(http: int, head: int) -> str:
    return f"""\
replicas:
  - name: tiny
    engine: vllm
    launch_mode: ray
    model: {MODEL}
    virtualenv: {VENV}
    tensor_parallel_size: 2
    port: {http}
    rendezvous_port: {head}
    env: {env_yaml({"LLMGW_TEST_RAY_ON_CPU": "1"})}
    ray_num_gpus: 1
    ray_auth: disabled
    args: {ENGINE_ARGS}
    restart: {{delay: 2, burst: 10, interval: 900}}
    health: {{interval: 1, timeout: 2, stability: 5, generation: {{interval: 1, timeout: 5}}}}
    group_restart: {{delay: 1, max_delay: 8, budget: 5, window: 900}}
    nodes:
      - {{name: node-a, address: 192.0.2.1, interface: eth0}}
      - {{name: node-b, address: 192.0.2.2, interface: eth0}}
"""


@pytest.fixture
def ray_replica(two_nodes: Nodes, tmp_path: Path
                ) -> Iterator[tuple[UserManager, UserManager, str, int]]:
    assert_engines()
    http, head = free_port(), free_port()
    spec = write(tmp_path / "spec.yaml", spec_text(http, head))
    leader, worker = two_nodes["node-a"], two_nodes["node-b"]
    leader.render(spec, "node-a")
    worker.render(spec, "node-b")
    yield leader, worker, f"http://192.0.2.1:{http}", head


def assert_stopped(leader: UserManager, worker: UserManager, head: int) -> None:
    for manager, units in ((leader, (HEAD, ENGINE)), (worker, (ENGINE,))):
        for unit in units:
            info = manager.show(unit, "ActiveState", "Result")
            assert info == {"ActiveState": "inactive", "Result": "success"}, (unit, info)
        assert manager.state_of(TARGET)[0] == "inactive"
    assert not manager_pids(leader) and not manager_pids(worker), ray_pids(leader, worker)
    assert leader.netns is not None
    assert port_is_free(head, "192.0.2.1", netns=leader.netns.name)


def test_ray_stop_during_start_up(
        ray_replica: tuple[UserManager, UserManager, str, int]) -> None:
    """Stopped while vllm serve still starts on the Ray cluster: every unit ends inactive
    (vllm serve exits 1 then, ray start 1 on SIGTERM: both clean), nothing is left."""
    leader, worker, base, head = ray_replica
    worker.systemctl("start", TARGET)
    leader.systemctl("start", TARGET)
    leader.wait_state(ENGINE, "active", 60)
    time.sleep(8)  # well inside start-up: /health comes 20 s or more after the cluster
    assert complete(leader, base, timeout=2) != 200
    stopping = time.monotonic()
    leader.systemctl("stop", TARGET)
    print(f"figure: the leader stopped in start-up in {time.monotonic() - stopping:.1f} s")
    assert QUICK_STOP in (leader.log_dir / f"{ENGINE}.log").read_text(errors="replace")
    stopping = time.monotonic()
    worker.systemctl("stop", TARGET)
    print(f"figure: the worker stopped in {time.monotonic() - stopping:.1f} s")
    assert_stopped(leader, worker, head)
