"""The client side of supervisor-to-supervisor traffic: `GET /v1/shards` on a peer.

A replica spanning nodes is ready only when every rank is, and the other ranks' health
comes from the peers' supervisors. Whatever answers on a peer's address is therefore
trusted with the replica's verdict, so this client believes as little as it can:

- one bounded budget (`deadline`) covers name resolution, connect, TLS handshake,
  sending, status line, headers and body; every socket operation waits at most what is
  left of it, so a peer dripping a byte at a time is cut at the deadline;
- no proxies (nothing reads http_proxy & co.: there is no urllib here), no redirects
  (a 3xx is an error naming its Location), no status other than 200;
- the body is capped (`max_bytes`) before and while it is read;
- the answer is parsed strictly into frozen dataclasses, and any deviation is an error
  naming the JSON path.

Every failure is one PeerError (errors.py) whose `kind` is one of PEER_FAILURES (the daemon counts
them by kind) and whose message is one line naming the peer (the daemon logs it,
rate-limited). No other exception escapes a fetch; only wrong arguments (a caller's bug,
not a peer's fault) raise ValueError.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, TypeVar

import h11

from llmgw_systemd.errors import PeerError, one_line
from llmgw_systemd.health.evidence import PeerShard
from llmgw_systemd.health.rules import RANK_STATES, STATES
from llmgw_systemd.spec.document import KeyPath, format_path
from llmgw_systemd.spec.names import is_node_name, is_replica_name
from llmgw_systemd.spec.reader import Reader
from llmgw_systemd.units.plan import DIGEST_HEX, is_digest

SHARDS_PATH = "/v1/shards"
REPLICAS_PATH = "/v1/replicas"
USER_AGENT = "llmgw-supervisor"
MAX_SHARDS = 1000
MAX_REASON = 2000
MAX_GENERATION = 64
MAX_HEADER_BYTES = 16 * 1024  # status line plus headers; a real peer sends a few hundred
RECV_SIZE = 64 * 1024
READING = "reading the body"
WAITING = "waiting for the status and headers"
GENERATION_RE = re.compile(r"[0-9a-f]*\Z")

T = TypeVar("T")


# One rank of one replica as the peer reports it: parsed straight into evidence.
ShardReport = PeerShard


@dataclass(frozen=True)
class PeerAnswer:
    """A peer's whole answer: who it says it is, its report version and its shards."""

    node: str
    version: int
    shards: tuple[ShardReport, ...]
    peer_cert: dict[str, Any] | None  # the server's getpeercert() over TLS, else None


def fetch_shards(host: str, port: int, *, deadline: float, after: int | None = None,
                 wait: float = 0.0, ssl_context: ssl.SSLContext | None = None,
                 server_hostname: str | None = None, max_bytes: int = 1 << 20,
                 clock: Callable[[], float] = time.monotonic) -> PeerAnswer:
    """GET /v1/shards from the supervisor at host:port, within `deadline` seconds in all.

    With `after`, a long-poll: the peer answers as soon as its version exceeds `after`,
    or after `wait` seconds; `deadline` must then exceed `wait` (by a margin for the
    network). With `ssl_context`, over TLS, the certificate checked against
    `server_hostname` (default: host); `peer_cert` is then the server's certificate as
    getpeercert() gives it (empty when the context does not verify). Raises PeerError on
    any failure of the peer or the network; ValueError on arguments out of range."""
    _check_arguments(host, port, deadline, after, wait, max_bytes)
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    target = SHARDS_PATH if after is None else f"{SHARDS_PATH}?after={after}&wait={_seconds(wait)}"
    fetch = _Fetch(host, port, deadline, clock)
    body, peer_cert = fetch.run(target, ssl_context, server_hostname or host, max_bytes)
    node, version, shards = _parse_answer(wire_reader(fetch.where), _json(fetch, body))
    return PeerAnswer(node, version, shards, peer_cert)


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


def fetch_replica(host: str, port: int, name: str, *, deadline: float,
                  clock: Callable[[], float] = time.monotonic) -> ReplicaAnswer:
    """GET /v1/replicas/NAME from the supervisor at host:port (this node's own, over
    loopback: `llmgw-render --apply` asks it about the other ranks). PeerError on any
    failure, as fetch_shards; a 404 means it does not watch the replica."""
    _check_arguments(host, port, deadline, None, 0.0, 1 << 20)
    if not is_replica_name(name):
        raise ValueError(f"not a replica name: {name!r}")
    fetch = _Fetch(host, port, deadline, clock)
    body, _ = fetch.run(f"{REPLICAS_PATH}/{name}", None, host, 1 << 20)
    wire = wire_reader(fetch.where)
    answer = wire.mapping(_json(fetch, body), (), ("state", "reason", "routable", "ranks"),
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


def _json(fetch: _Fetch, body: bytes) -> Any:
    try:
        return json.loads(body.decode("utf-8"), object_pairs_hook=_no_duplicate_keys,
                          parse_constant=_no_constant)
    except UnicodeDecodeError as exc:
        raise PeerError("malformed", f"{fetch.where}: the answer is not UTF-8: {exc}") from None
    except (ValueError, RecursionError) as exc:
        # json.JSONDecodeError is a ValueError, as are our hooks' complaints and the
        # int-digits limit; a deeply nested document hits the recursion limit
        raise PeerError("malformed", f"{fetch.where}: the answer is not JSON: "
                        f"{one_line(str(exc)) or type(exc).__name__}") from None


# -- the exchange ------------------------------------------------------------------------


class _Fetch:
    """One request over one connection, every step paid from one budget."""

    def __init__(self, host: str, port: int, deadline: float,
                 clock: Callable[[], float]) -> None:
        self.host = host
        self.port = port
        self.where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.deadline = deadline
        self.clock = clock
        self.ends = clock() + deadline
        self.phase = "resolving the name"

    def remaining(self) -> float:
        """What is left of the budget; out of it is a timeout naming the phase."""
        left = self.ends - self.clock()
        if left <= 0:
            self.timed_out()
        return left

    def timed_out(self) -> NoReturn:
        raise PeerError("timeout", f"{self.where}: no complete answer within "
                        f"{self.deadline:g} s (ran out while {self.phase})")

    def run(self, target: str, ssl_context: ssl.SSLContext | None, server_hostname: str,
            max_bytes: int) -> tuple[bytes, dict[str, Any] | None]:
        sock = self.connect()
        try:
            peer_cert: dict[str, Any] | None = None
            if ssl_context is not None:
                sock, peer_cert = self.handshake(sock, ssl_context, server_hostname)
            return self.exchange(sock, target, max_bytes), peer_cert
        finally:
            # no TLS close_notify: unwrap() would wait on the peer, and we are done with it
            sock.close()

    def connect(self) -> socket.socket:
        addresses = self.resolve()
        self.phase = "connecting"
        error: OSError | None = None
        for family, kind, proto, _, address in addresses:
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(self.remaining())
                sock.connect(address)
            except socket.timeout:
                sock.close()
                self.timed_out()
            except OSError as exc:
                sock.close()
                error = exc
                continue
            except BaseException:
                sock.close()
                raise
            return sock
        raise PeerError("connect", f"cannot connect to {self.where}: {_describe(error)}")

    def resolve(self) -> list[tuple[Any, ...]]:
        """getaddrinfo within the budget. An address literal (the usual peer) resolves at
        once; a name is looked up in a helper thread, because getaddrinfo cannot be
        interrupted and may sit in the resolver's own retries for tens of seconds. A lookup
        that outlives the budget is abandoned to finish on its own (daemon thread)."""
        self.remaining()
        try:
            ipaddress.ip_address(self.host.split("%", 1)[0])
        except ValueError:
            pass
        else:
            try:
                return list(socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM,
                                               flags=socket.AI_NUMERICHOST))
            except (OSError, UnicodeError) as exc:
                raise PeerError("connect", f"cannot resolve {self.where}: "
                                f"{_describe(exc)}") from None
        result: list[list[tuple[Any, ...]]] = []
        failure: list[BaseException] = []

        def lookup() -> None:
            try:
                result.append(list(socket.getaddrinfo(self.host, self.port,
                                                      type=socket.SOCK_STREAM)))
            except BaseException as exc:  # handed over to the caller's thread
                failure.append(exc)

        helper = threading.Thread(target=lookup, name=f"resolve {self.host}", daemon=True)
        helper.start()
        helper.join(self.remaining())
        if helper.is_alive():
            self.timed_out()
        if failure or not result or not result[0]:
            reason = _describe(failure[0]) if failure else "no address"
            raise PeerError("connect", f"cannot resolve {self.where}: {reason}")
        return result[0]

    def handshake(self, sock: socket.socket, context: ssl.SSLContext,
                  server_hostname: str) -> tuple[ssl.SSLSocket, dict[str, Any] | None]:
        self.phase = "in the TLS handshake"
        try:
            tls = context.wrap_socket(sock, server_hostname=server_hostname,
                                      do_handshake_on_connect=False)
        except (ssl.SSLError, ValueError) as exc:
            sock.close()
            raise PeerError("tls", f"TLS with {self.where}: {_describe(exc)}") from None
        try:
            tls.settimeout(self.remaining())
            tls.do_handshake()
            cert = tls.getpeercert()
        except socket.timeout:
            tls.close()
            self.timed_out()
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            tls.close()
            raise PeerError("tls", f"TLS handshake with {self.where} (as {server_hostname}) "
                            f"failed: {_describe(exc)}") from None
        except BaseException:
            tls.close()
            raise
        return tls, (dict(cert) if cert is not None else None)

    def exchange(self, sock: socket.socket, target: str, max_bytes: int) -> bytes:
        conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEADER_BYTES)
        request = conn.send(h11.Request(method="GET", target=target, headers=[
            ("Host", self.where), ("User-Agent", USER_AGENT), ("Accept", "application/json"),
            ("Connection", "close")]))
        request = (request or b"") + (conn.send(h11.EndOfMessage()) or b"")
        self.phase = "sending the request"
        self.io(sock, lambda: sock.sendall(request))
        self.phase = WAITING
        body = bytearray()
        closed = False
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                if closed:
                    got = (f" ({len(body)} body bytes received)" if self.phase == READING
                           else self.refusal_hint(sock))
                    raise PeerError("closed", f"{self.where} closed the connection while "
                                    f"{self.phase}{got}") from None
                raise PeerError("malformed", f"{self.where}: not a valid HTTP answer: "
                                f"{_describe(exc)}") from None
            if event is h11.NEED_DATA:
                data = self.io(sock, lambda: sock.recv(RECV_SIZE))
                closed = not data
                conn.receive_data(data)
            elif isinstance(event, h11.InformationalResponse):
                continue  # 1xx: the real status follows
            elif isinstance(event, h11.Response):
                self.check_status(event, max_bytes)
                self.phase = READING
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > max_bytes:
                    raise PeerError("too-large", f"{self.where}: the answer exceeds "
                                    f"{max_bytes} bytes")
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body)
            else:  # ConnectionClosed before a response, or PAUSED (never for a client)
                raise PeerError("closed", f"{self.where} closed the connection while "
                                f"{self.phase}{self.refusal_hint(sock)}")

    def refusal_hint(self, sock: socket.socket) -> str:
        """Why a TLS peer closes before any answer, most likely: with TLS 1.3 the client's
        handshake ends before the server has checked the client's certificate, so a
        server that refuses it shows here, as a closed connection."""
        if not isinstance(sock, ssl.SSLSocket) or self.phase != WAITING:
            return ""
        return (" right after the TLS handshake: it does not accept this node's certificate "
                "(another CA?), or it restarted")

    def io(self, sock: socket.socket, operation: Callable[[], T]) -> T:
        """One socket operation, waiting at most what is left of the budget: a peer that
        answers a byte at a time gets no fresh timeout per byte."""
        try:
            sock.settimeout(self.remaining())
            return operation()
        except socket.timeout:
            self.timed_out()
        except ssl.SSLError as exc:
            raise PeerError("tls", f"TLS with {self.where} failed while {self.phase}: "
                            f"{_describe(exc)}") from None
        except OSError as exc:
            raise PeerError("closed", f"connection to {self.where} lost while {self.phase}: "
                            f"{_describe(exc)}") from None

    def check_status(self, response: h11.Response, max_bytes: int) -> None:
        code = response.status_code
        headers = {name: value for name, value in response.headers}
        reason = one_line(response.reason.decode("latin-1"))
        if 300 <= code < 400:
            location = headers.get(b"location")
            named = (f"to {_quote(location.decode('latin-1'))}" if location is not None
                     else "without a Location")
            raise PeerError("redirect", f"{self.where} answered HTTP {code} {reason}, a "
                            f"redirect {named}; redirects are never followed")
        if code != 200:
            raise PeerError("http-status", f"{self.where} answered HTTP {code} {reason}")
        length = headers.get(b"content-length")
        if length is not None and int(length) > max_bytes:  # h11 checked it is digits
            raise PeerError("too-large", f"{self.where}: the answer is {int(length)} bytes, "
                            f"more than {max_bytes}")


# -- the answer --------------------------------------------------------------------------


def wire_reader(where: str) -> Reader:
    """The wire format is read by the spec's own typed reader (spec/reader.py): a value is
    checked the same way whoever wrote it; here an error names the peer and JSON path."""
    return Reader(lambda path, message, _at_key: PeerError(
        "malformed", f"{where}: {format_path(path) or 'top level'}: {message}"))


_VERSION_MAX = 2**63 - 1
_RANK_MAX = 2**31 - 1
_ANSWER_KEYS = ("node", "version", "shards")
_SHARD_KEYS = ("replica", "rank", "node", "state", "reason", "generation", "serving")
_OPTIONAL_SHARD_KEYS = ("started", "draining", "drained", "spec")
_CLOCK_MAX = 2**53  # seconds; JSON numbers beyond are not exact


def _parse_answer(wire: Reader, document: Any) -> tuple[str, int, tuple[ShardReport, ...]]:
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


# -- small helpers -----------------------------------------------------------------------


def _check_arguments(host: str, port: int, deadline: float, after: int | None, wait: float,
                     max_bytes: int) -> None:
    """Wrong arguments are the caller's bug, not the peer's fault: ValueError."""
    if not isinstance(host, str) or not host:
        raise ValueError(f"host must be a non-empty string, not {host!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port must be 1..65535, not {port!r}")
    if not (isinstance(deadline, (int, float)) and math.isfinite(deadline) and deadline > 0):
        raise ValueError(f"deadline must be a positive number of seconds, not {deadline!r}")
    if not (isinstance(wait, (int, float)) and math.isfinite(wait) and wait >= 0):
        raise ValueError(f"wait must be a number of seconds >= 0, not {wait!r}")
    if after is None:
        if wait:
            raise ValueError("wait is the long-poll's and needs after")
    elif isinstance(after, bool) or not isinstance(after, int) or after < 0:
        raise ValueError(f"after must be an integer >= 0, not {after!r}")
    elif deadline <= wait:
        raise ValueError(f"deadline ({deadline:g} s) must exceed wait ({wait:g} s)")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes must be a positive integer, not {max_bytes!r}")


def _seconds(value: float) -> str:
    # no exponent: "1e+06" would read as "1e 06" to a form decoder
    return f"{value:.3f}".rstrip("0").rstrip(".") or "0"


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "no address to try"
    if isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_message:
        return f"certificate verify failed: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return re.sub(r" \(_ssl\.c:\d+\)$", "", str(exc)) or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _quote(text: str) -> str:
    quoted = json.dumps(text)
    return quoted if len(quoted) <= 200 else f"{quoted[:197]}..."
