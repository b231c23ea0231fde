"""A restart of a node's supervisor (a package upgrade, `systemctl restart`) takes no
replica out of rotation (docs/supervisor.md, "A peer's supervisor restarting" and "A
restarted supervisor starts from what it knew"), while a node that goes silent still
counts as unknown by today's rules: the stand-in replica over two nodes, a supervisor
on each, each node's word sampled every 0.1 s throughout.

- node-b's supervisor stopped (SIGTERM) and started again with the same command line,
  its socket not kept: node-a's refused fetches hold node-b's last answer within the
  grace, so node-a says ready in every sample;
- node-a's (the serving node's) supervisor restarted: its API socket kept across the
  restart (as the shipped unit's FileDescriptorStoreMax= has systemd keep it), every
  request sent meanwhile is answered, and ready (its saved probes and node-b's saved
  answer, marked saved); node-b says ready in every sample;
- the controls: with `--peer-grace 0` the same restart of node-b takes the replica out
  on node-a, and without the kept socket node-a's own restart refuses requests, so the
  samples above can fail;
- node-b cut off the network (its supervisor silent, not refusing): node-a says degraded,
  rank 1 unreachable, as before.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from specs import free_port, two_node_replica
from supervisors import Sampler, SupervisorProcess, stop_and_show
from systemd_harness import Nodes, set_link, wait_until

pytestmark = pytest.mark.integration

API_PORT = 9470
TARGET = "llmgw-rep.target"
SETTLE = 3.0  # seconds sampled after a restart's supervisor answers again


def state_of(sup: SupervisorProcess) -> str:
    status, data = sup.get("/v1/replicas/rep", timeout=2)
    if status != 200 or not isinstance(data, dict):
        return f"error: HTTP {status}"
    ranks = "; ".join(f"rank {r['rank']}: {r['reason']}" for r in data.get("ranks", ()))
    return f"{data['state']}: {data['reason']} [{ranks}]"


Pair = tuple[Nodes, Path, list[SupervisorProcess]]


@pytest.fixture
def pair(two_nodes: Nodes, tmp_path: Path) -> Iterator[Pair]:
    http, head = free_port(), free_port()
    spec = two_node_replica(tmp_path / "spec.yaml", name="rep",
                            leader=two_nodes.address("node-a"),
                            worker=two_nodes.address("node-b"), http=http, head=head,
                            pid_file=tmp_path / "head.pids", delay=2, burst=20, interval=900)
    spec.write_text(spec.read_text() + "    health: {interval: 1, timeout: 1, stability: 2}\n")
    sups: list[SupervisorProcess] = []
    try:
        for node in ("node-a", "node-b"):
            manager = two_nodes[node]
            assert manager.netns is not None
            manager.render(spec, node)
            sups.append(SupervisorProcess(manager, node, spec,
                                          listen=f"{manager.netns.address}:{API_PORT}",
                                          keep_sockets=True))
        two_nodes["node-b"].systemctl("start", TARGET)
        two_nodes["node-a"].systemctl("start", TARGET)
        for sup in sups:
            sup.wait_state("rep", "ready", 90)
        yield two_nodes, spec, sups
    finally:
        stop_and_show(sups)


def restart(sup: SupervisorProcess, *, extra: list[str] | None = None,
            keep_sockets: bool = True) -> float:
    """SIGTERM, then the same command line (with `extra` options), its API socket kept
    unless told otherwise; when it answers."""
    sup.stop(release=not keep_sockets)
    if extra is not None:
        sup.extra = extra
    sup.start()
    return time.monotonic()


def test_a_restart_of_either_supervisor_takes_nothing_out_of_rotation(pair: Pair) -> None:
    _, _, (sup_a, sup_b) = pair
    with Sampler(lambda: state_of(sup_a)) as on_a:
        # not kept: its fetches are refused meanwhile, the grace's case (a supervisor
        # started again after a stop, or of a release that does not keep its socket)
        answering = restart(sup_b, keep_sockets=False)
        time.sleep(SETTLE)
    said = [s for _, s in on_a.seen]
    assert said and all(s.startswith("ready") for s in said), \
        f"node-a while node-b's supervisor restarted: {sorted(set(said))}"
    assert any("as reported" in s for s in said), "node-b's refusals were never seen"
    sup_b.wait_state("rep", "ready", 10)
    assert answering > 0

    with Sampler(lambda: state_of(sup_b)) as on_b, Sampler(lambda: state_of(sup_a)) as again:
        restart(sup_a)
        time.sleep(SETTLE)
    said_b = [s for _, s in on_b.seen]
    assert said_b and all(s.startswith("ready") for s in said_b), \
        f"node-b while node-a's supervisor restarted: {sorted(set(said_b))}"
    answered = [s for _, s in again.seen]
    assert answered and all(s.startswith("ready") for s in answered), \
        f"node-a's answers through its restart: {sorted(set(answered))}"
    log = sup_a.tail(20000)
    assert "starting from the evidence saved" in log
    assert "the socket systemd kept across the restart" in log


def test_without_the_grace_a_peer_restart_takes_it_out(pair: Pair) -> None:
    """The control for the samples above: they can fail."""
    _, _, (sup_a, sup_b) = pair
    with Sampler(lambda: state_of(sup_a)) as own:
        restart(sup_a, extra=["--peer-grace", "0"], keep_sockets=False)
    assert any(s.startswith("error") for _, s in own.seen), \
        f"node-a's restart without its kept socket refused nothing: {own.states()}"
    sup_a.wait_state("rep", "ready", 30)
    with Sampler(lambda: state_of(sup_a)) as on_a:
        restart(sup_b, keep_sockets=False)
        time.sleep(SETTLE)
    said = [s for _, s in on_a.seen]
    assert any(s.startswith("degraded") and "unreachable" in s for s in said), \
        f"node-a never noticed node-b's supervisor gone: {sorted(set(said))}"


def test_a_silent_peer_still_counts_as_unknown(pair: Pair) -> None:
    """A node cut off the network does not refuse: it is silent, and keeps today's
    rules (no grace)."""
    nodes, _, (sup_a, _) = pair
    netns = nodes["node-b"].netns
    assert netns is not None
    set_link(netns, connected=False)
    try:
        sup_a.wait_state("rep", "degraded", 30, reason="unreachable")
    finally:
        set_link(netns, connected=True)
    wait_until(lambda: state_of(sup_a).startswith("ready"), 60, "ready again", interval=0.5)
