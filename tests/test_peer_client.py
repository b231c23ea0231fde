"""The peer client against tiny hostile servers on real sockets (127.0.0.1, one on ::1).

Each server is a thread on port 0 that reads the request head and hands the connection
to a behaviour; every case must end in a PeerAnswer or one PeerError of the expected
kind, within its deadline (plus a liveness margin; no performance assertions).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import json
import random
import select
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from llmgw_systemd.errors import PEER_FAILURES, LlmgwError, PeerError
from llmgw_systemd.gather.peer_client import PeerAnswer, PeerSession, fetch_shards
from llmgw_systemd.gather.wire import ShardReport

PEER_ERROR_KINDS = PEER_FAILURES

HOSTILE_PEER = Path(__file__).parent / "standins" / "hostile_peer.py"
LIVENESS = 2.0  # a call must have returned by its deadline plus this (a hang bound only)

Handler = Callable[[socket.socket, bytes, threading.Event], None]

SHARD = {"replica": "llama-70b", "rank": 1, "node": "gpu-a2", "state": "ready",
         "reason": "all units up for 31 s", "generation": "3f2a9c0e" * 4, "serving": False}
REPORT = {"node": "gpu-a2", "version": 17, "shards": [SHARD]}
EXPECTED = PeerAnswer("gpu-a2", 17, (ShardReport(
    "llama-70b", 1, "gpu-a2", "ready", "all units up for 31 s", "3f2a9c0e" * 4, False),), None)


# -- tiny servers ------------------------------------------------------------------------


class Server:
    """A TCP server on a thread (port 0): each connection's request head is recorded and
    the connection handed to `handler` on its own thread. Stopped by the fixture."""

    def __init__(self, handler: Handler, *, host: str = "127.0.0.1",
                 tls: ssl.SSLContext | None = None, read_request: bool = True) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.create_server((host, 0), family=family)
        self.listener.settimeout(0.05)
        self.host = host
        self.port: int = self.listener.getsockname()[1]
        self.handler = handler
        self.tls = tls
        self.read_request = read_request
        self.requests: list[bytes] = []
        self.connections = 0
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.connections += 1
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        try:
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            request = read_head(conn) if self.read_request else b""
            self.requests.append(request)
            self.handler(conn, request, self.stopping)
        except OSError:
            pass  # the client hung up: for most behaviours, that is the point
        finally:
            conn.close()

    def stop(self) -> None:
        self.stopping.set()
        self.listener.close()
        for thread in self.threads:
            thread.join(timeout=5)


def read_head(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data and len(data) < 65536:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


@pytest.fixture
def serve() -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(handler: Handler, **options: Any) -> Server:
        server = Server(handler, **options)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


# -- behaviours --------------------------------------------------------------------------


def body_of(document: Any) -> bytes:
    return document if isinstance(document, bytes) else json.dumps(document).encode()


def answer(document: Any = REPORT, status: str = "200 OK", headers: str = "",
           framing: str = "length") -> Handler:
    """An HTTP/1.1 answer, framed by Content-Length, chunks or the connection's close."""
    body = body_of(document)

    def handler(conn: socket.socket, _request: bytes, _stop: threading.Event) -> None:
        head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nConnection: close\r\n"
        if framing == "continue":
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        if framing == "chunked":
            half = len(body) // 2
            conn.sendall(f"{head}Transfer-Encoding: chunked\r\n{headers}\r\n".encode()
                         + b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (
                             half, body[:half], len(body) - half, body[half:]))
        elif framing == "close":
            conn.sendall(f"{head}{headers}\r\n".encode() + body)
        else:
            conn.sendall(f"{head}Content-Length: {len(body)}\r\n{headers}\r\n".encode() + body)

    return handler


def raw(data: bytes) -> Handler:
    """Sends `data` as is, then closes."""
    def handler(conn: socket.socket, _request: bytes, _stop: threading.Event) -> None:
        conn.sendall(data)

    return handler


def drip(data: bytes, interval: float = 0.2) -> Handler:
    """One byte every `interval` seconds: each one would reset a per-operation timeout."""
    def handler(conn: socket.socket, _request: bytes, stop: threading.Event) -> None:
        for i in range(len(data)):
            if stop.wait(interval):
                return
            conn.sendall(data[i:i + 1])

    return handler


def hang(conn: socket.socket, _request: bytes, stop: threading.Event) -> None:
    stop.wait(10)


def endless(chunked: bool) -> Handler:
    """A 200 whose body never ends: chunked, or delimited by a close that never comes."""
    def handler(conn: socket.socket, _request: bytes, stop: threading.Event) -> None:
        framing = "Transfer-Encoding: chunked\r\n" if chunked else ""
        conn.sendall(f"HTTP/1.1 200 OK\r\n{framing}\r\n".encode())
        block = b"[" * 65536
        framed = b"%x\r\n%s\r\n" % (len(block), block) if chunked else block
        while not stop.is_set():
            conn.sendall(framed)

    return handler


def closed_mid_body(conn: socket.socket, _request: bytes, _stop: threading.Event) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{\"node\": \"gpu")


def close_at_once(conn: socket.socket, _request: bytes, _stop: threading.Event) -> None:
    pass  # the server closes after reading the request, without a word


def fetch(server: Server, **options: Any) -> PeerAnswer:
    options.setdefault("deadline", 5.0)
    return fetch_shards(server.host, server.port, **options)


def expect_error(call: Callable[[], object], kind: str, deadline: float) -> PeerError:
    """The call raises a PeerError of `kind` (and nothing else), and returns in time."""
    started = time.monotonic()
    with pytest.raises(PeerError) as caught:
        call()
    assert time.monotonic() - started < deadline + LIVENESS
    error = caught.value
    assert error.kind == kind, str(error)
    assert "\n" not in str(error) and "\r" not in str(error)
    return error


# -- good answers ------------------------------------------------------------------------


@pytest.mark.parametrize("framing", ["length", "chunked", "close", "continue"])
def test_good_answer(serve: Callable[..., Server], framing: str) -> None:
    # the fields the current server sends besides the wire format's are ignored
    extra = {**REPORT, "api": "v1", "shards": [{**SHARD, "ranks": 2, "units": {}}]}
    server = serve(answer(extra, framing=framing))
    assert fetch(server) == EXPECTED
    head = server.requests[0].decode()
    lines = head.split("\r\n")
    assert lines[0] == "GET /v1/shards HTTP/1.1"
    assert f"Host: 127.0.0.1:{server.port}" in lines
    assert "User-Agent: llmgw-supervisor" in lines
    assert "Accept: application/json" in lines
    assert server.connections == 1


@pytest.mark.parametrize(("fields", "draining", "drained"), [
    ({}, None, False),  # a peer of an earlier version says nothing of a drain
    ({"draining": None, "drained": False}, None, False),
    ({"draining": "planned restart of llmgw-r.target on b", "drained": False},
     "planned restart of llmgw-r.target on b", False),
    ({"draining": "planned stop of llmgw-r.target on a", "drained": True},
     "planned stop of llmgw-r.target on a", True),
])
def test_a_peer_says_whether_it_drains(serve: Callable[..., Server], fields: dict[str, Any],
                                       draining: str | None, drained: bool) -> None:
    server = serve(answer({**REPORT, "shards": [{**SHARD, **fields}]}))
    shard = fetch(server).shards[0]
    assert (shard.draining, shard.drained) == (draining, drained)


@pytest.mark.parametrize(("fields", "loaded", "running"), [
    ({}, "", ""),  # a peer of an earlier version says nothing of versions
    ({"spec": {"loaded": "ab" * 8, "running": "cd" * 8}}, "ab" * 8, "cd" * 8),
    ({"spec": {"loaded": "ab" * 8, "running": ""}}, "ab" * 8, ""),  # not running
])
def test_a_peer_says_which_spec_versions_its_rank_has(
        serve: Callable[..., Server], fields: dict[str, Any], loaded: str, running: str
) -> None:
    server = serve(answer({**REPORT, "shards": [{**SHARD, **fields}]}))
    shard = fetch(server).shards[0]
    assert (shard.loaded_digest, shard.running_digest) == (loaded, running)


@pytest.mark.parametrize(("clock", "started", "up_for"), [
    (1000, 958, 42), (1000, 1000, 0),
    (1000, None, None),  # its engine is not running
    (None, 958, None),  # no clock to read it against
])
def test_how_long_a_peer_engine_has_run(serve: Callable[..., Server], clock: int | None,
                                        started: int | None, up_for: int | None) -> None:
    """The answer's clock minus the shard's start, both on the peer's own clock."""
    server = serve(answer({**REPORT, "clock": clock, "shards": [{**SHARD, "started": started}]}))
    assert fetch(server).shards[0].up_for == up_for


def test_empty_report_and_empty_generation(serve: Callable[..., Server]) -> None:
    server = serve(answer({"node": "gpu-a2", "version": 0, "shards": [
        {**SHARD, "generation": "", "state": "stopped", "serving": True}]}))
    got = fetch(server)
    assert (got.version, got.shards[0].generation, got.shards[0].state) == (0, "", "stopped")
    assert got.shards[0].serving is True


def test_long_poll_request_carries_after_and_wait(serve: Callable[..., Server]) -> None:
    server = serve(answer())
    assert fetch(server, after=16, wait=2.5, deadline=5.0) == EXPECTED
    assert server.requests[0].startswith(b"GET /v1/shards?after=16&wait=2.5 HTTP/1.1\r\n")
    fetch(server, after=0, wait=30, deadline=35)
    assert server.requests[1].startswith(b"GET /v1/shards?after=0&wait=30 HTTP/1.1\r\n")


def test_ipv6_literal(serve: Callable[..., Server]) -> None:
    server = serve(answer(), host="::1")  # no ::1 here is a failure, never a skip
    assert fetch_shards("::1", server.port, deadline=5.0) == EXPECTED
    assert f"Host: [::1]:{server.port}\r\n".encode() in server.requests[0]
    # the bracketed form, as in a URL, works the same
    assert fetch_shards("[::1]", server.port, deadline=5.0) == EXPECTED


# -- the HTTP exchange -------------------------------------------------------------------


@pytest.mark.parametrize("status", ["301 Moved Permanently", "302 Found",
                                    "307 Temporary Redirect", "308 Permanent Redirect"])
def test_redirect_is_never_followed(serve: Callable[..., Server], status: str) -> None:
    target = serve(answer())
    location = f"http://127.0.0.1:{target.port}/v1/shards"
    server = serve(answer(b"", status, f"Location: {location}\r\n"))
    error = expect_error(lambda: fetch(server), "redirect", 5.0)
    assert location in str(error)
    assert status.split(maxsplit=1)[0] in str(error)
    time.sleep(0.1)  # would a follower's connection be late? it must not come at all
    assert target.connections == 0


FAILURES = [
    # (what, behaviour, fetch options, kind, message contains)
    ("HTTP 500", answer(b"oops", "500 Internal Server Error"), {}, "http-status",
     "HTTP 500 Internal Server Error"),
    ("HTTP 404", answer(b"", "404 Not Found"), {}, "http-status", "HTTP 404"),
    ("HTTP 204", answer(b"", "204 No Content"), {}, "http-status", "HTTP 204"),
    ("huge Content-Length",
     raw(b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n{"), {}, "too-large",
     "99999999999 bytes"),
    ("Content-Length over max_bytes", answer(), {"max_bytes": 100}, "too-large",
     "more than 100"),
    ("endless chunked body", endless(chunked=True), {}, "too-large",
     f"exceeds {1 << 20} bytes"),
    ("endless body until close", endless(chunked=False), {}, "too-large", "exceeds"),
    ("chunked over max_bytes", answer(framing="chunked"), {"max_bytes": 100}, "too-large",
     "exceeds 100 bytes"),
    ("closed mid-body", closed_mid_body, {}, "closed", "closed the connection while reading"),
    ("closed before answering", close_at_once, {}, "closed", "waiting for the status"),
    ("not HTTP", raw(b"SSH-2.0-OpenSSH_9.2\r\n\r\n"), {}, "malformed", "not a valid HTTP"),
    ("endless headers", raw(b"HTTP/1.1 200 OK\r\nX: " + b"a" * 100_000), {}, "malformed",
     "not a valid HTTP"),
    ("bad chunk size", raw(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"),
     {}, "malformed", "not a valid HTTP"),
]


@pytest.mark.parametrize(("what", "behaviour", "options", "kind", "contains"), FAILURES,
                         ids=[case[0] for case in FAILURES])
def test_failure(serve: Callable[..., Server], what: str, behaviour: Handler,
                 options: dict[str, Any], kind: str, contains: str) -> None:
    server = serve(behaviour)
    error = expect_error(lambda: fetch(server, **options), kind, 5.0)
    assert contains in str(error)
    assert f"127.0.0.1:{server.port}" in str(error)


GOOD_BYTES = (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body_of(REPORT))
              + body_of(REPORT))
GOOD_HEAD, GOOD_BODY = GOOD_BYTES.split(b"\r\n\r\n", 1)


def head_then_drip(conn: socket.socket, request: bytes, stop: threading.Event) -> None:
    conn.sendall(GOOD_HEAD + b"\r\n\r\n")
    drip(GOOD_BODY)(conn, request, stop)


@pytest.mark.parametrize(("what", "behaviour", "phase"), [
    ("whole answer dripped", drip(GOOD_BYTES), "waiting for the status and headers"),
    ("body dripped", head_then_drip, "reading the body"),
    ("accepts, never answers", hang, "waiting for the status and headers"),
], ids=["drip-head", "drip-body", "hang"])
def test_cut_at_the_deadline(serve: Callable[..., Server], what: str, behaviour: Handler,
                             phase: str) -> None:
    server = serve(behaviour)
    error = expect_error(lambda: fetch(server, deadline=1.0), "timeout", 1.0)
    assert "within 1 s" in str(error)
    assert phase in str(error)


def test_refused_port_is_connect() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, never listening: connections are refused
        error = expect_error(lambda: fetch_shards("127.0.0.1", port, deadline=5.0),
                             "connect", 5.0)
    assert f"cannot connect to 127.0.0.1:{port}" in str(error)
    assert "refused" in str(error)


def test_host_name(serve: Callable[..., Server]) -> None:
    server = serve(answer())
    # localhost may come first as ::1, where nothing listens: the next address is tried
    assert fetch_shards("localhost", server.port, deadline=5.0) == EXPECTED
    assert f"Host: localhost:{server.port}\r\n".encode() in server.requests[0]


def test_slow_name_resolution_is_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """getaddrinfo cannot be interrupted: a lookup that outlives the budget is left behind
    (released here once the test is over)."""
    release = threading.Event()
    resolve = socket.getaddrinfo

    def slow(*args: Any, **options: Any) -> Any:
        release.wait(10)
        return resolve(*args, **options)

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    try:
        error = expect_error(lambda: fetch_shards("localhost", 9, deadline=0.5), "timeout", 0.5)
    finally:
        release.set()
    assert "resolving the name" in str(error)


def test_budget_follows_the_given_clock(serve: Callable[..., Server]) -> None:
    """The budget is checked before every socket operation, on the clock given: the
    server spends the whole budget (on the fake clock) before its first byte."""
    now = [0.0]

    def spend_then_trickle(conn: socket.socket, _request: bytes, _stop: threading.Event) -> None:
        now[0] = 100.0
        conn.sendall(b"H")

    server = serve(spend_then_trickle)
    error = expect_error(lambda: fetch(server, deadline=10.0, clock=lambda: now[0]),
                         "timeout", 10.0)
    assert "within 10 s" in str(error)
    assert "waiting for the status and headers" in str(error)


# -- proxies -----------------------------------------------------------------------------


PROXY_VARIABLES = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy",
                   "ALL_PROXY")


def follows_proxies(url: str) -> None:
    """GET url as a proxy-honouring client does (urllib, its opener built now: urlopen's
    global one keeps the proxies of the first call)."""
    with contextlib.suppress(urllib.error.HTTPError), \
            urllib.request.build_opener().open(url, timeout=5):
        pass


def test_proxy_variables_have_no_effect(serve: Callable[..., Server],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = serve(answer(b"", "502 Bad Gateway"))
    real = serve(answer())
    for name in PROXY_VARIABLES:
        monkeypatch.setenv(name, f"http://127.0.0.1:{proxy.port}")
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    assert fetch(real) == EXPECTED
    assert fetch(real, after=1, wait=0.5, deadline=5.0) == EXPECTED
    assert proxy.connections == 0
    assert real.connections == 2
    # control: a client that honours the variables does reach this proxy
    follows_proxies(f"http://127.0.0.1:{real.port}/v1/shards")
    assert proxy.connections == 1
    assert real.connections == 2


# -- the answer's content ----------------------------------------------------------------


def report_with(**shard: Any) -> dict[str, Any]:
    return {**REPORT, "shards": [{**SHARD, **shard}]}


def without(key: str) -> dict[str, Any]:
    return {"node": "gpu-a2", "version": 1, "shards": [
        {k: v for k, v in SHARD.items() if k != key}]}


MALFORMED = [
    # (what, body, message contains)
    ("not JSON", b"<html>hello</html>", "the answer is not JSON"),
    ("not UTF-8", b'{"node": "\xff"}', "not UTF-8"),
    ("empty body", b"", "not JSON"),
    # the spec's own reader (spec/reader.py) checks the wire format: its messages
    ("a list", [SHARD], "top level: expected a mapping with keys node, version, shards, clock; "
     "got a list"),
    ("a string", "ready", "top level: expected a mapping with keys node, version, shards, clock; "
     "got a string ('ready')"),
    ("missing node", {"version": 1, "shards": []}, "top level: missing required key 'node'"),
    ("bad node", {**REPORT, "node": "gpu a2"}, "node: expected a node name; got 'gpu a2'"),
    ("node not a string", {**REPORT, "node": 7}, "node: expected a node name; got a number"),
    ("bool version", {**REPORT, "version": True},
     "version: expected a version number (an integer from 0 to 9223372036854775807); got a "
     "boolean (true)"),
    ("float version", {**REPORT, "version": 1.5}, "got a number (1.5)"),
    ("negative version", {**REPORT, "version": -1}, "version: expected a version number from "
     "0 to 9223372036854775807; got -1"),
    ("NaN version", b'{"node": "gpu-a2", "version": NaN, "shards": []}',
     "NaN is not a JSON number"),
    ("shards not a list", {**REPORT, "shards": {}},
     "shards: expected a list of shards; got a mapping"),
    ("too many shards", {**REPORT, "shards": [SHARD] * 1001},
     "shards: expected at most 1000 shards; got 1001"),
    ("shard not an object", {**REPORT, "shards": [SHARD, 3]},
     "shards[1]: expected a mapping with keys replica, rank, node, state, reason, generation, "
     "serving, started, draining, drained, spec; got a number (3)"),
    ("spec not a mapping", {**REPORT, "shards": [{**SHARD, "spec": "new"}]},
     "shards[0].spec: expected a mapping with keys loaded, running"),
    ("a spec digest not a digest", {**REPORT, "shards": [
        {**SHARD, "spec": {"loaded": "x" * 16, "running": ""}}]},
     "shards[0].spec.loaded: expected a spec digest (16 lowercase hex digits)"),
    ("draining not a string", {**REPORT, "shards": [{**SHARD, "draining": 7}]},
     "shards[0].draining: expected why that node drains the replica"),
    ("drained not a boolean", {**REPORT, "shards": [{**SHARD, "drained": "yes"}]},
     "shards[0].drained: expected whether the serving rank is drained"),
    ("started negative", {**REPORT, "clock": 50, "shards": [{**SHARD, "started": -1}]},
     "shards[0].started: expected when its engine started"),
    ("started not a number", {**REPORT, "clock": 50, "shards": [{**SHARD, "started": "x"}]},
     "shards[0].started: expected when its engine started"),
    ("started after the clock", {**REPORT, "clock": 50, "shards": [{**SHARD, "started": 51}]},
     "shards[0].started: expected a time no later than the answer's clock (50); got 51"),
    ("clock not a number", {**REPORT, "clock": "now"}, "clock: expected seconds"),
    ("rank a string", {**REPORT, "shards": [SHARD, SHARD, {**SHARD, "rank": "x"}]},
     "shards[2].rank: expected a rank (an integer from 0 to 2147483647); got a string ('x')"),
    ("negative rank", report_with(rank=-1),
     "shards[0].rank: expected a rank from 0 to 2147483647; got -1"),
    ("bool rank", report_with(rank=False), "shards[0].rank: expected a rank (an integer from "
     "0 to 2147483647); got a boolean (false)"),
    ("missing rank", without("rank"), "shards[0]: missing required key 'rank'"),
    ("unknown state", report_with(state="happy"),
     "shards[0].state: expected one of stopped, starting, ready, degraded, failed, unknown; "
     "got 'happy'"),
    ("state not a string", report_with(state=None), "shards[0].state: expected one of"),
    ("bad replica name", report_with(replica="Llama_70B"),
     "shards[0].replica: expected a replica name; got 'Llama_70B'"),
    ("replica starts with -", report_with(replica="-x"), "shards[0].replica"),
    ("replica too long", report_with(replica="a" * 64), "shards[0].replica"),
    ("bad shard node", report_with(node=""), "shards[0].node: expected a node name; got an "
     "empty string"),
    ("huge reason", report_with(reason="x" * 2001),
     "shards[0].reason: expected a reason of at most 2000 characters; got 2001"),
    ("reason not a string", report_with(reason=["x"]),
     "shards[0].reason: expected a reason; got a list"),
    ("generation not hex", report_with(generation="XYZ"),
     "shards[0].generation: expected a shard generation (lowercase hex, at most 64 "
     "characters); got 'XYZ'"),
    ("generation too long", report_with(generation="a" * 65), "shards[0].generation"),
    ("generation an integer (the old format)", report_with(generation=0),
     "shards[0].generation: expected a shard generation (lowercase hex, at most 64 "
     "characters); got a number (0)"),
    ("serving a string", report_with(serving="yes"),
     "shards[0].serving: expected whether it serves HTTP (true or false); got a string "
     "('yes')"),
    ("missing serving", without("serving"), "shards[0]: missing required key 'serving'"),
    ("a control character in a name", report_with(replica="a\nb"),
     "shards[0].replica: expected a replica name; got 'a\\x0ab'"),
    ("duplicate key", b'{"node": "gpu-a2", "version": 1, "version": 2, "shards": []}',
     'duplicate key "version"'),
    ("deeply nested", b"[" * 100_000 + b"]" * 100_000, "not JSON"),
]


@pytest.mark.parametrize(("what", "document", "contains"), MALFORMED,
                         ids=[case[0] for case in MALFORMED])
def test_malformed_answer(serve: Callable[..., Server], what: str, document: Any,
                          contains: str) -> None:
    server = serve(answer(document))
    error = expect_error(lambda: fetch(server), "malformed", 5.0)
    assert contains in str(error)
    assert str(error).startswith(f"127.0.0.1:{server.port}: ")


def test_limits_are_inclusive(serve: Callable[..., Server]) -> None:
    server = serve(answer({**REPORT, "shards": [
        {**SHARD, "replica": "a" * 63, "reason": "r" * 2000, "generation": "f" * 64}] * 1000}))
    got = fetch(server, max_bytes=4 << 20)
    assert len(got.shards) == 1000
    assert got.shards[999].replica == "a" * 63


def test_garbage_never_escapes_as_another_exception(serve: Callable[..., Server]) -> None:
    """Seeded mutations of a good answer (cut short, bytes flipped, bytes inserted): each
    fetch returns an answer or raises a PeerError, nothing else."""
    rng = random.Random(1234)  # noqa: S311 - reproducible test data, not secrets
    responses: list[bytes] = []
    for _ in range(60):
        data = bytearray(GOOD_BYTES)
        choice = rng.randrange(3)
        if choice == 0:
            del data[rng.randrange(len(data)):]
        elif choice == 1:
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        else:
            at = rng.randrange(len(data))
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        responses.append(bytes(data))
    queue = iter(responses)

    def next_response(conn: socket.socket, _request: bytes, _stop: threading.Event) -> None:
        conn.sendall(next(queue))

    server = serve(next_response)
    kinds: set[str] = set()
    for _ in responses:
        try:
            fetch(server, deadline=2.0)
            kinds.add("ok")
        except PeerError as exc:
            kinds.add(exc.kind)
            assert "\n" not in str(exc)
    assert kinds - {"ok"} <= set(PEER_ERROR_KINDS)
    assert "malformed" in kinds


# -- TLS ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, bytes]:
    """A CA and a server certificate for peer.test and 127.0.0.1 signed by it: (cert
    file, key file, the CA in PEM)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "llmgw test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "peer.test")]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("peer.test"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    folder = tmp_path_factory.mktemp("tls")
    cert_file, key_file = folder / "server.pem", folder / "server.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file, ca.public_bytes(serialization.Encoding.PEM)


def server_context(tls_files: tuple[Path, Path, bytes]) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tls_files[0], tls_files[1])
    return context


def client_context(tls_files: tuple[Path, Path, bytes]) -> ssl.SSLContext:
    return ssl.create_default_context(cadata=tls_files[2].decode())


@pytest.mark.parametrize("server_hostname", ["peer.test", None])
def test_tls(serve: Callable[..., Server], tls_files: tuple[Path, Path, bytes],
             server_hostname: str | None) -> None:
    server = serve(answer(), tls=server_context(tls_files))
    got = fetch(server, ssl_context=client_context(tls_files), server_hostname=server_hostname)
    assert (got.node, got.version, got.shards) == (EXPECTED.node, 17, EXPECTED.shards)
    assert got.peer_cert is not None
    assert got.peer_cert["subject"] == ((("commonName", "peer.test"),),)
    assert ("DNS", "peer.test") in got.peer_cert["subjectAltName"]


def test_tls_hostname_mismatch(serve: Callable[..., Server],
                               tls_files: tuple[Path, Path, bytes]) -> None:
    server = serve(answer(), tls=server_context(tls_files))
    error = expect_error(lambda: fetch(server, ssl_context=client_context(tls_files),
                                       server_hostname="gpu-a9.test"), "tls", 5.0)
    assert "gpu-a9.test" in str(error)
    assert "certificate verify failed" in str(error)
    assert server.requests == []  # no request was ever sent


def test_tls_untrusted_certificate(serve: Callable[..., Server],
                                   tls_files: tuple[Path, Path, bytes]) -> None:
    server = serve(answer(), tls=server_context(tls_files))
    error = expect_error(lambda: fetch(server, ssl_context=ssl.create_default_context(),
                                       server_hostname="peer.test"), "tls", 5.0)
    assert "certificate verify failed" in str(error)


def test_a_tls_peer_that_hangs_up_unanswered_is_said_to_refuse_our_certificate(
        serve: Callable[..., Server], tls_files: tuple[Path, Path, bytes]) -> None:
    """With TLS 1.3 a server checks the client's certificate after the client's handshake
    is done: one that refuses it hangs up before answering (seen between two booted
    nodes of different CAs). The error says so; over plain HTTP it would not."""
    hang_up: Handler = lambda conn, request, stopping: None  # noqa: E731
    server = serve(hang_up, tls=server_context(tls_files))
    error = expect_error(lambda: fetch(server, ssl_context=client_context(tls_files),
                                       server_hostname="peer.test"), "closed", 5.0)
    assert "right after the TLS handshake: it does not accept this node's certificate" \
        in str(error)
    plain = serve(hang_up)
    error = expect_error(lambda: fetch(plain), "closed", 5.0)
    assert "certificate" not in str(error)


def test_tls_to_a_plain_http_server(serve: Callable[..., Server],
                                    tls_files: tuple[Path, Path, bytes]) -> None:
    server = serve(answer(), read_request=False)
    expect_error(lambda: fetch(server, ssl_context=client_context(tls_files)), "tls", 5.0)


def test_tls_handshake_that_never_comes(serve: Callable[..., Server],
                                        tls_files: tuple[Path, Path, bytes]) -> None:
    server = serve(hang, read_request=False)
    error = expect_error(lambda: fetch(server, ssl_context=client_context(tls_files),
                                       deadline=1.0), "timeout", 1.0)
    assert "TLS handshake" in str(error)


# -- the interface -----------------------------------------------------------------------


@pytest.mark.parametrize(("options", "message"), [
    ({"deadline": 0}, "deadline"),
    ({"deadline": float("inf")}, "deadline"),
    ({"deadline": 5, "wait": 1}, "needs after"),
    ({"deadline": 5, "after": -1}, "after"),
    ({"deadline": 5, "after": True}, "after"),
    ({"deadline": 5, "after": 1, "wait": 5}, "must exceed wait"),
    ({"deadline": 5, "after": 1, "wait": float("nan")}, "wait"),
    ({"deadline": 5, "max_bytes": 0}, "max_bytes"),
])
def test_wrong_arguments_are_value_errors(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fetch_shards("127.0.0.1", 9, **options)
    with pytest.raises(ValueError, match="port"):
        fetch_shards("127.0.0.1", 0, deadline=5)


def test_peer_error() -> None:
    error = PeerError("closed", "a\nb\x1b[31m")
    assert isinstance(error, LlmgwError)
    assert (error.kind, str(error)) == ("closed", "a\\x0ab\\x1b[31m")
    assert len(str(PeerError("malformed", "x" * 10_000))) <= 400
    with pytest.raises(ValueError, match="kind"):
        PeerError("oops", "message")  # type: ignore[arg-type]


# -- the hostile peer stand-in -----------------------------------------------------------


@contextlib.contextmanager
def hostile_peer(mode: str, *options: str) -> Iterator[int]:
    """tests/standins/hostile_peer.py on 127.0.0.1:0 (as the integration tests run it),
    yielding its port; stopped by SIGTERM, which it must obey."""
    python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    process = subprocess.Popen([python, str(HOSTILE_PEER), "--listen", "127.0.0.1:0",
                                "--mode", mode, *options], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], 10)
        assert ready, "hostile_peer.py did not start listening"
        line = process.stdout.readline()
        assert line.startswith("listening on 127.0.0.1:"), line
        yield int(line.rsplit(":", 1)[1])
    finally:
        process.terminate()
        try:
            assert process.wait(timeout=5) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.mark.parametrize(("mode", "options", "kind"), [
    ("redirect", (), "redirect"),
    ("drip", ("--interval", "0.2"), "timeout"),
    ("hang", (), "timeout"),
    ("huge", (), "too-large"),
    ("malformed", (), "malformed"),
    ("flood", (), "too-large"),
])
def test_hostile_peer_modes(mode: str, options: tuple[str, ...], kind: str) -> None:
    with hostile_peer(mode, *options) as port:
        expect_error(lambda: fetch_shards("127.0.0.1", port, deadline=1.0), kind, 1.0)


def test_hostile_peer_lies_convincingly() -> None:
    with hostile_peer("lie", "--report", json.dumps(REPORT)) as port:
        assert fetch_shards("127.0.0.1", port, deadline=5.0) == EXPECTED


def test_hostile_peer_records_proxy_use(serve: Callable[..., Server], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    record = tmp_path / "proxy.jsonl"
    real = serve(answer())
    with hostile_peer("proxy-record", "--record", str(record)) as port:
        for name in PROXY_VARIABLES:
            monkeypatch.setenv(name, f"http://127.0.0.1:{port}")
        assert fetch(real) == EXPECTED
        assert not record.exists()
        # control: the record does catch a client that follows the variables
        follows_proxies(f"http://127.0.0.1:{real.port}/v1/shards")
    first_line = json.loads(record.read_text())["first_line"]
    assert first_line == f"GET http://127.0.0.1:{real.port}/v1/shards HTTP/1.1"


# -- a kept connection (PeerSession) -----------------------------------------------------


def kept(answers: int, *, close_after: int | None = None, bad_at: int | None = None
         ) -> Handler:
    """Answers up to `answers` requests on one connection (keep-alive); with close_after,
    hangs up, idle, after that many; with bad_at, answers that request with a malformed
    body."""
    def handler(conn: socket.socket, request: bytes, _stop: threading.Event) -> None:
        served = 0
        while request and served < answers:
            body = b"{not json" if served == bad_at else json.dumps(
                {**REPORT, "version": 17 + served}).encode()
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            served += 1
            if served == close_after:
                return
            request = read_head(conn)
            if request:
                server_requests.append(request)

    server_requests: list[bytes] = []
    return handler


def session_run(session: PeerSession, calls: int, **options: Any) -> list[PeerAnswer | str]:
    """`calls` fetches in a row on one session (one event loop): each answer's version,
    or the kind of its PeerError."""
    async def run() -> list[PeerAnswer | str]:
        out: list[PeerAnswer | str] = []
        for _ in range(calls):
            try:
                out.append(await session.fetch_shards(deadline=5.0, **options))
            except PeerError as exc:
                out.append(exc.kind)
        return out

    try:
        return asyncio.run(run())
    finally:
        session.close()


def versions(results: list[PeerAnswer | str]) -> list[int | str]:
    return [r.version if isinstance(r, PeerAnswer) else r for r in results]


def test_a_session_keeps_its_connection(serve: Callable[..., Server]) -> None:
    server = serve(kept(5))
    session = PeerSession(server.host, server.port)
    assert versions(session_run(session, 3)) == [17, 18, 19]
    assert server.connections == 1
    assert b"Connection: close" not in server.requests[0]
    # the one-shot wrapper still says it is done after one answer
    fetch(serve(answer()))


def test_a_kept_connection_the_peer_closed_while_idle_is_made_again(
        serve: Callable[..., Server]) -> None:
    """The peer hangs up between two requests (its keep-alive timeout, a restart): the
    next request goes once more on a new connection, and is answered."""
    server = serve(kept(5, close_after=1))
    session = PeerSession(server.host, server.port)
    assert versions(session_run(session, 3)) == [17, 17, 17]
    assert server.connections == 3


def test_a_failed_exchange_is_never_followed_on_its_connection(
        serve: Callable[..., Server]) -> None:
    """After a malformed answer the connection is closed: the next request opens a new
    one, never reads what may follow on the old one."""
    server = serve(kept(5, bad_at=1))
    session = PeerSession(server.host, server.port)
    assert versions(session_run(session, 3)) == [17, "malformed", 17]
    assert server.connections == 2


def test_a_peer_that_hangs_up_mid_answer_is_not_asked_twice(
        serve: Callable[..., Server]) -> None:
    """Only a request that got no byte of an answer is sent again."""
    server = serve(closed_mid_body)
    session = PeerSession(server.host, server.port)
    assert versions(session_run(session, 1)) == ["closed"]
    assert server.connections == 1


def test_a_new_tls_connection_resumes_the_session_and_keeps_the_certificate(
        serve: Callable[..., Server], tls_files: tuple[Path, Path, bytes]) -> None:
    server = serve(kept(5, close_after=1), tls=server_context(tls_files))
    session = PeerSession(server.host, server.port, ssl_context=client_context(tls_files),
                          server_hostname="peer.test")
    results = session_run(session, 3)
    assert versions(results) == [17, 17, 17]
    assert (session.handshakes, session.resumed) == (3, 2)
    for result in results:  # the certificate is the session's, resumed or not
        assert isinstance(result, PeerAnswer) and result.peer_cert is not None
        assert result.peer_cert["subject"] == ((("commonName", "peer.test"),),)


def test_a_reset_before_any_answer_counts_as_refused() -> None:
    """A supervisor that stops with our request queued resets it: the node's kernel
    answered, as with a refusal (the peer grace's evidence, docs/supervisor.md)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]

        def reset() -> None:
            conn, _ = listener.accept()
            conn.recv(4096)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # linger 0: an RST, not a FIN

        thread = threading.Thread(target=reset, daemon=True)
        thread.start()
        error = expect_error(lambda: fetch_shards("127.0.0.1", port, deadline=5.0),
                             "closed", 5.0)
        thread.join(5)
    assert error.refused, error
