"""What each engine and launch mode runs, table-driven (the pure planner): clean exit
statuses from what the real engines do (docs/engines.md), how a Ray token reaches the
processes under each manager, per-node settings, and the name a generation check asks
for."""

from __future__ import annotations

import pytest

from llmgw_systemd.spec.document import parse
from llmgw_systemd.spec.model import Replica
from llmgw_systemd.spec.replicas import build_spec
from llmgw_systemd.units.plan import Manager, plan_shard

SYSTEM = Manager(user=False, wait_for_port="/usr/bin/llmgw-wait-for-port")
USER = Manager(user=True, wait_for_port="/usr/bin/llmgw-wait-for-port")
# exit 1: stopped while it starts; SIGKILL: llmgw-stop-group ended a rank that ignored
# SIGTERM (blocked in its rendezvous) inside the stop
VLLM = (1, "SIGKILL")
TWO_NODES = "nodes: [{name: a, address: 10.0.0.1}, {name: b, address: 10.0.0.2}]"


def replica(body: str) -> Replica:
    text = "replicas:\n  - name: r\n" + "".join(f"    {line}\n" for line in body.splitlines())
    return build_spec([parse(text.encode(), "spec.yaml")]).replicas[0]


@pytest.mark.parametrize(("what", "body", "rank", "statuses"), [
    # vllm serve exits 1 when stopped during start-up, 0 once ready; ray start --block 1
    ("vLLM alone", "engine: vllm\nlaunch_mode: mp\nmodel: /m\nnodes: [{name: a, address: "
     "10.0.0.1}]", 0, {"engine": VLLM}),
    ("vLLM mp, rank 0", f"engine: vllm\nlaunch_mode: mp\nmodel: /m\n{TWO_NODES}", 0,
     {"engine": VLLM}),
    ("vLLM mp, headless rank 1", f"engine: vllm\nlaunch_mode: mp\nmodel: /m\n{TWO_NODES}", 1,
     {"engine": VLLM}),
    # ray start: 1 on SIGTERM; SIGKILL when llmgw-stop-group ends a join that ignored it
    ("vLLM on Ray, leader", f"engine: vllm\nmodel: /m\n{TWO_NODES}", 0,
     {"ray-head": (1,), "engine": VLLM}),
    ("vLLM on Ray, worker (ray start only)", f"engine: vllm\nmodel: /m\n{TWO_NODES}", 1,
     {"engine": (1, "SIGKILL")}),
    # a command or SGLang that must be SIGKILLed (it ignored SIGTERM for the whole grace)
    # ends failed, as a death by SIGKILL does: only vLLM's is known to be a clean stop
    ("SGLang (a stand-in only: nothing measured)", f"engine: sglang\nmodel: /m\n{TWO_NODES}",
     0, {"engine": ()}),
    ("a command: exit 0 is the only clean exit", "engine: command\nserving_rank: null\n"
     "nodes: [{name: a, address: 10.0.0.1}]\nranks: [{commands: [{argv: [/bin/true]}]}]", 0,
     {"engine": ()}),
])
def test_clean_exit_statuses(what: str, body: str, rank: int,
                             statuses: dict[str, tuple[int | str, ...]]) -> None:
    plan = plan_shard(replica(body), rank, SYSTEM)
    got = {s.name.removeprefix("llmgw-r-").removesuffix(".service"): s.success_exit_status
           for s in plan.services}
    assert got == statuses, what


RAY_TOKEN = f"engine: vllm\nmodel: /m\nray_auth: token\nray_token_file: /etc/t\n{TWO_NODES}"


@pytest.mark.parametrize(("manager", "env", "credentials"), [
    (SYSTEM, {"RAY_AUTH_MODE": "token"}, (("RAY_AUTH_TOKEN_PATH", "ray-token", "/etc/t"),)),
    (USER, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/etc/t"}, ()),
])
def test_ray_token_reaches_every_ray_process(manager: Manager, env: dict[str, str],
                                             credentials: tuple[tuple[str, str, str], ...]
                                             ) -> None:
    for rank in (0, 1):
        for service in plan_shard(replica(RAY_TOKEN), rank, manager).services:
            have = dict(service.environment)
            assert {k: have.get(k) for k in env} == env, service.name
            assert service.credential_env == credentials, service.name


def test_ray_auth_is_always_stated() -> None:
    """Unset, a Ray head turns token auth on by itself when ~/.ray/auth_token exists."""
    for service in plan_shard(replica(f"engine: vllm\nmodel: /m\n{TWO_NODES}"), 0,
                              SYSTEM).services:
        assert dict(service.environment)["RAY_AUTH_MODE"] == "disabled"


def test_node_env_wins_once_and_interface_feeds_gloo_and_nccl() -> None:
    r = replica("engine: vllm\nlaunch_mode: mp\nmodel: /m\nenv: {X: replica, Y: y}\nnodes:\n"
                "  - {name: a, address: 10.0.0.1, interface: eth0}\n"
                "  - {name: b, address: 10.0.0.2, interface: ib0, env: {X: node-b}}")
    env_a = plan_shard(r, 0, SYSTEM).services[-1].environment
    env_b = plan_shard(r, 1, SYSTEM).services[-1].environment
    assert dict(env_a)["X"] == "replica" and dict(env_b)["X"] == "node-b"
    assert [k for k, _ in env_b].count("X") == 1
    assert dict(env_a)["GLOO_SOCKET_IFNAME"] == dict(env_a)["NCCL_SOCKET_IFNAME"] == "eth0"
    assert dict(env_b)["GLOO_SOCKET_IFNAME"] == dict(env_b)["NCCL_SOCKET_IFNAME"] == "ib0"


@pytest.mark.parametrize(("args", "name"), [
    ("[]", "/models/x"),
    ("[--served-model-name, llama]", "llama"),
    ("[--served-model-name=llama]", "llama"),
    ("[--served-model-name, a, b]", "a"),
])
def test_the_served_model_name_is_what_completions_ask_for(args: str, name: str) -> None:
    r = replica(f"engine: vllm\nmodel: /models/x\nargs: {args}\n"
                "nodes: [{name: a, address: 10.0.0.1}]")
    assert r.http is not None and r.http.model == name


def test_stop_timeout_reaches_every_member() -> None:
    r = replica(f"engine: vllm\nmodel: /m\nstop_timeout: 240\n{TWO_NODES}")
    assert {s.timeout_stop_sec for s in plan_shard(r, 0, SYSTEM).services} == {240}


@pytest.mark.parametrize(("drain_text", "stop"), [
    ("", 40),  # the defaults: 5 s delay + 20 s timeout + 10 s exit + 5 s kill
    ("drain: {timeout: 60}\n", 80),  # a longer drain lengthens the stop with it
    ("drain: {delay: 0, timeout: 0}\n", 15),
])
def test_stop_timeout_holds_the_whole_planned_stop_when_not_set(drain_text: str,
                                                                 stop: int) -> None:
    """TimeoutStopSec= always holds the drain, the engine's exit and the kill (issue 42:
    a stop that ran past it ended Result=timeout, counted as a failure); the helper's
    SIGKILL comes STOP_MARGIN before it."""
    r = replica(f"engine: vllm\nmodel: /m\n{drain_text}{TWO_NODES}")
    assert r.stop_timeout == r.drain.stop_budget == stop
    services = plan_shard(r, 0, SYSTEM).services
    assert {s.timeout_stop_sec for s in services} == {stop}
    engine = services[-1].exec_stop
    assert engine is not None and engine[engine.index("--grace") + 1] == str(stop - 5)


def drain(*, serving: bool, delay: int = 5, timeout: int = 20) -> tuple[str, ...]:
    """The drain step's arguments (every engine's stop begins with it)."""
    return ("--drain", "r", "--supervisor", "127.0.0.1:9470", "--drain-delay", str(delay),
            "--drain-timeout", str(timeout), "--target", "llmgw-r.target",
            *(("--serving",) if serving else ()))


@pytest.mark.parametrize(("body", "rank", "stopped_by_helper"), [
    (f"engine: vllm\nlaunch_mode: mp\nmodel: /m\nstop_timeout: 40\n{TWO_NODES}", 1,
     {"engine": ("/usr/bin/llmgw-stop-group", "--grace", "35", *drain(serving=False))}),
    # a worker's ray start (KillMode=mixed): the main process first, as mixed does; the
    # head keeps plain mixed (its stop races the leader's restart delay)
    # the serving rank: its main process first (it drains, then stops its engine core);
    # a quick stop when it does not answer its health check
    (f"engine: vllm\nmodel: /m\n{TWO_NODES}", 0,
     {"ray-head": None, "engine": ("/usr/bin/llmgw-stop-group", "--grace", "35",
                                   "--main-first", "--health",
                                   "http://127.0.0.1:8000/health", "--unserved-grace", "5",
                                   *drain(serving=True))}),
    (f"engine: vllm\nlaunch_mode: mp\nmodel: /m\nhost: 10.0.0.1\nport: 9000\n"
     f"health: {{path: /ping}}\n{TWO_NODES}", 0,
     {"engine": ("/usr/bin/llmgw-stop-group", "--grace", "35", "--main-first", "--health",
                 "http://10.0.0.1:9000/ping", "--unserved-grace", "5", *drain(serving=True))}),
    (f"engine: vllm\nlaunch_mode: mp\nmodel: /m\nhost: '::'\n{TWO_NODES}", 0,
     {"engine": ("/usr/bin/llmgw-stop-group", "--grace", "35", "--main-first", "--health",
                 "http://[::1]:8000/health", "--unserved-grace", "5", *drain(serving=True))}),
    # a grace no longer than the quick one: nothing to shorten
    (f"engine: vllm\nlaunch_mode: mp\nmodel: /m\nstop_timeout: 10\n"
     f"drain: {{delay: 0, timeout: 5}}\n{TWO_NODES}", 0,
     {"engine": ("/usr/bin/llmgw-stop-group", "--grace", "5", "--main-first",
                 *drain(serving=True, delay=0, timeout=5))}),
    (f"engine: vllm\nmodel: /m\n{TWO_NODES}", 1,
     {"engine": ("/usr/bin/llmgw-stop-group", "--grace", "35", "--main-first",
                 *drain(serving=False))}),
    # every engine drains first; a command whose rank serves nothing is no --serving
    ("engine: command\nserving_rank: null\nnodes: [{name: a, address: 10.0.0.1}]\n"
     "ranks: [{commands: [{name: side, argv: [/bin/side]}, {argv: [/bin/true]}]}]", 0,
     {"side": None, "engine": ("/usr/bin/llmgw-stop-group", "--grace", "35",
                               "--failure-grace", "2", *drain(serving=False))}),
])
def test_vllm_is_stopped_by_the_group_helper_within_the_stop_timeout(
        body: str, rank: int, stopped_by_helper: dict[str, tuple[str, ...] | None]) -> None:
    plan = plan_shard(replica(body), rank, SYSTEM)
    got = {s.name.removeprefix("llmgw-r-").removesuffix(".service"): s.exec_stop
           for s in plan.services}
    assert got == stopped_by_helper


ONE_NODE = "nodes: [{name: a, address: 10.0.0.1}]"


@pytest.mark.parametrize(("body", "manager", "notes"), [
    (f"engine: vllm\nmodel: /m\n{ONE_NODE}", SYSTEM, ()),
    (f"engine: vllm\nmodel: /m\nuser: llmgw\n{ONE_NODE}", SYSTEM, ()),
    (f"engine: vllm\nmodel: /m\nuser: root\n{ONE_NODE}", SYSTEM, ("runs as root",)),
    (f"engine: vllm\nmodel: /m\nuser: '0'\n{ONE_NODE}", SYSTEM, ("runs as root",)),
    (f"engine: vllm\nmodel: /m\nhardening: off\n{ONE_NODE}", SYSTEM, ("without its sandbox",)),
    (f"engine: vllm\nmodel: /m\nuser: root\nhardening: false\n{ONE_NODE}", SYSTEM,
     ("runs as root", "without its sandbox")),
    # a user manager runs as its own user, unsandboxed: nothing to say
    (f"engine: vllm\nmodel: /m\nuser: root\nhardening: off\n{ONE_NODE}", USER, ()),
])
def test_the_planner_says_when_a_replica_runs_as_root_or_unsandboxed(
        body: str, manager: Manager, notes: tuple[str, ...]) -> None:
    plan = plan_shard(replica(body), 0, manager)
    assert len(plan.notes) == len(notes) and all(
        want in note for want, note in zip(notes, plan.notes)), plan.notes
    sandboxed = all(s.sandbox for s in plan.services)
    assert sandboxed == (manager is SYSTEM and "hardening" not in body)


MP = f"engine: vllm\nlaunch_mode: mp\nmodel: /m\n{TWO_NODES}"


@pytest.mark.parametrize(("what", "before", "after", "same"), [
    ("nothing changed", MP, MP, True),
    ("enable: starts it at boot, no unit of a rank changes", MP, f"{MP}\nenable: true", True),
    ("a variable (every rank's engine gets it)", MP, f"{MP}\nenv: {{X: '1'}}", False),
    ("another node's own variable changes this rank's version too", MP,
     MP.replace("10.0.0.2}", "10.0.0.2, env: {Y: '2'}}"), False),
    ("the engine's arguments", MP, f"{MP}\nargs: [--max-model-len, '512']", False),
    ("the drain (it is in the engine's ExecStop=)", MP, f"{MP}\ndrain: {{delay: 3}}", False),
    ("the health check: judged by the supervisor only", MP,
     f"{MP}\nhealth: {{timeout: 5}}", True),
])
def test_the_spec_digest_is_the_replicas_version_on_every_node(
        what: str, before: str, after: str, same: bool) -> None:
    """One digest for every rank, carried by every member; it changes exactly when
    some rank's units would."""
    old = [plan_shard(replica(before), rank, SYSTEM) for rank in (0, 1)]
    new = [plan_shard(replica(after), rank, SYSTEM) for rank in (0, 1)]
    for plans in (old, new):
        assert len({p.spec_digest for p in plans}) == 1, what
        for plan in plans:
            for service in plan.services:
                assert dict(service.environment)["LLMGW_SPEC_DIGEST"] == plan.spec_digest
    assert (old[0].spec_digest == new[0].spec_digest) == same, what


def test_the_spec_digest_does_not_depend_on_where_the_helpers_are() -> None:
    elsewhere = Manager(user=False, wait_for_port="/usr/local/bin/llmgw-wait-for-port")
    assert (plan_shard(replica(MP), 0, SYSTEM).spec_digest
            == plan_shard(replica(MP), 0, elsewhere).spec_digest)
