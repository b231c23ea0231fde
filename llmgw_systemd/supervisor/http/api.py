"""The supervisor's read-only HTTP API: exact routes over a published snapshot.

The reconcile loop publishes immutable JSON bodies after every judgement; requests only
pick them up, so a flood of requests costs no reads of systemd and nothing is cached per
request path. `GET /v1/shards?after=V` is a long-poll: answered as soon as this node's
shard reports differ from version V, or after `wait` seconds (docs/supervisor.md, "API").
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from llmgw_systemd.gather.wire import shards_answer
from llmgw_systemd.spec.names import is_replica_name
from llmgw_systemd.supervisor.http.server import Changes, Request, Response

API_VERSION = "v1"
DEFAULT_WAIT = 0.0
MAX_WAIT = 30.0
ALLOW = (("Allow", "GET, HEAD"),)
READY_PATH = "ready"
TEXT = "text/plain; charset=utf-8"


class Readiness(NamedTuple):
    """What `GET /v1/replicas/NAME/ready` answers: whether a gateway should send the
    replica new requests, and one line saying why. The same for each serving endpoint
    (`NAME.RANK`): the ranks of one replica step together, so every endpoint is in
    rotation exactly while the replica is."""

    routable: bool
    line: str
    serving: tuple[int, ...] = (0,)  # the ranks that serve HTTP: the endpoints


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one per judgement
class Published:
    """What the API serves, as of one judgement."""

    node: str
    version: int  # bumped whenever this node's shard reports change
    shards: tuple[dict[str, Any], ...] = ()
    replicas: bytes = b"[]"
    replica: Mapping[str, bytes] = field(default_factory=dict)
    ready: Mapping[str, Readiness] = field(default_factory=dict)


def encode(data: object) -> bytes:
    return json.dumps(data, indent=1).encode()


def shards_body(published: Published, clock: int | None = None) -> bytes:
    """The shard reports; `clock` is this node's monotonic clock in whole seconds at the
    answer, the scale of each report's `started` (a peer learns from the two how long
    ago an engine started, without comparing two nodes' clocks)."""
    return _shards_body(published, int(time.monotonic()) if clock is None else clock)


# Every peer's long-poll ends with the same answer within the same second: encoded once
# for them all (the newest Published, by identity: a judgement makes a new one).
@functools.lru_cache(maxsize=1)
def _shards_body(published: Published, clock: int) -> bytes:
    return encode(shards_answer(published.node, published.version, clock,
                                list(published.shards)))


def _ready(published: Published, name: str) -> Response:
    """For load balancers (HAProxy's httpchk, Envoy, nginx, keepalived, cloud health
    checks): 200 while a gateway should send the replica new requests, 503 otherwise
    (starting, degraded, draining, drained, stopped, failed), one line saying why."""
    replica, rank = endpoint(name)
    found = published.ready.get(replica)
    if found is None:
        return Response(404, f"no replica '{replica}' on this node\n".encode(), TEXT)
    if rank is not None and rank not in found.serving:
        serving = ", ".join(map(str, found.serving)) or "none"
        return Response(404, f"rank {rank} of '{replica}' serves no HTTP (its serving "
                        f"ranks: {serving})\n".encode(), TEXT)
    return Response(200 if found.routable else 503, f"{found.line}\n".encode(), TEXT)


def endpoint_name(replica: str, rank: int) -> str:
    """The readiness check's name of one serving endpoint: what endpoint() reads back."""
    return f"{replica}.{rank}"


def endpoint(name: str) -> tuple[str, int | None]:
    """A readiness check's name: a replica, or one serving endpoint of it, `NAME.RANK`
    (a HAProxy server name, unique in its backend; a replica name has no dot)."""
    replica, dot, rank = name.rpartition(".")
    if dot and replica and rank.isdigit() and len(rank) <= 4:
        return replica, int(rank)
    return name, None


def _error(status: int, message: str) -> Response:
    return Response(status, encode({"error": message}))


def _wait_params(query: tuple[tuple[str, str], ...]) -> tuple[int | None, float] | str:
    after: int | None = None
    wait = DEFAULT_WAIT
    for key, value in query:
        if key == "after":
            if not value.isdigit() or len(value) > 18:
                return "after: expected a version number"
            after = int(value)
        elif key == "wait":
            try:
                wait = float(value)
            except ValueError:
                return "wait: expected seconds"
            if not 0 <= wait <= MAX_WAIT:
                return f"wait: expected 0 to {MAX_WAIT:g} seconds"
        else:
            return f"unknown parameter '{key[:40]}' (allowed: after, wait)"
    return after, wait


def not_judged_yet() -> Response:
    """The answer of a supervisor that has not judged its replicas yet (just started)."""
    return _error(503, "starting: this supervisor has not judged its replicas yet")


async def handle(request: Request, current: Callable[[], Published], changes: Changes,
                 metrics: Callable[[], tuple[bytes, str]]) -> Response:
    """Route one GET or HEAD (the server answers other methods with 405)."""
    path = request.path
    if path == "/metrics":
        if request.query:
            return _error(400, "/metrics takes no parameters")
        body, kind = metrics()
        return Response(200, body, kind)
    if path == f"/{API_VERSION}/shards":
        params = _wait_params(request.query)
        if isinstance(params, str):
            return _error(400, params)
        after, wait = params
        if after is not None and wait > 0 and current().version == after:
            await changes.wait_after(after, wait)
        return Response(200, shards_body(current()))
    if request.query:
        return _error(400, f"{path[:80]} takes no parameters")
    if path == f"/{API_VERSION}/replicas":
        return Response(200, current().replicas)
    prefix = f"/{API_VERSION}/replicas/"
    if path.startswith(prefix):
        name, slash, sub = path[len(prefix):].partition("/")
        if sub == READY_PATH and is_replica_name(endpoint(name)[0]):
            return _ready(current(), name)
        if not is_replica_name(name) or (slash and sub != READY_PATH):
            return _error(404, "not a replica name" if not is_replica_name(name)
                          else f"no such route (try {prefix}{name}/{READY_PATH})")
        found = current().replica.get(name)
        if found is None:
            return _error(404, f"no replica '{name}' on this node")
        return Response(200, found)
    return _error(404, "no such route (try /v1/replicas, /v1/shards, /metrics)")
