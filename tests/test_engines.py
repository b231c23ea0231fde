"""The engine table (llmgw_systemd/spec/engines/): what each engine and launch mode says about
itself, one row per engine entry; that every entry's key table is exactly what the
reader allows; and that an engine is added with one module and nothing else."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from llmgw_systemd.errors import SpecError
from llmgw_systemd.spec import common_keys
from llmgw_systemd.spec import replicas as spec
from llmgw_systemd.spec.document import KeyPath, format_path, parse
from llmgw_systemd.spec.engines import sglang, vllm
from llmgw_systemd.spec.engines import table as engines
from llmgw_systemd.spec.engines.base import EngineEntry, Http, PortClaim, Step
from llmgw_systemd.spec.engines.table import ENGINES
from llmgw_systemd.spec.keys import Key, tcp_port
from llmgw_systemd.spec.model import Node, Replica
from llmgw_systemd.spec.reader import Reader
from llmgw_systemd.units.plan import Manager, plan_shard
from llmgw_systemd.units.render import render_shards

TWO_NODES = "nodes: [{name: a, address: 10.0.0.1}, {name: b, address: 10.0.0.2}]"
ONE_NODE = "nodes: [{name: a, address: 10.0.0.1}]"
COMMANDS_2 = ("engine: command\nport: 9000\nranks: [{commands: [{argv: [/bin/a], binds: "
              "[9000]}]}, {commands: [{name: side, argv: [/bin/s], binds: [7000]}, {argv: "
              "[/bin/b]}]}]\n" + TWO_NODES)


def replica(body: str) -> Replica:
    text = "replicas:\n  - name: r\n" + "".join(f"    {line}\n" for line in body.splitlines())
    return spec.build_spec([parse(text.encode(), "spec.yaml")]).replicas[0]


def error(body: str) -> str:
    with pytest.raises(SpecError) as caught:
        replica(body)
    return str(caught.value)


def web(rank: int, port: int) -> tuple[int, int, str, str]:
    return (rank, port, "port", "HTTP")


def meet(port: int) -> tuple[int, int, str, str]:
    return (0, port, "rendezvous_port", "rendezvous")


@dataclass(frozen=True)
class Row:
    """What one engine (and launch mode) says about a replica. The argv of each step is
    the render cases' to show (tests/cases/render)."""

    body: str
    steps: dict[int, tuple[str, ...]]  # rank -> step names, sidecars first
    http: Http | None
    claims: tuple[tuple[int, int, str, str], ...]  # (rank, port, key path, what)
    reserved: frozenset[str]
    follows_leader: bool
    least_stop_timeout: int | None = None


ROWS = {
    "vllm ray, two nodes: a Ray head on the leader, the worker only joins": Row(
        f"engine: vllm\nmodel: /m\n{TWO_NODES}",
        {0: ("ray-head", "engine"), 1: ("engine",)},
        Http((0,), "0.0.0.0", 8000, "/m", vllm.PROGRESS),
        (web(0, 8000), meet(6379)),
        frozenset({"VLLM_HOST_IP", "RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"}),
        True),
    "vllm ray, one node: the head still binds its port": Row(
        f"engine: vllm\nmodel: /m\n{ONE_NODE}", {0: ("ray-head", "engine")},
        Http((0,), "0.0.0.0", 8000, "/m", vllm.PROGRESS), (web(0, 8000), meet(6379)),
        frozenset({"VLLM_HOST_IP", "RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"}),
        False),
    "vllm mp, two nodes: the master port on rank 0, the served name from args": Row(
        f"engine: vllm\nlaunch_mode: mp\nmodel: /m\nport: 8100\nargs: [--served-model-name, "
        f"x]\n{TWO_NODES}", {0: ("engine",), 1: ("engine",)},
        Http((0,), "0.0.0.0", 8100, "x", vllm.PROGRESS), (web(0, 8100), meet(29500)),
        frozenset({"VLLM_HOST_IP"}), True),
    "vllm mp with a long drain: the common drain check covers it, not the engine": Row(
        f"engine: vllm\nlaunch_mode: mp\nmodel: /m\ndrain: {{timeout: 25}}\n"
        f"stop_timeout: 35\n{ONE_NODE}", {0: ("engine",)},
        Http((0,), "0.0.0.0", 8000, "/m", vllm.PROGRESS),
        (web(0, 8000),), frozenset({"VLLM_HOST_IP"}), False, None),
    "vllm mp, one node: no master port": Row(
        f"engine: vllm\nlaunch_mode: mp\nmodel: /m\n{ONE_NODE}", {0: ("engine",)},
        Http((0,), "0.0.0.0", 8000, "/m", vllm.PROGRESS), (web(0, 8000),),
        frozenset({"VLLM_HOST_IP"}),
        False),
    # its /health generates a token: a failing /health is work owed (docs/supervisor.md)
    "sglang, two nodes: no --enable-metrics, so no progress to read": Row(
        f"engine: sglang\nmodel: /m\nhost: 127.0.0.1\n{TWO_NODES}",
        {0: ("engine",), 1: ("engine",)},
        Http((0,), "127.0.0.1", 30000, "/m", generating_paths=sglang.GENERATING_PATHS),
        (web(0, 30000), meet(20000)), frozenset(), True),
    "sglang with --enable-metrics: its progress series": Row(
        f"engine: sglang\nmodel: /m\nargs: [--enable-metrics]\n{ONE_NODE}",
        {0: ("engine",)}, Http((0,), "0.0.0.0", 30000, "/m", sglang.PROGRESS,
                               sglang.GENERATING_PATHS),
        (web(0, 30000),), frozenset(), False),
    "command: its own sequences; the serving command's bind is its HTTP claim": Row(
        COMMANDS_2, {0: ("engine",), 1: ("side", "engine")}, Http((0,), "0.0.0.0", 9000, None),
        (web(0, 9000), (1, 7000, "ranks[1].commands[0].binds[0]", "command")), frozenset(),
        False),
    "command, serving rank 1; none named for completions": Row(
        "engine: command\nport: 9000\nserving_rank: 1\nranks: [{commands: [{argv: [/bin/a]}]},"
        f" {{commands: [{{argv: [/bin/b]}}]}}]\n{TWO_NODES}", {0: ("engine",), 1: ("engine",)},
        Http((1,), "0.0.0.0", 9000, None), (web(1, 9000),), frozenset(), False),
    "vllm data parallel, internal: rank 0 serves and meets the others at its RPC port": Row(
        f"engine: vllm\nlaunch_mode: mp\nmodel: /m\ndata_parallel_size: 4\n{TWO_NODES}",
        {0: ("engine",), 1: ("engine",)}, Http((0,), "0.0.0.0", 8000, "/m", vllm.PROGRESS),
        (web(0, 8000), meet(29550)), frozenset({"VLLM_HOST_IP"}), True),
    "vllm data parallel, hybrid: every node serves its own ranks": Row(
        f"engine: vllm\nlaunch_mode: mp\nmodel: /m\ndata_parallel_size: 2\n"
        f"data_parallel_lb: hybrid\n{TWO_NODES}",
        {0: ("engine",), 1: ("engine",)}, Http((0, 1), "0.0.0.0", 8000, "/m", vllm.PROGRESS),
        (web(0, 8000), web(1, 8000), meet(29550)), frozenset({"VLLM_HOST_IP"}), True),
    "sglang attention data parallel: rank 0 claims the ZMQ ports after the dist-init port": Row(
        f"engine: sglang\nmodel: /m\ntensor_parallel_size: 4\ndata_parallel_size: 4\n"
        f"{TWO_NODES}", {0: ("engine",), 1: ("engine",)},
        Http((0,), "0.0.0.0", 30000, "/m", generating_paths=sglang.GENERATING_PATHS),
        (web(0, 30000), meet(20000), *(meet(p) for p in range(20001, 20007))), frozenset(),
        True),
    "command, serving ranks 0 and 1: one endpoint on each node": Row(
        "engine: command\nport: 9000\nserving_rank: [0, 1]\nranks: [{commands: [{argv: "
        f"[/bin/a]}}]}}, {{commands: [{{argv: [/bin/b]}}]}}]\n{TWO_NODES}",
        {0: ("engine",), 1: ("engine",)}, Http((0, 1), "0.0.0.0", 9000, None),
        (web(0, 9000), web(1, 9000)), frozenset(), False),
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
    assert tuple((c.rank, c.port, format_path(c.path), c.what)
                 for c in r.engine.port_claims(len(r.nodes))) == row.claims
    assert frozenset(r.engine.reserved_env()) == row.reserved
    assert r.engine.follows_leader(len(r.nodes)) is row.follows_leader
    least = r.engine.least_stop_timeout()
    assert (least and least[0]) == row.least_stop_timeout


def _kind(r: Replica) -> tuple[str, str | None]:
    launch = getattr(r.engine, "launch", None)
    return r.engine.name, None if launch is None else launch.name


def test_every_engine_and_launch_mode_has_a_row() -> None:
    kinds = {_kind(replica(row.body)) for row in ROWS.values()}
    assert kinds == {("vllm", mode) for mode in vllm.LAUNCH_MODES} | {
        (name, None) for name in ENGINES if name != "vllm"}


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


# Every key of every engine's table, set to a value that is not its default: the specs
# below, by engine (vLLM's ray keys and launch_mode: mp cannot share one replica).
SAMPLES = {
    "vllm": [
        "model: /m\nport: 8001\nhost: 127.0.0.1\ntensor_parallel_size: 2\n"
        "pipeline_parallel_size: 2\nrendezvous_port: 6380\nargs: [--x]\nvirtualenv: /opt/v\n"
        "distributed_timeout: 60\nray_args: [--num-cpus=1]\n"
        "ray_head_args: [--include-dashboard=false]\nray_num_gpus: 1\nray_auth: token\n"
        "ray_token_file: /etc/t",
        "launch_mode: mp\nmodel: /m",
        "launch_mode: mp\nmodel: /m\ndata_parallel_size: 2\nexpert_parallel_size: 2\n"
        "data_parallel_lb: hybrid",
    ],
    "sglang": [
        "model: /m\nport: 30001\nhost: 127.0.0.1\ntensor_parallel_size: 2\n"
        "pipeline_parallel_size: 2\nrendezvous_port: 20001\nargs: [--x]\nvirtualenv: /opt/v\n"
        "data_parallel_size: 2\nexpert_parallel_size: 2",
    ],
    "command": [
        "serving_rank: 1\nport: 9000\n"
        "ranks: [{commands: [{argv: [/bin/a]}]}, {commands: [{argv: [/bin/b]}]}]\n"
        "progress: {steps: [steps_total], pending: [running, waiting]}",
    ],
}


@pytest.mark.parametrize("entry", ENGINES.values(), ids=list(ENGINES))
def test_each_key_in_a_table_is_read(entry: EngineEntry) -> None:
    """Each key of the table, left out of a spec that sets them all, changes the replica
    (or makes the spec wrong): no key is allowed and then ignored."""
    names = entry.key_names
    assert len(set(names)) == len(names), "a key listed twice"
    assert not set(names) & set(common_keys.COMMON_KEY_NAMES), "an engine key that every engine has"
    assert all(k.shown_default() and k.meaning for k in entry.keys)
    covered: set[str] = set()
    for sample in SAMPLES[entry.name]:
        lines = sample.splitlines()
        full = replica(f"engine: {entry.name}\n{sample}\n{TWO_NODES}")
        for i, line in enumerate(lines):
            key = line.split(":", 1)[0]
            covered.add(key)
            rest = "\n".join(lines[:i] + lines[i + 1:])
            try:
                without = replica(f"engine: {entry.name}\n{rest}\n{TWO_NODES}")
            except SpecError:
                continue  # required, or others depend on it: read all the same
            assert without != full, f"{key} is allowed and ignored"
    assert covered == set(names), "give each key of the table a sample value"


@pytest.mark.parametrize("entry", ENGINES.values(), ids=list(ENGINES))
def test_another_engines_key_is_refused_naming_its_engine(entry: EngineEntry) -> None:
    for other in ENGINES.values():
        for key in set(other.key_names) - set(entry.key_names):
            message = error(f"engine: {entry.name}\n{key}: 1\n{ONE_NODE}")
            owners = " and ".join(e.name for e in ENGINES.values() if key in e.key_names)
            assert f"'{key}' is not used by engine '{entry.name}' (it applies to engine " \
                   f"{owners})" in message


# A whole engine, as a module would hold it: its settings, key table and reader.
@dataclass(frozen=True)
class Echo:
    port: int

    @property
    def name(self) -> str:
        return "echo"

    @property
    def http(self) -> Http:
        return Http((0,), "127.0.0.1", self.port, None)

    def steps(self, replica: str, nodes: Sequence[Node], rank: int) -> tuple[Step, ...]:
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


ECHO_PORT = Key("port", tcp_port, 7, "its port")


def _read_echo(reader: Reader, data: Mapping[str, Any], path: KeyPath,
               nodes: tuple[Node, ...]) -> Echo:
    return Echo(ECHO_PORT.read(reader, data, path))


ECHO = EngineEntry("echo", "an echo server", (ECHO_PORT,), _read_echo)


def test_an_engine_is_one_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(engines.ENGINES, "echo", ECHO)
    r = replica(f"engine: echo\nport: 7007\nenv: {{A: b}}\n{ONE_NODE}")
    units = render_shards([plan_shard(r, 0, Manager(user=True, wait_for_port="/w"))])
    assert "ExecStart=/usr/bin/echo-server --port 7007\n" in units["llmgw-r-engine.service"]
    assert "'ECHO_PORT' is set by llmgw-render from port" in error(
        f"engine: echo\nenv: {{ECHO_PORT: '1'}}\n{ONE_NODE}")
    assert "'model' is not used by engine 'echo'" in error(f"engine: echo\nmodel: /m\n{ONE_NODE}")
