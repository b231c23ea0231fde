"""The engine tier's data parallel (issue 36; docs/engines.md, "Data parallel"): the real
vLLM (CPU build) with data parallel 2 over two network namespaces in the hybrid mode, so
each node serves its own data-parallel rank on its own HTTP endpoint, behind a real
HAProxy with one server per serving endpoint, configured from docs/loadbalancer.md as
written, four clients throughout. Beside it, `standby` (the stand-in
tests/standins/completion_server.py on node-b) takes the load while `dp` is out.

One replica serves every scenario, in file order:

1. Start: both endpoints (`dp.0` on node-a, `dp.1` on node-b) come into rotation and
   serve completions; each node's supervisor probes its own endpoint, and the replica's
   body names both.
2. SIGKILL of every process of node-b's rank under the load: both endpoints leave
   rotation (the ranks of one replica are one group), no supervisor says `ready` while
   the rank is down, and the group comes back by itself (every rank restarted).
3. A planned restart of node-b, a serving node: both endpoints drain together before any
   rank stops; not one request fails; the replica comes back.

Bounds here are the test's, never asserted figures."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from loadbalancer import HAProxy, Sampler, Server, Traffic, bridge_address, summary
from realengine import ENGINE_ARGS, MODEL, VENV, assert_engines, complete, env_yaml, manager_pids
from specs import PYTHON, free_port, write, yaml_list
from supervisors import Sampler as StateSampler
from supervisors import SupervisorProcess, stop_and_show
from systemd_harness import STANDINS, Nodes, hub_of, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.engines]

API_PORT = 9470
LB_ADDRESS = "192.0.2.100"
CLIENTS = 4
BACK = 400  # bound on a group restart of two vLLM ranks on this machine's two cores
ADDRESS = {"node-a": "192.0.2.1", "node-b": "192.0.2.2"}
ENDPOINTS = {"dp.0": "node-a", "dp.1": "node-b"}  # HAProxy server: its node


def spec_text(port: int, standby: int, rpc: int) -> str:
    common = """\
    drain: {delay: 3, timeout: 10}
    restart: {delay: 2, burst: 20, interval: 900}
    health: {interval: 1, timeout: 2, stability: 2, generation: {interval: 1, timeout: 5}}
"""
    argv = [PYTHON, str(STANDINS / "completion_server.py"), "--port", str(standby),
            "--delay", "0.2"]
    return f"""\
replicas:
  - name: dp
    engine: vllm
    launch_mode: mp
    model: {MODEL}
    virtualenv: {VENV}
    env: {env_yaml()}
    args: {ENGINE_ARGS}
    data_parallel_size: 2
    data_parallel_lb: hybrid
    port: {port}
    rendezvous_port: {rpc}
    stop_timeout: 20
    group_restart: {{delay: 1, max_delay: 8, budget: 10, window: 900}}
{common}    nodes:
      - {{name: node-a, address: 192.0.2.1, interface: eth0}}
      - {{name: node-b, address: 192.0.2.2, interface: eth0}}
  - name: standby
    engine: command
    serving_rank: 0
    port: {standby}
    progress: {{steps: [completion_steps_total], pending: [completion_running]}}
{common}    nodes: [{{name: node-b, address: 192.0.2.2}}]
    ranks:
      - commands:
          - argv: {yaml_list(argv)}
"""


@dataclass
class Cluster:
    nodes: Nodes
    port: int
    sups: dict[str, SupervisorProcess]
    lb: HAProxy
    hub: str

    def traffic(self, seconds: float = 900) -> Traffic:
        return Traffic(self.lb.url, clients=CLIENTS, seconds=seconds, timeout=60,
                       netns=self.hub)

    def main_pid(self, node: str) -> int:
        return int(self.nodes[node].show("llmgw-dp-engine.service", "MainPID")["MainPID"])

    def completes(self) -> bool:
        return all(complete(self.nodes[node], f"http://{ADDRESS[node]}:{self.port}") == 200
                   for node in ADDRESS)

    def serving(self) -> None:
        """Both endpoints answer completions and are in HAProxy's rotation."""
        wait_until(self.completes, BACK, "both endpoints to complete", interval=1)
        for server in ENDPOINTS:
            self.lb.wait_until_up(server, timeout=60)

    def said(self) -> str:
        """What each node's supervisor says of the replica: `node-a=ready node-b=...`."""
        return " ".join(f"{node}={sup.replica('dp')['state']}"
                        for node, sup in self.sups.items())


@contextlib.contextmanager
def running(nodes: Nodes, tmp: Path) -> Iterator[Cluster]:
    assert_engines()
    port, standby, rpc = free_port(), free_port(), free_port()
    spec = write(tmp / "spec.yaml", spec_text(port, standby, rpc))
    sups: list[SupervisorProcess] = []
    lb: HAProxy | None = None
    try:
        for node, address in ADDRESS.items():
            nodes[node].render(spec, node)
            sups.append(SupervisorProcess(nodes[node], node, spec,
                                          listen=f"{address}:{API_PORT}",
                                          state_dir=tmp / f"state-{node}"))
        nodes["node-b"].systemctl("start", "llmgw-standby.target")
        netns = nodes["node-a"].netns
        assert netns is not None
        hub = bridge_address(hub_of(netns), LB_ADDRESS)
        # one server per serving endpoint, named NAME.RANK: its check asks that node's
        # supervisor for /v1/replicas/NAME.RANK/ready (docs/loadbalancer.md)
        servers = [Server(name, ADDRESS[node], port, ADDRESS[node], API_PORT, node)
                   for name, node in ENDPOINTS.items()]
        servers.append(Server("standby", ADDRESS["node-b"], standby, ADDRESS["node-b"],
                              API_PORT, "node-b"))
        lb = HAProxy(tmp / "lb", servers, netns=hub, port=8080).start(timeout=30)
        lb.wait_until_up("standby", timeout=60)
        for node in reversed(ADDRESS):
            nodes[node].systemctl("start", "llmgw-dp.target")
        yield Cluster(nodes, port, {s.node: s for s in sups}, lb, hub)
        for node in ADDRESS:
            nodes[node].systemctl("stop", "llmgw-dp.target", *(
                ["llmgw-standby.target"] if node == "node-b" else []))
            assert not manager_pids(nodes[node]), f"{node}: processes left behind"
    finally:
        if lb is not None:
            lb.stop()
            print("===== haproxy log\n" + lb.log()[-3000:])
        stop_and_show(sups)


@pytest.fixture(scope="module")
def cluster(shared_two_nodes: Nodes, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Cluster]:
    with running(shared_two_nodes, tmp_path_factory.mktemp("engine-dp")) as cluster:
        yield cluster


def test_both_endpoints_serve_behind_haproxy(cluster: Cluster) -> None:
    started = time.monotonic()
    cluster.serving()
    print(f"figure: data parallel 2, hybrid: both endpoints in rotation "
          f"{time.monotonic() - started:.0f} s after the start")
    with cluster.traffic(seconds=20) as traffic:
        pass
    print(f"figure: 20 s of load: {summary(traffic.requests)}")
    assert not traffic.failed, traffic.failed[:5]
    served = traffic.served_by()
    assert served.get("dp.0", 0) > 0 and served.get("dp.1", 0) > 0, served
    for node, sup in cluster.sups.items():
        body = sup.replica("dp")
        assert body["state"] == "ready", body
        assert [(e["rank"], e["node"], e["check"]) for e in body["endpoints"]] == [
            (0, "node-a", "dp.0"), (1, "node-b", "dp.1")], body
        rank = list(ADDRESS).index(node)
        assert body["ranks"][rank]["state"] == "ready", body  # its own endpoint, probed


def test_a_killed_rank_takes_every_endpoint_out_and_comes_back(cluster: Cluster) -> None:
    """vLLM's own rank 0 does not notice a dead remote rank (docs/engines.md): its /health
    stays 200. The supervisors do, from node-b's unit."""
    cluster.serving()
    node_b, old = cluster.nodes["node-b"], cluster.main_pid("node-b")
    with Sampler(cluster.lb, interval=0.25) as sampler, cluster.traffic() as traffic, \
            StateSampler(cluster.said, 0.2) as states:
        time.sleep(3)
        killed = time.monotonic()
        node_b.systemctl("kill", "--signal=SIGKILL", "llmgw-dp-engine.service")
        wait_until(lambda: cluster.main_pid("node-b") not in (0, old), 60,
                   "node-b's rank to run again", interval=0.1)
        again = time.monotonic()
        cluster.serving()
        back = time.monotonic()
        time.sleep(3)
        traffic.finish()
    out = {server: next((at for at, up in sampler.samples
                         if at > killed and up is not None and server not in up), None)
           for server in ENDPOINTS}
    print(f"figure: SIGKILL of node-b's rank: out of rotation "
          f"{ {s: None if t is None else round(t - killed, 2) for s, t in out.items()} } s "
          f"after; node-b's rank running again at +{again - killed:.1f} s; both endpoints "
          f"back at +{back - killed:.0f} s; {summary(traffic.requests)}")
    assert all(t is not None for t in out.values()), out
    # never ready while node-b's rank was down: between the kill and its new start
    ready = [(round(at - killed, 2), said) for at, said in states.seen
             if killed + 1 < at < again and "=ready" in said]
    assert not ready, ready
    # every rank of the group started again, node-a's too
    assert cluster.main_pid("node-a") != 0


def test_planned_restart_of_a_serving_node_fails_nothing(cluster: Cluster) -> None:
    cluster.serving()
    with Sampler(cluster.lb, interval=0.25) as sampler, cluster.traffic() as traffic:
        time.sleep(3)
        asked = time.monotonic()
        cluster.nodes["node-b"].systemctl("restart", "llmgw-dp.target")
        wait_until(functools.partial(cluster.completes), BACK, "dp to complete again",
                   interval=1)
        cluster.serving()
        back = time.monotonic()
        time.sleep(3)
        traffic.finish()
    out = {server: next((round(at - asked, 2) for at, up in sampler.samples
                         if at > asked and up is not None and server not in up), None)
           for server in ENDPOINTS}
    print(f"figure: planned restart of node-b: endpoints out at {out} s, both back at "
          f"+{back - asked:.0f} s; {summary(traffic.requests)}")
    assert not traffic.failed, traffic.failed[:5]
    assert all(t is not None for t in out.values()), out
