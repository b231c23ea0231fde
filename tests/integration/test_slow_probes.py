"""Slow is not down (docs/supervisor.md): a real supervisor on one node's user manager,
the stand-in engine tests/standins/completion_server.py (progress from its metrics), a
client loop sending it completions, the supervisor's word sampled every 0.1 s.

- its health endpoint slow (SIGUSR2: 5 s, the probe's timeout 1 s) while its steps go on
  under the client's requests: ready in every sample, and said busy;
- the same with no request (nothing steps while the probe waits): out at the first slow
  probe, as before;
- the process frozen (SIGSTOP: the kernel still accepts its connections, nothing answers,
  its metrics time out too, so nothing tells slow from hung): ready through
  `health.timeouts` probes in a row, then out; never later than that bound;
- killed (SIGKILL): refused at once, whatever `timeouts` says.
"""

from __future__ import annotations

import http.client
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from specs import PYTHON, free_port, write, yaml_list
from supervisors import Sampler, SupervisorProcess
from systemd_harness import STANDINS, UserManager, wait_until

pytestmark = pytest.mark.integration

TARGET, ENGINE = "llmgw-s.target", "llmgw-s-engine.service"
INTERVAL, TIMEOUT, TIMEOUTS = 1, 1, 3


def spec_text(port: int) -> str:
    argv = [PYTHON, str(STANDINS / "completion_server.py"), "--port", str(port),
            "--host", "127.0.0.1", "--delay", "0.2", "--slow-health", "5"]
    return f"""\
replicas:
  - name: s
    engine: command
    serving_rank: 0
    port: {port}
    progress: {{steps: [completion_steps_total], pending: [completion_running]}}
    health: {{interval: {INTERVAL}, timeout: {TIMEOUT}, timeouts: {TIMEOUTS}, stability: 1}}
    restart: {{delay: 2, burst: 20, interval: 900}}
    nodes: [{{name: node, address: 127.0.0.1}}]
    ranks:
      - commands:
          - argv: {yaml_list(argv)}
"""


class Clients:
    """Two threads sending completions back to back (each answered after 0.2 s)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(2)]

    def run(self) -> None:
        deadline = time.monotonic() + 300
        while not self.stop.is_set() and time.monotonic() < deadline:
            connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            try:
                connection.request("POST", "/v1/completions", body=b'{"max_tokens": 4}',
                                   headers={"Content-Type": "application/json"})
                connection.getresponse().read()
            except OSError:
                self.stop.wait(0.1)
            finally:
                connection.close()

    def __enter__(self) -> Clients:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=15)


Setup = tuple[UserManager, SupervisorProcess, int]


@pytest.fixture
def serving(one_node: UserManager, tmp_path: Path) -> Iterator[Setup]:
    port = free_port()
    spec = write(tmp_path / "spec.yaml", spec_text(port))
    one_node.render(spec, "node")
    sup = SupervisorProcess(one_node, "node", spec, listen=f"127.0.0.1:{free_port()}")
    try:
        one_node.systemctl("start", TARGET)
        sup.wait_state("s", "ready", 60)
        yield one_node, sup, int(one_node.show(ENGINE, "MainPID")["MainPID"])
        one_node.systemctl("stop", TARGET)
    finally:
        sup.stop()
        print(f"===== supervisor log\n{sup.tail(6000)}")


def said(sup: SupervisorProcess) -> Sampler:
    def read() -> str:
        data = sup.replica("s")
        reason = "; ".join(str(r["reason"]) for r in data["ranks"])
        return f"{data['state']}{'+busy' if data.get('busy') else ''}: {reason}"
    return Sampler(read, 0.1)


def test_a_slow_health_endpoint_while_the_engine_steps_stays_ready(serving: Setup) -> None:
    _, sup, pid = serving
    with Clients(sup_port(sup)), said(sup) as sampler:
        time.sleep(2)
        os.kill(pid, signal.SIGUSR2)  # /health answers after 5 s from now on
        time.sleep(4 * (INTERVAL + TIMEOUT) * TIMEOUTS)
        os.kill(pid, signal.SIGUSR2)
        time.sleep(2)
    states = [s for _, s in sampler.seen]
    assert all(s.startswith("ready") for s in states), sorted(set(states))[:5]
    assert any(s.startswith("ready+busy") and "health probe waits behind" in s
               for s in states), sorted(set(states))[:5]


def test_a_slow_health_endpoint_with_no_step_is_down_at_once(serving: Setup) -> None:
    _, sup, pid = serving
    os.kill(pid, signal.SIGUSR2)
    try:
        slowed = time.monotonic()
        data = sup.wait_state("s", "degraded", 30, reason="no engine step since it began")
        out = time.monotonic() - slowed
    finally:
        os.kill(pid, signal.SIGUSR2)
    # the first probe that began after the change, and one more reading
    assert out < 2 * (INTERVAL + TIMEOUT) + INTERVAL + 3, (out, data)
    sup.wait_state("s", "ready", 30)


def test_a_frozen_engine_is_tolerated_for_its_timeouts_then_out(serving: Setup) -> None:
    _, sup, pid = serving
    with said(sup) as sampler:
        frozen = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            sup.wait_state("s", "degraded", 30, reason="no answer within")
        finally:
            os.kill(pid, signal.SIGCONT)
        sup.wait_state("s", "ready", 30)
    after = [(t - frozen, s) for t, s in sampler.seen if t > frozen]
    tolerated = [s for _, s in after if "allowed in a row" in s]
    assert tolerated, after[:10]
    assert f"{TIMEOUTS - 1} of {TIMEOUTS} allowed in a row" in " ".join(tolerated)
    # never ready past the bound: each probe begins INTERVAL after the last one ended
    bound = TIMEOUTS * (INTERVAL + TIMEOUT) + 2
    first_out = next(t for t, s in after if not s.startswith("ready"))
    assert first_out < bound, (first_out, after[:20])
    late = [(round(t, 1), s) for t, s in after
            if first_out < t and s.startswith("ready") and "allowed" in s]
    assert not late, late


def test_a_killed_engine_is_down_at_once(serving: Setup) -> None:
    manager, sup, pid = serving
    with said(sup) as sampler:
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: any(t > killed and not s.startswith("ready")
                               for t, s in sampler.seen), 10, "the death seen")
    after = [s for t, s in sampler.seen if t > killed]
    assert not any("allowed in a row" in s for s in after), after[:10]
    manager.wait_state(ENGINE, "active", timeout=30)
    sup.wait_state("s", "ready", 30)


def sup_port(sup: SupervisorProcess) -> int:
    """The engine's port, from the spec the supervisor watches."""
    for line in sup.spec.read_text().splitlines():
        if line.strip().startswith("port:"):
            return int(line.split(":")[1])
    raise AssertionError("no port in the spec")
