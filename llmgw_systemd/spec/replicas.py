"""The replica spec: typed data, and its validation from parsed YAML (pure).

Every check raises one SpecError naming file, line, key path and what was expected.
Files and replicas are checked in document order, so the first bad replica a user sees
is the first in the file. Within a replica: its name, its engine, which keys it may
have, its nodes, then its engine's own keys (read by the engine's entry in spec/engines/),
then the rest of the keys every engine has.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from llmgw_systemd.errors import SpecError
from llmgw_systemd.spec.document import Document, KeyPath, format_path
from llmgw_systemd.spec.endpoint import is_host
from llmgw_systemd.spec.engines.base import EngineEntry, Http, SpecKey
from llmgw_systemd.spec.engines.table import ENGINES
from llmgw_systemd.spec.names import is_node_name
from llmgw_systemd.spec.reader import NAME_RE, Checker, kind

if TYPE_CHECKING:
    from llmgw_systemd.spec.engines.base import EngineSettings

MAX_REPLICA_NAME = 63

ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,30}\$?\Z|[0-9]{1,10}\Z")
GPU_RE = re.compile(r"[0-9]+\Z|(GPU|MIG)-[A-Za-z0-9/-]+\Z")
# Environment variable names that say "this is a secret": such values belong in
# environment_file (root-only) because unit files are world-readable.
SECRET_NAME_RE = re.compile(r"TOKEN|SECRET|PASSW(OR)?D|API_?KEY|CREDENTIAL|PRIVATE_?KEY", re.I)
# Linux interface names: at most 15 bytes, no '/', ':' or white space (dev_valid_name).
IFNAME_RE = re.compile(r"[A-Za-z0-9_@.+-]{1,15}\Z")
# vLLM exits within a second of SIGTERM once ready, within 7 s while it starts, a
# headless rank about 10 s after it; a worker orphaned by a killed rank ignores SIGTERM
# and waits for the SIGKILL at the end of this (docs/engines.md).
DEFAULT_STOP_TIMEOUT = 30
# Set by the planner for every engine, from common keys.
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
GPUS_VAR = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class Node:
    """One rank's machine: the name --node matches, the address peers dial."""

    name: str
    address: str
    interface: str | None = None  # the NIC for gloo/NCCL traffic on this node
    env: tuple[tuple[str, str], ...] = ()  # this node's own variables (they win)


@dataclass(frozen=True)
class RestartPolicy:
    """Restart=always after delay seconds; at most burst starts per interval."""

    delay: int = 10
    burst: int = 5
    interval: int = 1200


@dataclass(frozen=True)
class HealthCheck:
    """How the supervisor judges the shards: the serving rank's HTTP probe, and how long
    a non-serving rank must stay up before it counts as ready."""

    path: str = "/health"
    interval: int = 5
    timeout: int = 2
    stability: int = 30
    generation: GenerationCheck | None = None


@dataclass(frozen=True)
class GenerationCheck:
    """A one-token completion asked of the serving rank, because /health can stay 200
    while generation fails (a dead mp peer, a lost Ray worker: docs/engines.md)."""

    interval: int = 30
    timeout: int = 10


@dataclass(frozen=True)
class GroupRestartPolicy:
    """A replica's group_restart (the supervisor's, health/group_restart.py): the delay before
    the nth restart in a window is delay x 2^(n-1), at most max_delay; at most budget
    restarts within window seconds. Here, not there: the render path reads it and need
    not import the supervisor's rules."""

    delay: int = 5
    max_delay: int = 300
    budget: int = 5
    window: int = 3600


@dataclass(frozen=True)
class Replica:
    """One replica of a model across its nodes, validated: the keys every engine has,
    and its engine's own settings (spec/engines/)."""

    name: str
    nodes: tuple[Node, ...]
    engine: EngineSettings
    rendezvous_timeout: int
    port_release_timeout: int
    gpus: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    environment_file: str | None
    stop_timeout: int
    user: str | None
    restart: RestartPolicy
    health: HealthCheck
    group_restart: GroupRestartPolicy
    source: str
    # Start at boot: the generator links the target into multi-user.target (or
    # default.target); llmgw-render --apply enables and starts it.
    enable: bool = False

    @property
    def http(self) -> Http | None:
        """The rank that serves HTTP, if one does."""
        return self.engine.http

    def rank_of(self, node_name: str) -> int | None:
        for rank, node in enumerate(self.nodes):
            if node.name == node_name:
                return rank
        return None


@dataclass(frozen=True)
class Spec:
    """Every replica of every spec file given."""

    replicas: tuple[Replica, ...]

    def node_names(self) -> list[str]:
        return sorted({n.name for r in self.replicas for n in r.nodes})


def _inline(policy: Any, skip: tuple[str, ...] = ()) -> str:
    """A default as the docs show it: `{delay: 10, burst: 5}`."""
    fields = ", ".join(f"{k}: {v}" for k, v in vars(policy).items() if k not in skip)
    return f"`{{{fields}}}`"


# The keys every engine has: with each engine's own table (spec/engines/) the whole of what a
# replica may say; the reader allows these names and the README's tables are written
# from them (scripts/manpages.py).
COMMON_KEYS = (
    SpecKey("name", "required", "replica name; part of every unit name"),
    SpecKey("engine", "required", "which engine runs it: " + ", ".join(
        f"`{e}`" for e in ENGINES)),
    SpecKey("enable", "`false`", "start at boot: the generator links the target into "
            "`multi-user.target.wants`; `llmgw-render --apply` enables and starts it. "
            "Without `--apply`, `llmgw-render` only accepts the key."),
    SpecKey("nodes", "required", "list of `{name, address, interface, env}`; `name` is what "
            "`--node` matches (the host name by default), `address` what peers dial (an IP "
            "address or DNS name; vLLM needs IPs). Rank = position; rank 0 leads. "
            "`interface` (optional) is the node's NIC for collective traffic, set as "
            "`GLOO_SOCKET_IFNAME` and `NCCL_SOCKET_IFNAME` on that node only: without it "
            "gloo binds whatever the host name resolves to (often 127.0.0.1) and a "
            "cross-node start fails with `Gloo connectFullMesh failed`. `env` (optional) is "
            "that node's own environment, which wins over the replica's."),
    SpecKey("rendezvous_timeout", "300", "seconds a rank waits for the rendezvous point "
            "before its shard fails (and retries under `restart`)"),
    SpecKey("port_release_timeout", "30", "seconds a command that binds a port waits for it "
            "to be free before failing"),
    SpecKey("gpus", "none", "GPU indexes or UUIDs, set as `CUDA_VISIBLE_DEVICES`"),
    SpecKey("env", "none", "extra environment; names that look like secrets (`*TOKEN*`, "
            "`*SECRET*`, `*API_KEY*`, ...) are refused, because unit files are "
            "world-readable; so are the variables the units set themselves"),
    SpecKey("environment_file", "none", "absolute path of a root-only `KEY=value` file "
            "(`EnvironmentFile=`): put `HF_TOKEN`, `VLLM_API_KEY` there"),
    SpecKey("stop_timeout", str(DEFAULT_STOP_TIMEOUT), "`TimeoutStopSec=` of every member, "
            "then SIGKILL: vLLM exits within a second of SIGTERM once ready, within 7 s while "
            "it starts, a headless rank after about 10 s; a worker orphaned by a killed rank "
            "ignores SIGTERM and waits for this. Must exceed vLLM's `--shutdown-timeout` "
            "(its drain) by 10 s."),
    SpecKey("user", "root", "`User=` of every unit"),
    SpecKey("restart", _inline(RestartPolicy()), "a dead member restarts "
            "the shard after `delay` s (at least 1); at most `burst` starts within "
            "`interval` s, then the shard stays failed. `interval` must exceed `burst x "
            "delay` or the budget could never run out."),
    SpecKey("group_restart", _inline(GroupRestartPolicy()),
            "how the supervisor restarts the ranks that follow a dead leader (see the "
            "supervisor above)"),
    SpecKey("health", _inline(HealthCheck(), skip=("generation",)), "the "
            "supervisor's checks (see above); `generation: {interval: 30, timeout: 10}` (or "
            "`true`) adds a one-token completion of the serving rank (`POST "
            "/v1/completions`, `max_tokens: 1`, the served model name): the rank is ready "
            "only while one succeeded for its current start within interval + timeout. "
            "Turn it on for multi-node vLLM with mp, whose `/health` stays 200 after a peer "
            "died until a request fails, and wherever a hung engine must not count as "
            "ready; it costs one token per interval."),
)
COMMON_KEY_NAMES = tuple(k.name for k in COMMON_KEYS)


# (every key some engine allows, the common ones first; engine -> the keys it allows)
KeyTable = tuple[tuple[str, ...], dict[str, frozenset[str]]]


def replica_keys() -> KeyTable:
    """The keys, from the engine table as it is now (so the table is the only place an
    engine's keys are listed); worked out once per document, not per replica."""
    own = {name: frozenset(COMMON_KEY_NAMES + e.key_names) for name, e in ENGINES.items()}
    every = tuple(dict.fromkeys(
        COMMON_KEY_NAMES + tuple(n for e in ENGINES.values() for n in e.key_names)))
    return every, own


def build_spec(documents: Sequence[Document]) -> Spec:
    """Every replica of every document, or the first error (in document order)."""
    placed = _read_documents(documents)
    found = conflicts(placed)
    if found:
        raise found[0].later
    return Spec(tuple(p.replica for p in placed))


def collect_spec(documents: Sequence[Document | SpecError]) -> tuple[Spec, tuple[SpecError, ...]]:
    """Each file on its own, for readers that must not stop for one bad file (the
    generator, the supervisor): a file with an error loses its replicas and reports its
    first error; two files that conflict both lose theirs, with an error at each naming
    both places. The other files' replicas are kept. A file that could not be read or
    parsed comes in as its SpecError."""
    errors: dict[str, list[SpecError]] = {}
    good: list[list[Placed]] = []
    for doc in documents:
        if isinstance(doc, SpecError):
            errors.setdefault(doc.file, []).append(doc)
            continue
        try:
            placed = _read_documents([doc])
            found = conflicts(placed)
            if found:
                raise found[0].later
        except SpecError as exc:
            errors.setdefault(doc.file, []).append(exc)
            continue
        good.append(placed)
    for conflict in conflicts([p for placed in good for p in placed]):
        for error in (conflict.later, conflict.earlier):
            errors.setdefault(error.file, []).append(error)
    replicas = tuple(p.replica for placed in good for p in placed
                     if p.doc.file not in errors)
    ordered = tuple(e for doc in documents for e in errors.pop(doc.file, []))
    return Spec(replicas), ordered


def keep_last_good(spec: Spec, errors: Sequence[SpecError], previous: Spec | None) -> Spec:
    """collect_spec's result for a reader that already runs (the supervisor): a file that
    turned bad keeps the replicas it had in the previous spec, so an edit with a typo
    never makes a running replica vanish; a file that is gone takes its replicas along."""
    if previous is None or not errors:
        return spec
    bad = {e.file for e in errors}
    names = {r.name for r in spec.replicas}
    kept = tuple(r for r in previous.replicas if r.source in bad and r.name not in names)
    return Spec(spec.replicas + kept)


def _read_documents(documents: Sequence[Document]) -> list[Placed]:
    placed: list[Placed] = []
    names: set[str] = set()
    for doc in documents:
        check = Checker(doc)
        top = check.mapping(doc.data, (), ("replicas",), ("replicas",))
        items = check.sequence(top["replicas"], ("replicas",), "replicas")
        keys = replica_keys()
        for index, item in enumerate(items):
            path: KeyPath = ("replicas", index)
            entry = Placed(_replica(check, item, path, keys), doc, path)
            placed.append(entry)
            if entry.replica.name in names:  # reported here, before later files' errors
                raise _name_conflicts(placed)[0].later
            names.add(entry.replica.name)
    return placed


def _where(doc: Document, path: KeyPath) -> str:
    return f"{doc.file}:{doc.key_line(path)} ({format_path(path)})"


def _replica(check: Checker, raw: Any, path: KeyPath, keys: KeyTable) -> Replica:
    every, allowed_by_engine = keys
    data = check.mapping(raw, path, every, ("name", "engine", "nodes"))
    name = check.matching(data["name"], (*path, "name"), NAME_RE,
                          "a replica name of lowercase letters, digits and '-', starting with "
                          "a letter or digit (it becomes part of unit names)")
    if len(name) > MAX_REPLICA_NAME:
        raise check.fail((*path, "name"), f"expected a replica name of at most "
                         f"{MAX_REPLICA_NAME} characters (it becomes part of unit names); "
                         f"got {len(name)}")
    entry = ENGINES[check.choice(data["engine"], (*path, "engine"), tuple(ENGINES))]
    _refuse_other_engines_keys(check, data, path, entry, allowed_by_engine[entry.name])
    nodes = _nodes(check, data["nodes"], (*path, "nodes"))
    engine = entry.read(check, data, path, nodes)

    stop_timeout = check.optional_int(data, "stop_timeout", path, 1, 86400,
                                      "a timeout in seconds", DEFAULT_STOP_TIMEOUT)
    least = engine.least_stop_timeout()
    if least is not None and stop_timeout < least[0]:
        where = (*path, "stop_timeout") if "stop_timeout" in data else path
        raise check.fail(where, f"stop_timeout ({stop_timeout} s) must be at least {least[1]}"
                         "; set stop_timeout")
    gpus: tuple[str, ...] = check.optional(data, "gpus", path, lambda v, p: _gpus(check, v, p), ())
    # What the units set themselves, and from which key: the spec's env may not set it.
    # A node's own env may set CUDA_VISIBLE_DEVICES (that node's GPUs differ). The nodes
    # were read before the engine said what it sets: their env is checked now.
    by_engine = engine.reserved_env()
    by_interface = dict.fromkeys(IFNAME_VARS, "the nodes' interface")
    for rank, node in enumerate(nodes):
        own = {**by_engine, **(by_interface if node.interface is not None else {})}
        for key, _ in node.env:
            _refuse_reserved(check, (*path, "nodes", rank, "env", key), key, own)
    reserved = {**by_engine, **(by_interface if any(n.interface for n in nodes) else {}),
                **({GPUS_VAR: "gpus"} if gpus else {})}
    env: tuple[tuple[str, str], ...] = check.optional(
        data, "env", path, lambda v, p: _env(check, v, p, reserved), ())
    environment_file = check.optional(
        data, "environment_file", path,
        lambda v, p: check.abs_path(v, p, "an environment file"), None)
    user = check.optional(data, "user", path, lambda v, p: check.matching(
        v, p, USER_RE, "a user name ([a-z_][a-z0-9_-]*) or numeric UID"), None)
    return Replica(
        name=name, nodes=nodes, engine=engine,
        rendezvous_timeout=check.optional_int(data, "rendezvous_timeout", path, 1, 86400,
                                              "a timeout in seconds", 300),
        port_release_timeout=check.optional_int(data, "port_release_timeout", path, 0, 3600,
                                                "a timeout in seconds", 30),
        gpus=gpus, env=env, environment_file=environment_file, stop_timeout=stop_timeout,
        user=user,
        restart=check.optional(data, "restart", path, lambda v, p: _restart(check, v, p),
                               RestartPolicy()),
        health=check.optional(data, "health", path, lambda v, p: _health(check, v, p),
                              HealthCheck()),
        group_restart=check.optional(data, "group_restart", path,
                                     lambda v, p: _group_restart(check, v, p),
                                     GroupRestartPolicy()),
        source=check.doc.file,
        enable=check.optional(data, "enable", path, lambda v, p: check.boolean(
            v, p, "whether the replica starts at boot"), False),
    )


def _refuse_other_engines_keys(check: Checker, data: Mapping[str, Any], path: KeyPath,
                               entry: EngineEntry, allowed: frozenset[str]) -> None:
    """A key of another engine's table, named with the engines it belongs to."""
    for key in data:
        if key in allowed:
            continue
        users = " and ".join(e.name for e in ENGINES.values() if key in e.key_names)
        raise check.fail((*path, key), f"'{key}' is not used by engine '{entry.name}' (it "
                         f"applies to engine {users})", at_key=True)


def _nodes(check: Checker, raw: Any, path: KeyPath) -> tuple[Node, ...]:
    items = check.sequence(raw, path, "nodes (rank = position, rank 0 leads)", min_len=1)
    nodes: list[Node] = []
    seen_names: dict[str, int] = {}
    seen_addresses: dict[str, int] = {}
    for rank, item in enumerate(items):
        npath = (*path, rank)
        data = check.mapping(item, npath, ("name", "address", "interface", "env"),
                             ("name", "address"))
        name = check.string(data["name"], (*npath, "name"), "a node's host name")
        if not is_node_name(name):
            raise check.fail((*npath, "name"), "expected a node's host name (letters, "
                             f"digits, '.', '_', '-'); got '{name}'")
        address = check.string(data["address"], (*npath, "address"),
                               "an IP address or host name")
        if not is_host(address):
            raise check.fail((*npath, "address"),
                             f"expected an IP address or host name; got '{address}'")
        if name in seen_names:
            raise check.fail((*npath, "name"), f"duplicate node name '{name}' (already rank "
                             f"{seen_names[name]} of this replica)")
        if address in seen_addresses:
            raise check.fail((*npath, "address"), f"duplicate address '{address}' (already "
                             f"rank {seen_addresses[address]} of this replica)")
        seen_names[name] = rank
        seen_addresses[address] = rank
        interface = check.optional(data, "interface", npath, lambda v, p: check.matching(
            v, p, IFNAME_RE, "a network interface name (at most 15 characters, no '/', ':' "
            "or spaces)"), None)
        env: tuple[tuple[str, str], ...] = ()
        if data.get("env") is not None:
            env = _env(check, data["env"], (*npath, "env"))
        nodes.append(Node(name, address, interface, env))
    return tuple(nodes)


def _gpus(check: Checker, raw: Any, path: KeyPath) -> tuple[str, ...]:
    items = check.sequence(raw, path, "GPU indexes or UUIDs")
    out: list[str] = []
    for i, item in enumerate(items):
        text = str(item) if isinstance(item, int) and not isinstance(item, bool) else item
        text = check.matching(text, (*path, i), GPU_RE, "a GPU index (0, 1, ...) or UUID")
        if text in out:
            raise check.fail((*path, i), f"GPU {text} is listed twice")
        out.append(text)
    return tuple(out)


def _env(check: Checker, raw: Any, path: KeyPath, reserved: Mapping[str, str] | None = None
         ) -> tuple[tuple[str, str], ...]:
    """NAME: value pairs; with reserved, a name the units set is refused at its place."""
    if not isinstance(raw, dict):
        raise check.fail(path, f"expected a mapping of NAME: value; got {kind(raw)}")
    out: list[tuple[str, str]] = []
    for key, value in raw.items():
        kpath = (*path, key)
        if not ENV_NAME_RE.match(key):
            raise check.fail(kpath, f"expected an environment variable name "
                             f"([A-Za-z_][A-Za-z0-9_]*); got '{key}'", at_key=True)
        if SECRET_NAME_RE.search(key):
            raise check.fail(kpath, f"'{key}' looks like a secret, and unit files are "
                             "world-readable; put it in environment_file instead", at_key=True)
        if reserved is not None:
            _refuse_reserved(check, kpath, key, reserved)
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise check.fail(kpath, f"expected a string value; got {kind(value)}"
                             + (" (quote it: 'true')" if isinstance(value, bool) else ""))
        out.append((key, value if isinstance(value, str) else str(value)))
    return tuple(out)


def _refuse_reserved(check: Checker, path: KeyPath, key: str, reserved: Mapping[str, str]
                     ) -> None:
    if key in reserved:
        raise check.fail(path, f"'{key}' is set by llmgw-render from {reserved[key]}",
                         at_key=True)


def _restart(check: Checker, raw: Any, path: KeyPath) -> RestartPolicy:
    data = check.mapping(raw, path, ("delay", "burst", "interval"))
    base = RestartPolicy()
    policy = RestartPolicy(
        delay=check.optional_int(data, "delay", path, 1, 86400,
                                 "seconds between a failure and the restart", base.delay),
        burst=check.optional_int(data, "burst", path, 1, 1000,
                                 "starts allowed within the interval", base.burst),
        interval=check.optional_int(data, "interval", path, 1, 604800,
                                    "an interval in seconds", base.interval),
    )
    # burst starts need at least burst x delay seconds: with a shorter interval the
    # budget can never run out and a crash-looping shard restarts forever.
    if policy.interval <= policy.burst * policy.delay:
        raise check.fail(path, f"restart.interval ({policy.interval} s) must be longer than "
                         f"burst x delay ({policy.burst} x {policy.delay} s), or the restart "
                         "budget never runs out")
    return policy


def _group_restart(check: Checker, raw: Any, path: KeyPath) -> GroupRestartPolicy:
    data = check.mapping(raw, path, ("delay", "max_delay", "budget", "window"))
    base = GroupRestartPolicy()
    policy = GroupRestartPolicy(
        delay=check.optional_int(data, "delay", path, 0, 604800,
                                 "seconds before the first group restart", base.delay),
        max_delay=check.optional_int(data, "max_delay", path, 0, 604800,
                                     "the longest backoff in seconds", base.max_delay),
        budget=check.optional_int(data, "budget", path, 0, 604800,
                                  "group restarts allowed in the window", base.budget),
        window=check.optional_int(data, "window", path, 1, 604800, "a window in seconds",
                                  base.window),
    )
    if policy.max_delay < policy.delay:
        raise check.fail((*path, "max_delay"), f"expected at least delay ({policy.delay} s); "
                         f"got {policy.max_delay}")
    return policy


def _health(check: Checker, raw: Any, path: KeyPath) -> HealthCheck:
    data = check.mapping(raw, path, ("path", "interval", "timeout", "stability", "generation"))
    base = HealthCheck()
    probe_path = check.optional(data, "path", path, lambda v, p: check.string(
        v, p, "an HTTP path such as /health"), base.path)
    if not probe_path.startswith("/") or any(c in probe_path for c in " ?#"):
        raise check.fail((*path, "path"), f"expected an HTTP path such as /health; got "
                         f"'{probe_path}'")
    return HealthCheck(
        path=probe_path,
        interval=check.optional_int(data, "interval", path, 1, 3600, "seconds between probes",
                                    base.interval),
        timeout=check.optional_int(data, "timeout", path, 1, 600, "a probe timeout in seconds",
                                   base.timeout),
        stability=check.optional_int(data, "stability", path, 0, 86400,
                                     "seconds a non-serving rank must stay up", base.stability),
        generation=check.optional(data, "generation", path,
                                  lambda v, p: _generation(check, v, p), None),
    )


def _generation(check: Checker, raw: Any, path: KeyPath) -> GenerationCheck | None:
    if raw is True or raw is False:
        return GenerationCheck() if raw else None
    data = check.mapping(raw, path, ("interval", "timeout"))
    base = GenerationCheck()
    return GenerationCheck(
        interval=check.optional_int(data, "interval", path, 1, 86400,
                                    "seconds between one-token completions", base.interval),
        timeout=check.optional_int(data, "timeout", path, 1, 600,
                                   "a completion timeout in seconds", base.timeout),
    )


class Conflict(NamedTuple):  # a NamedTuple, as spec/engines/base.py says why
    """Two places in the specs that cannot both hold (a replica name used twice, a node
    with two addresses, a port claimed twice): an error at each, naming the other."""

    later: SpecError
    earlier: SpecError


class Placed(NamedTuple):
    """A replica with the document and key path it was read from."""

    replica: Replica
    doc: Document
    path: KeyPath


def conflicts(placed: Sequence[Placed]) -> list[Conflict]:
    """Every conflict among the replicas, in document order: names, then node addresses,
    then ports (the order build_spec reports them in)."""
    return [*_name_conflicts(placed), *_address_conflicts(placed), *_port_conflicts(placed)]


def _name_conflicts(placed: Sequence[Placed]) -> list[Conflict]:
    out: list[Conflict] = []
    first: dict[str, Placed] = {}
    for entry in placed:
        name = entry.replica.name
        if name not in first:
            first[name] = entry
            continue
        other = first[name]
        here, there = (*entry.path, "name"), (*other.path, "name")
        out.append(Conflict(
            later=entry.doc.error(here, f"replica name '{name}' is already used at "
                                  f"{_where(other.doc, there)}"),
            earlier=other.doc.error(there, f"replica name '{name}' is also used at "
                                    f"{_where(entry.doc, here)}")))
    return out


def _address_conflicts(placed: Sequence[Placed]) -> list[Conflict]:
    out: list[Conflict] = []
    seen: dict[str, tuple[str, Placed, int]] = {}  # node name -> (address, first use, rank)
    for entry in placed:
        for rank, node in enumerate(entry.replica.nodes):
            if node.name not in seen:
                seen[node.name] = (node.address, entry, rank)
                continue
            address, other, other_rank = seen[node.name]
            if address == node.address:
                continue
            here = (*entry.path, "nodes", rank, "address")
            there = (*other.path, "nodes", other_rank, "address")
            out.append(Conflict(
                later=entry.doc.error(here, f"node '{node.name}' has address '{address}' in "
                                      f"replica '{other.replica.name}' at "
                                      f"{_where(other.doc, there)} but '{node.address}' here"),
                earlier=other.doc.error(there, f"node '{node.name}' has address "
                                        f"'{node.address}' in replica '{entry.replica.name}' "
                                        f"at {_where(entry.doc, here)} but '{address}' here")))
    return out


def port_claims(replica: Replica) -> list[tuple[str, int, KeyPath, str]]:
    """(node name, port, key path in the replica, what) for every port the replica binds."""
    return [(replica.nodes[c.rank].name, c.port, c.path, c.what)
            for c in replica.engine.port_claims(len(replica.nodes))]


def _port_conflicts(placed: Sequence[Placed]) -> list[Conflict]:
    out: list[Conflict] = []
    claimed: dict[tuple[str, int], tuple[Placed, KeyPath, str]] = {}
    for entry in placed:
        for node, port, rel, what in port_claims(entry.replica):
            key = (node, port)
            if key not in claimed:
                claimed[key] = (entry, rel, what)
                continue
            other, other_rel, other_what = claimed[key]
            here, there = (*entry.path, *rel), (*other.path, *other_rel)
            same = other is entry
            out.append(Conflict(
                later=entry.doc.error(here, f"port {port} on node '{node}' is already claimed "
                                      f"by {'this replica' if same else repr_replica(other)} "
                                      f"as its {other_what} port at {_where(other.doc, there)}"
                                      f"{_default_note(entry.doc, here, port)}"),
                earlier=other.doc.error(there, f"port {port} on node '{node}' is also claimed "
                                        f"by {'this replica' if same else repr_replica(entry)} "
                                        f"as its {what} port at {_where(entry.doc, here)}"
                                        f"{_default_note(other.doc, there, port)}")))
    return out


def repr_replica(entry: Placed) -> str:
    return f"replica '{entry.replica.name}'"


def _default_note(doc: Document, path: KeyPath, port: int) -> str:
    return "" if doc.has(path) else f" ({path[-1]} defaults to {port} for this engine; set it)"
