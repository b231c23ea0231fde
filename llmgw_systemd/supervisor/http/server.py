"""A small, bounded HTTP/1.1 server for the supervisor's read-only API (asyncio + h11).

The stdlib ThreadingHTTPServer it replaces spent a thread and an fd per idle connection,
listened with a backlog of 5, printed tracebacks when clients hung up and put the Python
version in `Server:`. This one runs one event loop in a daemon thread and bounds everything
a client can hold: connections (the one idle longest is evicted when a new one arrives at
the cap), the time to send a request head (a total deadline, not per byte), the time to
take a response, the size of a request head, and the number of requests in handlers.
It knows nothing about routes: a handler (async, so long-polls can park) gets a Request
and returns a Response. Only GET and HEAD reach it; requests with a body are refused.
Nothing is kept per path or per client once a connection closes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import http
import json
import resource
import socket
import ssl
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from email.utils import formatdate
from functools import lru_cache
from typing import Any, cast
from urllib.parse import parse_qsl, urlsplit

import h11

from llmgw_systemd.supervisor.rate_limited_log import RateLimitedLog

_MAX_HEAD = 8192  # bytes of request line + headers
_MAX_QUERY_PAIRS = 16
_READ_LIMIT = 16384  # bytes buffered per connection before we stop reading from it
_FD_RESERVE = 64  # fds left to the rest of the process (D-Bus, probes, peer fetches)
# Accepts per wake-up of the listener. An evicted socket closes one loop turn later, so
# this bounds how far past the cap the fd count can go (well inside the reserve).
_ACCEPT_BURST = 32
_LINGER = 1.0  # seconds we read and discard an unread request body after refusing it
_LINGER_BYTES = 256 * 1024
_LOG_INTERVAL = 10.0  # seconds between two log lines of one kind
_JOIN_TIMEOUT = 5.0
_RESERVED = frozenset({"server", "date", "content-type", "content-length", "cache-control",
                       "connection", "transfer-encoding"})
_JSON = "application/json"
_OUT_OF_FDS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_STATS = ("accepted", "evicted", "refused_at_cap", "header_timeouts", "write_timeouts",
          "bad_requests", "handler_errors", "client_gone", "requests", "busy",
          "tls_failures", "accept_errors")


@dataclass(frozen=True)
class Request:
    """A request as a handler sees it (GET or HEAD, never with a body)."""

    method: str  # "GET" or "HEAD"
    path: str  # the target's path, raw (not percent-decoded), no query
    query: tuple[tuple[str, str], ...]  # parse_qsl of the query, at most 16 pairs
    peer: tuple[str, int]
    peer_cert: dict[str, Any] | None  # ssl getpeercert() under TLS, else None


@dataclass(frozen=True)
class Response:
    """What a handler answers. The server adds Server, Date, Content-Length, Cache-Control."""

    status: int
    body: bytes = b""
    content_type: str = _JSON
    # Extra headers, e.g. (("Retry-After", "5"),); not those the server sets (-> 500).
    headers: tuple[tuple[str, str], ...] = ()


Handler = Callable[[Request], Awaitable[Response]]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Changes:
    """A change counter that handlers can wait on (long-poll).

    bump() may be called from any thread. wait_after() runs in an event loop: that of a
    server it is attached to (HttpServer.attach), or any other; several servers, each with
    its loop, can share one Changes. bump() wakes the waiters of every loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._version = 0
        # Per loop, its waiting futures; a set is only touched in its own loop's thread.
        self._waiters: dict[asyncio.AbstractEventLoop, set[asyncio.Future[None]]] = {}

    @property
    def version(self) -> int:
        return self._version

    def bump(self) -> int:
        """Count one change and wake every waiter; returns the new version."""
        with self._lock:
            self._version += 1
            version = self._version
            loops = list(self._waiters)
        for loop in loops:
            try:
                loop.call_soon_threadsafe(self._wake, loop)
            except RuntimeError:  # closed (its server stopped): nobody waits there now
                self._unbind(loop)
        return version

    async def wait_after(self, version: int, timeout: float) -> int:
        """The current version, as soon as it is past `version` or after `timeout` s."""
        loop = asyncio.get_running_loop()
        # Known before the version is read: a racing bump() then either sees this loop
        # and wakes it, or incremented before the check below (both under the lock).
        waiters = self._bind(loop)
        deadline = loop.time() + timeout
        while self._version <= version:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            fut: asyncio.Future[None] = loop.create_future()
            waiters.add(fut)
            timer = loop.call_later(remaining, _resolve, fut)
            try:
                await fut
            finally:
                timer.cancel()
                waiters.discard(fut)
        return self._version

    def _bind(self, loop: asyncio.AbstractEventLoop) -> set[asyncio.Future[None]]:
        with self._lock:
            return self._waiters.setdefault(loop, set())

    def _unbind(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self._waiters.pop(loop, None)

    def _wake(self, loop: asyncio.AbstractEventLoop) -> None:
        for fut in list(self._waiters.get(loop, ())):
            _resolve(fut)


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _Conn(asyncio.Protocol):
    """One client connection: buffers what arrives and wakes the task serving it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                 peer: tuple[str, int], tls: bool) -> None:
        self.loop = loop
        self.sock = sock
        self.peer = peer
        self.tls = tls
        self.started = False  # its task ran: from then on that task closes the socket
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task[None] | None = None
        self.peer_cert: dict[str, Any] | None = None
        self.buf = bytearray()
        self.eof = False
        self.eof_fed = False
        self.lost = False
        self.write_paused = False
        # While its request is handled, reading stops at the first byte the client
        # pipelines: the rest waits in the kernel, so a busy connection buffers at most one
        # read here. Stopping only then (not when the request arrives) spares a quiet
        # long-poll two epoll changes per request (bench/scale.py).
        self.reading = True
        self._read_paused = False
        self._waiter: asyncio.Future[None] | None = None

    # asyncio.Protocol callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._flow()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        # Keep our side open to answer a client that half-closed after its request;
        # asyncio's TLS transport cannot half-close (and warns if asked to).
        return not self.tls

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._wake()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake()

    # for the serving task
    def take(self, limit: int) -> bytes:
        data = bytes(self.buf[:limit])
        del self.buf[:limit]
        self._flow()
        return data

    def want_data(self, wanted: bool) -> None:
        self.reading = wanted
        self._flow()

    async def wait(self, deadline: float) -> None:
        """Until a callback above fires or the loop's clock reaches deadline."""
        fut: asyncio.Future[None] = self.loop.create_future()
        self._waiter = fut
        timer = self.loop.call_at(deadline, _resolve, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._waiter = None

    def abort(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.abort()

    def _flow(self) -> None:
        pause = (not self.reading and bool(self.buf)) or len(self.buf) > _READ_LIMIT
        if pause == self._read_paused or self.transport is None or self.lost or self.eof:
            return
        self._read_paused = pause
        if pause:
            self.transport.pause_reading()
        else:
            self.transport.resume_reading()

    def _wake(self) -> None:
        if self._waiter is not None:
            _resolve(self._waiter)


class HttpServer:
    """The server: start() binds and serves from a daemon thread, stop() ends it all.

    A server starts once. Open connections are capped at max_connections, and at the
    RLIMIT_NOFILE soft limit (read by start()) less 64 fds for the rest of the process.
    At the cap a new connection evicts the one waiting longest for a request head (idle
    keep-alive, slow sender, TLS handshake); one whose request is in the handler or being
    answered is never evicted, and when all are such the new one is closed at once.
    header_timeout runs from accept (under TLS: from the end of the handshake, which has
    handshake_timeout) or from the end of the previous response. A handler runs to its end
    even if its client left (its answer is then dropped); stop() cancels it.
    """

    def __init__(self, host: str, port: int, handler: Handler, *,
                 server_name: str = "llmgw-supervisor",
                 ssl_context: ssl.SSLContext | None = None, max_connections: int = 4096,
                 max_waiting: int = 256, header_timeout: float = 5.0,
                 write_timeout: float = 10.0, handshake_timeout: float = 5.0,
                 backlog: int = 1024, log: Callable[[str], None] = _stderr) -> None:
        if max_connections < 1 or max_waiting < 0 or backlog < 1:
            raise ValueError("max_connections and backlog must be >= 1, max_waiting >= 0")
        if min(header_timeout, write_timeout, handshake_timeout) <= 0:
            raise ValueError("timeouts must be positive")
        if not 0 <= port <= 65535:
            raise ValueError(f"port {port} out of range")
        if not (server_name.isascii() and server_name.isprintable()):
            raise ValueError(f"server_name {server_name!r}: printable ASCII only")
        self._host = host
        self._port = port
        self._handler = handler
        self._server_name = server_name.encode("ascii")
        self._ssl = ssl_context
        self._max_connections = max_connections
        self._max_waiting = max_waiting
        self._header_timeout = header_timeout
        self._write_timeout = write_timeout
        self._handshake_timeout = handshake_timeout
        self._backlog = backlog
        self._log = RateLimitedLog(log, _LOG_INTERVAL)
        self._cap = max_connections
        self._sock: socket.socket | None = None
        self._address: tuple[str, int] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._shared = False  # served on a loop it does not own (start(loop))
        self._changes: list[Changes] = []
        self._conns: set[_Conn] = set()
        # Connections waiting for a request head, oldest wait first: the eviction order.
        self._idle: dict[_Conn, None] = {}
        self._in_handler = 0
        self._stats = dict.fromkeys(_STATS, 0)

    # public
    @property
    def address(self) -> tuple[str, int]:
        if self._address is None:
            raise RuntimeError("not started")
        return self._address

    @property
    def listener(self) -> socket.socket:
        """The listening socket (to hand to systemd's store)."""
        if self._sock is None:
            raise RuntimeError("not started")
        return self._sock

    @property
    def stats(self) -> dict[str, int]:
        """Counters since start (`accepted` counts every accept(), the refused too;
        `bad_requests` the 400/405/413/431 we answered ourselves; `busy` the 503s), plus
        `open` connections and requests `in_handler` now."""
        out = dict(self._stats)
        out["open"] = len(self._conns)
        out["in_handler"] = self._in_handler
        return out

    def attach(self, changes: Changes) -> None:
        self._changes.append(changes)
        if self._loop is not None and not self._loop.is_closed():
            changes._bind(self._loop)

    def start(self, loop: asyncio.AbstractEventLoop | None = None, *,
              listener: socket.socket | None = None) -> None:
        """Bind and listen (OSError on failure), or serve `listener`, a listening socket
        made elsewhere (one systemd kept across a restart); then serve: from a daemon
        thread of its own, or on `loop` when given (running in another thread, such as
        the supervisor's runtime; that loop's exception handler is its owner's)."""
        if self._thread is not None or self._loop is not None:
            raise RuntimeError("HttpServer.start() called twice")
        self._cap = self._fd_cap()
        sock = self._bind() if listener is None else listener
        sock.setblocking(False)
        self._sock = sock
        name = sock.getsockname()
        self._address = (str(name[0]), int(name[1]))
        if loop is not None:
            self._loop, self._shared = loop, True
            ready: concurrent.futures.Future[None] = concurrent.futures.Future()
            shared = loop

            def setup() -> None:
                try:
                    self._listen(shared)
                except BaseException as exc:  # reported below
                    ready.set_exception(exc)
                else:
                    ready.set_result(None)

            try:
                loop.call_soon_threadsafe(setup)
                ready.result(_JOIN_TIMEOUT)
            except BaseException as exc:
                sock.close()
                raise OSError(f"HTTP server on {self._host}:{self._port}: {exc!r}") from None
            return
        loop = asyncio.new_event_loop()
        started = threading.Event()
        failed: list[BaseException] = []
        thread = threading.Thread(target=self._run, args=(loop, started, failed),
                                  name="http", daemon=True)
        self._loop, self._thread = loop, thread
        thread.start()
        if not started.wait(_JOIN_TIMEOUT) or failed:
            sock.close()
            why = f"{failed[0]!r}" if failed else "the event loop did not start"
            raise OSError(f"HTTP server on {self._host}:{self._port}: {why}")

    def stop(self) -> None:
        """Close the listener and every connection; on a thread of its own, end the loop
        and join the thread."""
        loop, thread = self._loop, self._thread
        if self._shared and loop is not None:
            closed = threading.Event()

            def close() -> None:
                try:
                    self._close_all(loop)
                finally:
                    closed.set()

            try:
                loop.call_soon_threadsafe(close)
            except RuntimeError:  # the loop closed meanwhile: nothing left open on it
                return
            if not _in_loop(loop):
                closed.wait(_JOIN_TIMEOUT)
            return
        if loop is None or thread is None or not thread.is_alive():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(self._shutdown, loop)
        if threading.current_thread() is not thread:
            thread.join(_JOIN_TIMEOUT)
            if thread.is_alive():
                self._log("stop", f"http: the server thread did not end within "
                          f"{_JOIN_TIMEOUT:.0f} s (a handler that ignores cancellation?)")

    def _listen(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._sock is None:
            raise RuntimeError("no listening socket")
        loop.add_reader(self._sock.fileno(), self._on_acceptable, loop, self._sock)
        for changes in self._changes:
            changes._bind(loop)

    # the loop's thread
    def _run(self, loop: asyncio.AbstractEventLoop, ready: threading.Event,
             failed: list[BaseException]) -> None:
        try:
            asyncio.set_event_loop(loop)
            loop.set_exception_handler(self._on_loop_error)
            self._listen(loop)
        except BaseException as exc:  # reported by start()
            failed.append(exc)
            ready.set()
            loop.close()
            return
        ready.set()
        try:
            loop.run_forever()
        finally:
            # Tasks the handler spawned, and connections still closing: cancel and let
            # them finish (bounded), so closing the loop leaves nothing pending behind.
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.wait(pending, timeout=2.0))
            loop.run_until_complete(asyncio.sleep(0))  # connection_lost callbacks
            loop.run_until_complete(loop.shutdown_asyncgens())
            for changes in self._changes:
                changes._unbind(loop)
            loop.close()

    def _shutdown(self, loop: asyncio.AbstractEventLoop) -> None:
        self._close_all(loop)
        loop.stop()

    def _close_all(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._sock is not None and self._sock.fileno() != -1:  # twice: stop() raced
            loop.remove_reader(self._sock.fileno())
            self._sock.close()
        for conn in list(self._conns):
            self._drop(conn)

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, (ConnectionError, ssl.SSLError)):
            self._stats["client_gone"] += 1
            return
        detail = f": {type(exc).__name__}: {_one_line(str(exc))}" if exc else ""
        self._log("asyncio", f"http: {context.get('message', 'asyncio error')}{detail}")

    def _on_acceptable(self, loop: asyncio.AbstractEventLoop, listener: socket.socket) -> None:
        for _ in range(_ACCEPT_BURST):
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                self._stats["accept_errors"] += 1
                self._log("accept", f"http: accept failed: {exc}")
                if exc.errno in _OUT_OF_FDS:
                    # The kernel keeps the backlog; try again shortly instead of spinning.
                    loop.remove_reader(listener.fileno())
                    loop.call_later(0.5, self._resume_accepting, loop, listener)
                return
            self._admit(loop, sock, (str(addr[0]), int(addr[1])))

    def _resume_accepting(self, loop: asyncio.AbstractEventLoop,
                          listener: socket.socket) -> None:
        if listener.fileno() != -1:  # not closed by stop() meanwhile
            loop.add_reader(listener.fileno(), self._on_acceptable, loop, listener)

    def _admit(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
               peer: tuple[str, int]) -> None:
        self._stats["accepted"] += 1
        if len(self._conns) >= self._cap:
            victim = next(iter(self._idle), None)
            if victim is None:  # every connection is in a handler or being answered
                self._stats["refused_at_cap"] += 1
                sock.close()
                return
            self._stats["evicted"] += 1
            self._drop(victim)
        conn = _Conn(loop, sock, peer, self._ssl is not None)
        self._conns.add(conn)
        self._idle[conn] = None
        conn.task = loop.create_task(self._serve(conn))

    def _drop(self, conn: _Conn) -> None:
        """Forget a connection now and tear it down (its fd closes on the next loop turn)."""
        self._forget(conn)
        conn.abort()
        if conn.task is not None:
            conn.task.cancel()
        if not conn.started:
            # A task cancelled before its first step never runs its body (nor its finally).
            conn.sock.close()

    def _forget(self, conn: _Conn) -> None:
        self._conns.discard(conn)
        self._idle.pop(conn, None)

    def _set_idle(self, conn: _Conn) -> None:
        conn.want_data(True)
        if conn in self._conns:
            self._idle.pop(conn, None)
            self._idle[conn] = None  # to the end: the newest wait

    def _set_busy(self, conn: _Conn) -> None:
        conn.want_data(False)
        self._idle.pop(conn, None)

    # one connection
    async def _serve(self, conn: _Conn) -> None:
        conn.started = True
        try:
            try:
                await conn.loop.connect_accepted_socket(
                    lambda: conn, conn.sock, ssl=self._ssl,
                    ssl_handshake_timeout=self._handshake_timeout if self._ssl else None)
            except (OSError, EOFError, asyncio.TimeoutError):
                # hung up or reset before we got to it; TLS: the handshake failed or was slow
                self._stats["tls_failures" if self._ssl else "client_gone"] += 1
                return
            if conn.transport is None:
                return
            if self._ssl is not None:
                conn.peer_cert = conn.transport.get_extra_info("peercert")
            while True:
                request = await self._read_request(conn)
                if request is None or not await self._answer(conn, request):
                    break
                if conn.h11.our_state is not h11.DONE or conn.h11.their_state is not h11.DONE:
                    break
                conn.h11.start_next_cycle()
            await self._close(conn)
        except asyncio.CancelledError:
            pass  # evicted, or the server stops: the connection goes either way
        except Exception as exc:  # a bug here: one line, and this connection only
            self._log("internal", f"http: connection from {conn.peer[0]} failed: "
                      f"{_describe(exc)}")
        finally:
            self._forget(conn)
            if conn.transport is None:
                # Never connected, or cancelled in the TLS handshake: asyncio has taken the
                # socket off its selector already, so closing it here is safe.
                conn.sock.close()
            conn.abort()
            conn.task = None  # no cycle left for the garbage collector to find

    async def _read_request(self, conn: _Conn) -> h11.Request | None:
        """The next request head, within header_timeout; None: close the connection."""
        self._set_idle(conn)
        deadline = conn.loop.time() + self._header_timeout
        h = conn.h11
        while True:
            try:
                event = h.next_event()
            except h11.RemoteProtocolError as exc:
                if conn.eof_fed:  # hung up mid-head: nobody to answer
                    self._stats["client_gone"] += 1
                    return None
                self._stats["bad_requests"] += 1
                status = exc.error_status_hint
                message = "request head too large" if status == 431 else "bad request"
                await self._fail(conn, status, message)
                return None
            if isinstance(event, h11.Request):
                return event
            if event is not h11.NEED_DATA:  # ConnectionClosed: a clean close between requests
                return None
            while not conn.buf and not conn.eof and not conn.lost:
                if conn.loop.time() >= deadline:
                    self._stats["header_timeouts"] += 1
                    return None
                await conn.wait(deadline)
            if conn.buf:
                # Feed h11 no more than one byte past the limit, so that a whole oversized
                # head arriving in one read is refused too (h11 checks only incomplete ones).
                buffered = len(h.trailing_data[0])
                h.receive_data(conn.take(max(1, _MAX_HEAD + 1 - buffered)))
            elif conn.lost:
                if h.trailing_data[0]:
                    self._stats["client_gone"] += 1
                return None
            else:
                conn.eof_fed = True
                h.receive_data(b"")

    async def _answer(self, conn: _Conn, event: h11.Request) -> bool:
        """Answer one request; False: close the connection afterwards."""
        self._set_busy(conn)
        self._stats["requests"] += 1
        method = event.method.decode("ascii", "replace")
        head = method == "HEAD"
        if _has_body(event):
            self._stats["bad_requests"] += 1
            await self._fail(conn, 413, "a request body is not accepted", head=head)
            return False
        try:
            end = conn.h11.next_event()  # a request without a body ends at once
        except h11.RemoteProtocolError:
            end = None
        if not isinstance(end, h11.EndOfMessage):
            self._stats["bad_requests"] += 1
            await self._fail(conn, 400, "bad request", head=head)
            return False
        if method not in ("GET", "HEAD"):
            self._stats["bad_requests"] += 1
            return await self._error(conn, 405, "method not allowed", head=head,
                                     extra=(("Allow", "GET, HEAD"),))
        target = _parse_target(event.target)
        if target is None:
            self._stats["bad_requests"] += 1
            await self._fail(conn, 400, "bad request target", head=head)
            return False
        if self._in_handler >= self._max_waiting:
            self._stats["busy"] += 1
            return await self._error(conn, 503, "busy", head=head,
                                     extra=(("Retry-After", "1"),))
        request = Request(method, target[0], target[1], conn.peer, conn.peer_cert)
        self._in_handler += 1
        try:
            response = await self._handler(request)
            extra = _checked(response)
            head_event = self._head(response.status, len(response.body),
                                    response.content_type, extra)
        except Exception as exc:  # the handler's bug: 500, one line, this connection only
            self._stats["handler_errors"] += 1
            self._log("handler", f"http: handler failed on {method} {_clip(target[0])}: "
                      f"{_describe(exc)}")
            if not conn.lost:
                await self._send(conn, self._head(500, len(_INTERNAL), _JSON, close=True),
                                 _INTERNAL, head)
            return False
        finally:
            self._in_handler -= 1
        return await self._send(conn, head_event, response.body, head)

    async def _error(self, conn: _Conn, status: int, message: str, *, head: bool,
                     extra: tuple[tuple[str, str], ...] = ()) -> bool:
        body = _error_body(message)
        return await self._send(conn, self._head(status, len(body), _JSON, extra), body, head)

    async def _fail(self, conn: _Conn, status: int, message: str, *,
                    head: bool = False) -> None:
        """Answer an error, then close (what the client sent next cannot be trusted)."""
        body = _error_body(message)
        if await self._send(conn, self._head(status, len(body), _JSON, close=True), body, head):
            await self._linger(conn)

    def _head(self, status: int, length: int, content_type: str,
              extra: tuple[tuple[str, str], ...] = (), *, close: bool = False) -> h11.Response:
        """Raises h11.LocalProtocolError or ValueError for what cannot be sent."""
        if not 200 <= status <= 599:
            raise ValueError(f"status {status} out of range")
        headers = [(b"Server", self._server_name), (b"Date", _http_date(int(time.time()))),
                   (b"Content-Type", content_type.encode("ascii"))]
        if status in (204, 304):
            if length:
                raise ValueError(f"status {status} with a body")
        else:
            headers.append((b"Content-Length", str(length).encode()))
        headers.append((b"Cache-Control", b"no-store"))
        headers.extend((k.encode("ascii"), v.encode("ascii")) for k, v in extra)
        if close:
            headers.append((b"Connection", b"close"))
        return h11.Response(status_code=status, headers=headers, reason=_reason(status))

    async def _send(self, conn: _Conn, event: h11.Response, body: bytes, head: bool) -> bool:
        """Write a whole response within write_timeout; False: the connection is done."""
        h = conn.h11
        try:
            parts = [h.send(event) or b""]
            if body and not head and event.status_code not in (204, 304):
                parts.append(h.send(h11.Data(data=body)) or b"")
            parts.append(h.send(h11.EndOfMessage()) or b"")
        except h11.LocalProtocolError:  # h11 cannot send here (a protocol error came first)
            return False
        transport = conn.transport
        if conn.lost or transport is None or transport.is_closing():
            self._stats["client_gone"] += 1
            return False
        transport.write(b"".join(parts))
        deadline = conn.loop.time() + self._write_timeout
        while conn.write_paused and not conn.lost:
            if conn.loop.time() >= deadline:
                self._stats["write_timeouts"] += 1
                conn.abort()  # what it has not taken will not go out either
                return False
            await conn.wait(deadline)
        if conn.lost:
            self._stats["client_gone"] += 1
            return False
        return True

    async def _linger(self, conn: _Conn) -> None:
        """After refusing a request, read and drop what the client still sends, for a
        moment: closing with unread data makes the kernel send a reset, which may
        destroy our answer before the client reads it."""
        transport = conn.transport
        if transport is None or conn.lost or not transport.can_write_eof():
            return
        self._set_idle(conn)
        try:
            transport.write_eof()  # shutdown(SHUT_WR) itself, when nothing is buffered
        except OSError:  # reset meanwhile
            self._stats["client_gone"] += 1
            conn.abort()
            return
        deadline = conn.loop.time() + min(_LINGER, self._header_timeout)
        dropped = 0
        while not conn.eof and not conn.lost and dropped < _LINGER_BYTES:
            dropped += len(conn.take(_READ_LIMIT))
            if conn.loop.time() >= deadline:
                break
            if not conn.buf:
                await conn.wait(deadline)

    async def _close(self, conn: _Conn) -> None:
        """Close after what is buffered went out, or drop the client after write_timeout."""
        transport = conn.transport
        if transport is None or conn.lost:
            return
        self._set_idle(conn)
        transport.close()
        deadline = conn.loop.time() + self._write_timeout
        while not conn.lost:
            if conn.loop.time() >= deadline:
                self._stats["write_timeouts"] += 1
                transport.abort()
                return
            await conn.wait(deadline)

    # setup
    def _fd_cap(self) -> int:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self._max_connections
        return max(1, min(self._max_connections, soft - _FD_RESERVE))

    def _bind(self) -> socket.socket:
        try:
            infos = socket.getaddrinfo(self._host or None, self._port,
                                       type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except UnicodeError as exc:  # a name the IDNA codec refuses
            raise OSError(f"cannot resolve {self._host!r}: {exc}") from exc
        if not infos:
            raise OSError(f"cannot resolve {self._host!r}")
        family, kind, proto, _, sockaddr = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and self._host == "::":
                # "::" means every address, IPv4 too, whatever the sysctl default says.
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(sockaddr)
            sock.listen(self._backlog)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock


_INTERNAL = json.dumps({"error": "internal error"}).encode()


@lru_cache(maxsize=1)
def _http_date(second: int) -> bytes:
    """The Date header's value, made once a second however many answers go out."""
    return formatdate(second, usegmt=True).encode()


def _error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def _reason(status: int) -> bytes:
    try:
        return http.HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b""


def _has_body(event: h11.Request) -> bool:
    for name, value in event.headers:
        if name == b"transfer-encoding":
            return True
        if name == b"content-length" and int(value) > 0:  # h11 checked it is digits
            return True
    return False


def _parse_target(target: bytes) -> tuple[str, tuple[tuple[str, str], ...]] | None:
    """(path, query) of an origin-form or absolute-form target, None if neither or
    if the query has too many fields."""
    text = target.decode("latin-1")  # h11 lets only visible ASCII through
    if text.startswith("/"):
        path, _, query = text.partition("?")
    elif text[:7].lower() == "http://" or text[:8].lower() == "https://":
        parts = urlsplit(text)
        path, query = parts.path or "/", parts.query
    else:
        return None
    try:
        pairs = parse_qsl(query, keep_blank_values=True, max_num_fields=_MAX_QUERY_PAIRS)
    except ValueError:
        return None
    return path, tuple(pairs)


def _checked(response: Response) -> tuple[tuple[str, str], ...]:
    if not isinstance(response, Response) or not isinstance(response.body, bytes):
        raise TypeError(f"handler returned {type(response).__name__}, not a Response "
                        "with a bytes body")
    for name, _ in response.headers:
        if name.lower() in _RESERVED:
            raise ValueError(f"handler set the {name} header, which the server sets")
    return response.headers


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _one_line(text: str) -> str:
    return _clip(" ".join(text.split()), 300)


def _describe(exc: BaseException) -> str:
    """`Type: message (at file:line)`: enough to find the bug, in one log line."""
    where = ""
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        where = f" (at {frames[-1].filename}:{frames[-1].lineno})"
    return f"{type(exc).__name__}: {_one_line(str(exc))}{where}"


__all__ = ["Changes", "Handler", "HttpServer", "Request", "Response"]
