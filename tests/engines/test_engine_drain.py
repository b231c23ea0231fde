"""The engine tier's drain (docs/supervisor.md, "Drain"; docs/loadbalancer.md): the real
vLLM (CPU build) behind a real HAProxy, configured from the doc as written, on a third
machine (the bridge's namespace), with four clients throughout. Beside the vLLM replica in
rotation: `standby` on node-b, the stand-in tests/standins/completion_server.py as a
command engine, so that the load has somewhere to go (two vLLM replicas at once are more
than this machine's two cores carry). One vLLM replica runs at a time:

- `one`: one node (node-a);
- `tp`: the mp backend, tensor parallel over node-a (rank 0, serving) and node-b (rank 1).

They serve every scenario, in file order:

1. `systemctl restart llmgw-one.target`: not one request fails; HAProxy has taken `one`
   out within the drain delay; vLLM stopped in its drain mode (--shutdown-timeout, from
   drain.timeout) and the stop ended inactive, not killed at TimeoutStopSec=; `standby`
   is in rotation in every sample.
2. `systemctl restart llmgw-tp.target` on node-b, the worker: not one request fails (rank
   1 stops only once rank 0 has nothing in flight: its leaving breaks rank 0's
   collective), and `tp` comes back into rotation.
3. `llmgw-systemd drain tp --wait`, then `resume tp`: nothing fails, nothing stops; out
   of rotation within the delay, back within HAProxy's rise checks.
4. Failures never wait: SIGKILL of rank 1's main process alone; every rank of the group
   has a new main process within seconds (issue 42), with no drain step.
5. A spec change (a variable in every engine's environment) rolled node by node with
   `llmgw-render --apply`, as docs/generator.md shows: node-a's apply stages `tp`; node-b's
   restarts its changed replicas one at a time (`tp` once, as a group), each waited for
   until it is routable again. Not one request fails, `tp` or `standby` is in HAProxy's
   rotation in every sample, each engine restarts exactly once, and every engine process
   runs the new environment.
6. Slow is not down: `tp` alone, its processes pinned to one core, under four times the
   clients, health.timeout 1 s: in HAProxy's rotation in every sample, nothing fails,
   and the serving node's supervisor says ready throughout.
7. node-b's supervisor restarted under the load: `tp` in rotation in every sample,
   nothing fails.

Bounds here are the test's, never asserted figures: bench/drain.py measures."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import rolling
from loadbalancer import (
    HAProxy,
    Request,
    Sampler,
    Server,
    Traffic,
    bridge_address,
    in_rotation,
    not_in_rotation,
    out_window,
    summary,
    transitions,
)
from realengine import ENGINE_ARGS, MODEL, VENV, assert_engines, complete, env_yaml, manager_pids
from specs import PYTHON, free_port, write, yaml_list
from supervisors import Sampler as StateSampler
from supervisors import SupervisorProcess, stop_and_show
from systemd_harness import STANDINS, Nodes, UserManager, cgroup_pids, hub_of, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.engines]

API_PORT = 9470
# the replicas' drain: the delay is the product's default; 3 s was once too short for
# HAProxy's two checks of a supervisor answering slowly beside the other CI lane (a request
# sent to `standby` as it stopped failed 502)
DELAY, TIMEOUT = 5, 10
LB_ADDRESS = "192.0.2.100"
CLIENTS = 4
SETTLE = 5  # slack on top of a bound, for a loaded machine
BACK = 300  # bound on a vLLM restart on this machine's two cores
RISE = 1.25  # HAProxy's `rise 2` checks: one, and `fastinter 250ms` later the second
# (docs/loadbalancer.md)
ADDRESS = {"node-a": "192.0.2.1", "node-b": "192.0.2.2"}
NODES = {"one": ("node-a",), "tp": ("node-a", "node-b"), "standby": ("node-b",)}
VLLM_REPLICAS = {"one", "tp"}


def spec_text(ports: dict[str, int], master: int, delay: int = DELAY, timeout: int = TIMEOUT,
              rollout: str = "") -> str:
    """rollout: a value for ROLLOUT in every engine's environment (a spec change)."""
    extra = {"ROLLOUT": rollout} if rollout else {}
    common = f"""\
    drain: {{delay: {delay}, timeout: {timeout}}}
    restart: {{delay: 2, burst: 20, interval: 900}}
    health: {{interval: 1, timeout: 2, stability: 2, generation: {{interval: 1, timeout: 5}}}}
"""
    vllm = f"""\
    engine: vllm
    launch_mode: mp
    model: {MODEL}
    virtualenv: {VENV}
    env: {env_yaml(extra)}
    args: {ENGINE_ARGS}
    stop_timeout: 20
    group_restart: {{delay: 1, max_delay: 8, budget: 10, window: 900}}
"""
    standby = [PYTHON, str(STANDINS / "completion_server.py"), "--port",
               str(ports["standby"]), "--delay", "0.2"]
    return f"""\
replicas:
  - name: one
{vllm}{common}    port: {ports["one"]}
    nodes: [{{name: node-a, address: 192.0.2.1, interface: eth0}}]
  - name: tp
{vllm}{common}    tensor_parallel_size: 2
    port: {ports["tp"]}
    rendezvous_port: {master}
    distributed_timeout: 60
    nodes:
      - {{name: node-a, address: 192.0.2.1, interface: eth0}}
      - {{name: node-b, address: 192.0.2.2, interface: eth0}}
  - name: standby
    engine: command
    serving_rank: 0
    port: {ports["standby"]}
    progress: {{steps: [completion_steps_total], pending: [completion_running]}}
{common}    nodes: [{{name: node-b, address: 192.0.2.2}}]
    env: {env_yaml(extra)}
    ranks:
      - commands:
          - argv: {yaml_list(standby)}
"""


@dataclass
class Cluster:
    nodes: Nodes
    base: dict[str, str]  # replica: its serving rank's URL
    sups: dict[str, SupervisorProcess]
    lb: HAProxy
    hub: str
    spec: Path
    ports: dict[str, int]
    master: int

    def traffic(self, seconds: float = 900) -> Traffic:
        return Traffic(self.lb.url, clients=CLIENTS, seconds=seconds, timeout=60,
                       netns=self.hub)

    def main_pid(self, node: str, replica: str) -> int:
        unit = f"llmgw-{replica}-engine.service"
        return int(self.nodes[node].show(unit, "MainPID")["MainPID"])

    def log(self, node: str, replica: str) -> str:
        path = self.nodes[node].log_dir / f"llmgw-{replica}-engine.service.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def step_lines(self, node: str, replica: str) -> list[str]:
        """What llmgw-stop-group said in the engine's log."""
        return [line for line in self.log(node, replica).splitlines()
                if line.startswith(f"llmgw-stop-group: {replica}: ")]

    def serving(self, replica: str) -> None:
        """The replica, and none of the other vLLM ones, serving and in HAProxy's rotation
        (started if it is not)."""
        for other in VLLM_REPLICAS - {replica}:
            for node in NODES[other]:
                self.nodes[node].systemctl("stop", f"llmgw-{other}.target")
        for node in reversed(NODES[replica]):  # the worker first: rank 0 waits for it
            self.nodes[node].systemctl("start", f"llmgw-{replica}.target")
        wait_until(functools.partial(self.completes, replica), BACK, f"{replica} to complete",
                   interval=1)
        self.lb.wait_until_up(replica, timeout=60)

    def completes(self, replica: str) -> bool:
        return complete(self.nodes["node-a"], self.base[replica]) == 200


@contextlib.contextmanager
def running(nodes: Nodes, tmp: Path, delay: int = DELAY, timeout: int = TIMEOUT
            ) -> Iterator[Cluster]:
    """The replicas (drain: {delay, timeout}) rendered on `nodes`, both supervisors up, the
    standby serving behind HAProxy (the vLLM replicas start with Cluster.serving);
    afterwards every unit stopped and nothing left."""
    assert_engines()
    ports = {r: free_port() for r in ("one", "tp", "standby")}
    master = free_port()
    spec = write(tmp / "spec.yaml", spec_text(ports, master, delay, timeout))
    sups: list[SupervisorProcess] = []
    lb: HAProxy | None = None
    try:
        for node, address in ADDRESS.items():
            nodes[node].render(spec, node)
            # sockets kept across a restart, as the shipped unit has systemd keep them
            sups.append(SupervisorProcess(nodes[node], node, spec,
                                          listen=f"{address}:{API_PORT}",
                                          state_dir=tmp / f"state-{node}",
                                          keep_sockets=True))
        nodes["node-b"].systemctl("start", "llmgw-standby.target")
        netns = nodes["node-a"].netns
        assert netns is not None
        hub = bridge_address(hub_of(netns), LB_ADDRESS)
        serving = {r: NODES[r][0] for r in ports}  # the serving rank's node
        servers = [Server(r, ADDRESS[n], ports[r], ADDRESS[n], API_PORT, n)
                   for r, n in serving.items()]
        lb = HAProxy(tmp / "lb", servers, netns=hub, port=8080).start(timeout=30)
        lb.wait_until_up("standby", timeout=60)
        base = {r: f"http://{ADDRESS[n]}:{ports[r]}" for r, n in serving.items()}
        yield Cluster(nodes, base, {s.node: s for s in sups}, lb, hub, spec, ports, master)
        for node in ADDRESS:
            nodes[node].systemctl("stop", *(f"llmgw-{r}.target" for r in ports
                                             if node in NODES[r]))
            assert not manager_pids(nodes[node]), f"{node}: processes left behind"
    finally:
        if lb is not None:
            lb.stop()
            print("===== haproxy log\n" + lb.log()[-3000:])
        stop_and_show(sups)


@pytest.fixture(scope="module")
def cluster(shared_two_nodes: Nodes, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Cluster]:
    with running(shared_two_nodes, tmp_path_factory.mktemp("engine-drain")) as cluster:
        yield cluster


def timed_out(manager: UserManager, unit: str) -> bool:
    """Whether systemd ended a stop of the unit at TimeoutStopSec= (and killed it)."""
    return f"{unit}: Failed with result 'timeout'" in manager.log_text()


@dataclass(frozen=True)
class Disruption:
    """One planned restart under load: the requests; when it was asked, when systemctl
    returned, when HAProxy had the replica back; the sampler's view of the replica
    (out: first sample without it after asked; came_back: first with it after that)."""

    requests: list[Request]
    asked: float
    returned: float
    back: float
    out: float | None
    came_back: float | None
    samples: list[tuple[float, frozenset[str] | None]]

    @property
    def failed(self) -> list[Request]:
        return [r for r in self.requests if r.status != 200]

    def served_after_back(self, replica: str) -> int:
        return sum(1 for r in self.requests
                   if r.started >= self.back and r.status == 200 and r.server == replica)

    def last(self, count: int = 12) -> list[tuple[float, float, str, int]]:
        """The last requests: (started, relative to back; took; server; status)."""
        return [(round(r.started - self.back, 2), round(r.took, 2), r.server, r.status)
                for r in sorted(self.requests, key=lambda r: r.started)[-count:]]


def planned_restart(cluster: Cluster, node: str, replica: str) -> Disruption:
    """`systemctl restart llmgw-REPLICA.target` on `node` under the load, until HAProxy
    has the replica back and it served a few seconds more."""
    lb, serving = cluster.lb, NODES[replica][0]

    def said() -> str:
        return "; ".join(f"{r}: {data['state']}: {data.get('reason', '')}"
                         for r, n in ((replica, serving), ("standby", "node-b"))
                         for data in (cluster.sups[n].replica(r),))
    with Sampler(lb, interval=0.25) as sampler, cluster.traffic() as traffic, \
            StateSampler(said, 0.2) as states:
        time.sleep(3)  # both serve
        asked = time.monotonic()
        cluster.nodes[node].systemctl("restart", f"llmgw-{replica}.target")
        returned = time.monotonic()
        # the new engine serving first: with no drain, systemctl returns before HAProxy
        # has even noticed that the old one went
        wait_until(functools.partial(cluster.completes, replica), BACK,
                   f"{replica} to complete again", interval=1)
        lb.wait_until_up(replica, timeout=BACK)
        back = time.monotonic()
        time.sleep(3)  # it serves again
        traffic.finish()
    seen = [(at, up is not None and replica in up) for at, up in sampler.samples]
    out = next((at for at, up in seen if at > asked and not up), None)
    came_back = next((at for at, up in seen if out is not None and at > out and up), None)
    changes = [(round(at - asked, 1), state) for i, (at, state) in enumerate(states.seen)
               if i == 0 or states.seen[i - 1][1] != state]
    print(f"the supervisors, from the restart on: {changes}")
    return Disruption(traffic.requests, asked, returned, back, out, came_back,
                      list(sampler.samples))


def out_window_of(restart: Disruption, replica: str) -> tuple[float, float]:
    """When the replica left rotation (after it was asked) and came back."""
    out, came_back = out_window(restart.samples, replica)
    assert restart.asked < out, (restart.asked, out)
    return out, came_back


def crash(cluster: Cluster, node: str, replica: str) -> float:
    """SIGKILL of every process of the replica's engine unit on `node`, as when the node
    dies: seconds until its next engine process runs (a new MainPID)."""
    manager, unit = cluster.nodes[node], f"llmgw-{replica}-engine.service"
    old = cluster.main_pid(node, replica)
    killed = time.monotonic()
    manager.systemctl("kill", "--signal=SIGKILL", unit)

    def again() -> float | None:
        return (time.monotonic() - killed if cluster.main_pid(node, replica) not in (0, old)
                else None)
    return wait_until(again, 60, f"{unit} to run again", interval=0.05)


def test_restart_of_a_one_node_replica_fails_nothing(cluster: Cluster) -> None:
    cluster.serving("one")
    old = cluster.main_pid("node-a", "one")
    restart = planned_restart(cluster, "node-a", "one")
    out, came_back = out_window_of(restart, "one")
    print(f"figure: restart of one: {summary(restart.requests)}; systemctl restart took "
          f"{restart.returned - restart.asked:.1f} s; out of rotation at "
          f"+{out - restart.asked:.2f} s, back at +{came_back - restart.asked:.1f} s")
    assert not restart.failed, restart.failed[:5]
    assert out < restart.asked + DELAY + SETTLE
    assert in_rotation(restart.samples, "standby", 0, float("inf")), \
        not_in_rotation(restart.samples, "standby")
    assert cluster.main_pid("node-a", "one") not in (0, old)
    assert restart.served_after_back("one") > 0, restart.last()
    # vLLM drained on SIGTERM (its --shutdown-timeout, from drain.timeout), and the stop
    # ended before TimeoutStopSec=
    assert f"mode=drain timeout={TIMEOUT}s" in cluster.log("node-a", "one")
    assert not timed_out(cluster.nodes["node-a"], "llmgw-one-engine.service")
    step = cluster.step_lines("node-a", "one")
    assert any("out of rotation: waiting for the gateways to notice" in s for s in step), step


def test_planned_restart_of_the_worker_node_fails_nothing(cluster: Cluster) -> None:
    cluster.serving("tp")
    old = cluster.main_pid("node-b", "tp")
    restart = planned_restart(cluster, "node-b", "tp")
    out, came_back = out_window_of(restart, "tp")
    print(f"figure: restart of tp's worker node: {summary(restart.requests)}; systemctl "
          f"restart took {restart.returned - restart.asked:.1f} s; out of rotation at "
          f"+{out - restart.asked:.2f} s, back at +{came_back - restart.asked:.1f} s; rank 1 "
          f"said {cluster.step_lines('node-b', 'tp')}")
    assert not restart.failed, restart.failed[:5]
    assert out < restart.asked + DELAY + SETTLE
    assert in_rotation(restart.samples, "standby", 0, float("inf")), \
        not_in_rotation(restart.samples, "standby")
    assert cluster.main_pid("node-b", "tp") not in (0, old)
    assert restart.served_after_back("tp") > 0, restart.last()
    # rank 1 waited for rank 0 to have nothing in flight, then went
    assert cluster.step_lines("node-b", "tp")[-1].endswith(": drained")
    assert not timed_out(cluster.nodes["node-b"], "llmgw-tp-engine.service")


def test_drain_wait_and_resume_fail_nothing_and_stop_nothing(cluster: Cluster) -> None:
    lb, sup = cluster.lb, cluster.sups["node-a"]
    cluster.serving("tp")
    pids = {node: cluster.main_pid(node, "tp") for node in ADDRESS}
    with Sampler(lb, interval=0.25) as sampler, cluster.traffic() as traffic:
        time.sleep(3)
        asked = time.monotonic()
        drained = sup.cli("drain", "tp", "--wait", "--reason", "test")
        returned = time.monotonic()
        assert drained.returncode == 0, (drained.stdout, drained.stderr)
        lb.wait_until_down("tp", timeout=SETTLE)
        time.sleep(3)  # the standby alone carries the load meanwhile
        resumed = time.monotonic()
        done = sup.cli("resume", "tp")
        assert done.returncode == 0, (done.stdout, done.stderr)
        lb.wait_until_up("tp", timeout=RISE + SETTLE)
        back = time.monotonic()
        time.sleep(2)
        requests = traffic.finish()
    out, came_back = out_window(sampler.samples, "tp")
    print(f"figure: drain --wait of tp: {summary(requests)}; returned after "
          f"{returned - asked:.1f} s; out of rotation at +{out - asked:.2f} s; back "
          f"{back - resumed:.1f} s after resume")
    assert not traffic.failed, traffic.failed[:5]
    assert asked < out < asked + DELAY + 1  # within the delay, and a sample's slack
    assert resumed < came_back < resumed + RISE + SETTLE
    assert in_rotation(sampler.samples, "standby", 0, float("inf")), \
        not_in_rotation(sampler.samples, "standby")
    assert {node: cluster.main_pid(node, "tp") for node in ADDRESS} == pids
    assert not [r for r in requests if r.server == "tp" and out < r.started < resumed]
    assert traffic.served_by(since=back).get("tp", 0) > 0, traffic.served_by(back)


# issue 42's bound on an idle machine, from the kill to every rank's new main process
# (restart.delay 2 s included); this tier shares two cores with the other CI lane
REGROUP = 5


def test_a_killed_rank_restarts_the_whole_group_at_once(cluster: Cluster) -> None:
    """SIGKILL of rank 1's main process alone (vLLM's worker outlives it, serving):
    systemd runs the ExecStop=, whose drain step finds the main process gone and SIGKILLs
    what is left at once; node-b reports the rank failed from its death, and node-a's
    supervisor restarts its own shard on that, not on seeing rank 1 running again. Every
    rank of the group has a new main process within REGROUP s (+ SETTLE here); at 724de46
    it took 41.8 s (issue 42)."""
    node_a, node_b = cluster.nodes["node-a"], cluster.nodes["node-b"]
    unit = "llmgw-tp-engine.service"
    cluster.serving("tp")
    steps = len(cluster.step_lines("node-b", "tp"))
    before = {n: cluster.nodes[n].show(unit, "InvocationID", "MainPID") for n in ADDRESS}
    killed = time.monotonic()
    node_b.kill_main(unit)

    def regrouped() -> dict[str, float] | None:
        for node in ADDRESS:
            now = cluster.nodes[node].show(unit, "InvocationID", "MainPID")
            if node not in seen and now["InvocationID"] != before[node]["InvocationID"] \
                    and now["MainPID"] not in ("0", before[node]["MainPID"]):
                seen[node] = time.monotonic() - killed
        return seen if len(seen) == len(ADDRESS) else None

    seen: dict[str, float] = {}
    wait_until(regrouped, 120, "every rank of tp to have a new main process", interval=0.1)
    print(f"figure: SIGKILL of rank 1's main process: new main process on "
          f"{ {n: round(s, 2) for n, s in sorted(seen.items())} } s after")
    said = cluster.step_lines("node-b", "tp")[steps:]
    assert said and all(line.endswith(": no drain") for line in said), said
    assert "SIGKILL to what is left at once" in cluster.log("node-b", "tp")
    assert max(seen.values()) < REGROUP + SETTLE, (seen, node_a.dump()[-3000:])
    cluster.serving("tp")  # and the group serves again


def engine_environ(manager: UserManager, replica: str) -> dict[str, str]:
    return rolling.engine_environ(manager, f"llmgw-{replica}-engine.service")


ENGINES = (("node-a", "tp"), ("node-b", "tp"), ("node-b", "standby"))
ROLLED = ("tp", "standby")  # the replicas in rotation during a roll


@dataclass(frozen=True)
class Roll:
    """One spec change rolled node by node under the load (roll())."""

    requests: list[Request]
    lines: dict[str, list[str]]  # node: what its apply printed
    applies: dict[str, float]  # node: seconds its apply took
    samples: list[tuple[float, frozenset[str] | None]]
    invocations: dict[tuple[str, str], set[str]]  # (node, replica): engine starts seen
    took: float  # from the first apply until every rolled replica is back in rotation

    @property
    def failed(self) -> list[Request]:
        return [r for r in self.requests if r.status != 200]

    def fewest_in_rotation(self) -> int:
        return min(len((up or frozenset()) & set(ROLLED)) for _, up in self.samples)

    def restarts(self) -> dict[str, int]:
        """Per engine, how many times it started during the roll."""
        return {f"{r}@{n}": len(ids) - 1 for (n, r), ids in self.invocations.items()}

    def around(self, request: Request) -> list[tuple[float, list[str]]]:
        """HAProxy's rotation in the samples from 6 s before a request to 1 s after it
        (times relative to its start): what a failed request's message shows."""
        return [(round(at - request.started, 2), sorted(up or ())) for at, up in self.samples
                if request.started - 6 <= at <= request.started + 1]

    def out_of_rotation(self, server: str) -> float:
        """Seconds `server` spent out of HAProxy's rotation during the roll."""
        changes = transitions(self.samples, server)
        out = 0.0
        for (at, up), (after, _) in zip(changes, [*changes[1:], (self.samples[-1][0], True)]):
            out += after - at if not up else 0.0
        return out


def roll(cluster: Cluster, value: str, *extra: str) -> Roll:
    """ROLLOUT=value into every engine's environment, applied on node-a, then node-b
    (`llmgw-render --apply EXTRA`), under the load; until every rolled replica serves
    again and is back in HAProxy's rotation."""
    cluster.serving("tp")
    seen = {(n, r): {cluster.nodes[n].show(f"llmgw-{r}-engine.service", "InvocationID")
                     ["InvocationID"]} for n, r in ENGINES}

    def invocations() -> str:
        for node, replica in ENGINES:
            now = cluster.nodes[node].show(f"llmgw-{replica}-engine.service",
                                           "InvocationID")["InvocationID"]
            if now:
                seen[(node, replica)].add(now)
        return ""
    write(cluster.spec, spec_text(cluster.ports, cluster.master, rollout=value))
    lines, applies = {}, {}
    with Sampler(cluster.lb, interval=0.25, limit=1800) as sampler, \
            cluster.traffic(seconds=1800) as traffic, StateSampler(invocations, 0.5):
        time.sleep(3)
        started = time.monotonic()
        for node in ("node-a", "node-b"):
            begun = time.monotonic()
            lines[node] = cluster.nodes[node].apply(cluster.spec, node, *extra).stdout \
                .splitlines()
            applies[node] = time.monotonic() - begun
        for replica in ROLLED:
            wait_until(functools.partial(cluster.completes, replica), BACK,
                       f"{replica} to complete", interval=1)
            cluster.lb.wait_until_up(replica, timeout=BACK)
        took = time.monotonic() - started
        time.sleep(3)
        requests = traffic.finish()
    return Roll(requests, lines, applies, list(sampler.samples), seen, took)


def test_a_change_rolled_node_by_node_fails_nothing(cluster: Cluster) -> None:
    done = roll(cluster, "second")
    first, last = done.lines["node-a"], done.lines["node-b"]
    print(f"figure: roll over two nodes: {summary(done.requests)}; applies took "
          f"{done.applies}; fewest in rotation {done.fewest_in_rotation()}; restarts "
          f"{done.restarts()}; {first} {last}")
    assert first[0].startswith("replica one: updated (changed: "), first
    assert first[0].endswith("; not running, so left stopped)"), first
    assert first[1].startswith("replica tp: staged (changed: "), first
    assert sorted(line.split(" (")[0] for line in last) == [
        "replica standby: restarted", "replica tp: restarted"], last
    assert any("every rank carries version" in line for line in last), last
    assert not done.failed, (done.failed[:5], done.around(done.failed[0]), {
        replica: cluster.step_lines("node-b", replica) for replica in ROLLED})
    # never both out of rotation: every sample has tp or standby in it
    assert done.fewest_in_rotation() >= 1, [
        (round(at, 1), up) for at, up in done.samples
        if not (up or frozenset()) & set(ROLLED)][:10]
    for node, replica in ENGINES:
        assert engine_environ(cluster.nodes[node], replica).get("ROLLOUT") == "second"
    # one restart per engine for the whole roll
    assert done.restarts() == {"tp@node-a": 1, "tp@node-b": 1, "standby@node-b": 1}


# How long the saturation below lasts: long enough in CI to have seen, at 724de46, a
# replica leave rotation on one slow probe (issue 40 saw one in 120 s of lighter load);
# LLMGW_TEST_SATURATION_SECONDS=300 for the five minutes bench/saturation.py reports.
SATURATION = float(os.environ.get("LLMGW_TEST_SATURATION_SECONDS", "90"))


def said(sup: SupervisorProcess, replica: str) -> str:
    status, data = sup.get(f"/v1/replicas/{replica}", timeout=5)
    if status != 200 or not isinstance(data, dict):
        return f"error: HTTP {status}"
    ranks = "; ".join(str(r["reason"]) for r in data.get("ranks", ()))
    progress = data.get("progress") or {}
    return (f"{data['state']}: {data['reason']} [{ranks}] (progress: "
            f"{progress.get('verdict')}: {progress.get('reason')})")


def pin(cluster: Cluster, cpus: str) -> int:
    """Every process (and thread) of tp's engine units, on both nodes, on `cpus`; how
    many processes were."""
    pinned = 0
    for node in NODES["tp"]:
        group = cluster.nodes[node].show("llmgw-tp-engine.service",
                                         "ControlGroup")["ControlGroup"]
        for pid in cgroup_pids(group):
            done = subprocess.run(["taskset", "-a", "-c", "-p", cpus, str(pid)],
                                  capture_output=True, check=False, timeout=10)
            pinned += done.returncode == 0
    return pinned


def health_timeout(cluster: Cluster, seconds: int) -> None:
    """health.timeout for every replica; both supervisors read the spec again within
    their slow timer (5 s: they look at its mtime), and no unit changes."""
    text = cluster.spec.read_text()
    changed = re.sub(r"health: \{interval: 1, timeout: \d+,",
                     f"health: {{interval: 1, timeout: {seconds},", text)
    assert changed.count(f"interval: 1, timeout: {seconds},") == 3, changed
    write(cluster.spec, changed)
    time.sleep(8)


def test_a_saturated_replica_stays_in_rotation(cluster: Cluster) -> None:
    """Slow is not down (docs/supervisor.md): `tp` (two engine processes on the two
    cores, pinned to one) alone in rotation (the stand-in drained) under four times the
    usual clients, health.timeout 1 s, so that its health probes and one-token checks
    answer late. It
    stays in HAProxy's rotation in every sample, no request fails, and node-a's
    supervisor (its serving rank) never says anything but ready."""
    cluster.serving("tp")
    sup, standby = cluster.sups["node-a"], cluster.sups["node-b"]
    # every request to tp: the stand-in out of rotation (an operator's drain)
    drained = standby.cli("drain", "standby", "--wait", "--reason", "saturate tp")
    assert drained.returncode == 0, (drained.stdout, drained.stderr)
    cluster.lb.wait_until_down("standby", timeout=DELAY + SETTLE)
    words = StateSampler(functools.partial(said, sup, "tp"), interval=0.5)
    traffic = Traffic(cluster.lb.url, clients=4 * CLIENTS, seconds=SATURATION,
                      max_tokens=64, timeout=120, netns=cluster.hub)
    try:
        # every process of tp's units on both nodes pinned to one core, which they
        # saturate: the API servers' event loops wait behind the engines' threads
        assert pin(cluster, "0") >= 3, "tp's processes not pinned"
        health_timeout(cluster, 1)
        with Sampler(cluster.lb, interval=0.25, limit=SATURATION + 300) as lb, words:
            start = time.monotonic()
            with traffic:
                pass
            end = time.monotonic()
    finally:
        pin(cluster, f"0-{(os.cpu_count() or 1) - 1}")
        health_timeout(cluster, 2)
        standby.cli("resume", "standby")
    requests = traffic.requests
    failed = [r for r in requests if r.status != 200]
    slow = sum(1 for _, s in words.seen if "slow: " in s or "busy" in s)
    took = sorted(r.took for r in requests if r.server == "tp" and r.status == 200)
    print(f"figure: saturation {SATURATION:.0f} s: {summary(requests)}; tp's median "
          f"{took[len(took) // 2] if took else 0:.1f} s, slowest {max(took, default=0):.1f} s; "
          f"samples slow or busy {slow} of {len(words.seen)}")
    not_ready = [(round(t - start, 1), s) for t, s in words.seen if not s.startswith("ready")]
    assert not not_ready, not_ready[:5]
    assert in_rotation(lb.samples, "tp", start, end), not_in_rotation(lb.samples, "tp")[:10]
    assert not failed, failed[:5]


def test_a_restart_of_either_node_s_supervisor_takes_nothing_out(cluster: Cluster) -> None:
    """A supervisor restart no gateway notices (docs/supervisor.md): each node's
    supervisor restarted in turn (SIGTERM, then the same command line, its API sockets
    kept as systemd keeps them for the shipped unit), the worker node's first, while tp
    serves the load behind HAProxy. tp stays in rotation in every sample and no request
    fails: HAProxy's checks of node-a wait in the kept socket's backlog and get the new
    supervisor's first verdict, from the evidence it saved."""
    cluster.serving("tp")
    worker, leader = cluster.sups["node-b"], cluster.sups["node-a"]
    with Sampler(cluster.lb, interval=0.25) as lb, cluster.traffic() as traffic:
        time.sleep(2)
        start = time.monotonic()
        worker.restart()
        worker.wait_state("tp", "ready", 30)
        time.sleep(3)
        between = time.monotonic()
        leader.restart()
        leader.wait_state("tp", "ready", 60)
        time.sleep(5)
        end = time.monotonic()
        requests = traffic.finish()
    out = [(round(t - between, 2), up) for t, up in lb.samples
           if t > between and up is not None and "tp" not in up]
    print(f"figure: supervisor restarts under load: {summary(requests)}; while node-a's "
          f"own restarted, tp out of rotation in {len(out)} samples of 0.25 s")
    assert "the socket systemd kept across the restart" in leader.tail(20000)
    assert in_rotation(lb.samples, "tp", start, end), not_in_rotation(lb.samples, "tp")[:10]
    assert not [r for r in requests if r.status != 200], summary(requests)
