"""Several serving endpoints of one replica behind a real HAProxy (docs/loadbalancer.md,
"A replica with several serving endpoints"): `web`, a command engine on two nodes whose
ranks 0 and 1 both serve HTTP (`serving_rank: [0, 1]`, as every node of a data-parallel
replica in vLLM's hybrid mode does), one HAProxy server per endpoint named `web.0` and
`web.1` with the doc's check line as written, and `spare`, a one-node replica on node-a
that carries the load while `web` is out. Four clients send completions throughout.

- Both endpoints serve; each node's supervisor probes its own; `/v1/replicas/web.1/ready`
  answers as `/v1/replicas/web/ready` does, and 404 for a rank that does not serve.
- SIGKILL of node-b's engine: both endpoints leave rotation (the ranks of one replica are
  one group), no supervisor says `ready` while it is down, both come back by themselves.
- A planned restart of either node: both endpoints are out of rotation before any
  engine gets SIGTERM, nothing fails, both come back.
- A spec change rolled node by node (`llmgw-render --apply` on node-a, then node-b):
  node-a's apply stages `web`, node-b's restarts it once as a group, drained; nothing
  fails, and each of its engines starts exactly once more, with the change.

The engine is tests/standins/completion_server.py (answers after 0.3 s; drains on
SIGTERM and prints the moment on CLOCK_MONOTONIC, which every namespace shares)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from loadbalancer import HAProxy, Sampler, Server, Traffic, bridge_address, in_rotation, summary
from rolling import Starts, engine_environ
from specs import PYTHON, free_port, write, yaml_list
from supervisors import Sampler as StateSampler
from supervisors import SupervisorProcess, stop_and_show
from systemd_harness import STANDINS, Nodes, hub_of, wait_until

pytestmark = [pytest.mark.integration]

API_PORT = 9470
DELAY, TIMEOUT = 2, 10  # the replicas' drain
CLIENTS = 4
LB_ADDRESS = "192.0.2.100"
ADDRESS = {"node-a": "192.0.2.1", "node-b": "192.0.2.2"}
ENDPOINTS = {"web.0": "node-a", "web.1": "node-b"}
ENGINE = "llmgw-web-engine.service"
BACK = 60


def spec_text(web: int, spare: int, rollout: str = "first") -> str:
    def argv(port: int) -> str:
        return yaml_list([PYTHON, str(STANDINS / "completion_server.py"), "--port", str(port),
                          "--delay", "0.3"])
    common = f"""\
    engine: command
    progress: {{steps: [completion_steps_total], pending: [completion_running]}}
    drain: {{delay: {DELAY}, timeout: {TIMEOUT}}}
    health: {{interval: 1, timeout: 1, stability: 1}}
    restart: {{delay: 1, burst: 20, interval: 900}}
    group_restart: {{delay: 1, max_delay: 4, budget: 10, window: 900}}
    env: {{ROLLOUT: {rollout}}}
"""
    return f"""\
replicas:
  - name: web
{common}    serving_rank: [0, 1]
    port: {web}
    nodes:
      - {{name: node-a, address: 192.0.2.1}}
      - {{name: node-b, address: 192.0.2.2}}
    ranks:
      - commands: [{{argv: {argv(web)}}}]
      - commands: [{{argv: {argv(web)}}}]
  - name: spare
{common}    port: {spare}
    nodes: [{{name: node-a, address: 192.0.2.1}}]
    ranks:
      - commands: [{{argv: {argv(spare)}}}]
"""


@dataclass
class Cluster:
    nodes: Nodes
    sups: dict[str, SupervisorProcess]
    lb: HAProxy
    hub: str
    spec: Path
    ports: tuple[int, int]  # web's, spare's

    def traffic(self, seconds: float) -> Traffic:
        return Traffic(self.lb.url, clients=CLIENTS, seconds=seconds, timeout=30,
                       netns=self.hub)

    def main_pid(self, node: str) -> int:
        return int(self.nodes[node].show(ENGINE, "MainPID")["MainPID"])

    def engine_log(self, node: str) -> str:
        log = self.nodes[node].log_dir / f"{ENGINE}.log"
        return log.read_text(errors="replace") if log.exists() else ""

    def both_up(self) -> None:
        for server in ENDPOINTS:
            self.lb.wait_until_up(server, timeout=BACK)

    def said(self) -> str:
        return " ".join(f"{node}={sup.replica('web')['state']}"
                        for node, sup in self.sups.items())


@pytest.fixture
def cluster(two_nodes: Nodes, tmp_path: Path) -> Iterator[Cluster]:
    web, spare = free_port(), free_port()
    spec = write(tmp_path / "spec.yaml", spec_text(web, spare))
    sups: list[SupervisorProcess] = []
    lb: HAProxy | None = None
    try:
        for node, address in ADDRESS.items():
            two_nodes[node].render(spec, node)
            sups.append(SupervisorProcess(two_nodes[node], node, spec,
                                          listen=f"{address}:{API_PORT}"))
        for node in reversed(ADDRESS):
            two_nodes[node].systemctl("start", "llmgw-web.target")
        two_nodes["node-a"].systemctl("start", "llmgw-spare.target")
        netns = two_nodes["node-a"].netns
        assert netns is not None
        hub = bridge_address(hub_of(netns), LB_ADDRESS)
        servers = [Server(name, ADDRESS[node], web, ADDRESS[node], API_PORT, node)
                   for name, node in ENDPOINTS.items()]
        servers.append(Server("spare", ADDRESS["node-a"], spare, ADDRESS["node-a"], API_PORT,
                              "node-a"))
        lb = HAProxy(tmp_path / "lb", servers, netns=hub, port=8080).start(timeout=30)
        cluster = Cluster(two_nodes, {s.node: s for s in sups}, lb, hub, spec, (web, spare))
        lb.wait_until_up("spare", timeout=BACK)
        cluster.both_up()
        yield cluster
    finally:
        if lb is not None:
            lb.stop()
            print("===== haproxy log\n" + lb.log()[-3000:])
        stop_and_show(sups)


def sigterm_times(log: str) -> list[float]:
    return [float(m) for m in re.findall(r"^SIGTERM at ([0-9.]+) with", log, re.M)]


def out_at(samples: list[tuple[float, frozenset[str] | None]], server: str,
           after: float) -> float | None:
    return next((at for at, up in samples if at > after and up is not None
                 and server not in up), None)


def test_every_endpoint_serves_and_leaves_with_the_group(cluster: Cluster) -> None:
    sup_b = cluster.sups["node-b"]
    assert sup_b.get("/v1/replicas/web.1/ready")[0] == 200
    assert sup_b.get("/v1/replicas/web.0/ready")[0] == 200
    assert sup_b.get("/v1/replicas/spare.1/ready")[0] == 404  # spare has one endpoint
    body = sup_b.replica("web")
    assert [(e["rank"], e["node"], e["check"]) for e in body["endpoints"]] == [
        (0, "node-a", "web.0"), (1, "node-b", "web.1")], body
    assert all("HTTP 200" in r["reason"] for r in body["ranks"]), body  # each probed
    old = cluster.main_pid("node-b")
    with Sampler(cluster.lb, interval=0.1) as sampler, cluster.traffic(120) as traffic, \
            StateSampler(cluster.said, 0.1) as states:
        time.sleep(4)
        killed = time.monotonic()
        cluster.nodes["node-b"].systemctl("kill", "--signal=SIGKILL", ENGINE)
        wait_until(lambda: cluster.main_pid("node-b") not in (0, old), 30,
                   "node-b's engine to run again", interval=0.05)
        again = time.monotonic()
        cluster.both_up()
        back = time.monotonic()
        time.sleep(3)
        traffic.finish()
    served = traffic.served_by(since=0)
    out = {s: out_at(sampler.samples, s, killed) for s in ENDPOINTS}
    print(f"served before and after: {summary(traffic.requests)}; SIGKILL of node-b's "
          f"engine: out at { {s: t and round(t - killed, 2) for s, t in out.items()} }, "
          f"its engine again at +{again - killed:.2f} s, both back at +{back - killed:.1f} s")
    assert served.get("web.0", 0) > 0 and served.get("web.1", 0) > 0, served
    assert all(t is not None for t in out.values()), out
    ready = [(round(at - killed, 2), said) for at, said in states.seen
             if killed + 0.5 < at < again and "=ready" in said]
    assert not ready, ready
    assert traffic.served_by(since=back).get("web.0", 0) > 0, traffic.served_by(back)


@pytest.mark.parametrize("node", ["node-b", "node-a"])
def test_a_planned_restart_of_either_serving_node_fails_nothing(cluster: Cluster,
                                                               node: str) -> None:
    with Sampler(cluster.lb, interval=0.1) as sampler, cluster.traffic(120) as traffic:
        time.sleep(3)
        asked = time.monotonic()
        cluster.nodes[node].systemctl("restart", "llmgw-web.target")
        cluster.both_up()
        back = time.monotonic()
        time.sleep(3)
        traffic.finish()
    out = {s: out_at(sampler.samples, s, asked) for s in ENDPOINTS}
    terms = {n: [t for t in sigterm_times(cluster.engine_log(n)) if t > asked]
             for n in ADDRESS}
    first_term = min((t for ts in terms.values() for t in ts), default=None)
    print(f"planned restart of {node}: {summary(traffic.requests)}; out at "
          f"{ {s: t and round(t - asked, 2) for s, t in out.items()} }, first SIGTERM at "
          f"{first_term and round(first_term - asked, 2)}, both back at +{back - asked:.1f} s")
    assert not traffic.failed, traffic.failed[:5]
    assert all(t is not None for t in out.values()), out
    assert first_term is not None and terms[node], terms  # the restarted node drained
    assert all(t < first_term for t in out.values() if t is not None), (out, first_term)
    assert in_rotation(sampler.samples, "spare", 0, float("inf"))
    assert traffic.served_by(since=back).get("web.0", 0) + \
        traffic.served_by(since=back).get("web.1", 0) > 0, traffic.served_by(back)


def test_a_change_rolled_node_by_node_restarts_the_group_once(cluster: Cluster) -> None:
    write(cluster.spec, spec_text(*cluster.ports, rollout="second"))
    lines: dict[str, list[str]] = {}
    managers = {node: cluster.nodes[node] for node in ADDRESS}
    with Sampler(cluster.lb, interval=0.1) as sampler, cluster.traffic(180) as traffic, \
            Starts(managers, ENGINE, 0.1) as starts:
        time.sleep(3)
        for node in ADDRESS:
            lines[node] = cluster.nodes[node].apply(cluster.spec, node).stdout.splitlines()
        cluster.both_up()
        time.sleep(3)
        traffic.finish()
    print(f"roll: {summary(traffic.requests)}; {lines}")
    assert any(line.startswith("replica web: staged") for line in lines["node-a"]), lines
    assert any(line.startswith("replica web: restarted") for line in lines["node-b"]), lines
    assert not traffic.failed, traffic.failed[:5]
    # something was in rotation in every sample: spare while web restarted, and back
    assert all(up for _, up in sampler.samples if up is not None), [
        round(at, 1) for at, up in sampler.samples if up is not None and not up]
    assert starts.counts() == {"node-a": 2, "node-b": 2}  # the one before, and one more
    for node in ADDRESS:
        assert engine_environ(cluster.nodes[node], ENGINE).get("ROLLOUT") == "second"
