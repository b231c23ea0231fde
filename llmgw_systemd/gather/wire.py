"""The wire format between supervisors and their tools: `GET /v1/shards` (a node's shard
reports) and `GET /v1/replicas/NAME` (a replica's view), written by the daemon and read
by the peer client, here once: the keys, their limits, the encoding and the strict
parse (pure: no I/O).

The parse reads with the spec's own typed reader (spec/reader.py): a value is checked the
same way whoever wrote it; an error names the peer and the JSON path. Unknown keys are
ignored (others=True): a newer peer may send fields this one does not know.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NoReturn

from llmgw_systemd.errors import PeerError, one_line
from llmgw_systemd.health.evidence import PeerShard
from llmgw_systemd.health.rules import RANK_STATES, STATES
from llmgw_systemd.spec.document import KeyPath, format_path
from llmgw_systemd.spec.names import is_node_name, is_replica_name
from llmgw_systemd.spec.reader import Reader
from llmgw_systemd.units.plan import DIGEST_HEX, is_digest

SHARDS_PATH = "/v1/shards"
REPLICAS_PATH = "/v1/replicas"
MAX_SHARDS = 1000
MAX_REASON = 2000
MAX_GENERATION = 64
GENERATION_RE = re.compile(r"[0-9a-f]*\Z")

# One rank of one replica as the peer reports it: parsed straight into evidence.
ShardReport = PeerShard


@dataclass(frozen=True)
class RankLine:
    """One rank as a supervisor's replica view says it (GET /v1/replicas/NAME)."""

    rank: int
    node: str
    state: str
    reason: str
    loaded_digest: str = ""
    running_digest: str = ""


@dataclass(frozen=True)
class ReplicaAnswer:
    """A supervisor's whole view of one replica: its state, whether a gateway should send
    it requests, and every rank."""

    state: str
    reason: str
    routable: bool
    ranks: tuple[RankLine, ...]



# -- writing -----------------------------------------------------------------------------


def shard_report(*, replica: str, rank: int, ranks: int, node: str, serving: bool,
                 state: str, reason: str, generation: str, started: int | None,
                 draining: str | None, drained: bool, loaded: str, running: str,
                 units: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One shard's report in GET /v1/shards: what parse_answer reads back (`ranks` and
    `units` are for people and tools; peers ignore them)."""
    return {
        "replica": replica, "rank": rank, "ranks": ranks, "node": node,
        "serving": serving, "state": state, "reason": reason, "generation": generation,
        # when its engine became active, in whole seconds of the node's monotonic clock
        # (the answer's `clock` is the same clock): peers work out how long it has run
        "started": started,
        # a drain (health/drain.py): why this node drains the replica, and (the serving
        # rank's node) whether nothing is in flight any more
        "draining": draining, "drained": drained,
        # its spec versions (health/versions.py): what its units carry, what its engine
        # started with ("" where not known)
        "spec": {"loaded": loaded, "running": running},
        "units": units,
    }


def shards_answer(node: str, version: int, clock: int, shards: list[dict[str, Any]]
                  ) -> dict[str, Any]:
    """The whole of GET /v1/shards: who answers, its report version, its clock, its
    shards' reports."""
    return {"node": node, "version": version, "clock": clock, "shards": shards}


def replica_rank(*, rank: int, node: str, state: str, reason: str, loaded: str,
                 running: str) -> dict[str, Any]:
    """One rank in GET /v1/replicas/NAME: what parse_replica reads back."""
    return {"rank": rank, "node": node, "state": state, "reason": reason,
            "spec": {"loaded": loaded, "running": running}}


# -- reading -----------------------------------------------------------------------------


def decode(where: str, body: bytes) -> Any:
    """An answer's JSON, strictly: UTF-8, no duplicate keys, no NaN or Infinity."""
    try:
        return json.loads(body.decode("utf-8"), object_pairs_hook=_no_duplicate_keys,
                          parse_constant=_no_constant)
    except UnicodeDecodeError as exc:
        raise PeerError("malformed", f"{where}: the answer is not UTF-8: {exc}") from None
    except (ValueError, RecursionError) as exc:
        # json.JSONDecodeError is a ValueError, as are our hooks' complaints and the
        # int-digits limit; a deeply nested document hits the recursion limit
        raise PeerError("malformed", f"{where}: the answer is not JSON: "
                        f"{one_line(str(exc)) or type(exc).__name__}") from None


def parse_replica(wire: Reader, document: Any) -> ReplicaAnswer:
    answer = wire.mapping(document, (), ("state", "reason", "routable", "ranks"),
                          ("state", "reason", "routable", "ranks"), others=True)
    ranks = []
    for i, item in enumerate(wire.sequence(answer["ranks"], ("ranks",), "ranks",
                                           max_len=MAX_SHARDS)):
        path: KeyPath = ("ranks", i)
        rank = wire.mapping(item, path, ("rank", "node", "state", "reason", "spec"),
                            ("rank", "node", "state", "reason"), others=True)
        ranks.append(RankLine(
            rank=wire.integer(rank["rank"], (*path, "rank"), 0, _RANK_MAX, "a rank"),
            node=_node_name(wire, rank["node"], (*path, "node")),
            state=wire.choice(rank["state"], (*path, "state"), RANK_STATES),
            reason=wire.string(rank["reason"], (*path, "reason"), "a reason", empty=True,
                               max_len=MAX_REASON),
            **_versions(wire, rank.get("spec"), (*path, "spec"))))
    return ReplicaAnswer(
        state=wire.choice(answer["state"], ("state",), STATES),
        reason=wire.string(answer["reason"], ("reason",), "a reason", empty=True,
                           max_len=MAX_REASON),
        routable=wire.boolean(answer["routable"], ("routable",), "whether it is routable"),
        ranks=tuple(ranks))


def wire_reader(where: str) -> Reader:
    """The spec's typed reader, its errors naming the peer `where` and the JSON path."""
    return Reader(lambda path, message, _at_key: PeerError(
        "malformed", f"{where}: {format_path(path) or 'top level'}: {message}"))


_VERSION_MAX = 2**63 - 1
_RANK_MAX = 2**31 - 1
_ANSWER_KEYS = ("node", "version", "shards")
_SHARD_KEYS = ("replica", "rank", "node", "state", "reason", "generation", "serving")
_OPTIONAL_SHARD_KEYS = ("started", "draining", "drained", "spec")
_CLOCK_MAX = 2**53  # seconds; JSON numbers beyond are not exact


def parse_answer(wire: Reader, document: Any) -> tuple[str, int, tuple[ShardReport, ...]]:
    # others=True: a newer peer may send fields this one does not know
    answer = wire.mapping(document, (), (*_ANSWER_KEYS, "clock"), _ANSWER_KEYS, others=True)
    node = _node_name(wire, answer["node"], ("node",))
    version = wire.integer(answer["version"], ("version",), 0, _VERSION_MAX,
                            "a version number")
    clock = None if answer.get("clock") is None else wire.integer(
        answer["clock"], ("clock",), 0, _CLOCK_MAX, "seconds of the peer's monotonic clock")
    items = wire.sequence(answer["shards"], ("shards",), "shards", max_len=MAX_SHARDS)
    return node, version, tuple(_shard(wire, item, ("shards", i), clock)
                                for i, item in enumerate(items))


def _shard(wire: Reader, value: Any, path: KeyPath, clock: int | None) -> ShardReport:
    shard = wire.mapping(value, path, (*_SHARD_KEYS, *_OPTIONAL_SHARD_KEYS), _SHARD_KEYS,
                         others=True)

    def at(key: str) -> KeyPath:
        return (*path, key)

    return ShardReport(
        replica=wire.matching(shard["replica"], at("replica"), is_replica_name,
                               "a replica name"),
        rank=wire.integer(shard["rank"], at("rank"), 0, _RANK_MAX, "a rank"),
        node=_node_name(wire, shard["node"], at("node")),
        state=wire.choice(shard["state"], at("state"), RANK_STATES),
        reason=wire.string(shard["reason"], at("reason"), "a reason", empty=True,
                            max_len=MAX_REASON),
        generation=wire.matching(shard["generation"], at("generation"), _is_generation,
                                  "a shard generation (lowercase hex, at most "
                                  f"{MAX_GENERATION} characters)", empty=True),
        serving=wire.boolean(shard["serving"], at("serving"), "whether it serves HTTP"),
        up_for=_up_for(wire, shard.get("started"), clock, at("started")),
        # a drain (health/drain.py); absent from a peer of an earlier version
        draining=None if shard.get("draining") is None else wire.string(
            shard["draining"], at("draining"), "why that node drains the replica",
            max_len=MAX_REASON),
        drained=shard.get("drained") is not None and wire.boolean(
            shard["drained"], at("drained"), "whether the serving rank is drained"),
        **_versions(wire, shard.get("spec"), at("spec")),
    )


def _versions(wire: Reader, value: Any, path: KeyPath) -> dict[str, str]:
    """A shard's spec versions (health/versions.py); absent from a peer of an earlier
    version: not known."""
    if value is None:
        return {}
    spec = wire.mapping(value, path, ("loaded", "running"), ("loaded", "running"),
                        others=True)
    return {f"{key}_digest": wire.matching(spec[key], (*path, key),
                                           lambda text: not text or is_digest(text),
                                           f"a spec digest ({DIGEST_HEX} lowercase hex digits)",
                                           empty=True)
            for key in ("loaded", "running")}


def _up_for(wire: Reader, started: Any, clock: int | None, path: KeyPath) -> int | None:
    """How long the shard's engine had run at the answer: the answer's clock minus the
    shard's `started`, both that node's (None: not running, or a peer of an earlier
    version, which sends neither)."""
    if started is None or clock is None:
        return None
    value = wire.integer(started, path, 0, _CLOCK_MAX, "when its engine started (seconds "
                         "of the answer's clock)")
    if value > clock:
        raise wire.fail(path, f"expected a time no later than the answer's clock ({clock}); "
                        f"got {value}")
    return clock - value


def _is_generation(text: str) -> bool:
    return len(text) <= MAX_GENERATION and bool(GENERATION_RE.match(text))


def _node_name(wire: Reader, value: Any, path: KeyPath) -> str:
    return wire.matching(value, path, is_node_name, "a node name")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json keeps the last of duplicate keys; two readers of one answer could disagree
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {json.dumps(key)}")
            seen.add(key)
    return obj


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")
