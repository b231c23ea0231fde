"""The engine tier, across two nodes: the real vLLM on its own multiprocessing backend,
tensor parallel over two network namespaces (`--headless` on rank 1), each node with its
own systemd and supervisor (docs/engines.md).

A completion; SIGKILL of every process of rank 1: the supervisors never call the replica ready while
completions fail, and bring the whole group back; a stop of rank 0 alone: rank 1 does
not linger as a broken half but starts again to wait for a new rank 0, and the group
forms again when rank 0 returns; a stop leaves nothing behind. A stop in the middle of
start-up (rank 0 waiting for its peer) ends inactive, not failed."""

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
    Completions,
    assert_engines,
    assert_truthful,
    complete,
    env_yaml,
    manager_pids,
)
from specs import free_port, write
from supervisors import Sampler, SupervisorProcess
from systemd_harness import Nodes, UserManager, port_is_free, wait_until

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


def test_mp_two_nodes_group_comes_back_and_no_broken_half(
        mp_replica: tuple[UserManager, UserManager, str, int, Path]) -> None:
    leader, worker, base, master, spec = mp_replica
    sups = [SupervisorProcess(leader, "node-a", spec, listen=f"192.0.2.1:{API_PORT}"),
            SupervisorProcess(worker, "node-b", spec, listen=f"192.0.2.2:{API_PORT}")]
    try:
        leader.systemctl("start", TARGET)
        worker.systemctl("start", TARGET)
        wait_until(lambda: complete(leader, base) == 200, 300, "a first completion",
                   interval=1)
        sups[0].wait_state("tiny", "ready", 60)

        # SIGKILL of rank 1: rank 0's /health stays 200, completions fail
        with Sampler(lambda: str(sups[0].replica("tiny")["state"]), 0.25) as said, \
                Completions(leader, base) as answers:
            killed = time.monotonic()
            # the whole rank at once, as when its node dies (a SIGKILL of the main
            # process alone leaves its worker serving until the stop timeout)
            worker.systemctl("kill", "--signal=SIGKILL", ENGINE)
            wait_until(lambda: any(t > killed and s != 200 for t, _, s in answers.seen),
                       60, "completions to fail after rank 1 died")
            wait_until(lambda: any(t > killed and s == 200 for t, _, s in answers.seen[-3:])
                       and said.seen[-1][1] == "ready", 300, "the group to serve again",
                       interval=1)
            time.sleep(3)
        assert_truthful(said.seen, answers.seen, killed)

        # rank 0 stopped alone: rank 1 starts again to wait for a new rank 0; the half
        # that joined the old one does not linger
        joined = main_pid(worker)
        leader.systemctl("stop", TARGET)
        wait_until(lambda: main_pid(worker) not in (0, joined), 60,
                   "rank 1 to start again")
        wait_until(lambda: joined not in manager_pids(worker), 30, "the old rank 1 to go")
        sups[1].wait_state("tiny", "degraded", 10)

        # rank 0 back: the group forms again, without anyone's hand on rank 1
        leader.systemctl("start", TARGET)
        wait_until(lambda: complete(leader, base) == 200, 300, "completions again",
                   interval=1)
        sups[0].wait_state("tiny", "ready", 60)

        leader.systemctl("stop", TARGET)
        worker.systemctl("stop", TARGET)
        assert_stopped((leader, worker), master)
    finally:
        for sup in sups:
            sup.stop()
            print(f"===== {sup.node}: supervisor log\n{sup.tail(6000)}")


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
