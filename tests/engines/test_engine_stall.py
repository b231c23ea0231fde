"""The engine tier, bad days across two nodes (docs/supervisor.md, "Stalls";
docs/engines.md): the real vLLM on mp and on Ray, tensor parallel over two network
namespaces, each node with its own systemd and supervisor. One replica per backend serves
every scenario in turn (a start of TP=2 costs a minute of these two cores):

- saturation: more long completions than --max-num-seqs for three times stall_after, so
  the one-token check times out behind them: every sample ready (some of them busy), no
  restart, every completion finishes;
- every process of rank 1 frozen (SIGSTOP, as a hung GPU leaves them): /health stays 200
  and no step runs; the supervisors restart the group as a stall, with no hand, and never
  say ready over a failed completion once the freeze is older than the check's interval
  + timeout;
- the network between the nodes cut for longer than stall_after, then back: serving
  again with no hand, never ready over a failed completion, the budget not burned down
  while the other node is unreachable;
- mp: SIGKILL of every process of rank 1 (as when its node dies): never ready while
  completions fail, the whole group back with no hand; then rank 0 stopped alone: rank 1
  does not linger as a broken half but starts again to wait for a new rank 0, and the
  group forms again when rank 0 returns;
- Ray: SIGKILL of the worker's raylet: back with no hand, never ready while completions
  fail; then the same freeze (every process of the worker node) and cut;
- both: a stop leaves every unit inactive (not failed), no process and the rendezvous
  port free;
- one node: vLLM's engine core process alone frozen, its API server answering /health
  200: restarted as a stall.
- one node, no generation check: vLLM's API server process frozen, its health endpoint
  and metrics timing out alike: out of rotation once `health.timeouts` probes in a row
  have timed out, never ready over a failed completion after that, ready once thawed.

Times here are the test's bounds, never asserted figures: bench/stall.py measures."""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from realengine import (
    MODEL,
    VENV,
    Completions,
    Load,
    assert_engines,
    assert_truthful,
    cmdline,
    complete,
    env_yaml,
    manager_pids,
    ray_pids,
)
from specs import free_port, write
from supervisors import ApiReader, Sampler, SupervisorProcess
from systemd_harness import Nodes, UserManager, port_is_free, set_link, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.engines]

TARGET, ENGINE = "llmgw-tiny.target", "llmgw-tiny-engine.service"
HEAD = "llmgw-tiny-ray-head.service"
API_PORT = 9471
STALL_AFTER = 10
CHECK = {"interval": 1, "timeout": 5}  # the generation check
# Not ready over a failed completion once the fault is older than the check's interval
# + timeout (the next check after the last success times out then), plus three seconds:
# the fault's start is stamped before `systemctl kill` returns (its SIGSTOP lands later),
# then the judge and, for the other node, the peer's long poll take their turns, on two
# cores that Ray and vLLM keep busy (a sample is stamped when its read began). With one
# second, a Ray run saw a node still say ready 7.3 s after the freeze, once in two runs.
NOTICE = CHECK["interval"] + CHECK["timeout"] + 3
# two sequences at a time: six clients keep four waiting, and the check with them
ARGS = ('[--max-model-len, "256", --enforce-eager, --dtype, float32, --max-num-seqs, "2"]')


def spec_text(http: int, master: int, mode: str = "mp") -> str:
    # A worker's raylet that lost its head gives up after 10 s, not Ray's 60: these
    # nodes share one PID namespace, and `ray start --head` refuses to start while any
    # process on the machine names its address in --gcs-address (Ray's
    # services.find_gcs_addresses greps ps): the old raylet on node-b, waiting out a
    # cut, kept node-a's new head from starting until its start limit was spent. On
    # separate machines (and in the booted tier) no such process is visible.
    ray = {"ray": f"""\
    env: {env_yaml({"LLMGW_TEST_RAY_ON_CPU": "1", "RAY_gcs_rpc_server_reconnect_timeout_s": "10"})}
    ray_num_gpus: 1
    ray_auth: disabled
"""}.get(mode, f"""\
    distributed_timeout: 60
    env: {env_yaml()}
""")
    return f"""\
replicas:
  - name: tiny
    engine: vllm
    launch_mode: {mode}
    model: {MODEL}
    virtualenv: {VENV}
    tensor_parallel_size: 2
    port: {http}
    rendezvous_port: {master}
    stop_timeout: 15
    drain: {{delay: 2, timeout: 5}}
{ray}    args: {ARGS}
    restart: {{delay: 2, burst: 20, interval: 900}}
    health: {{interval: 1, timeout: 2, stability: 5, stall_after: {STALL_AFTER},
              generation: {{interval: {CHECK["interval"]}, timeout: {CHECK["timeout"]}}}}}
    group_restart: {{delay: 1, max_delay: 8, budget: 6, window: 900}}
    nodes:
      - {{name: node-a, address: 192.0.2.1, interface: eth0}}
      - {{name: node-b, address: 192.0.2.2, interface: eth0}}
"""


Replica = tuple[UserManager, UserManager, str, list[SupervisorProcess], int]


def _replica(two_nodes: Nodes, tmp_path: Path, mode: str) -> Iterator[Replica]:
    assert_engines()
    http, master = free_port(), free_port()
    spec = write(tmp_path / "spec.yaml", spec_text(http, master, mode))
    leader, worker = two_nodes["node-a"], two_nodes["node-b"]
    leader.render(spec, "node-a")
    worker.render(spec, "node-b")
    sups = [SupervisorProcess(leader, "node-a", spec, listen=f"192.0.2.1:{API_PORT}"),
            SupervisorProcess(worker, "node-b", spec, listen=f"192.0.2.2:{API_PORT}")]
    try:
        worker.systemctl("start", TARGET)
        leader.systemctl("start", TARGET)
        base = f"http://192.0.2.1:{http}"
        wait_until(lambda: complete(leader, base) == 200, 300, "a first completion",
                   interval=1)
        for sup in sups:
            sup.wait_state("tiny", "ready", 60)
        yield leader, worker, base, sups, master
        for manager in (leader, worker):
            manager.systemctl("stop", TARGET)
        assert_stopped(leader, worker, master, (HEAD, ENGINE) if mode == "ray" else (ENGINE,))
    finally:
        for sup in sups:
            sup.stop()
            print(f"===== {sup.node}: supervisor log\n{sup.tail(8000)}")


@pytest.fixture
def mp_replica(two_nodes: Nodes, tmp_path: Path) -> Iterator[Replica]:
    yield from _replica(two_nodes, tmp_path, "mp")


@pytest.fixture
def ray_replica(two_nodes: Nodes, tmp_path: Path) -> Iterator[Replica]:
    yield from _replica(two_nodes, tmp_path, "ray")


def assert_stopped(leader: UserManager, worker: UserManager, master: int,
                   leader_units: tuple[str, ...]) -> None:
    """Every unit inactive, not failed; no process left; the rendezvous port free."""
    for manager, units in ((leader, leader_units), (worker, (ENGINE,))):
        for unit in units:
            info = manager.show(unit, "ActiveState", "Result")
            assert info == {"ActiveState": "inactive", "Result": "success"}, (unit, info)
        assert manager.state_of(TARGET)[0] == "inactive"
        assert not manager_pids(manager), \
            f"{manager.name}: processes left behind: {[cmdline(p) for p in manager_pids(manager)]}"
    assert leader.netns is not None
    assert port_is_free(master, "192.0.2.1", netns=leader.netns.name)


def main_pid(manager: UserManager) -> int:
    return int(manager.show(ENGINE, "MainPID")["MainPID"])


def said_by(sup: SupervisorProcess) -> Sampler:
    """Samples of what one supervisor says: its state, '+busy' when it says busy, and
    its reason when it is not ready (an assertion then says why)."""
    def read() -> str:
        data = sup.replica("tiny")
        if data["state"] != "ready":
            return f"{data['state']}: {data.get('reason', '')}"
        return f"ready{'+busy' if data.get('busy') else ''}"
    return Sampler(read, 0.25)


def restarts(sup: SupervisorProcess) -> tuple[float, float]:
    """(group restarts in the budget window, of which stall restarts)."""
    return (float(sup.replica("tiny")["group_restarts"]),
            sup.metric('llmgw_stall_restarts_total{replica="tiny"}'))


def last_ready(sampler: Sampler, since: float) -> float:
    """Seconds after `since` of the last 'ready' before the first sample that was not."""
    after = [(t, s) for t, s in sampler.seen if t > since]
    first_not = next((t for t, s in after if not s.startswith("ready")), None)
    ready = [t for t, s in after if s.startswith("ready") and (first_not is None
                                                              or t < first_not)]
    return (ready[-1] - since) if ready else 0.0


def serving_again(leader: UserManager, answers: Completions, said: list[Sampler],
                  since: float, what: str) -> None:
    wait_until(lambda: any(t > since and s == 200 for t, _, s in answers.seen[-3:])
               and all(s.seen and s.seen[-1][1].startswith("ready") for s in said),
               420, what, interval=1)
    time.sleep(3)


def figure(text: str) -> None:
    print(f"figure: {text}")


def saturate(leader: UserManager, base: str, sups: list[SupervisorProcess]) -> None:
    before = [restarts(s) for s in sups]
    samplers = [said_by(s) for s in sups]
    with samplers[0], samplers[1], Load(leader, base, clients=6, seconds=3 * STALL_AFTER,
                                        tokens=200) as load:
        pass
    took = [r["took"] for r in load.results]
    figure(f"saturation: {len(took)} completions, median {statistics.median(took):.1f} s, "
           f"busy in {sum('busy' in s for _, s in samplers[0].seen)} of "
           f"{len(samplers[0].seen)} samples")
    assert load.results, "no completion finished"
    assert all(r["status"] == 200 and r["tokens"] == 200 for r in load.results), \
        [r for r in load.results if r["status"] != 200 or r["tokens"] != 200]
    for sup, sampler, was in zip(sups, samplers, before):
        not_ready = [(round(t, 1), s) for t, s in sampler.seen if not s.startswith("ready")]
        assert not not_ready, f"{sup.node} said not ready under load: {not_ready[:10]}"
        assert restarts(sup) == was, f"{sup.node} restarted a busy replica"
    # the load did make the check wait: otherwise this proved nothing
    assert any("busy" in s for _, s in samplers[0].seen), "the check never timed out"


def freeze_worker(leader: UserManager, worker: UserManager, base: str,
                  sups: list[SupervisorProcess], what: str) -> None:
    """Every process of the worker node's engine unit frozen (SIGSTOP, as a hung GPU
    leaves them): the group serves again with no hand, and neither supervisor says
    ready over a failed completion once the freeze is older than NOTICE."""
    # Frozen from idle: a freeze right behind real work looks busy for stall_after
    # (docs/supervisor.md, "Stalls"), and a fresh-clone run right after the saturation
    # said ready 10.3 s into the freeze. Wait until the serving rank's supervisor has
    # read the engine idle since.
    wait_until(lambda: (sups[0].replica("tiny").get("progress") or {}).get("verdict")
               == "idle", 120, "the engine to be read idle", interval=0.25)
    samplers = [said_by(s) for s in sups]
    with samplers[0], samplers[1], Completions(leader, base) as answers:
        frozen = time.monotonic()
        worker.systemctl("kill", "--signal=SIGSTOP", ENGINE)
        wait_until(lambda: any(t > frozen and s != 200 for t, _, s in answers.seen),
                   60, f"completions to fail after {what} froze")
        serving_again(leader, answers, samplers, frozen, "the group to serve again")
    figure(f"{what} frozen: last said ready "
           f"{[round(last_ready(s, frozen), 1) for s in samplers]} s after")
    for sampler in samplers:
        assert_truthful(sampler.seen, answers.seen, frozen, notice=NOTICE)


def cut_between_nodes(leader: UserManager, worker: UserManager, base: str,
                      sups: list[SupervisorProcess], what: str) -> None:
    """The network between the nodes cut for twice stall_after, then back: serving
    again with no hand, never ready over a failed completion, and at most the one
    restart the stall asks for while the other node is unreachable."""
    before = [restarts(s)[0] for s in sups]
    samplers = [said_by(s) for s in sups]
    assert worker.netns is not None
    with samplers[0], samplers[1], Completions(leader, base) as answers:
        cut = time.monotonic()
        set_link(worker.netns, connected=False)
        try:
            time.sleep(2 * STALL_AFTER)
            during = [restarts(s)[0] - b for s, b in zip(sups, before)]
        finally:
            set_link(worker.netns, connected=True)
        back = time.monotonic()
        serving_again(leader, answers, samplers, back, "serving again after the cut")
    for sampler in samplers:
        assert_truthful(sampler.seen, answers.seen, cut, notice=NOTICE)
    figure(f"{what}, cut {back - cut:.0f} s: group restarts during it {during}, after "
           f"{[restarts(s)[0] - b for s, b in zip(sups, before)]}")
    assert all(d <= 1 for d in during), during


def killed(leader: UserManager, base: str, sup: SupervisorProcess, kill: Callable[[], object],
           what: str, notice: float = 1.0) -> None:
    """`kill()` under completions: they fail, the replica serves again with no hand, and
    the supervisor never said ready while they failed (after `notice`)."""
    with Sampler(lambda: str(sup.replica("tiny")["state"]), 0.25) as said, \
            Completions(leader, base) as answers:
        since = time.monotonic()
        kill()
        wait_until(lambda: any(t > since and s != 200 for t, _, s in answers.seen),
                   60, f"completions to fail after {what}")
        wait_until(lambda: any(t > since and s == 200 for t, _, s in answers.seen[-3:])
                   and said.seen[-1][1] == "ready", 300, f"serving again after {what}",
                   interval=1)
        time.sleep(3)
    assert_truthful(said.seen, answers.seen, since, notice=notice)


def test_mp_busy_frozen_cut_killed_and_a_lone_rank_0_stop(mp_replica: Replica) -> None:
    leader, worker, base, sups, _ = mp_replica
    saturate(leader, base, sups)
    # /health on rank 0 stays 200 while rank 1 is frozen: no step runs
    stalls_before = restarts(sups[0])[1]
    freeze_worker(leader, worker, base, sups, "mp rank 1")
    assert restarts(sups[0])[1] > stalls_before, "not restarted as a stall"
    cut_between_nodes(leader, worker, base, sups, "mp")

    # the whole rank at once, as when its node dies (a SIGKILL of the main process alone,
    # whose worker the stop now SIGKILLs at once, is test_engine_drain.py's)
    killed(leader, base, sups[0],
           lambda: worker.systemctl("kill", "--signal=SIGKILL", ENGINE), "rank 1 died")

    # rank 0 stopped alone: rank 1 starts again to wait for a new rank 0; the half that
    # joined the old one does not linger
    joined = main_pid(worker)
    leader.systemctl("stop", TARGET)
    wait_until(lambda: main_pid(worker) not in (0, joined), 60, "rank 1 to start again")
    wait_until(lambda: joined not in manager_pids(worker), 30, "the old rank 1 to go")
    sups[1].wait_state("tiny", "degraded", 10)
    # rank 0 back: the group forms again, without anyone's hand on rank 1
    leader.systemctl("start", TARGET)
    wait_until(lambda: complete(leader, base) == 200, 300, "completions again", interval=1)
    sups[0].wait_state("tiny", "ready", 60)


def test_ray_lost_raylet_frozen_worker_node_and_a_cut(ray_replica: Replica) -> None:
    """A killed raylet, then every process of the Ray worker node frozen (raylet,
    workers, `ray start`: Ray's own health check or the stall, whichever comes first,
    ends the group), then the cut."""
    leader, worker, base, sups, _ = ray_replica
    raylet = wait_until(lambda: next((p for p, c in ray_pids(worker).items()
                                      if "/raylet " in c or c.endswith("/raylet")), None),
                        10, "the worker's raylet")
    # A killed raylet reaches systemd only when Ray's worker notices it and exits: one
    # fresh-clone run saw the supervisor learn of it 1.5 s after the kill (and say ready
    # at 1.2 s, 0.5 s before the first failed completion began).
    killed(leader, base, sups[0], lambda: os.kill(raylet, signal.SIGKILL),
           "the worker's raylet died", notice=2.0)
    freeze_worker(leader, worker, base, sups, "Ray worker")
    figure(f"Ray worker frozen: stall restarts {restarts(sups[0])[1]:.0f}, group "
           f"restarts {[restarts(s)[0] for s in sups]}")
    cut_between_nodes(leader, worker, base, sups, "Ray")


def single_spec(http: int) -> str:
    return f"""\
replicas:
  - name: tiny
    engine: vllm
    launch_mode: mp
    model: {MODEL}
    virtualenv: {VENV}
    host: 127.0.0.1
    port: {http}
    stop_timeout: 15
    drain: {{delay: 2, timeout: 5}}
    env: {env_yaml()}
    args: {ARGS}
    restart: {{delay: 2, burst: 20, interval: 900}}
    health: {{interval: 1, timeout: 2, stability: 5, stall_after: {STALL_AFTER},
              generation: {{interval: {CHECK["interval"]}, timeout: {CHECK["timeout"]}}}}}
    group_restart: {{delay: 1, max_delay: 8, budget: 6, window: 900}}
    nodes: [{{name: node, address: 127.0.0.1}}]
"""


@contextlib.contextmanager
def single_replica(one_node: UserManager, tmp_path: Path, text: Callable[[int], str]
                   ) -> Iterator[tuple[str, SupervisorProcess]]:
    """The one-node replica of `text(port)` rendered and serving (a first completion
    answered, its supervisor says ready): its URL and supervisor, stopped afterwards."""
    assert_engines()
    http = free_port()
    spec = write(tmp_path / "spec.yaml", text(http))
    one_node.render(spec, "node")
    base = f"http://127.0.0.1:{http}"
    sup = SupervisorProcess(one_node, "node", spec, listen=f"127.0.0.1:{free_port()}")
    try:
        one_node.systemctl("start", TARGET)
        wait_until(lambda: complete(one_node, base) == 200, 300, "a first completion",
                   interval=1)
        sup.wait_state("tiny", "ready", 60)
        yield base, sup
    finally:
        sup.stop()
        print(f"===== supervisor log\n{sup.tail(8000)}")


def test_a_frozen_engine_core_behind_a_live_api_server_is_restarted(
        one_node: UserManager, tmp_path: Path) -> None:
    """vLLM's engine core process alone frozen: its API server answers /health 200 in
    milliseconds, no step runs; restarted as a stall, serving again with no hand."""
    with single_replica(one_node, tmp_path, single_spec) as (base, sup):
        core = wait_until(lambda: next((p for p in manager_pids(one_node)
                                        if "EngineCore" in cmdline(p)), None),
                          10, "vLLM's engine core process")
        sampler = said_by(sup)
        with sampler, Completions(one_node, base) as answers:
            frozen = time.monotonic()
            os.kill(core, signal.SIGSTOP)
            wait_until(lambda: any(t > frozen and s != 200 for t, _, s in answers.seen),
                       60, "completions to fail after the engine core froze")
            # the API server still answers: what a load balancer's health check sees
            assert health_status(one_node, base) == 200
            serving_again(one_node, answers, [sampler], frozen, "serving again")
        assert_truthful(sampler.seen, answers.seen, frozen, notice=NOTICE)
        assert restarts(sup)[1] == 1, "not restarted as a stall"
        one_node.systemctl("stop", TARGET)
        assert not manager_pids(one_node), "processes left behind"


def health_status(manager: UserManager, base: str) -> int:
    status, _ = ApiReader(manager, "node", base).get("/health", timeout=3)
    return status


# Slow is not down (docs/supervisor.md): with no generation check and the metrics as
# silent as the health endpoint, a rank that served stays ready through TIMEOUTS probes in
# a row that time out. A probe begins `interval` after the last one ended, so the last of
# them ends within TIMEOUTS x (interval + timeout) of the fault, plus the judge's turn.
TIMEOUTS = 3


def frozen_api_spec(http: int) -> str:
    text = single_spec(http).replace(
        f"""    health: {{interval: 1, timeout: 2, stability: 5, stall_after: {STALL_AFTER},
              generation: {{interval: {CHECK["interval"]}, timeout: {CHECK["timeout"]}}}}}
""", f"""    health: {{interval: 1, timeout: 2, timeouts: {TIMEOUTS}, stability: 5,
              stall_after: {STALL_AFTER}}}
""")
    assert f"timeouts: {TIMEOUTS}" in text, "the spec's shape changed"
    return text


def test_a_frozen_api_server_leaves_rotation_within_its_timeouts(
        one_node: UserManager, tmp_path: Path) -> None:
    """vLLM's API server process frozen (SIGSTOP; its engine core runs on): its health
    endpoint and its metrics time out alike, so nothing tells slow from hung, and the
    rank is taken out once `timeouts` probes in a row have timed out: never ready over a
    failed completion after that bound; ready again once it is thawed."""
    with single_replica(one_node, tmp_path, frozen_api_spec) as (base, sup):
        api = int(one_node.show(ENGINE, "MainPID")["MainPID"])
        assert "EngineCore" not in cmdline(api), cmdline(api)
        sampler = said_by(sup)
        with sampler, Completions(one_node, base) as answers:
            frozen = time.monotonic()
            os.kill(api, signal.SIGSTOP)
            try:
                sup.wait_state("tiny", "degraded", 60, reason="no answer within")
                out = time.monotonic() - frozen
                wait_until(lambda: any(t > frozen and s != 200 for t, _, s in answers.seen),
                           60, "completions to fail while the API server is frozen")
                time.sleep(3)  # the word while frozen, sampled a while
            finally:
                os.kill(api, signal.SIGCONT)
            serving_again(one_node, answers, [sampler], frozen, "serving again")
        notice = TIMEOUTS * (1 + 2) + 3
        assert_truthful(sampler.seen, answers.seen, frozen, notice=notice)
        figure(f"frozen API server: out of rotation {out:.1f} s after the freeze "
               f"(bound {notice} s)")
        one_node.systemctl("stop", TARGET)
        assert not manager_pids(one_node), "processes left behind"
