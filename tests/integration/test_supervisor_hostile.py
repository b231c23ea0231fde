"""The supervisor in a hostile world (docs/supervisor.md), on one node: its peers are
other loopback addresses (127.0.0.2, ...), where the test puts liars, droppers, drippers,
redirectors and floods. In every case the replica is never `ready` while it cannot serve
(the API is sampled all along), nothing restarts on a claim that does not count, and the
process stays up, answering, with bounded memory.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from certs import cluster
from specs import free_port, write
from supervisors import SUPERVISOR, ApiReader, HostilePeer, Sampler, SupervisorProcess
from systemd_harness import STANDINS, UserManager, wait_until

pytestmark = pytest.mark.integration

ENGINE = "llmgw-rep-engine.service"
B, C = "127.0.0.2", "127.0.0.3"


def spec_text(http: int, *, budget: int = 3, side: bool = False) -> str:
    """rep: rank 0 here (an HTTP server), rank 1 on node b. side (optional): rank 0 here,
    rank 1 on node c, so that this node also dials c."""
    text = f"""\
replicas:
  - name: rep
    engine: command
    port: {http}
    health: {{path: /, interval: 1, timeout: 1, stability: 1}}
    restart: {{delay: 1, burst: 50, interval: 600}}
    group_restart: {{delay: 1, max_delay: 2, budget: {budget}, window: 600}}
    nodes:
      - {{name: node, address: 127.0.0.1}}
      - {{name: b, address: {B}}}
    ranks:
      - commands: [{{argv: [/usr/bin/python3, -m, http.server, --bind, 127.0.0.1, "{http}"]}}]
      - commands: [{{argv: [/usr/bin/sleep, infinity]}}]
"""
    if side:
        text += f"""\
  - name: side
    engine: command
    serving_rank: null
    health: {{stability: 0}}
    nodes:
      - {{name: node, address: 127.0.0.1}}
      - {{name: c, address: {C}}}
    ranks:
      - commands: [{{argv: [/usr/bin/sleep, infinity]}}]
      - commands: [{{argv: [/usr/bin/sleep, infinity]}}]
"""
    return text


def report(*shards: tuple[str, int, str, str], node: str = "b", version: int = 1
           ) -> dict[str, Any]:
    return {"node": node, "version": version, "shards": [
        {"replica": r, "rank": k, "node": n, "state": s, "reason": f"{s}, says {node}",
         "generation": "ab" * 16, "serving": False} for r, k, n, s in shards]}


class Node:
    """The one node: its manager, the spec, the supervisor and whatever peers a test adds."""

    def __init__(self, manager: UserManager, tmp: Path) -> None:
        self.manager, self.tmp = manager, tmp
        self.http, self.port = free_port(), free_port()
        self.peers: list[HostilePeer] = []
        self.supervisor: SupervisorProcess | None = None

    def setup(self, *, budget: int = 3, side: bool = False, start: bool = True) -> Path:
        spec = write(self.tmp / "spec.yaml", spec_text(self.http, budget=budget, side=side))
        self.manager.render(spec, "node")
        if start:
            self.manager.systemctl("start", "llmgw-rep.target",
                                   *(["llmgw-side.target"] if side else []))
        return spec

    def supervise(self, spec: Path, **options: Any) -> SupervisorProcess:
        self.supervisor = SupervisorProcess(self.manager, "node", spec,
                                            listen=f"127.0.0.1:{self.port}", **options)
        return self.supervisor

    def peer(self, address: str, mode: str, **options: Any) -> HostilePeer:
        peer = HostilePeer(f"{address}:{self.port}", mode, **options)
        self.peers.append(peer)
        return peer

    def state(self, name: str = "rep") -> str:
        assert self.supervisor is not None
        return str(self.supervisor.replica(name)["state"])

    def engine_pid(self) -> int:
        return int(self.manager.show(ENGINE, "MainPID")["MainPID"])

    def close(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
            print("===== supervisor log\n" + self.supervisor.tail())
        for peer in self.peers:
            peer.stop()


@pytest.fixture
def node(one_node: UserManager, tmp_path: Path) -> Iterator[Node]:
    harness = Node(one_node, tmp_path)
    try:
        yield harness
    finally:
        harness.close()


def never_ready(node: Node, seconds: float, name: str = "rep") -> set[str]:
    """Sample the replica's state for a window; it must never read `ready`."""
    with Sampler(lambda: node.state(name)) as sampler:
        time.sleep(seconds)  # the observation window
    states = sampler.states()
    assert "ready" not in states, sampler.seen
    assert not any(s.startswith("error") for s in states), states  # the API kept answering
    return states


def test_a_third_node_cannot_speak_for_a_rank(node: Node) -> None:
    """c vouches for b's rank while b is unreachable: ignored and counted, never ready."""
    spec = node.setup(side=True)
    node.peer(C, "lie", report=report(("rep", 1, "b", "ready"), ("side", 1, "c", "ready"),
                                      node="c"))
    sup = node.supervise(spec)
    sup.wait_state("side", "ready")  # c's report about its own rank counts
    sup.wait_state("rep", "degraded", reason="supervisor on b unreachable")
    never_ready(node, 4)
    assert sup.metric('llmgw_peer_reports_ignored_total{replica="rep"}') > 0
    assert "ignored a report: c reported rank 1 of rep" in sup.tail()


def test_a_node_claiming_another_node_s_rank_is_ignored(node: Node) -> None:
    spec = node.setup()
    node.peer(B, "lie", report=report(("rep", 0, "node", "ready"), ("rep", 1, "c", "ready")))
    sup = node.supervise(spec)
    sup.wait_state("rep", "degraded", reason="reports no shard of rep")
    never_ready(node, 3)
    assert sup.metric('llmgw_peer_reports_ignored_total{replica="rep"}') >= 2


@pytest.mark.parametrize("mode, kind", [
    ("drip", "timeout"), ("hang", "timeout"), ("redirect", "redirect"),
    ("huge", "too-large"), ("malformed", "malformed"), ("flood", "too-large")])
def test_a_broken_peer_is_unknown_never_ready(node: Node, tmp_path: Path, mode: str,
                                              kind: str) -> None:
    spec = node.setup()
    record = tmp_path / "redirect-target.jsonl"
    target = node.peer("127.0.0.4", "proxy-record", extra=["--record", str(record)])
    del target
    extra = ["--interval", "0.3", "--location", f"http://127.0.0.4:{node.port}/v1/shards"]
    node.peer(B, mode, extra=extra)
    sup = node.supervise(spec, extra=["--peer-timeout", "1"])
    rss_before = sup.rss_kb()
    sup.wait_state("rep", "degraded", reason="supervisor on b unreachable", timeout=30)
    never_ready(node, 5)
    assert sup.metric(f'llmgw_peer_fetch_failures_total{{kind="{kind}",peer="b"}}') >= 1
    assert sup.alive()
    assert not record.exists() or not record.read_text().strip()  # nothing followed
    assert sup.rss_kb() - rss_before < 30_000  # a flood is cut at the size cap


def test_peers_are_never_reached_through_a_proxy(node: Node, tmp_path: Path) -> None:
    spec = node.setup()
    record = tmp_path / "proxy.jsonl"
    node.peer("127.0.0.5", "proxy-record", extra=["--record", str(record)])
    node.peer(B, "lie", report=report(("rep", 1, "b", "ready")))
    proxy = f"http://127.0.0.5:{node.port}"
    env = {name: proxy for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY",
                                    "all_proxy", "ALL_PROXY")}
    sup = node.supervise(spec, env=env)
    sup.wait_state("rep", "ready")  # b was reached directly
    assert not record.exists() or not record.read_text().strip()


def test_a_lying_peer_spends_the_budget_once_even_across_restarts(node: Node) -> None:
    """Plain HTTP believes whoever answers on b's address; the worst a liar can do is
    spend the group-restart budget, and a supervisor restart does not refill it."""
    spec = node.setup(budget=1)
    wait_until(lambda: node.engine_pid() > 0, 20, "the engine")
    first = node.engine_pid()
    node.peer(B, "lie", report=report(("rep", 1, "b", "failed")))
    sup = node.supervise(spec)
    sup.wait_state("rep", "failed", reason="group restart budget spent", timeout=40)
    assert node.engine_pid() != first  # the one restart the budget allowed
    assert "restarting this node's shard" in sup.tail()
    second = node.engine_pid()
    sup.stop()
    sup.start()  # as after a crash, or systemctl restart llmgw-supervisor
    seen = sup.wait_state("rep", "failed", reason="group restart budget spent")
    assert seen["group_restarts"] == 1
    time.sleep(4)  # an observation window longer than the backoff: nothing restarts
    assert node.engine_pid() == second
    assert sup.tail().count("restarting this node's shard") == 1


def test_with_tls_a_plain_liar_is_refused_and_restarts_nothing(node: Node,
                                                               tmp_path: Path) -> None:
    spec = node.setup(budget=3)
    files = cluster(tmp_path / "tls", [("node", "127.0.0.1"), ("b", B)])["node"]
    wait_until(lambda: node.engine_pid() > 0, 20, "the engine")
    first = node.engine_pid()
    node.peer(B, "lie", report=report(("rep", 1, "b", "failed")))
    sup = node.supervise(spec, extra=[
        "--tls-cert", files.cert, "--tls-key", files.key, "--tls-ca", files.ca,
        "--local", f"127.0.0.1:{free_port()}"])
    base = sup.base  # the plain loopback listener
    sup.wait_state("rep", "degraded", reason="unreachable", base=base)
    with Sampler(lambda: str(sup.replica("rep", base=base)["state"])) as sampler:
        time.sleep(5)  # more than the group-restart delay and backoff
    assert sampler.states() == {"degraded"}, sampler.seen
    assert node.engine_pid() == first
    assert sup.replica("rep", base=base)["group_restarts"] == 0
    assert sup.metric("llmgw_peer_fetch_failures_total", base=base) > 0
    assert "TLS handshake" in sup.tail()  # a plain server never completes one


def _raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(need, soft)), hard))


def test_thousands_of_idle_and_slow_clients(node: Node) -> None:
    spec = node.setup()
    node.peer(B, "lie", report=report(("rep", 1, "b", "ready")))
    sup = node.supervise(spec)
    sup.wait_state("rep", "ready")
    _raise_fd_limit(4000)
    idle: list[socket.socket] = []
    try:
        for _ in range(2000):  # connect and say nothing
            idle.append(socket.create_connection(("127.0.0.1", node.port), timeout=5))
        drippers = [socket.create_connection(("127.0.0.1", node.port), timeout=5)
                    for _ in range(100)]
        idle += drippers
        for i in range(3):  # byte-a-second clients, for a few seconds
            for sock in drippers:
                with contextlib.suppress(OSError):
                    sock.send(b"GET /v1/replicas HTTP/1.1\r\n"[i:i + 1])
            # others are answered meanwhile (the helper's socket timeout bounds it)
            assert sup.replica("rep")["state"] == "ready"
            time.sleep(1)
        assert sup.alive()
    finally:
        for sock in idle:
            sock.close()
    # 20,000 requests for unique paths: nothing is kept per path
    before = sup.rss_kb()
    with socket.create_connection(("127.0.0.1", node.port), timeout=10) as sock:
        reader = sock.makefile("rb")
        for i in range(20_000):
            sock.sendall(f"GET /v1/replicas/x{i} HTTP/1.1\r\nHost: a\r\n\r\n".encode())
            status = reader.readline()
            assert status.startswith(b"HTTP/1.1 404"), status
            length = 0
            while (line := reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            reader.read(length)
    grown = sup.rss_kb() - before
    assert grown <= 10_240, f"RSS grew by {grown} kB over 20,000 unique paths"
    assert sup.replica("rep")["state"] == "ready"


def test_stopped_unstarted_and_unrendered_units_cost_no_reads(node: Node,
                                                              tmp_path: Path) -> None:
    """A bulk read loads stopped units and systemd unloads them again; neither may
    trigger the next read. Nor may unrelated transient units coming and going."""
    lines = ["replicas:"]
    for name in ("active", "stopped", "unstarted", "unrendered"):
        lines += [f"  - name: {name}", "    engine: command", "    serving_rank: null",
                  "    health: {stability: 0}", "    nodes: [{name: node, address: 127.0.0.1}]",
                  "    ranks: [{commands: [{argv: [/usr/bin/sleep, infinity]}]}]"]
    full = write(tmp_path / "all.yaml", "\n".join(lines) + "\n")
    rendered = write(tmp_path / "rendered.yaml", "\n".join(lines[:-6]) + "\n")
    node.manager.render(rendered, "node")
    node.manager.systemctl("start", "llmgw-active.target", "llmgw-stopped.target")
    node.manager.systemctl("stop", "llmgw-stopped.target")
    sup = node.supervise(full)
    sup.wait_state("active", "ready")
    sup.wait_state("unrendered", "failed", reason="not-found")
    time.sleep(1)
    reads = sup.metric("llmgw_dbus_reads_total")
    time.sleep(10)  # two slow ticks of 5 s
    quiet = sup.metric("llmgw_dbus_reads_total") - reads
    assert quiet <= 4, f"{quiet} reads in 10 s with nothing changing"
    # unrelated units churning: 10 a second for 5 s
    reads = sup.metric("llmgw_dbus_reads_total")
    for i in range(50):
        subprocess.run(["systemd-run", "--user", "--quiet", f"--unit=churn-{i}", "/bin/true"],
                       env=node.manager.env, check=False, timeout=30, capture_output=True)
        time.sleep(0.1)
    churned = sup.metric("llmgw_dbus_reads_total") - reads
    assert churned <= 4, f"{churned} reads while unrelated units came and went"
    assert sup.replica("active")["state"] == "ready"



def own_reason(sup: SupervisorProcess, name: str) -> str:
    return str(sup.replica(name)["ranks"][0]["reason"])


def test_a_manager_stall_holds_the_last_read_then_says_unreachable(node: Node) -> None:
    """systemd frozen (as a manager busy reloading beside engines restarting): what it
    said last stands for the grace, said as such, while its processes run; then the
    rank is unknown and never ready until systemd answers again."""
    spec = node.setup()
    node.peer(B, "lie", report=report(("rep", 1, "b", "ready")))
    # the last read may be a slow tick (5 s) and a bus timeout old when the stall shows
    sup = node.supervise(spec, extra=["--dbus-timeout", "1", "--systemd-grace", "20"])
    sup.wait_state("rep", "ready")
    manager_pid = node.manager.pid
    os.kill(manager_pid, signal.SIGSTOP)
    try:
        wait_until(lambda: "systemd not answering" in own_reason(sup, "rep"), 20,
                   "the held read")
        # held, its engine still probed: longer than a probe result counts (4 s)
        with Sampler(node.state) as held:
            time.sleep(6)
        assert held.states() == {"ready"}, held.seen
        sup.wait_state("rep", "degraded", reason="systemd unreachable", timeout=40)
        never_ready(node, 4)
        assert sup.alive()
    finally:
        os.kill(manager_pid, signal.SIGCONT)
    sup.wait_state("rep", "ready", timeout=30)


def test_a_death_while_systemd_is_frozen_is_not_held(node: Node) -> None:
    """systemd frozen, then a main process of a non-serving shard (no probe to tell)
    killed: it is a zombie nobody reaps, and its replica leaves `ready` within the
    grace; the other replica's held read still stands."""
    spec = node.setup(side=True)
    node.peer(B, "lie", report=report(("rep", 1, "b", "ready")))
    node.peer(C, "lie", report=report(("side", 1, "c", "ready"), node="c"))
    sup = node.supervise(spec, extra=["--dbus-timeout", "1", "--systemd-grace", "60"])
    sup.wait_state("rep", "ready")
    sup.wait_state("side", "ready")
    side_engine = int(node.manager.show("llmgw-side-engine.service", "MainPID")["MainPID"])
    assert side_engine > 1
    manager_pid = node.manager.pid
    os.kill(manager_pid, signal.SIGSTOP)
    try:
        wait_until(lambda: "systemd not answering" in own_reason(sup, "side"), 30,
                   "the held read")
        os.kill(side_engine, signal.SIGKILL)
        sup.wait_state("side", "degraded", reason="main process gone", timeout=30)
        assert node.state("rep") == "ready"  # its process runs: its read still stands
        assert "systemd not answering" in own_reason(sup, "rep")
        assert sup.alive()
    finally:
        os.kill(manager_pid, signal.SIGCONT)
    sup.wait_state("rep", "ready", timeout=30)


def test_a_dbus_stall_longer_than_the_watchdog(node: Node, tmp_path: Path) -> None:
    """Run as its shipped unit runs (Type=notify, a watchdog) with a 2 s WatchdogSec=,
    then freeze dbus-daemon for three of those: the API says systemd is unreachable,
    never ready, and the watchdog does not kill the supervisor."""
    spec = node.setup()
    node.peer(B, "lie", report=report(("rep", 1, "b", "ready")))
    unit = "llmgw-test-supervisor.service"
    run = subprocess.run(
        ["systemd-run", "--user", f"--unit={unit}", "--property=Type=notify",
         "--property=NotifyAccess=main", "--property=WatchdogSec=2",
         str(Path(SUPERVISOR)), "--user", "--node", "node", "--listen",
         f"127.0.0.1:{node.port}", "--dbus-timeout", "1", "--systemd-grace", "2",
         "--state-dir",
         str(tmp_path / "state"), str(spec)],
        env=node.manager.env, capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    probe = ApiReader(node.manager, "node", f"http://127.0.0.1:{node.port}")
    probe.wait_state("rep", "ready", timeout=30)
    before = node.manager.show(unit, "MainPID", "NRestarts")
    bus = int(node.manager.show("dbus.service", "MainPID")["MainPID"])
    assert bus > 1
    os.kill(bus, signal.SIGSTOP)
    try:
        probe.wait_state("rep", "degraded", reason="systemd unreachable", timeout=10)
        with Sampler(lambda: str(probe.replica("rep")["state"])) as sampler:
            time.sleep(6)  # three watchdog periods, six bus timeouts
        assert sampler.states() == {"degraded"}, sampler.seen
    finally:
        os.kill(bus, signal.SIGCONT)
    probe.wait_state("rep", "ready", timeout=30)
    after = node.manager.show(unit, "MainPID", "NRestarts", "ActiveState", "Result")
    assert after == {**before, "ActiveState": "active", "Result": "success"}, (before, after)
    node.manager.systemctl("stop", unit)


def test_hanging_peers_do_not_starve_another_replica_s_probe(node: Node,
                                                              tmp_path: Path) -> None:
    """rep's peer hangs every fetch; wedged's engine accepts and never answers. Each has
    its own fetcher and prober: wedged is never ready, and rep's peer is just unknown."""
    spec = node.setup()
    wedged_port = free_port()
    with spec.open("a") as text:
        text.write(f"""\
  - name: wedged
    engine: command
    port: {wedged_port}
    health: {{path: /, interval: 1, timeout: 1, stability: 1}}
    nodes: [{{name: node, address: 127.0.0.1}}]
    ranks:
      - commands: [{{argv: [/usr/bin/python3, {STANDINS}/hanging_server.py, 127.0.0.1,
                            "{wedged_port}"]}}]
""")
    node.manager.render(spec, "node")
    node.manager.systemctl("start", "llmgw-wedged.target")
    node.peer(B, "hang")
    sup = node.supervise(spec)
    sup.wait_state("wedged", "starting", reason="no answer within 1 s")
    sup.wait_state("rep", "degraded", reason="supervisor on b unreachable")
    never_ready(node, 5, name="wedged")
    assert sup.alive()
