"""What an engine module provides, and the pieces every engine shares (pure).

An engine module (vllm, sglang, command) holds everything about its engine in one
place: its spec keys (the table that drives both the reader and the docs), their
defaults, the environment its units set, the steps each rank runs, which rank serves
HTTP, which exits are clean. The spec reader (spec/replicas.py) reads the keys every engine has
and hands the rest to the engine's entry; the planner (units/plan.py) asks the engine for its
steps and knows nothing else of it (docs/design.md §2).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal, NamedTuple

from llmgw_systemd.spec.document import KeyPath
from llmgw_systemd.spec.endpoint import Endpoint
from llmgw_systemd.spec.keys import Key, Parse
from llmgw_systemd.spec.reader import Reader

if TYPE_CHECKING:  # types only: a Protocol costs import time on the render path
    from typing import Protocol

    from llmgw_systemd.spec.model import Node

    class EngineSettings(Protocol):
        """One replica's engine keys, validated, and what follows from them. mypy checks
        that every engine's settings class provides all of it."""

        @property
        def name(self) -> str:
            """The spec's `engine:` value."""
            ...

        @property
        def http(self) -> Http | None:
            """The serving ranks, or None when no rank serves HTTP."""
            ...

        def steps(self, replica: str, nodes: Sequence[Node], rank: int) -> tuple[Step, ...]:
            """The command sequence of one rank: sidecars first, the engine last."""
            ...

        def port_claims(self, n_nodes: int) -> tuple[PortClaim, ...]:
            """Every port the replica's ranks bind."""
            ...

        def reserved_env(self) -> Mapping[str, str]:
            """Variables this engine's units set, each with the key it comes from: the
            spec's env may not set them."""
            ...

        def follows_leader(self, n_nodes: int) -> bool:
            """Whether the other ranks cannot serve without rank 0 (one engine across the
            nodes), so the supervisor restarts them as a group."""
            ...

        def least_stop_timeout(self) -> tuple[int, str] | None:
            """The shortest stop_timeout that lets the engine stop cleanly, and why."""
            ...

    # Reads an engine's keys from a replica's mapping (already checked for unknown keys),
    # given its nodes (read first: they are common to every engine).
    ReadSettings = Callable[[Reader, Mapping[str, Any], KeyPath, tuple[Node, ...]],
                            EngineSettings]


# How systemd stops a member: every process at once, or the main process first.
KillMode = Literal["control-group", "mixed"]
# What a claimed port is for, as conflict errors name it.
PortUse = Literal["HTTP", "rendezvous", "command"]


# The small records of this module are NamedTuples, not frozen dataclasses: immutable and
# typed all the same, and about 0.1 ms to create against 1 ms, on the render path that a
# generator runs (docs/generator.md, bench/generator.py, bench/render.py).
@dataclass(frozen=True)
class Step:
    """One command of a shard's sequence, with what must hold before it starts. Every
    step but the last is a sidecar that lives as long as the shard; the last is the
    engine, whose exit is the shard's exit."""

    name: str  # unit name suffix: "ray-head", "engine"
    role: str  # for people: "Ray head on port 6379", "vLLM headless rank 1"
    argv: tuple[str, ...]
    wait_for: tuple[Endpoint, ...] = ()  # must accept TCP connections before the start
    frees: tuple[Endpoint, ...] = ()  # must be bindable (nobody listening) before the start
    env: tuple[tuple[str, str], ...] = ()
    clean_exit_statuses: tuple[int, ...] = ()
    # (variable, credential name, source file): the variable names the file, loaded as a
    # credential where the manager can (never the secret itself in the unit)
    credential_env: tuple[tuple[str, str, str], ...] = ()
    kill_mode: KillMode = "control-group"  # "mixed" for `ray start`
    clean_exit_signals: tuple[str, ...] = ()
    stop_with_grace: bool = False  # ExecStop=llmgw-stop-group: SIGTERM, grace, SIGKILL
    # SIGTERM to the main process alone at a stop: it drains what it serves and stops its
    # own children (vLLM's API server with --shutdown-timeout stops its engine core once
    # the requests in flight are done; signalled with it, the core dies under them)
    main_drains: bool = False


class Http(NamedTuple):
    """The ranks that serve HTTP (each on its own node, at the same host and port), where
    the supervisor probes them, and the model name a generation check asks for (None:
    the request names none and the server picks). Most layouts have one serving rank;
    data parallel with a load balancer in front has one per node (vLLM's hybrid mode)."""

    ranks: tuple[int, ...]
    host: str
    port: int
    model: str | None
    progress: ProgressSeries | None = None  # None: no stall detection (no metrics)
    # health paths at which the engine answers only once it generated a token
    generating_paths: tuple[str, ...] = ()

    def port_of(self, rank: int) -> int | None:
        """The HTTP port `rank` serves on, None when it serves none."""
        return self.port if rank in self.ranks else None


class ProgressSeries(NamedTuple):
    """Where an engine says it is making progress (docs/supervisor.md, "Stalls"): the
    metrics path on its HTTP port, sample names whose sum is a counter that moves on
    every engine step, and sample names whose sum is the requests running and waiting."""

    path: str
    steps: tuple[str, ...]
    pending: tuple[str, ...]


class PortClaim(NamedTuple):
    """A port a rank binds, with the key path (in the replica) that set it: two claims
    of one port on one node are a conflict, reported at both places."""

    rank: int
    port: int
    path: KeyPath
    what: PortUse


class EngineEntry(NamedTuple):
    """One row of the engine table (spec/engines/table.py)."""

    name: str  # the spec's `engine:` value
    summary: str  # one line for the docs
    keys: tuple[Key[Any], ...]  # every key of this engine's own, one row each
    read: ReadSettings  # (reader, replica mapping, its key path, nodes) -> EngineSettings

    @property
    def key_names(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.keys)


# Flags whose value is a secret: in a unit file anyone on the node could read it.
SECRET_FLAGS = ("--api-key", "--hf-token", "--token")


def refuse_secret_flags(reader: Reader, key: str, args: Sequence[str], path: KeyPath) -> None:
    for i, arg in enumerate(args):
        flag = arg.split("=", 1)[0]
        if flag in SECRET_FLAGS:
            raise reader.fail((*path, key, i), f"'{flag}' would put a secret into a "
                             "world-readable unit file; set it through environment_file "
                             "(e.g. VLLM_API_KEY, HF_TOKEN) instead")


def refuse_owned_flags(reader: Reader, args: Sequence[str], path: KeyPath,
                       owned: Mapping[str, str]) -> None:
    """A flag of `args` that llmgw-render sets from a key (`owned`: flag -> the key): the
    two would contradict each other, and which one the engine takes is its parser's
    whim."""
    for i, arg in enumerate(args):
        flag = arg.split("=", 1)[0]
        if flag in owned:
            raise reader.fail((*path, "args", i), f"'{flag}' is set by llmgw-render from "
                              f"{owned[flag]}; set that instead")


def arguments(what: str) -> Parse[tuple[str, ...]]:
    """A parser of arguments for a command line: strings, no flag whose value is a secret."""
    def parse(reader: Reader, value: Any, path: KeyPath) -> tuple[str, ...]:
        args = reader.str_list(value, path, what)
        refuse_secret_flags(reader, path[-1], args, path[:-1])  # type: ignore[arg-type]
        return args
    return parse


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of `flag` in an argument list (`--flag V` or `--flag=V`), if given."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def wildcard(address: str) -> str:
    """The wildcard address of the node's family: what a bind test must try."""
    return "::" if ":" in address else "0.0.0.0"  # noqa: S104 - a bind test, not a listener


def uses_rendezvous(n_nodes: int) -> bool:
    """A rendezvous port is bound on rank 0 only when there are ranks to meet."""
    return n_nodes > 1
