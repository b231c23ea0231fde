"""The replica spec: typed data, and its validation from parsed YAML (pure).

Every check raises one SpecError naming file, line, key path and what was expected.
Checks run in document order, so the first error a user sees is the first in the file.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Literal, TypeVar

from .endpoint import Endpoint, is_host, is_ip, parse_endpoint
from .errors import SpecError
from .grouprestart import GroupRestartPolicy
from .yamldoc import Document, KeyPath, format_path

T = TypeVar("T")

# Closed vocabularies: mypy checks that every match over them is exhaustive.
Engine = Literal["vllm", "sglang", "command"]
LaunchMode = Literal["ray", "mp"]  # vllm only
ENGINES: tuple[Engine, ...] = ("vllm", "sglang", "command")
LAUNCH_MODES: tuple[LaunchMode, ...] = ("ray", "mp")
DEFAULT_HTTP_PORT = {"vllm": 8000, "sglang": 30000}
DEFAULT_RENDEZVOUS_PORT = {("vllm", "ray"): 6379, ("vllm", "mp"): 29500, ("sglang", None): 20000}
DEFAULT_VIRTUALENV = "/usr/local"
MAX_REPLICA_NAME = 63

NAME_RE = re.compile(r"[a-z0-9][a-z0-9-]*\Z")
NODE_NAME_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?\Z")
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,30}\$?\Z|[0-9]{1,10}\Z")
GPU_RE = re.compile(r"[0-9]+\Z|(GPU|MIG)-[A-Za-z0-9/-]+\Z")
# Environment variable names that say "this is a secret": such values belong in
# environment_file (root-only) because unit files are world-readable.
SECRET_NAME_RE = re.compile(r"TOKEN|SECRET|PASSW(OR)?D|API_?KEY|CREDENTIAL|PRIVATE_?KEY", re.I)
SECRET_FLAGS = ("--api-key", "--hf-token", "--token")
# Linux interface names: at most 15 bytes, no '/', ':' or white space (dev_valid_name).
IFNAME_RE = re.compile(r"[A-Za-z0-9_@.+-]{1,15}\Z")
RAY_AUTH_MODES = ("disabled", "token")
DEFAULT_RAY_TOKEN_FILE = "/etc/llmgw/ray-token"  # noqa: S105 - a path, not a secret
# vLLM exits within a second of SIGTERM once ready, within 7 s while it starts, a
# headless rank about 10 s after it; a worker orphaned by a killed rank ignores SIGTERM
# and waits for the SIGKILL at the end of this (docs/engines.md).
DEFAULT_STOP_TIMEOUT = 30
# vLLM's --shutdown-timeout (drain in-flight requests) must end before systemd's SIGKILL.
SHUTDOWN_MARGIN = 10


@dataclass(frozen=True)
class Node:
    """One rank's machine: the name --node matches, the address peers dial."""

    name: str
    address: str
    interface: str | None = None  # the NIC for gloo/NCCL traffic on this node
    env: tuple[tuple[str, str], ...] = ()  # this node's own variables (they win)


@dataclass(frozen=True)
class Command:
    """One command of a shard: every one but the last is a sidecar, the last the engine."""

    name: str
    argv: tuple[str, ...]
    wait_for: tuple[Endpoint, ...] = ()
    binds: tuple[int, ...] = ()


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
class Replica:
    """One replica of a model across its nodes, validated."""

    name: str
    engine: Engine
    launch_mode: LaunchMode | None
    nodes: tuple[Node, ...]
    port: int | None
    serving_rank: int | None
    rendezvous_port: int | None
    rendezvous_timeout: int
    port_release_timeout: int
    model: str | None
    tensor_parallel_size: int
    pipeline_parallel_size: int
    host: str
    gpus: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    environment_file: str | None
    args: tuple[str, ...]
    ray_args: tuple[str, ...]
    ray_head_args: tuple[str, ...]
    ray_num_gpus: int | None
    ray_auth: str  # "disabled" or "token" (vLLM on Ray only)
    ray_token_file: str | None
    distributed_timeout: int | None
    stop_timeout: int
    user: str | None
    virtualenv: str
    restart: RestartPolicy
    health: HealthCheck
    group_restart: GroupRestartPolicy
    ranks: tuple[tuple[Command, ...], ...]
    source: str
    # Start at boot: the generator links the target into multi-user.target (or
    # default.target); llmgw-render --apply enables and starts it.
    enable: bool = False

    @property
    def uses_rendezvous(self) -> bool:
        """Whether rank 0 binds rendezvous_port: a Ray head always, others when multi-node."""
        if self.engine == "command":
            return False
        return self.launch_mode == "ray" or len(self.nodes) > 1

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


# Keys every engine accepts, then the keys only some engines accept.
COMMON_KEYS = (
    "name", "engine", "nodes", "port", "rendezvous_timeout", "port_release_timeout", "gpus",
    "env", "environment_file", "user", "restart", "health", "group_restart", "stop_timeout",
    "enable",
)
ENGINE_KEYS = {
    "vllm": ("launch_mode", "model", "tensor_parallel_size", "pipeline_parallel_size",
             "rendezvous_port", "args", "virtualenv", "host", "ray_args", "ray_head_args",
             "ray_num_gpus", "ray_auth", "ray_token_file", "distributed_timeout"),
    "sglang": ("model", "tensor_parallel_size", "pipeline_parallel_size", "rendezvous_port",
               "args", "virtualenv", "host"),
    "command": ("ranks", "serving_rank"),
}
RAY_ONLY_KEYS = ("ray_args", "ray_head_args", "ray_num_gpus", "ray_auth", "ray_token_file")
ALL_REPLICA_KEYS = tuple(dict.fromkeys(COMMON_KEYS + sum(ENGINE_KEYS.values(), ())))


# The checked spelling -> its Literal value (a lookup, so mypy needs no cast).
_ENGINE_BY_NAME: dict[str, Engine] = {e: e for e in ENGINES}
_LAUNCH_MODE_BY_NAME: dict[str, LaunchMode] = {m: m for m in LAUNCH_MODES}


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    import difflib  # only on the error path: it costs a few ms to import

    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


class _Checker:
    """Typed reads from one document, each failing with file, line and key path."""

    def __init__(self, doc: Document) -> None:
        self.doc = doc

    def fail(self, path: KeyPath, message: str, *, at_key: bool = False) -> SpecError:
        return self.doc.error(path, message, at_key=at_key)

    def mapping(self, value: Any, path: KeyPath, allowed: Sequence[str],
                required: Sequence[str] = ()) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(path, f"expected a mapping with keys {', '.join(allowed)}; "
                            f"got {_kind(value)}")
        for key in value:
            if key not in allowed:
                raise self.fail((*path, key), f"unknown key '{key}'"
                                f"{did_you_mean(key, allowed)} (allowed: {', '.join(allowed)})",
                                at_key=True)
        for key in required:
            if key not in value:
                raise self.fail(path, f"missing required key '{key}'")
        return value

    def sequence(self, value: Any, path: KeyPath, what: str, *, min_len: int = 0) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(path, f"expected a list of {what}; got {_kind(value)}")
        if len(value) < min_len:
            raise self.fail(path, f"expected at least {min_len} {what}; got {len(value)}")
        return value

    def string(self, value: Any, path: KeyPath, what: str = "a string") -> str:
        if not isinstance(value, str):
            raise self.fail(path, f"expected {what}; got {_kind(value)}")
        if not value:
            raise self.fail(path, f"expected {what}; got an empty string")
        return value

    def integer(self, value: Any, path: KeyPath, lo: int, hi: int, what: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(path, f"expected {what} (an integer from {lo} to {hi}); "
                            f"got {_kind(value)}")
        if not lo <= value <= hi:
            raise self.fail(path, f"expected {what} from {lo} to {hi}; got {value}")
        return value

    def boolean(self, value: Any, path: KeyPath, what: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(path, f"expected {what} (true or false); got {_kind(value)}")
        return value

    def port(self, value: Any, path: KeyPath) -> int:
        return self.integer(value, path, 1, 65535, "a TCP port")

    def choice(self, value: Any, path: KeyPath, choices: Sequence[str]) -> str:
        text = self.string(value, path, f"one of {', '.join(choices)}")
        if text not in choices:
            raise self.fail(path, f"expected one of {', '.join(choices)}; got '{text}'"
                            f"{did_you_mean(text, choices)}")
        return text

    def matching(self, value: Any, path: KeyPath, pattern: re.Pattern[str], what: str) -> str:
        text = self.string(value, path, what)
        if not pattern.match(text):
            raise self.fail(path, f"expected {what}; got '{text}'")
        return text

    def abs_path(self, value: Any, path: KeyPath, what: str) -> str:
        text = self.string(value, path, f"an absolute path to {what}")
        if not text.startswith("/"):
            raise self.fail(path, f"expected an absolute path to {what}; got '{text}' "
                            "(systemd runs commands without a search path)")
        if posixpath.normpath(text) != text and text != "/":
            raise self.fail(path, f"expected a normalized absolute path to {what}; got '{text}' "
                            f"(write '{posixpath.normpath(text)}')")
        if text.endswith("\\"):
            raise self.fail(path, f"expected a path to {what}; a trailing backslash would "
                            "continue the unit file line")
        return text

    def str_list(self, value: Any, path: KeyPath, what: str) -> tuple[str, ...]:
        items = self.sequence(value, path, what)
        out = []
        for i, item in enumerate(items):
            if isinstance(item, bool) or not isinstance(item, (str, int, float)):
                raise self.fail((*path, i), f"expected a string; got {_kind(item)}")
            out.append(item if isinstance(item, str) else str(item))
        return tuple(out)

    def endpoint(self, value: Any, path: KeyPath) -> Endpoint:
        text = self.string(value, path, "an address HOST:PORT")
        parsed = parse_endpoint(text)
        if isinstance(parsed, str):
            raise self.fail(path, parsed)
        return parsed

    def optional(self, mapping: dict[str, Any], key: str, path: KeyPath,
                 read: Callable[[Any, KeyPath], T], default: T) -> T:
        if key not in mapping or mapping[key] is None:
            return default
        return read(mapping[key], (*path, key))

    def optional_int(self, mapping: dict[str, Any], key: str, path: KeyPath, lo: int, hi: int,
                     what: str, default: int) -> int:
        return self.optional(mapping, key, path,
                             lambda v, p: self.integer(v, p, lo, hi, what), default)


def _kind(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"a string ('{value}')"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


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
        check = _Checker(doc)
        top = check.mapping(doc.data, (), ("replicas",), ("replicas",))
        items = check.sequence(top["replicas"], ("replicas",), "replicas")
        for index, item in enumerate(items):
            path: KeyPath = ("replicas", index)
            entry = Placed(_replica(check, item, path), doc, path)
            placed.append(entry)
            if entry.replica.name in names:  # reported here, before later files' errors
                raise _name_conflicts(placed)[0].later
            names.add(entry.replica.name)
    return placed


def _where(doc: Document, path: KeyPath) -> str:
    return f"{doc.file}:{doc.key_line(path)} ({format_path(path)})"


def _replica(check: _Checker, raw: Any, path: KeyPath) -> Replica:
    data = check.mapping(raw, path, ALL_REPLICA_KEYS, ("name", "engine", "nodes"))
    name = check.matching(data["name"], (*path, "name"), NAME_RE,
                          "a replica name of lowercase letters, digits and '-', starting with "
                          "a letter or digit (it becomes part of unit names)")
    if len(name) > MAX_REPLICA_NAME:
        raise check.fail((*path, "name"), f"expected a replica name of at most "
                         f"{MAX_REPLICA_NAME} characters (it becomes part of unit names); "
                         f"got {len(name)}")
    engine = _ENGINE_BY_NAME[check.choice(data["engine"], (*path, "engine"), ENGINES)]
    for key in data:
        if key not in COMMON_KEYS and key not in ENGINE_KEYS[engine]:
            users = [e for e in ENGINES if key in ENGINE_KEYS[e]]
            hint = ("engine 'vllm' is the only one with launch modes" if key == "launch_mode"
                    else f"it applies to engine {' and '.join(users)}")
            raise check.fail((*path, key), f"'{key}' is not used by engine '{engine}' ({hint})",
                             at_key=True)

    launch_mode: LaunchMode | None = None
    if engine == "vllm":
        launch_mode = _LAUNCH_MODE_BY_NAME[check.optional(
            data, "launch_mode", path, lambda v, p: check.choice(v, p, LAUNCH_MODES), "ray")]
    nodes = _nodes(check, data["nodes"], (*path, "nodes"), engine, launch_mode)

    if engine == "command":
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
        model = None
        rendezvous_port = None
    else:
        ranks = ()
        serving_rank = 0
        if "model" not in data:
            raise check.fail(path, f"missing required key 'model' (engine '{engine}' needs a "
                             "model path or name)")
        model = check.string(data["model"], (*path, "model"), "a model path or name")
        if model.startswith("-"):
            raise check.fail((*path, "model"), f"expected a model path or name; got '{model}', "
                             "which would be read as an option")
        port = check.optional(data, "port", path, check.port, DEFAULT_HTTP_PORT[engine])
        rendezvous_port = check.optional(data, "rendezvous_port", path, check.port,
                                         DEFAULT_RENDEZVOUS_PORT[(engine, launch_mode)])
        if engine == "vllm":
            for rank, node in enumerate(nodes):
                if not is_ip(node.address):
                    raise check.fail((*path, "nodes", rank, "address"), "expected an IP address "
                                     f"(vLLM needs VLLM_HOST_IP per node); got '{node.address}'")

    tp = check.optional_int(data, "tensor_parallel_size", path, 1, 4096,
                            "a tensor parallel size", 1)
    pp = check.optional_int(data, "pipeline_parallel_size", path, 1, 4096,
                            "a pipeline parallel size", 1)
    host = check.optional(data, "host", path, _ip_reader(check, "an IP address to bind HTTP to"),
                          "0.0.0.0")  # noqa: S104 - the gateway must reach the serving rank
    args: tuple[str, ...] = check.optional(data, "args", path,
                          lambda v, p: check.str_list(v, p, "engine arguments"), ())
    ray_args: tuple[str, ...] = check.optional(data, "ray_args", path,
                              lambda v, p: check.str_list(v, p, "'ray start' arguments"), ())
    ray_head_args: tuple[str, ...] = check.optional(
        data, "ray_head_args", path,
        lambda v, p: check.str_list(v, p, "'ray start --head' arguments"), ())
    for key in RAY_ONLY_KEYS:
        if key in data and launch_mode != "ray":
            raise check.fail((*path, key), f"'{key}' applies only to launch_mode 'ray'",
                             at_key=True)
    for key, values in (("args", args), ("ray_args", ray_args),
                        ("ray_head_args", ray_head_args)):
        for i, arg in enumerate(values):
            flag = arg.split("=", 1)[0]
            if flag in SECRET_FLAGS:
                raise check.fail((*path, key, i), f"'{flag}' would put a secret into a "
                                 "world-readable unit file; set it through environment_file "
                                 "(e.g. VLLM_API_KEY, HF_TOKEN) instead")
    ray_num_gpus = check.optional(data, "ray_num_gpus", path, lambda v, p: check.integer(
        v, p, 0, 4096, "the GPUs each Ray node offers"), None)
    ray_auth = check.optional(data, "ray_auth", path,
                              lambda v, p: check.choice(v, p, RAY_AUTH_MODES), "disabled")
    ray_token_file = check.optional(data, "ray_token_file", path,
                                    lambda v, p: check.abs_path(v, p, "the Ray token file"),
                                    None)
    if ray_token_file is not None and ray_auth != "token":
        raise check.fail((*path, "ray_token_file"), "a token file needs ray_auth: token",
                         at_key=True)
    if ray_auth == "token" and ray_token_file is None:
        ray_token_file = DEFAULT_RAY_TOKEN_FILE
    distributed_timeout = check.optional(data, "distributed_timeout", path, lambda v, p:
                                         check.integer(v, p, 1, 86400, "a timeout in seconds"),
                                         None)
    stop_timeout = check.optional_int(data, "stop_timeout", path, 1, 86400,
                                      "a timeout in seconds", DEFAULT_STOP_TIMEOUT)
    drain = flag_value(args, "--shutdown-timeout") if engine == "vllm" else None
    if drain is not None and drain.isdigit() and stop_timeout < int(drain) + SHUTDOWN_MARGIN:
        where = (*path, "stop_timeout") if "stop_timeout" in data else path
        raise check.fail(where, f"stop_timeout ({stop_timeout} s) must be at least vLLM's "
                         f"--shutdown-timeout ({drain} s) + {SHUTDOWN_MARGIN} s, or systemd "
                         "kills the engine while it drains; set stop_timeout")
    gpus: tuple[str, ...] = check.optional(data, "gpus", path, lambda v, p: _gpus(check, v, p), ())
    any_interface = any(node.interface for node in nodes)
    env: tuple[tuple[str, str], ...] = check.optional(
        data, "env", path, lambda v, p: _env(check, v, p, engine, launch_mode, bool(gpus),
                                             interface=any_interface), ())
    environment_file = check.optional(
        data, "environment_file", path,
        lambda v, p: check.abs_path(v, p, "an environment file"), None)
    user = check.optional(data, "user", path, lambda v, p: check.matching(
        v, p, USER_RE, "a user name ([a-z_][a-z0-9_-]*) or numeric UID"), None)
    virtualenv = check.optional(data, "virtualenv", path,
                                lambda v, p: check.abs_path(v, p, "the engine's installation "
                                                            "(a virtualenv or prefix)"),
                                DEFAULT_VIRTUALENV)
    rendezvous_timeout = check.optional_int(data, "rendezvous_timeout", path, 1, 86400,
                                            "a timeout in seconds", 300)
    port_release_timeout = check.optional_int(data, "port_release_timeout", path, 0, 3600,
                                              "a timeout in seconds", 30)
    restart = check.optional(data, "restart", path, lambda v, p: _restart(check, v, p),
                             RestartPolicy())
    health = check.optional(data, "health", path, lambda v, p: _health(check, v, p),
                            HealthCheck())
    group_restart = check.optional(data, "group_restart", path,
                                   lambda v, p: _group_restart(check, v, p),
                                   GroupRestartPolicy())
    return Replica(
        name=name, engine=engine, launch_mode=launch_mode, nodes=nodes, port=port,
        serving_rank=serving_rank, rendezvous_port=rendezvous_port,
        rendezvous_timeout=rendezvous_timeout, port_release_timeout=port_release_timeout,
        model=model, tensor_parallel_size=tp, pipeline_parallel_size=pp, host=host, gpus=gpus,
        env=env, environment_file=environment_file, args=args, ray_args=ray_args,
        ray_head_args=ray_head_args, ray_num_gpus=ray_num_gpus, ray_auth=ray_auth,
        ray_token_file=ray_token_file, distributed_timeout=distributed_timeout,
        stop_timeout=stop_timeout, user=user, health=health, group_restart=group_restart,
        virtualenv=virtualenv, restart=restart, ranks=ranks, source=check.doc.file,
        enable=check.optional(data, "enable", path, lambda v, p: check.boolean(
            v, p, "whether the replica starts at boot"), False),
    )


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of `flag` in an argument list (`--flag V` or `--flag=V`), if given."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _ip_reader(check: _Checker, what: str) -> Callable[[Any, KeyPath], str]:
    def read(value: Any, path: KeyPath) -> str:
        text = check.string(value, path, what)
        if not is_ip(text):
            raise check.fail(path, f"expected {what}; got '{text}'")
        return text
    return read


def _nodes(check: _Checker, raw: Any, path: KeyPath, engine: str, launch_mode: str | None
           ) -> tuple[Node, ...]:
    items = check.sequence(raw, path, "nodes (rank = position, rank 0 leads)", min_len=1)
    nodes: list[Node] = []
    seen_names: dict[str, int] = {}
    seen_addresses: dict[str, int] = {}
    for rank, item in enumerate(items):
        npath = (*path, rank)
        data = check.mapping(item, npath, ("name", "address", "interface", "env"),
                             ("name", "address"))
        name = check.matching(data["name"], (*npath, "name"), NODE_NAME_RE,
                              "a node's host name (letters, digits, '.', '_', '-')")
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
            env = _env(check, data["env"], (*npath, "env"), engine, launch_mode,
                       has_gpus=False, interface=interface is not None)
        nodes.append(Node(name, address, interface, env))
    return tuple(nodes)


def _ranks(check: _Checker, raw: Any, path: KeyPath, n_nodes: int) -> tuple[tuple[Command, ...],
                                                                             ...]:
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
            is_engine = i == len(cmds_raw) - 1
            cmd = _command(check, cmd_raw, cpath, i, is_engine)
            if cmd.name in names:
                raise check.fail((*cpath, "name"), f"duplicate command name '{cmd.name}' "
                                 f"(already commands[{names[cmd.name]}])")
            names[cmd.name] = i
            commands.append(cmd)
        ranks.append(tuple(commands))
    return tuple(ranks)


def _command(check: _Checker, raw: Any, path: KeyPath, index: int, is_engine: bool) -> Command:
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


def _gpus(check: _Checker, raw: Any, path: KeyPath) -> tuple[str, ...]:
    items = check.sequence(raw, path, "GPU indexes or UUIDs")
    out: list[str] = []
    for i, item in enumerate(items):
        text = str(item) if isinstance(item, int) and not isinstance(item, bool) else item
        text = check.matching(text, (*path, i), GPU_RE, "a GPU index (0, 1, ...) or UUID")
        if text in out:
            raise check.fail((*path, i), f"GPU {text} is listed twice")
        out.append(text)
    return tuple(out)


RESERVED_ENV = {
    "CUDA_VISIBLE_DEVICES": "gpus",
    "VLLM_HOST_IP": "each node's address",
    "RAY_ADDRESS": "the leader's address and rendezvous_port",
    "RAY_AUTH_MODE": "ray_auth",
    "RAY_AUTH_TOKEN_PATH": "ray_auth and ray_token_file",
    "GLOO_SOCKET_IFNAME": "the nodes' interface",
    "NCCL_SOCKET_IFNAME": "the nodes' interface",
}


def _env(check: _Checker, raw: Any, path: KeyPath, engine: str, launch_mode: str | None,
         has_gpus: bool, *, interface: bool) -> tuple[tuple[str, str], ...]:
    if not isinstance(raw, dict):
        raise check.fail(path, f"expected a mapping of NAME: value; got {_kind(raw)}")
    out: list[tuple[str, str]] = []
    for key, value in raw.items():
        kpath = (*path, key)
        if not ENV_NAME_RE.match(key):
            raise check.fail(kpath, f"expected an environment variable name "
                             f"([A-Za-z_][A-Za-z0-9_]*); got '{key}'", at_key=True)
        if SECRET_NAME_RE.search(key):
            raise check.fail(kpath, f"'{key}' looks like a secret, and unit files are "
                             "world-readable; put it in environment_file instead", at_key=True)
        reserved_from = RESERVED_ENV.get(key)
        on_ray = engine == "vllm" and launch_mode == "ray"
        sets_it = ((key == "CUDA_VISIBLE_DEVICES" and has_gpus)
                   or (key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") and interface)
                   or (engine == "vllm" and key == "VLLM_HOST_IP")
                   or (on_ray and key in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")))
        if reserved_from and sets_it:
            raise check.fail(kpath, f"'{key}' is set by llmgw-render from {reserved_from}",
                             at_key=True)
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise check.fail(kpath, f"expected a string value; got {_kind(value)}"
                             + (" (quote it: 'true')" if isinstance(value, bool) else ""))
        out.append((key, value if isinstance(value, str) else str(value)))
    return tuple(out)


def _restart(check: _Checker, raw: Any, path: KeyPath) -> RestartPolicy:
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


def _group_restart(check: _Checker, raw: Any, path: KeyPath) -> GroupRestartPolicy:
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


def _health(check: _Checker, raw: Any, path: KeyPath) -> HealthCheck:
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


def _generation(check: _Checker, raw: Any, path: KeyPath) -> GenerationCheck | None:
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


@dataclass(frozen=True)
class Conflict:
    """Two places in the specs that cannot both hold (a replica name used twice, a node
    with two addresses, a port claimed twice): an error at each, naming the other."""

    later: SpecError
    earlier: SpecError


@dataclass(frozen=True)
class Placed:
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
    claims: list[tuple[str, int, KeyPath, str]] = []
    if replica.serving_rank is not None and replica.port is not None:
        claims.append((replica.nodes[replica.serving_rank].name, replica.port, ("port",),
                       "HTTP"))
    if replica.rendezvous_port is not None and replica.uses_rendezvous:
        claims.append((replica.nodes[0].name, replica.rendezvous_port, ("rendezvous_port",),
                       "rendezvous"))
    for rank, commands in enumerate(replica.ranks):
        for i, cmd in enumerate(commands):
            for j, port in enumerate(cmd.binds):
                if rank == replica.serving_rank and port == replica.port:
                    continue  # the serving command binding its own HTTP port: one claim
                claims.append((replica.nodes[rank].name, port,
                               ("ranks", rank, "commands", i, "binds", j), "command"))
    return claims


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
