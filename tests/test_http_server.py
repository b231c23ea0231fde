"""The bounded HTTP server (llmgw_systemd.supervisor.http.server) against real sockets on loopback.

Durations below are liveness limits ("answered at all within 5 s"), never performance
figures; every loop is bounded.
"""

from __future__ import annotations

import asyncio
import datetime
import gc
import http.client
import ipaddress
import json
import os
import resource
import select
import socket
import ssl
import struct
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import h11
import pytest

from llmgw_systemd.supervisor.http import server as httpserve
from llmgw_systemd.supervisor.http.server import Changes, HttpServer, Request, Response

LIVE = 5.0  # seconds: "it happened at all"
BIG = 16 * 1024 * 1024


class App:
    """A tiny router: what the supervisor's handler will look like, in miniature."""

    def __init__(self) -> None:
        self.changes = Changes()
        self.calls = 0
        self.requests: list[Request] = []  # kept only when keep_requests is set
        self.keep_requests = False
        self.slow_done = threading.Event()

    async def __call__(self, request: Request) -> Response:
        self.calls += 1
        if self.keep_requests:
            self.requests.append(request)
        path = request.path
        if path == "/":
            return Response(200, b'{"hello": "world"}')
        if path == "/echo":
            return _json({"method": request.method, "query": request.query,
                          "peer": request.peer[0]})
        if path == "/text":
            return Response(200, b"hi\n", content_type="text/plain; version=0.0.4",
                            headers=(("X-Extra", "1"),))
        if path == "/boom":
            raise ZeroDivisionError("boom")
        if path == "/bad-response":
            return "not a response"  # type: ignore[return-value]
        if path == "/reserved-header":
            return Response(200, b"{}", headers=(("Content-Length", "1"),))
        if path == "/big":
            return Response(200, b"x" * BIG, content_type="application/octet-stream")
        if path == "/block":
            # Blocks the whole loop on purpose: connections arriving meanwhile queue in
            # the backlog and are then accepted in one burst.
            time.sleep(0.3)
            return Response(200, b"{}")
        if path == "/slow":
            await asyncio.sleep(0.3)
            self.slow_done.set()
            return Response(200, b"{}")
        if path == "/wait":
            since = int(dict(request.query).get("since", "0"))
            version = await self.changes.wait_after(since, timeout=30)
            return _json({"version": version})
        if path == "/cert":
            cert = request.peer_cert
            subject = None if cert is None else dict(x[0] for x in cert["subject"])
            return _json({"subject": subject})
        return Response(404, b'{"error": "not found"}')


def _json(data: object) -> Response:
    return Response(200, json.dumps(data).encode())


@pytest.fixture(autouse=True)
def no_traceback(capfd: pytest.CaptureFixture[str]) -> Iterator[None]:
    """Whatever a test does to the server, nothing like a traceback reaches stderr."""
    yield
    err = capfd.readouterr().err
    for bad in ("Traceback", "Exception in", "exception was never retrieved",
                "Task was destroyed"):
        assert bad not in err, err


Servers = Callable[..., tuple[HttpServer, App, list[str]]]


@pytest.fixture
def servers() -> Iterator[Servers]:
    """Start servers on 127.0.0.1 port 0 (their App and log lines); all stopped after."""
    started: list[HttpServer] = []

    def make(host: str = "127.0.0.1", **options: Any) -> tuple[HttpServer, App, list[str]]:
        app, lines = App(), list[str]()
        server = HttpServer(host, 0, app, log=lines.append, **options)
        server.attach(app.changes)
        server.start()
        started.append(server)
        return server, app, lines

    yield make
    for server in started:
        server.stop()
    for server in started:
        assert server.stats["open"] == 0


@pytest.fixture
def many_fds() -> Iterator[None]:
    """Thousands of client sockets in this process: soft RLIMIT_NOFILE up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # a machine that cannot hold 2000 clients cannot show the cap: a failure, not a skip
    assert hard == resource.RLIM_INFINITY or hard >= 3000, f"RLIMIT_NOFILE hard limit {hard}"
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def get(server: HttpServer, path: str, method: str = "GET",
        ) -> tuple[int, dict[str, str], bytes]:
    conn = client(server)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def client(server: HttpServer) -> http.client.HTTPConnection:
    host, port = server.address
    return http.client.HTTPConnection(host, port, timeout=LIVE)


def connect(server: HttpServer) -> socket.socket:
    return socket.create_connection(server.address, timeout=LIVE)


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes (bounded: the socket's timeout, a size cap)."""
    out = b""
    while len(out) < 1 << 20:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        out += chunk
    return out


def exchange(server: HttpServer, data: bytes) -> bytes:
    with connect(server) as sock:
        sock.sendall(data)
        return read_all(sock)


def split(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def reset_close(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0) instead of a FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def wait_until(condition: Callable[[], bool], limit: float = LIVE) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def closed_by_server(sock: socket.socket) -> bool:
    """Has the server closed this connection (without answering)? Does not block."""
    poller = select.poll()  # not select(): these fds may be past 1024
    poller.register(sock, select.POLLIN)
    if not poller.poll(0):
        return False
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True


# -- requests and answers --------------------------------------------------------------

ROUTES = [
    # (path, status, content type, body)
    ("/", 200, "application/json", b'{"hello": "world"}'),
    ("/nowhere", 404, "application/json", b'{"error": "not found"}'),
    ("/text", 200, "text/plain; version=0.0.4", b"hi\n"),
    ("/?x=1", 200, "application/json", b'{"hello": "world"}'),
]


@pytest.mark.parametrize(("path", "status", "kind", "body"), ROUTES)
def test_routes_and_headers(servers: Servers, path: str, status: int, kind: str,
                            body: bytes) -> None:
    server, app, lines = servers()
    got_status, headers, got_body = get(server, path)
    assert (got_status, got_body) == (status, body)
    assert headers["Content-Type"] == kind
    assert headers["Content-Length"] == str(len(body))
    assert headers["Server"] == "llmgw-supervisor"  # never a Python version
    assert headers["Cache-Control"] == "no-store"
    assert app.calls == 1 and lines == []


def test_extra_headers_and_server_name(servers: Servers) -> None:
    server, _, _ = servers(server_name="llmgw-supervisor/test")
    _, headers, _ = get(server, "/text")
    assert headers["X-Extra"] == "1"
    assert headers["Server"] == "llmgw-supervisor/test"


QUERIES = [
    # (target, what the handler sees as (method, query) or the status the server answers)
    ("/echo", [], 200),
    ("/echo?a=1&b=&a=2", [["a", "1"], ["b", ""], ["a", "2"]], 200),
    ("/echo?name=llama%2070b", [["name", "llama 70b"]], 200),
    ("/echo?" + "&".join(f"k{i}=v" for i in range(16)), [[f"k{i}", "v"] for i in range(16)],
     200),
    ("/echo?" + "&".join(f"k{i}=v" for i in range(17)), None, 400),
    ("http://node-a:9470/echo?a=1", [["a", "1"]], 200),  # absolute form
]


@pytest.mark.parametrize(("target", "query", "status"), QUERIES)
def test_query(servers: Servers, target: str, query: list[list[str]] | None,
               status: int) -> None:
    server, app, _ = servers()
    raw = exchange(server, f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                   .encode())
    got, _, body = split(raw)
    assert got == status
    if query is not None:
        assert json.loads(body) == {"method": "GET", "query": query, "peer": "127.0.0.1"}
    else:
        assert app.calls == 0


def test_path_is_raw(servers: Servers) -> None:
    server, app, _ = servers()
    app.keep_requests = True
    get(server, "/replicas/llama%2F70b?x=%41")
    assert app.requests[0].path == "/replicas/llama%2F70b"
    assert app.requests[0].query == (("x", "A"),)


def test_head(servers: Servers) -> None:
    server, app, _ = servers()
    _, get_headers, get_body = get(server, "/text")
    raw = exchange(server, b"HEAD /text HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    status, headers, body = split(raw)
    assert status == 200
    assert body == b""  # not a byte of it, though Content-Length says how long it is
    assert headers["content-length"] == str(len(get_body)) == get_headers["Content-Length"]
    assert headers["content-type"] == get_headers["Content-Type"]
    assert app.calls == 2


REFUSED = [
    # (what, request, status, connection closed after)
    ("POST", b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405, False),
    ("DELETE", b"DELETE /x HTTP/1.1\r\nHost: x\r\n\r\n", 405, False),
    ("OPTIONS *", b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", 405, False),
    ("lower-case get", b"get / HTTP/1.1\r\nHost: x\r\n\r\n", 405, False),
    ("GET with a body", b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello", 413,
     True),
    ("POST with a body", b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc", 413,
     True),
    ("chunked body", b"GET / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"5\r\nhello\r\n0\r\n\r\n", 413, True),
    ("head over 8 KiB in one piece",
     b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431, True),
    ("head over 8 KiB, many headers",
     b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-A: aaaaaaaaaaaaaaaaaaaa\r\n" * 400 + b"\r\n",
     431, True),
    ("not HTTP", b"hello there\r\n\r\n", 400, True),
    ("bad header line", b"GET / HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", 400, True),
    ("HTTP/1.1 without Host", b"GET / HTTP/1.1\r\n\r\n", 400, True),
    ("bad Content-Length", b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400,
     True),
    ("space in target", b"GET /a b HTTP/1.1\r\nHost: x\r\n\r\n", 400, True),
    ("target not a path", b"GET x HTTP/1.1\r\nHost: x\r\n\r\n", 400, True),
]


@pytest.mark.parametrize(("what", "request_bytes", "status", "closes"), REFUSED,
                         ids=[row[0] for row in REFUSED])
def test_refused_without_calling_the_handler(servers: Servers, what: str, request_bytes: bytes,
                                             status: int, closes: bool) -> None:
    server, app, lines = servers()
    with connect(server) as sock:
        sock.sendall(request_bytes)
        if closes:
            raw = read_all(sock)  # returns only because the server closes
        else:
            # Kept alive: the connection still answers a good request after the refusal.
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            raw = read_all(sock)
    got, headers, body = split(raw)
    assert got == status
    assert "error" in json.loads(body.split(b"HTTP/1.1")[0])
    assert headers["server"] == "llmgw-supervisor"
    if status == 405:
        assert headers["allow"] == "GET, HEAD"
    if closes:
        assert headers["connection"] == "close"
        assert app.calls == 0
    else:
        assert raw.count(b"HTTP/1.1 200 OK") == 1 and app.calls == 1
    assert lines == []
    assert server.stats["bad_requests"] == 1


def test_http10(servers: Servers) -> None:
    server, _, _ = servers()
    status, headers, body = split(exchange(server, b"GET / HTTP/1.0\r\n\r\n"))
    assert (status, body) == (200, b'{"hello": "world"}')
    assert headers["connection"] == "close"


def test_keep_alive(servers: Servers) -> None:
    server, _, _ = servers()
    conn = client(server)
    try:
        for path in ("/", "/echo", "/nowhere"):
            conn.request("GET", path)
            response = conn.getresponse()
            response.read()
            assert not response.will_close
    finally:
        conn.close()
    assert server.stats["accepted"] == 1
    assert server.stats["requests"] == 3


def test_pipelined_requests(servers: Servers) -> None:
    server, _, _ = servers()
    raw = exchange(server, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
                   b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n"
                   b"GET /text HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert raw.count(b"HTTP/1.1 200 OK") == 3
    assert raw.endswith(b"hi\n")


BROKEN_HANDLERS = [
    # (path, what the log line names)
    ("/boom", "ZeroDivisionError: boom"),
    ("/bad-response", "not a Response"),
    ("/reserved-header", "Content-Length header"),
]


@pytest.mark.parametrize(("path", "logged"), BROKEN_HANDLERS)
def test_handler_error(servers: Servers, path: str, logged: str) -> None:
    server, _, lines = servers()
    for _ in range(2):
        status, headers, body = get(server, path)
        assert status == 500
        assert json.loads(body) == {"error": "internal error"}
        assert headers["Connection"] == "close"
    assert len(lines) == 1, lines  # the second within 10 s is counted, not logged
    assert logged in lines[0] and "\n" not in lines[0]
    assert server.stats["handler_errors"] == 2
    assert get(server, "/")[0] == 200  # and it keeps serving


# -- clients that misbehave -------------------------------------------------------------

def _mid_head(server: HttpServer, app: App) -> None:
    with connect(server) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHo")


def _mid_head_reset(server: HttpServer, app: App) -> None:
    sock = connect(server)
    sock.sendall(b"GET / HT")
    time.sleep(0.05)
    reset_close(sock)


def _mid_response(server: HttpServer, app: App) -> None:
    sock = connect(server)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
    assert sock.recv(1000).startswith(b"HTTP/1.1 200")
    reset_close(sock)


def _before_the_answer(server: HttpServer, app: App) -> None:
    sock = connect(server)
    sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    reset_close(sock)
    assert app.slow_done.wait(LIVE)  # the handler returned after its client went away


def _before_the_answer_fin(server: HttpServer, app: App) -> None:
    with connect(server) as sock:
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    assert app.slow_done.wait(LIVE)


def _connect_only(server: HttpServer, app: App) -> None:
    reset_close(connect(server))


def _reset_after_a_refused_body(server: HttpServer, app: App) -> None:
    # Resets racing the server's 413 and its half-close (which once raised ENOTCONN):
    # a few rounds, so that some land inside the window.
    for _ in range(20):
        sock = connect(server)
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"
                     + b"a" * 30000)
        reset_close(sock)


HANGUPS = [_mid_head, _mid_head_reset, _mid_response, _before_the_answer,
           _before_the_answer_fin, _connect_only, _reset_after_a_refused_body]


@pytest.mark.parametrize("hang_up", HANGUPS, ids=[f.__name__.strip("_") for f in HANGUPS])
def test_client_hangs_up(servers: Servers, hang_up: Callable[[HttpServer, App], None]) -> None:
    server, app, lines = servers()
    hang_up(server, app)
    assert wait_until(lambda: server.stats["open"] == 0)
    assert get(server, "/")[0] == 200
    assert lines == []  # counters only; the autouse fixture checks stderr


def test_header_timeout_is_a_total_deadline(servers: Servers) -> None:
    """50 clients dripping a request head a byte at a time, each byte well inside
    header_timeout, are dropped at header_timeout, and others are served meanwhile."""
    server, _, _ = servers(header_timeout=1.0)
    head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    drippers = [connect(server) for _ in range(50)]
    dropped: set[int] = set()
    served = False
    try:
        for step in range(40):  # 0.1 s apart: 4 s, a liveness limit
            for i, sock in enumerate(drippers):
                if i in dropped:
                    continue
                if closed_by_server(sock):
                    dropped.add(i)
                    continue
                try:
                    sock.send(head[step:step + 1])
                except OSError:  # reset after the server closed
                    dropped.add(i)
            if step == 3:
                served = get(server, "/")[0] == 200
            if len(dropped) == len(drippers):
                break
            time.sleep(0.1)
    finally:
        for sock in drippers:
            sock.close()
    assert served
    assert len(dropped) == 50
    assert server.stats["header_timeouts"] >= 50


def test_idle_keep_alive_times_out(servers: Servers) -> None:
    server, _, _ = servers(header_timeout=0.5)
    with connect(server) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        raw = read_all(sock)  # returns when the idle connection is closed
    assert raw.startswith(b"HTTP/1.1 200")
    assert server.stats["header_timeouts"] == 1


def test_write_timeout(servers: Servers) -> None:
    """A client that never reads its (large) response is dropped after write_timeout."""
    server, _, _ = servers(write_timeout=0.5)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(LIVE)
    try:
        sock.connect(server.address)
        sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        assert get(server, "/")[0] == 200  # others are served while it stalls
        assert wait_until(lambda: server.stats["write_timeouts"] == 1)
        assert wait_until(lambda: server.stats["open"] == 0)
        assert server.stats["write_timeouts"] == 1  # dropped once, not also on close
    finally:
        sock.close()


def _park(server: HttpServer, count: int) -> tuple[ThreadPoolExecutor, list[Future[Any]]]:
    """`count` long-polls parked in the handler (each in a thread of its own)."""
    pool = ThreadPoolExecutor(count)
    before = server.stats["in_handler"]
    futures = [pool.submit(get, server, "/wait?since=0") for _ in range(count)]
    assert wait_until(lambda: server.stats["in_handler"] == before + count)
    return pool, futures


def test_long_poll_woken_from_another_thread(servers: Servers) -> None:
    server, app, _ = servers()
    pool, (future,) = _park(server, 1)
    try:
        assert not future.done()
        threading.Thread(target=app.changes.bump).start()
        status, _, body = future.result(LIVE)  # the handler waits 30 s unless woken
        assert (status, json.loads(body)) == (200, {"version": 1})
        # Already past the version asked for: answered at once.
        assert json.loads(get(server, "/wait?since=0")[2]) == {"version": 1}
    finally:
        pool.shutdown()


def test_one_changes_for_two_servers(servers: Servers) -> None:
    """The supervisor's API and local listeners share one Changes: a bump wakes both."""
    first, app, _ = servers()
    second, other, _ = servers()
    other.changes = app.changes
    second.attach(app.changes)
    pool_a, (a,) = _park(first, 1)
    pool_b, (b,) = _park(second, 1)
    try:
        app.changes.bump()
        assert json.loads(a.result(LIVE)[2]) == json.loads(b.result(LIVE)[2]) == {"version": 1}
    finally:
        pool_a.shutdown()
        pool_b.shutdown()


def test_max_waiting(servers: Servers) -> None:
    server, app, lines = servers(max_waiting=2)
    pool, futures = _park(server, 2)
    try:
        calls = app.calls
        status, headers, body = get(server, "/")
        assert status == 503 and headers["Retry-After"] == "1"
        assert "error" in json.loads(body)
        assert app.calls == calls  # refused without calling the handler
        app.changes.bump()
        assert [f.result(LIVE)[0] for f in futures] == [200, 200]
        assert get(server, "/")[0] == 200
    finally:
        pool.shutdown()
    assert server.stats["busy"] == 1 and lines == []


def test_idle_flood_evicts_the_oldest_waiting(servers: Servers, many_fds: None) -> None:
    """2000 idle connections against max_connections=500: the idle ones are evicted
    oldest first, a fresh client is answered, a parked long-poll is never evicted."""
    server, app, _ = servers(max_connections=500)
    pool, (parked,) = _park(server, 1)
    idle: list[socket.socket] = []
    try:
        for _ in range(2000):
            idle.append(connect(server))
        assert wait_until(lambda: server.stats["accepted"] >= 2001, 10.0)
        assert server.stats["open"] <= 500
        assert server.stats["evicted"] >= 1500
        assert get(server, "/")[0] == 200
        assert not parked.done()
        app.changes.bump()
        assert parked.result(LIVE)[0] == 200
        # Oldest first: the first ones were closed; the newest 400 are still open.
        assert wait_until(lambda: all(closed_by_server(s) for s in idle[:1000]))
        assert not any(closed_by_server(s) for s in idle[-400:])
    finally:
        for sock in idle:
            sock.close()
        pool.shutdown()


def test_at_cap_with_nothing_evictable(servers: Servers) -> None:
    server, app, _ = servers(max_connections=2)
    pool, futures = _park(server, 2)
    try:
        with connect(server) as sock:
            assert read_all(sock) == b""  # closed at once
        assert server.stats["refused_at_cap"] == 1
        app.changes.bump()
        assert [f.result(LIVE)[0] for f in futures] == [200, 200]
    finally:
        pool.shutdown()


def test_cap_follows_rlimit_nofile(servers: Servers) -> None:
    """Connections are capped at RLIMIT_NOFILE's soft limit - 64 (read at start())."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    assert in_use <= 60, f"{in_use} fds in use: cannot lower the limit to 72"
    resource.setrlimit(resource.RLIMIT_NOFILE, (72, hard))
    try:
        server, _, _ = servers(max_connections=4096)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    fds = len(os.listdir("/proc/self/fd"))
    gc.disable()  # an fd that only the garbage collector would close must show here
    pool = ThreadPoolExecutor(1)
    try:
        blocked = pool.submit(get, server, "/block")
        assert wait_until(lambda: server.stats["in_handler"] == 1)
        # Accepted in one burst once the loop is free again: most are evicted before
        # their task ever ran.
        idle = [connect(server) for _ in range(20)]
        try:
            assert blocked.result(LIVE)[0] == 200
            assert wait_until(lambda: server.stats["accepted"] == 21)
            assert server.stats["open"] <= 8
            assert server.stats["evicted"] >= 12
        finally:
            for sock in idle:
                sock.close()
        assert wait_until(lambda: server.stats["open"] == 0)
        # Every evicted socket was closed too, even one whose task had not started.
        assert wait_until(lambda: len(os.listdir("/proc/self/fd")) <= fds)
    finally:
        gc.enable()
        pool.shutdown()


def test_listen_backlog(servers: Servers) -> None:
    server, _, _ = servers(backlog=777)
    # Linux's TCP_INFO on a listening socket: tcpi_sacked is the accept queue's size.
    listener = server._sock
    assert listener is not None
    info = listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    assert struct.unpack_from("I", info, 28)[0] == 777


def test_memory_flat_over_unique_paths(servers: Servers) -> None:
    """Nothing is kept per path or per client: 2000 requests for unique long paths
    over 200 connections leave nothing allocated by the server behind."""
    server, _, _ = servers()
    watched = [tracemalloc.Filter(True, httpserve.__file__),
               tracemalloc.Filter(True, str(Path(h11.__file__).parent / "*"))]

    def traffic(tag: str) -> None:
        for c in range(100):
            conn = client(server)
            try:
                for r in range(10):
                    conn.request("GET", f"/{tag}-{c}-{r}-" + "p" * 200 + f"?q={c}{r}")
                    conn.getresponse().read()
            finally:
                conn.close()
        assert wait_until(lambda: server.stats["open"] == 0)

    tracemalloc.start()
    try:
        traffic("warm-up")
        gc.collect()
        before = tracemalloc.take_snapshot().filter_traces(watched)
        traffic("unique")
        gc.collect()
        after = tracemalloc.take_snapshot().filter_traces(watched)
    finally:
        tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert grown < 64 * 1024, grown  # the paths alone are 400 KiB


def test_ipv6(servers: Servers) -> None:
    server, _, _ = servers(host="::1")  # no IPv6 loopback here is a failure, never a skip
    assert server.address[0] == "::1"
    conn = http.client.HTTPConnection("::1", server.address[1], timeout=LIVE)
    try:
        conn.request("GET", "/echo")
        assert json.loads(conn.getresponse().read())["peer"] == "::1"
    finally:
        conn.close()


def test_start_and_stop(servers: Servers) -> None:
    server, _, _ = servers()
    taken = HttpServer("127.0.0.1", server.address[1], App())
    with pytest.raises(OSError):
        taken.start()
    taken.stop()  # nothing started: nothing to do
    with pytest.raises(OSError):
        HttpServer("no-such-host.invalid", 0, App()).start()
    server.stop()
    server.stop()  # idempotent
    with pytest.raises(OSError):
        socket.create_connection(server.address, timeout=LIVE).close()


# -- Changes ----------------------------------------------------------------------------

def test_changes_wait_after() -> None:
    async def scenario() -> tuple[int, int, int]:
        changes = Changes()
        at_once = await changes.wait_after(-1, timeout=30)  # already past: no wait
        timed_out = await changes.wait_after(0, timeout=0.05)
        waiter = asyncio.ensure_future(changes.wait_after(0, timeout=30))
        await asyncio.sleep(0)
        thread = threading.Thread(target=changes.bump)
        thread.start()
        woken = await asyncio.wait_for(waiter, LIVE)
        thread.join()
        return at_once, timed_out, woken

    assert asyncio.run(scenario()) == (0, 0, 1)


def test_changes_forgets_closed_loops() -> None:
    changes = Changes()

    async def wait_briefly() -> int:
        return await changes.wait_after(0, timeout=0.01)

    assert asyncio.run(wait_briefly()) == 0  # that loop is closed now
    assert changes.bump() == 1  # no error; the closed loop is dropped
    assert changes._waiters == {}


def test_changes_bump_counts() -> None:
    changes = Changes()
    assert changes.version == 0
    assert [changes.bump() for _ in range(3)] == [1, 2, 3]
    assert changes.version == 3


# -- TLS --------------------------------------------------------------------------------

def _self_signed(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, usable as server, client and CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "llmgw-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = directory / "cert.pem", directory / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


def test_tls(servers: Servers, tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    cert, key = _self_signed(tmp_path)
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(cert, key)
    server_context.verify_mode = ssl.CERT_OPTIONAL
    server_context.load_verify_locations(cert)
    server, _, lines = servers(ssl_context=server_context, handshake_timeout=0.5)

    def fetch(with_cert: bool) -> object:
        context = ssl.create_default_context(cafile=str(cert))
        if with_cert:
            context.load_cert_chain(cert, key)
        host, port = server.address
        conn = http.client.HTTPSConnection(host, port, timeout=LIVE, context=context)
        try:
            conn.request("GET", "/cert")
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    assert fetch(with_cert=True) == {"subject": {"commonName": "llmgw-test"}}
    assert fetch(with_cert=False) == {"subject": None}
    # A client that never starts the handshake, one that hangs up in it, one that
    # speaks plain HTTP: dropped, counted, and nothing printed.
    with connect(server) as silent:
        assert read_all(silent) == b""  # returns after handshake_timeout
    with connect(server) as quitter:
        quitter.sendall(b"\x16\x03\x01\x00\xa5\x01\x00")
    with connect(server) as plain:
        plain.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        read_all(plain)
    assert wait_until(lambda: server.stats["tls_failures"] >= 3)
    assert fetch(with_cert=True) == {"subject": {"commonName": "llmgw-test"}}
    assert lines == []


def test_stop_closes_everything(servers: Servers) -> None:
    server, _, _ = servers()
    pool, (parked,) = _park(server, 1)
    idle = [connect(server) for _ in range(3)]
    try:
        assert wait_until(lambda: server.stats["open"] == 4)
        server.stop()  # returns once the loop's thread has ended (bounded)
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            parked.result(LIVE)
        assert all(read_all(sock) == b"" for sock in idle)
        assert server.stats["open"] == 0 and server.stats["in_handler"] == 0
        with pytest.raises(ConnectionRefusedError):
            connect(server).close()
    finally:
        for sock in idle:
            sock.close()
        pool.shutdown()
