"""The engine table (llmgw_systemd/engines/): what each engine and launch mode says about
itself, one row per engine entry; that every entry's key table is exactly what the
reader allows; and that an engine is added with one module and nothing else."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from llmgw_systemd import engines, spec
from llmgw_systemd.engines import ENGINES, EngineEntry, Http, PortClaim, SpecKey, Step
from llmgw_systemd.errors import SpecError
from llmgw_systemd.plan import Manager, plan_shard
from llmgw_systemd.render import render_shards
from llmgw_systemd.specread import Checker
from llmgw_systemd.yamldoc import KeyPath, parse

TWO_NODES = "nodes: [{name: a, address: 10.0.0.1}, {name: b, address: 10.0.0.2}]"
ONE_NODE = "nodes: [{name: a, address: 10.0.0.1}]"
COMMANDS_2 = ("engine: command\nport: 9000\nranks: [{commands: [{argv: [/bin/a], binds: "
              "[9000]}]}, {commands: [{name: side, argv: [/bin/s], binds: [7000]}, {argv: "
              "[/bin/b]}]}]\n" + TWO_NODES)


def replica(body: str) -> spec.Replica:
    text = "replicas:\n  - name: r\n" + "".join(f"    {line}\n" for line in body.splitlines())
    return spec.build_spec([parse(text.encode(), "spec.yaml")]).replicas[0]


def error(body: str) -> str:
    with pytest.raises(SpecError) as caught:
        replica(body)
    return str(caught.value)


@dataclass(frozen=True)
class Row:
    """What one engine (and launch mode) says about a replica."""

    body: str
    steps: dict[int, tuple[str, ...]]  # rank -> step names, sidecars first
    http: Http | None
    claims: tuple[tuple[int, int, str], ...]  # (rank, port, what)
    reserved: frozenset[str]
    follows_leader: bool


ROWS = {
    "vllm ray, two nodes: a Ray head on the leader, the worker only joins": Row(
        f"engine: vllm\nmodel: /m\n{TWO_NODES}",
        {0: ("ray-head", "engine"), 1: ("engine",)}, Http(0, "0.0.0.0", 8000, "/m"),
        ((0, 8000, "HTTP"), (0, 6379, "rendezvous")),
        frozenset({"VLLM_HOST_IP", "RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"}),
        True),
    "vllm ray, one node: the head still binds its port": Row(
        f"engine: vllm\nmodel: /m\n{ONE_NODE}", {0: ("ray-head", "engine")},
        Http(0, "0.0.0.0", 8000, "/m"), ((0, 8000, "HTTP"), (0, 6379, "rendezvous")),
        frozenset({"VLLM_HOST_IP", "RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"}),
        False),
    "vllm mp, two nodes: the master port on rank 0, the served name from args": Row(
        f"engine: vllm\nlaunch_mode: mp\nmodel: /m\nport: 8100\nargs: [--served-model-name, "
        f"x]\n{TWO_NODES}", {0: ("engine",), 1: ("engine",)},
        Http(0, "0.0.0.0", 8100, "x"), ((0, 8100, "HTTP"), (0, 29500, "rendezvous")),
        frozenset({"VLLM_HOST_IP"}), True),
    "vllm mp, one node: no master port": Row(
        f"engine: vllm\nlaunch_mode: mp\nmodel: /m\n{ONE_NODE}", {0: ("engine",)},
        Http(0, "0.0.0.0", 8000, "/m"), ((0, 8000, "HTTP"),), frozenset({"VLLM_HOST_IP"}),
        False),
    "sglang, two nodes": Row(
        f"engine: sglang\nmodel: /m\nhost: 127.0.0.1\n{TWO_NODES}",
        {0: ("engine",), 1: ("engine",)}, Http(0, "127.0.0.1", 30000, "/m"),
        ((0, 30000, "HTTP"), (0, 20000, "rendezvous")), frozenset(), True),
    "command: its own sequences; the serving command's bind is its HTTP claim": Row(
        COMMANDS_2, {0: ("engine",), 1: ("side", "engine")}, Http(0, "0.0.0.0", 9000, None),
        ((0, 9000, "HTTP"), (1, 7000, "command")), frozenset(), False),
    "command, serving rank 1; none named for completions": Row(
        "engine: command\nport: 9000\nserving_rank: 1\nranks: [{commands: [{argv: [/bin/a]}]},"
        f" {{commands: [{{argv: [/bin/b]}}]}}]\n{TWO_NODES}", {0: ("engine",), 1: ("engine",)},
        Http(1, "0.0.0.0", 9000, None), ((1, 9000, "HTTP"),), frozenset(), False),
    "command, no rank serves HTTP": Row(
        f"engine: command\nserving_rank: null\nranks: [{{commands: [{{argv: [/bin/a]}}]}}]\n"
        f"{ONE_NODE}", {0: ("engine",)}, None, (), frozenset(), False),
}


@pytest.mark.parametrize("what", ROWS)
def test_what_each_engine_says_about_a_replica(what: str) -> None:
    row = ROWS[what]
    r = replica(row.body)
    assert {rank: tuple(s.name for s in r.engine.steps(r.name, r.nodes, rank))
            for rank in range(len(r.nodes))} == row.steps
    assert r.http == row.http
    assert tuple((c.rank, c.port, c.what) for c in r.engine.port_claims(len(r.nodes))) \
        == row.claims
    assert frozenset(r.engine.reserved_env()) == row.reserved
    assert r.engine.follows_leader(len(r.nodes)) is row.follows_leader


def test_every_engine_has_a_row() -> None:
    assert {replica(row.body).engine.name for row in ROWS.values()} == set(ENGINES)


@pytest.mark.parametrize(("body", "variable"), [
    (f"engine: vllm\nmodel: /m\nenv: {{RAY_ADDRESS: x}}\n{TWO_NODES}", "RAY_ADDRESS"),
    (f"engine: vllm\nlaunch_mode: mp\nmodel: /m\nenv: {{VLLM_HOST_IP: x}}\n{TWO_NODES}",
     "VLLM_HOST_IP"),
    ("engine: vllm\nmodel: /m\nnodes: [{name: a, address: 10.0.0.1, env: {RAY_AUTH_MODE: x}}]",
     "RAY_AUTH_MODE"),
    (f"engine: vllm\nmodel: /m\ngpus: [0]\nenv: {{CUDA_VISIBLE_DEVICES: '1'}}\n{ONE_NODE}",
     "CUDA_VISIBLE_DEVICES"),
    ("engine: sglang\nmodel: /m\nenv: {NCCL_SOCKET_IFNAME: x}\nnodes: [{name: a, address: "
     "10.0.0.1, interface: ib0}]", "NCCL_SOCKET_IFNAME"),
])
def test_the_spec_cannot_set_what_the_units_set(body: str, variable: str) -> None:
    assert f"'{variable}' is set by llmgw-render" in error(body)


@pytest.mark.parametrize(("body", "allowed"), [
    # an engine's own variable is the spec's to set where that engine does not set it
    (f"engine: vllm\nlaunch_mode: mp\nmodel: /m\nenv: {{RAY_ADDRESS: x}}\n{ONE_NODE}",
     "RAY_ADDRESS"),
    (f"engine: sglang\nmodel: /m\nenv: {{VLLM_HOST_IP: x}}\n{ONE_NODE}", "VLLM_HOST_IP"),
    # a node's own GPUs
    ("engine: vllm\nmodel: /m\ngpus: [0]\nnodes: [{name: a, address: 10.0.0.1, env: "
     "{CUDA_VISIBLE_DEVICES: '1'}}]", "CUDA_VISIBLE_DEVICES"),
])
def test_what_the_units_do_not_set_is_the_specs(body: str, allowed: str) -> None:
    r = replica(body)
    assert allowed in dict(r.env) or any(allowed in dict(n.env) for n in r.nodes)


@pytest.mark.parametrize("entry", ENGINES.values(), ids=list(ENGINES))
def test_each_key_table_is_what_its_reader_allows(entry: EngineEntry) -> None:
    names = entry.key_names
    assert len(set(names)) == len(names), "a key listed twice"
    assert not set(names) & set(spec.COMMON_KEY_NAMES), "an engine key that every engine has"
    assert all(k.default and k.meaning for k in entry.keys)
    for key in names:  # the value may be wrong; the key itself must be allowed
        message = error(f"engine: {entry.name}\n{key}: {{}}\n{ONE_NODE}")
        assert "unknown key" not in message and "is not used by engine" not in message, key
    for other in ENGINES.values():
        for key in set(other.key_names) - set(names):
            message = error(f"engine: {entry.name}\n{key}: 1\n{ONE_NODE}")
            assert f"'{key}' is not used by engine '{entry.name}'" in message
            assert other.name in message or key == "launch_mode"


# A whole engine, as a module would hold it: its settings, key table and reader.
@dataclass(frozen=True)
class Echo:
    port: int

    @property
    def name(self) -> str:
        return "echo"

    @property
    def http(self) -> Http:
        return Http(0, "127.0.0.1", self.port, None)

    def steps(self, replica: str, nodes: Sequence[spec.Node], rank: int) -> tuple[Step, ...]:
        return (Step(name="engine", role="echo server",
                     argv=("/usr/bin/echo-server", "--port", str(self.port))),)

    def port_claims(self, n_nodes: int) -> tuple[PortClaim, ...]:
        return (PortClaim(0, self.port, ("port",), "HTTP"),)

    def reserved_env(self) -> Mapping[str, str]:
        return {"ECHO_PORT": "port"}

    def follows_leader(self, n_nodes: int) -> bool:
        return False

    def least_stop_timeout(self) -> tuple[int, str] | None:
        return None


def _read_echo(check: Checker, data: Mapping[str, Any], path: KeyPath,
               nodes: tuple[spec.Node, ...]) -> Echo:
    return Echo(check.optional(data, "port", path, check.port, 7))


ECHO = EngineEntry("echo", "an echo server", (SpecKey("port", "7", "its port"),), _read_echo)


def test_an_engine_is_one_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(engines.ENGINES, "echo", ECHO)
    r = replica(f"engine: echo\nport: 7007\nenv: {{A: b}}\n{ONE_NODE}")
    units = render_shards([plan_shard(r, 0, Manager(user=True, wait_for_port="/w"))])
    assert "ExecStart=/usr/bin/echo-server --port 7007\n" in units["llmgw-r-engine.service"]
    assert "'ECHO_PORT' is set by llmgw-render from port" in error(
        f"engine: echo\nenv: {{ECHO_PORT: '1'}}\n{ONE_NODE}")
    assert "'model' is not used by engine 'echo'" in error(f"engine: echo\nmodel: /m\n{ONE_NODE}")
