"""engine: command (pure): each rank runs the commands the spec lists, the last one as the
engine; for anything the other engines do not cover, and for the test stand-ins."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmgw_systemd.spec.document import KeyPath
from llmgw_systemd.spec.endpoint import Endpoint
from llmgw_systemd.spec.engines.base import EngineEntry, Http, PortClaim, SpecKey, Step, wildcard
from llmgw_systemd.spec.reader import NAME_RE, Checker

if TYPE_CHECKING:
    from llmgw_systemd.spec.replicas import Node

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
        claims = [] if http is None else [PortClaim(http.rank, http.port, ("port",), "HTTP")]
        for rank, commands in enumerate(self.ranks):
            for i, cmd in enumerate(commands):
                for j, port in enumerate(cmd.binds):
                    if http is not None and rank == http.rank and port == http.port:
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


KEYS = (
    SpecKey("ranks", "required", "one entry per node: `{commands: [...]}`; each command "
            "`{name, argv, wait_for, binds}`: `argv` starts with an absolute executable; "
            "`wait_for` lists `HOST:PORT` (IPv6 `[ADDR]:PORT`) to wait for; `binds` lists "
            "ports that must be free first. The last command is the engine."),
    SpecKey("serving_rank", "0", "which rank serves HTTP (`null`: none)"),
    SpecKey("port", "required with a serving rank", "HTTP port of the serving rank"),
)


def read(check: Checker, data: Mapping[str, Any], path: KeyPath, nodes: tuple[Node, ...]
         ) -> Commands:
    if "ranks" not in data:
        raise check.fail(path, "missing required key 'ranks' (engine 'command' takes one "
                         "entry of commands per node)")
    ranks = _ranks(check, data["ranks"], (*path, "ranks"), len(nodes))
    serving_rank: int | None = 0
    if "serving_rank" in data:
        serving_rank = None if data["serving_rank"] is None else check.integer(
            data["serving_rank"], (*path, "serving_rank"), 0, len(nodes) - 1,
            "the rank that serves HTTP")
    port = check.optional(data, "port", path, check.port, None)
    if serving_rank is not None and port is None:
        raise check.fail(path, "missing required key 'port' (the HTTP port of serving rank "
                         f"{serving_rank}; set serving_rank: null if no rank serves HTTP)")
    if serving_rank is None and port is not None:
        raise check.fail((*path, "port"), "a port is set but serving_rank is null; "
                         "say which rank serves HTTP")
    serving = None if serving_rank is None or port is None else Http(
        serving_rank, HOST, port, None)
    return Commands(ranks, serving)


ENTRY = EngineEntry(
    name="command",
    summary="commands of your own, one sequence per rank",
    keys=KEYS,
    read=read,
)


def _ranks(check: Checker, raw: Any, path: KeyPath, n_nodes: int
           ) -> tuple[tuple[Command, ...], ...]:
    items = check.sequence(raw, path, "ranks (one per node)")
    if len(items) != n_nodes:
        raise check.fail(path, f"expected one entry per node ({n_nodes}); got {len(items)}")
    ranks = []
    for rank, item in enumerate(items):
        rpath = (*path, rank)
        data = check.mapping(item, rpath, ("commands",), ("commands",))
        cmds_raw = check.sequence(data["commands"], (*rpath, "commands"), "commands",
                                  min_len=1)
        commands: list[Command] = []
        names: dict[str, int] = {}
        for i, cmd_raw in enumerate(cmds_raw):
            cpath = (*rpath, "commands", i)
            cmd = _command(check, cmd_raw, cpath, i, i == len(cmds_raw) - 1)
            if cmd.name in names:
                raise check.fail((*cpath, "name"), f"duplicate command name '{cmd.name}' "
                                 f"(already commands[{names[cmd.name]}])")
            names[cmd.name] = i
            commands.append(cmd)
        ranks.append(tuple(commands))
    return tuple(ranks)


def _command(check: Checker, raw: Any, path: KeyPath, index: int, is_engine: bool) -> Command:
    data = check.mapping(raw, path, ("name", "argv", "wait_for", "binds"), ("argv",))
    default = "engine" if is_engine else f"sidecar{index}"
    name = check.optional(data, "name", path, lambda v, p: check.matching(
        v, p, NAME_RE, "a command name of lowercase letters, digits and '-' (it becomes part "
        "of a unit name)"), default)
    if name == "engine" and not is_engine:
        raise check.fail((*path, "name"), "the name 'engine' is reserved for the last command")
    argv = check.str_list(check.sequence(data["argv"], (*path, "argv"), "arguments", min_len=1),
                          (*path, "argv"), "arguments")
    check.abs_path(argv[0], (*path, "argv", 0), "the executable")
    wait_for: tuple[Endpoint, ...] = check.optional(data, "wait_for", path, lambda v, p: tuple(
        check.endpoint(item, (*p, i))
        for i, item in enumerate(check.sequence(v, p, "addresses HOST:PORT"))), ())
    binds: tuple[int, ...] = check.optional(data, "binds", path, lambda v, p: tuple(
        check.port(item, (*p, i)) for i, item in enumerate(check.sequence(v, p, "ports"))), ())
    return Command(name, argv, wait_for, binds)
