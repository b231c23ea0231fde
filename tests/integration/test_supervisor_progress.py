"""Liveness from the engine's progress, under a real user manager with the supervisor:
a frozen engine (its /health still 200) is group-restarted once no step ran for
stall_after, and a saturated one (its generation check timing out behind real work)
stays ready and is never restarted. The engine is tests/standins/stepping_engine.py,
which publishes a step counter as vLLM does; the real vLLM's freeze is the engines
tier's."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from specs import PYTHON, free_port, write, yaml_list
from systemd_harness import STANDINS, UserManager, wait_until
from test_supervisor_faults import LocalSupervisor

pytestmark = pytest.mark.integration

TARGET, ENGINE = "llmgw-step.target", "llmgw-step-engine.service"
STALL_AFTER = 6


def spec(path: Path, http: int) -> Path:
    argv = [PYTHON, str(STANDINS / "stepping_engine.py"), "--port", str(http),
            "--busy-wait", "4"]
    return write(path, f"""\
replicas:
  - name: step
    engine: command
    port: {http}
    progress: {{steps: [stepping_steps_total], pending: [stepping_running, stepping_waiting]}}
    restart: {{delay: 1, burst: 20, interval: 900}}
    health: {{interval: 1, timeout: 1, stability: 1, stall_after: {STALL_AFTER},
              generation: {{interval: 1, timeout: 2}}}}
    group_restart: {{delay: 1, max_delay: 2, budget: 5, window: 600}}
    nodes: [{{name: node, address: 127.0.0.1}}]
    ranks:
      - commands:
          - argv: {yaml_list(argv)}
""")


class StepSupervisor(LocalSupervisor):
    name = "step"  # the replica it is asked about

    def replica(self, name: str = "") -> dict[str, object]:
        return super().replica(name or self.name)

    def state(self) -> str:
        data = self.get(f"/v1/replicas/{self.name}", timeout=2)
        return str(data["state"]) if isinstance(data, dict) else "no answer"

    def metric(self, name: str) -> float:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=3) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name))


@pytest.fixture
def stepping(one_node: UserManager, tmp_path: Path) -> Iterator[StepSupervisor]:
    path = spec(tmp_path / "spec.yaml", free_port())
    one_node.render(path, "node")
    one_node.systemctl("start", TARGET)
    sup = StepSupervisor(one_node, path, free_port())
    try:
        wait_until(lambda: sup.state() == "ready", 60, "the replica to be ready")
        yield sup
    finally:
        sup.stop()
        print(sup.log.read_text(errors="replace")[-3000:])


def main_pid(manager: UserManager) -> int:
    return int(manager.show(ENGINE, "MainPID")["MainPID"])


def test_a_frozen_engine_with_health_200_is_restarted_as_a_stall(
        stepping: StepSupervisor) -> None:
    manager = stepping.manager
    frozen = main_pid(manager)
    manager.systemctl("kill", "--signal=SIGUSR1", "--kill-whom=main", ENGINE)
    # the generation check's own request is the pending work that no step serves
    seen: list[str] = []

    def restarted() -> bool:
        seen.append(stepping.state())
        return main_pid(manager) not in (0, frozen)

    wait_until(restarted, STALL_AFTER + 40, "the stalled engine to be restarted", 0.5)
    assert "this rank stalled" in stepping.log.read_text()
    assert stepping.metric("llmgw_stall_restarts_total") == 1
    # truthful meanwhile: not ready once the check had time to fail
    assert "ready" not in seen[10:], seen
    wait_until(lambda: stepping.state() == "ready", 60, "the replica to serve again")
    assert stepping.replica()["progress"] is not None


def test_a_saturated_engine_stays_ready_and_is_never_restarted(
        stepping: StepSupervisor) -> None:
    manager = stepping.manager
    pid = main_pid(manager)
    manager.systemctl("kill", "--signal=SIGUSR2", "--kill-whom=main", ENGINE)
    states, busy, why = [], [], []
    end = time.monotonic() + 3 * STALL_AFTER + 4  # a bound on the sampling, not a figure
    while time.monotonic() < end:
        data = stepping.replica()
        states.append(str(data["state"]))
        busy.append(bool(data["busy"]))
        why.append(f"{data['state']}: {data['reason']} / {data['progress']}")
        time.sleep(0.25)
    manager.systemctl("kill", f"--signal={signal.SIGUSR2.name}", "--kill-whom=main", ENGINE)
    assert any(busy), "the generation check never waited behind the load"
    # from the first busy sample on: ready in every sample
    first = busy.index(True)
    assert set(states[first:]) == {"ready"}, [w for w in why[first:]
                                              if not w.startswith("ready")]
    assert main_pid(manager) == pid
    assert stepping.metric("llmgw_stall_restarts_total") == 0
    assert "stalled" not in stepping.log.read_text()


# -- SGLang, through its stand-in at its interface (tests/standins/sglang_standin): the
# rendered `python -m sglang.launch_server`, its metrics names, its generating /health
SG_TARGET, SG_ENGINE = "llmgw-sg.target", "llmgw-sg-engine.service"
SGLANG_STANDIN = STANDINS / "sglang_standin"


def sglang_spec(path: Path, http: int, *, generation: bool) -> Path:
    venv = path.parent / "sglang-venv"  # its python is Debian's; sglang is the stand-in
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    if not (venv / "bin" / "python").exists():
        (venv / "bin" / "python").symlink_to(PYTHON)
    check = ", generation: {interval: 1, timeout: 2}" if generation else ""
    return write(path, f"""\
replicas:
  - name: sg
    engine: sglang
    model: /models/m
    virtualenv: {venv}
    host: 127.0.0.1
    port: {http}
    args: [--enable-metrics]
    env: {{PYTHONPATH: {SGLANG_STANDIN}}}
    restart: {{delay: 1, burst: 20, interval: 900}}
    health: {{interval: 1, timeout: 3, stability: 1, stall_after: {STALL_AFTER}{check}}}
    group_restart: {{delay: 1, max_delay: 2, budget: 5, window: 600}}
    nodes: [{{name: node, address: 127.0.0.1}}]
""")


class SglangSupervisor(StepSupervisor):
    name = "sg"


def sglang_up(manager: UserManager, tmp_path: Path, *, generation: bool) -> SglangSupervisor:
    path = sglang_spec(tmp_path / "spec.yaml", free_port(), generation=generation)
    manager.render(path, "node")
    manager.systemctl("start", SG_TARGET)
    sup = SglangSupervisor(manager, path, free_port())
    try:
        wait_until(lambda: sup.state() == "ready", 60, "the SGLang stand-in to be ready")
    except AssertionError:
        sup.stop()
        raise
    return sup


@pytest.mark.parametrize("generation", [True, False], ids=["with-check", "health-only"])
def test_a_frozen_sglang_is_restarted_as_a_stall(one_node: UserManager, tmp_path: Path,
                                                 generation: bool) -> None:
    """Frozen while idle: its gauges say nothing is pending, but its own /health asks
    for a token, and that request is owed work; with or without the generation check."""
    sup = sglang_up(one_node, tmp_path, generation=generation)
    try:
        frozen = int(one_node.show(SG_ENGINE, "MainPID")["MainPID"])
        one_node.systemctl("kill", "--signal=SIGUSR1", "--kill-whom=main", SG_ENGINE)
        seen: list[str] = []

        def restarted() -> bool:
            data = sup.replica()
            seen.append(f"{data['state']}: {data['reason']} / {data['progress']}")
            return int(one_node.show(SG_ENGINE, "MainPID")["MainPID"]) not in (0, frozen)

        try:
            wait_until(restarted, STALL_AFTER + 60, "the stalled SGLang to restart", 0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; it said: {seen[-5:]}") from None
        assert "this rank stalled" in sup.log.read_text()
        assert sup.metric("llmgw_stall_restarts_total") == 1
        wait_until(lambda: sup.state() == "ready", 60, "SGLang to serve again")
    finally:
        sup.stop()
        print(sup.log.read_text(errors="replace")[-3000:])


def test_a_saturated_sglang_stays_ready(one_node: UserManager, tmp_path: Path) -> None:
    """Its /health answers behind load (anything sent back counts); the generation check
    waits behind it: busy, ready in every sample, never restarted."""
    sup = sglang_up(one_node, tmp_path, generation=True)
    try:
        pid = int(one_node.show(SG_ENGINE, "MainPID")["MainPID"])
        one_node.systemctl("kill", "--signal=SIGUSR2", "--kill-whom=main", SG_ENGINE)
        samples = []
        end = time.monotonic() + 3 * STALL_AFTER + 4  # a bound on the sampling
        while time.monotonic() < end:
            data = sup.replica()
            samples.append((str(data["state"]), bool(data["busy"]), str(data["reason"])))
            time.sleep(0.25)
        busy = [b for _, b, _ in samples]
        assert any(busy), "the generation check never waited behind the load"
        after = samples[busy.index(True):]
        assert {s for s, _, _ in after} == {"ready"}, [a for a in after if a[0] != "ready"]
        assert int(one_node.show(SG_ENGINE, "MainPID")["MainPID"]) == pid
        assert sup.metric("llmgw_stall_restarts_total") == 0
    finally:
        sup.stop()
        print(sup.log.read_text(errors="replace")[-3000:])
