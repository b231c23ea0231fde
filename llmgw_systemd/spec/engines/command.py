"""engine: command (pure): each rank runs the commands the spec lists, the last one as the
engine; for anything the other engines do not cover, and for the test stand-ins."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmgw_systemd.spec.document import KeyPath
from llmgw_systemd.spec.endpoint import Endpoint
from llmgw_systemd.spec.engines.base import (
    EngineEntry,
    Http,
    PortClaim,
    ProgressSeries,
    Step,
    wildcard,
)
from llmgw_systemd.spec.keys import REQUIRED, Key, matching, read_all, tcp_port
from llmgw_systemd.spec.names import RESTART_UNITS, is_word
from llmgw_systemd.spec.reader import Reader

if TYPE_CHECKING:
    from llmgw_systemd.spec.model import Node

# Where the supervisor probes a command's HTTP port: the spec does not say which address
# it binds, so the wildcard (probed on loopback).
HOST = "0.0.0.0"  # noqa: S104


@dataclass(frozen=True)
class Command:
    """One command of a rank: every one but the last is a sidecar, the last the engine."""

    name: str
    argv: tuple[str, ...]
    wait_for: tuple[Endpoint, ...] = ()
    binds: tuple[int, ...] = ()


@dataclass(frozen=True)
class Commands:
    ranks: tuple[tuple[Command, ...], ...]  # one sequence per node
    http: Http | None  # the rank that serves HTTP, if one does

    @property
    def name(self) -> str:
        return "command"

    def steps(self, replica: str, nodes: Sequence[Node], rank: int) -> tuple[Step, ...]:
        any_address = wildcard(nodes[rank].address)
        commands = self.ranks[rank]
        return tuple(
            Step(name="engine" if i == len(commands) - 1 else cmd.name,
                 role=f"command {cmd.name}", argv=cmd.argv, wait_for=cmd.wait_for,
                 frees=tuple(Endpoint(any_address, port) for port in cmd.binds))
            for i, cmd in enumerate(commands))

    def port_claims(self, n_nodes: int) -> tuple[PortClaim, ...]:
        http = self.http
        claims = [] if http is None else [PortClaim(rank, http.port, ("port",), "HTTP")
                                          for rank in http.ranks]
        for rank, commands in enumerate(self.ranks):
            for i, cmd in enumerate(commands):
                for j, port in enumerate(cmd.binds):
                    if http is not None and rank in http.ranks and port == http.port:
                        continue  # the serving command binding its own HTTP port: one claim
                    claims.append(PortClaim(rank, port, ("ranks", rank, "commands", i,
                                                         "binds", j), "command"))
        return tuple(claims)

    def reserved_env(self) -> Mapping[str, str]:
        return {}

    def follows_leader(self, n_nodes: int) -> bool:
        return False  # each rank is its own program: nothing says one needs another

    def least_stop_timeout(self) -> tuple[int, str] | None:
        return None


def read_argv(reader: Reader, value: Any, path: KeyPath) -> tuple[str, ...]:
    argv = reader.str_list(reader.sequence(value, path, "arguments", min_len=1), path,
                           "arguments")
    reader.abs_path(argv[0], (*path, 0), "the executable")
    return argv


def read_endpoints(reader: Reader, value: Any, path: KeyPath) -> tuple[Endpoint, ...]:
    return tuple(reader.endpoint(item, (*path, i))
                 for i, item in enumerate(reader.sequence(value, path, "addresses HOST:PORT")))


def read_ports(reader: Reader, value: Any, path: KeyPath) -> tuple[int, ...]:
    return tuple(reader.port(item, (*path, i))
                 for i, item in enumerate(reader.sequence(value, path, "ports")))


NO_ENDPOINTS: tuple[Endpoint, ...] = ()
NO_PORTS: tuple[int, ...] = ()
# One command of a rank; its name defaults to its place (engine, sidecar0, ...).
COMMAND_KEYS = (
    Key("name", matching(is_word, "a command name of lowercase letters, digits and '-' (it "
                         "becomes part of a unit name)"), None, "the unit name's suffix"),
    Key("argv", read_argv, REQUIRED, "the command, its executable an absolute path"),
    Key("wait_for", read_endpoints, NO_ENDPOINTS, "addresses that must accept connections "
        "first"),
    Key("binds", read_ports, NO_PORTS, "ports that must be free first"),
)
_NAME, _ARGV, _WAIT_FOR, _BINDS = COMMAND_KEYS


def read_ranks(reader: Reader, value: Any, path: KeyPath) -> tuple[tuple[Command, ...], ...]:
    items = reader.sequence(value, path, "ranks (one per node)")
    ranks = []
    for rank, item in enumerate(items):
        rpath = (*path, rank)
        data = reader.mapping(item, rpath, ("commands",), ("commands",))
        cmds_raw = reader.sequence(data["commands"], (*rpath, "commands"), "commands",
                                   min_len=1)
        commands: list[Command] = []
        names: dict[str, int] = {}
        for i, cmd_raw in enumerate(cmds_raw):
            cpath = (*rpath, "commands", i)
            cmd = _command(reader, cmd_raw, cpath, i, i == len(cmds_raw) - 1)
            if cmd.name in names:
                raise reader.fail((*cpath, "name"), f"duplicate command name '{cmd.name}' "
                                  f"(already commands[{names[cmd.name]}])")
            names[cmd.name] = i
            commands.append(cmd)
        ranks.append(tuple(commands))
    return tuple(ranks)


def _command(reader: Reader, raw: Any, path: KeyPath, index: int, is_engine: bool) -> Command:
    data = reader.mapping(raw, path, tuple(k.name for k in COMMAND_KEYS),
                          tuple(k.name for k in COMMAND_KEYS if k.required))
    name = _NAME.read(reader, data, path) or ("engine" if is_engine else f"sidecar{index}")
    if name == "engine" and not is_engine:
        raise reader.fail((*path, "name"), "the name 'engine' is reserved for the last command")
    if name in RESTART_UNITS:
        raise reader.fail((*path, "name"), f"the name '{name}' is reserved: "
                          f"llmgw-REPLICA-{name}.service restarts the shard")
    return Command(name, _ARGV.read(reader, data, path), _WAIT_FOR.read(reader, data, path),
                   _BINDS.read(reader, data, path))


RANKS = Key("ranks", read_ranks, REQUIRED,
            "one entry per node: `{commands: [...]}`; each command `{name, argv, wait_for, "
            "binds}`: `argv` starts with an absolute executable; `wait_for` lists "
            "`HOST:PORT` (IPv6 `[ADDR]:PORT`) to wait for; `binds` lists ports that must be "
            "free first. The last command is the engine.",
            missing="engine 'command' takes one entry of commands per node")
def read_serving_ranks(reader: Reader, value: Any, path: KeyPath) -> tuple[int, ...]:
    """One rank, or a list of them (each serving HTTP on `port` of its own node)."""
    what = "the rank that serves HTTP, or a list of ranks"
    if not isinstance(value, list):
        return (reader.integer(value, path, 0, 4095, what),)
    items = reader.sequence(value, path, "ranks that serve HTTP", min_len=1)
    ranks = tuple(reader.integer(item, (*path, i), 0, 4095, "a rank that serves HTTP")
                  for i, item in enumerate(items))
    for i, rank in enumerate(ranks):
        if rank in ranks[:i]:
            raise reader.fail((*path, i), f"rank {rank} is listed twice")
    return ranks


SERVING_RANK: Key[tuple[int, ...]] = Key(
    "serving_rank", read_serving_ranks, (0,),
    "which rank serves HTTP, or a list of ranks that each serve on `port` of their own "
    "node, one endpoint each (`null`: none)", shown="0", null=())
PORT: Key[int | None] = Key("port", tcp_port, None, "HTTP port of the serving rank",
                            shown="required with a serving rank")
# A Prometheus sample name: what a progress series may name (no labels: they are summed).
SAMPLE_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,199}\Z")


def read_metrics_path(reader: Reader, value: Any, path: KeyPath) -> str:
    text = reader.string(value, path, "an HTTP path such as /metrics", max_len=200)
    if not text.startswith("/") or any(c in text for c in " ?#") or not text.isprintable():
        raise reader.fail(path, f"expected an HTTP path such as /metrics; got '{text}'")
    return text


def read_samples(reader: Reader, value: Any, path: KeyPath) -> tuple[str, ...]:
    items = reader.sequence(value, path, "Prometheus sample names", min_len=1, max_len=16)
    return tuple(reader.matching(item, (*path, i), SAMPLE_NAME_RE,
                                 "a Prometheus sample name such as my_steps_total")
                 for i, item in enumerate(items))


PROGRESS_KEYS = (
    Key("path", read_metrics_path, "/metrics", "the serving rank's metrics page"),
    Key("steps", read_samples, REQUIRED, "sample names whose sum moves on every step of "
        "the engine (a counter)"),
    Key("pending", read_samples, REQUIRED, "sample names whose sum is the requests "
        "running and waiting"),
)


def read_progress(reader: Reader, value: Any, path: KeyPath) -> ProgressSeries | None:
    return ProgressSeries(**read_all(reader, PROGRESS_KEYS, value, path))


PROGRESS: Key[ProgressSeries | None] = Key(
    "progress", read_progress, None, "where the serving rank says it makes progress: "
    "`{path: /metrics, steps: [...], pending: [...]}` (Prometheus text); with it, work "
    "pending and no step for `health.stall_after` restarts the replica, and a busy engine "
    "stays ready (docs/supervisor.md, \"Stalls\"); without, only the generation check "
    "counts", shown="none")
KEYS = (RANKS, SERVING_RANK, PORT, PROGRESS)


def read(reader: Reader, data: Mapping[str, Any], path: KeyPath, nodes: tuple[Node, ...]
         ) -> Commands:
    ranks = RANKS.read(reader, data, path)
    if len(ranks) != len(nodes):
        raise reader.fail((*path, "ranks"), f"expected one entry per node ({len(nodes)}); "
                          f"got {len(ranks)}")
    serving = SERVING_RANK.read(reader, data, path)
    for i, rank in enumerate(serving):
        if rank >= len(nodes):
            where = (*path, "serving_rank") + ((i,) if isinstance(data["serving_rank"], list)
                                               else ())
            raise reader.fail(where, f"expected the rank that serves HTTP from "
                              f"0 to {len(nodes) - 1}; got {rank}")
    http_port = PORT.read(reader, data, path)
    if serving and http_port is None:
        raise reader.fail(path, "missing required key 'port' (the HTTP port of serving rank "
                          f"{', '.join(map(str, serving))}; set serving_rank: null if no "
                          "rank serves HTTP)")
    if not serving and http_port is not None:
        raise reader.fail((*path, "port"), "a port is set but serving_rank is null; "
                          "say which rank serves HTTP")
    progress = PROGRESS.read(reader, data, path)
    if progress is not None and not serving:
        raise reader.fail((*path, "progress"), "progress is read from the serving rank, "
                          "but serving_rank is null")
    http = None if not serving or http_port is None else Http(
        serving, HOST, http_port, None, progress)
    return Commands(ranks, http)


ENTRY = EngineEntry(
    name="command",
    summary="commands of your own, one sequence per rank",
    keys=KEYS,
    read=read,
)
