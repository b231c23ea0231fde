"""Drain under a real HAProxy (docs/supervisor.md, "Drain"; docs/loadbalancer.md): two
one-node replicas, `a` on node-a and `b` on node-b, each behind its own node's
supervisor, and HAProxy (the doc's backend, as written) on a third machine, the bridge's
namespace, checking /v1/replicas/NAME/ready on each node. Four clients send completions
throughout.

- `systemctl --user restart llmgw-a.target`: not one request fails; HAProxy has taken
  `a` out before its engine gets SIGTERM (the engine prints the moment, on the
  CLOCK_MONOTONIC every namespace shares), puts it back after, and `b` is in rotation
  in every sample.
- `llmgw-systemd drain a --wait` in node-a's namespace: out of rotation, nothing
  failed, nothing stopped; `llmgw-systemd resume a` puts it back.
- Failures never wait: a SIGKILLed engine (a failure to systemd, which then runs no
  ExecStop=) is restarting within a moment; one that exits 0 on its own runs the drain
  step, which says the main process is gone and goes at once.

No baseline with `drain: {delay: 0}`: the stand-in refuses new connections from the
moment it gets SIGTERM, which HAProxy retries elsewhere (`retry-on conn-failure`), and
finishes what it has: with it, a restart without the delay fails nothing either, so a
baseline could not show the difference reliably.

The engine is tests/standins/completion_server.py (answers after 0.5 s; drains on
SIGTERM). Every process is stopped by PID; the managers and namespaces are the
two_nodes fixture's."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from loadbalancer import (
    HAProxy,
    Sampler,
    Server,
    Traffic,
    bridge_address,
    in_rotation,
    not_in_rotation,
    out_window,
    summary,
)
from specs import PYTHON, free_port, write, yaml_list
from supervisors import SupervisorProcess, stop_and_show
from systemd_harness import STANDINS, Nodes, UserManager, hub_of, wait_until

pytestmark = [pytest.mark.integration]

API_PORT = 9470
DELAY, TIMEOUT = 3, 10  # the replicas' drain
ANSWER = 0.5  # seconds the stand-in takes per completion
CLIENTS = 4
LB_ADDRESS = "192.0.2.100"  # HAProxy's, on the bridge
SETTLE = 5  # slack on top of a bound, for a loaded machine
STEP_LINE = "llmgw-stop-group: a: "


def spec_text(ports: dict[str, int]) -> str:
    replicas = []
    for name, node, address in (("a", "node-a", "192.0.2.1"), ("b", "node-b", "192.0.2.2")):
        argv = [PYTHON, str(STANDINS / "completion_server.py"), "--port", str(ports[name]),
                "--delay", str(ANSWER)]
        replicas.append(f"""\
  - name: {name}
    engine: command
    serving_rank: 0
    port: {ports[name]}
    progress: {{steps: [completion_steps_total], pending: [completion_running]}}
    drain: {{delay: {DELAY}, timeout: {TIMEOUT}}}
    health: {{interval: 1, timeout: 1, stability: 1}}
    restart: {{delay: 2, burst: 20, interval: 900}}
    nodes: [{{name: {node}, address: {address}}}]
    ranks:
      - commands:
          - argv: {yaml_list(argv)}
""")
    return "replicas:\n" + "".join(replicas)


@dataclass
class Cluster:
    nodes: Nodes
    spec: Path
    sups: dict[str, SupervisorProcess]
    lb: HAProxy
    lb_netns: str

    def engine_log(self, name: str) -> str:
        node = "node-a" if name == "a" else "node-b"
        log = self.nodes[node].log_dir / f"llmgw-{name}-engine.service.log"
        return log.read_text(errors="replace") if log.exists() else ""

    def traffic(self, seconds: float) -> Traffic:
        return Traffic(self.lb.url, clients=CLIENTS, seconds=seconds, timeout=30,
                       netns=self.lb_netns)


@pytest.fixture
def cluster(two_nodes: Nodes, tmp_path: Path) -> Iterator[Cluster]:
    ports = {"a": free_port(), "b": free_port()}
    spec = write(tmp_path / "spec.yaml", spec_text(ports))
    sups: list[SupervisorProcess] = []
    lb: HAProxy | None = None
    try:
        for name, node in (("a", "node-a"), ("b", "node-b")):
            manager = two_nodes[node]
            assert manager.netns is not None
            manager.render(spec, node)
            manager.systemctl("start", f"llmgw-{name}.target")
            sups.append(SupervisorProcess(manager, node, spec,
                                          listen=f"{manager.netns.address}:{API_PORT}"))
        for sup, name in zip(sups, ("a", "b")):
            sup.wait_state(name, "ready", 60)
        netns = two_nodes["node-a"].netns
        assert netns is not None
        hub = bridge_address(hub_of(netns), LB_ADDRESS)
        servers = [Server("a", "192.0.2.1", ports["a"], "192.0.2.1", API_PORT, "node-a"),
                   Server("b", "192.0.2.2", ports["b"], "192.0.2.2", API_PORT, "node-b")]
        lb = HAProxy(tmp_path / "lb", servers, netns=hub, port=8080).start(timeout=30)
        lb.wait_until_up("a", timeout=SETTLE + 5)
        lb.wait_until_up("b", timeout=SETTLE + 5)
        yield Cluster(two_nodes, spec, {s.node: s for s in sups}, lb, hub)
    finally:
        if lb is not None:
            lb.stop()
            print("===== haproxy log\n" + lb.log()[-3000:])
        stop_and_show(sups)


def sigterm_times(log: str) -> list[float]:
    return [float(m) for m in re.findall(r"^SIGTERM at ([0-9.]+) with", log, re.M)]


def step_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith(STEP_LINE)]


def test_planned_restart_leaves_rotation_first_and_fails_nothing(cluster: Cluster) -> None:
    node_a: UserManager = cluster.nodes["node-a"]
    lb = cluster.lb
    engine_pid = int(node_a.show("llmgw-a-engine.service", "MainPID")["MainPID"])
    with Sampler(lb, interval=0.25) as sampler, cluster.traffic(30) as traffic:
        time.sleep(3)  # both serve
        asked = time.monotonic()
        node_a.systemctl("restart", "llmgw-a.target")  # returns once the restart is done
        restarted = time.monotonic()
        lb.wait_until_up("a", timeout=30)
        back = time.monotonic()
    requests, failed = traffic.requests, traffic.failed
    print(f"restart: {summary(requests)}; systemctl restart took "
          f"{restarted - asked:.1f} s; back in rotation {back - asked:.1f} s after it")
    assert not failed, failed[:5]
    assert len(requests) > 40, summary(requests)

    out, came_back = out_window(sampler.samples, "a")
    terms = sigterm_times(cluster.engine_log("a"))
    assert len(terms) == 1, cluster.engine_log("a")
    term = terms[0]
    print(f"a out of rotation at +{out - asked:.2f} s, SIGTERM at +{term - asked:.2f} s, "
          f"back at +{came_back - asked:.2f} s: {came_back - out:.1f} s out")
    assert asked < out < term, (asked, out, term)  # HAProxy saw it first
    assert term - asked >= DELAY  # nothing signalled before the delay ran out
    assert came_back > term
    assert in_rotation(sampler.samples, "b", 0, float("inf")), \
        not_in_rotation(sampler.samples, "b")
    # the engine really restarted, and `a` served again afterwards
    assert int(node_a.show("llmgw-a-engine.service", "MainPID")["MainPID"]) != engine_pid
    assert traffic.served_by(since=back).get("a", 0) > 0, traffic.served_by(back)
    # nothing new went to `a` from the SIGTERM until it was back
    assert not [r for r in requests if r.server == "a" and term < r.started < came_back - 1]
    step = step_lines(cluster.engine_log("a"))
    assert any("out of rotation: waiting for the gateways to notice" in s for s in step), step
    # then it went: the serving rank once the delay was over (or the supervisor already
    # counted nothing in flight)
    assert step[-1].endswith((f"out of rotation for {DELAY} s; the engine drains what it has "
                              "in flight on SIGTERM", ": drained")), step


def test_drain_and_resume_from_the_cli(cluster: Cluster) -> None:
    node_a = cluster.nodes["node-a"]
    lb = cluster.lb
    engine_pid = int(node_a.show("llmgw-a-engine.service", "MainPID")["MainPID"])
    with Sampler(lb, interval=0.25) as sampler, cluster.traffic(25) as traffic:
        time.sleep(3)
        asked = time.monotonic()
        drained = cluster.sups["node-a"].cli("drain", "a", "--wait", "--reason", "test")
        returned = time.monotonic()
        assert drained.returncode == 0, (drained.stdout, drained.stderr)
        lb.wait_until_down("a", timeout=SETTLE)
        data = cluster.sups["node-a"].replica("a")
        time.sleep(3)  # `b` alone carries the load meanwhile
        resumed = time.monotonic()
        done = cluster.sups["node-a"].cli("resume", "a")
        assert done.returncode == 0, (done.stdout, done.stderr)
        lb.wait_until_up("a", timeout=30)
        back = time.monotonic()
    requests, failed = traffic.requests, traffic.failed
    out, came_back = out_window(sampler.samples, "a")
    print(f"drain --wait: {summary(requests)}; returned after {returned - asked:.1f}"
          f" s; a out at +{out - asked:.2f} s, {came_back - out:.1f} s out; back "
          f"{back - resumed:.1f} s after resume")
    assert not failed, failed[:5]
    assert data["routable"] is False, data
    assert "asked by" in str(data), data
    assert asked < out < returned + SETTLE
    assert came_back > resumed
    assert in_rotation(sampler.samples, "b", 0, float("inf")), \
        not_in_rotation(sampler.samples, "b")
    # nothing new reached `a` while it was out, and nothing was stopped
    assert not [r for r in requests if r.server == "a" and out < r.started < resumed]
    assert traffic.served_by(since=back).get("a", 0) > 0, traffic.served_by(back)
    assert int(node_a.show("llmgw-a-engine.service", "MainPID")["MainPID"]) == engine_pid
    assert not sigterm_times(cluster.engine_log("a"))


def test_failures_never_wait(cluster: Cluster) -> None:
    """SIGKILL of the engine: systemd counts it a failure (no SuccessExitStatus for a
    command engine) and runs no ExecStop=, so nothing drains; an engine that exits 0 on
    its own: ExecStop= runs, and the drain step goes at once, its main process gone."""
    node_a = cluster.nodes["node-a"]
    engine = "llmgw-a-engine.service"
    killed = time.monotonic()
    node_a.systemctl("kill", "--signal=SIGKILL", "--kill-whom=main", engine)
    node_a.wait_state(engine, "activating", 30, sub="auto-restart")
    stopped = time.monotonic() - killed
    print(f"SIGKILL: waiting to restart {stopped:.2f} s after; "
          f"{step_lines(cluster.engine_log('a'))}")
    assert stopped < DELAY  # no drain delay
    assert not step_lines(cluster.engine_log("a"))  # no ExecStop= after a failure
    cluster.sups["node-a"].wait_state("a", "ready", 60)  # and it comes back

    ended = time.monotonic()
    node_a.systemctl("kill", "--signal=SIGUSR1", "--kill-whom=main", engine)
    wait_until(lambda: step_lines(cluster.engine_log("a")), 30,
               "the drain step of the engine that ended")
    node_a.wait_state(engine, "activating", 30, sub="auto-restart")
    stopped = time.monotonic() - ended
    step = step_lines(cluster.engine_log("a"))
    print(f"exit 0: waiting to restart {stopped:.2f} s after; {step}")
    assert step == ["llmgw-stop-group: a: the main process is gone (a failure): no drain"], step
    assert stopped < DELAY  # it did not wait
    assert not sigterm_times(cluster.engine_log("a"))  # never drained
    cluster.sups["node-a"].wait_state("a", "ready", 60)
