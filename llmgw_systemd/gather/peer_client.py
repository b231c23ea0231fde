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

A PeerSession (asyncio) keeps its connection between requests: the daemon's long-polls
to a peer cost requests, not TCP and TLS handshakes, and when the connection must be made
again (the peer restarted, closed it, or an exchange failed) the last TLS session is
resumed. TLS runs through an ssl.SSLObject over memory buffers, the only way Python
offers to resume a session on an asyncio socket. A connection is reused only after a
complete, successful exchange; any failure closes it. fetch_shards is a
one-shot wrapper for callers without an event loop.

Every failure is one PeerError (errors.py) whose `kind` is one of PEER_FAILURES (the daemon counts
them by kind) and whose message is one line naming the peer (the daemon logs it,
rate-limited). No other exception escapes a fetch; only wrong arguments (a caller's bug,
not a peer's fault) raise ValueError.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import json
import math
import os
import re
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, TypeVar, cast

import h11

from llmgw_systemd.errors import PeerError, one_line
from llmgw_systemd.gather.wire import (
    SHARDS_PATH,
    ShardReport,
    decode,
    parse_answer,
    wire_reader,
)

USER_AGENT = "llmgw-supervisor"
MAX_HEADER_BYTES = 16 * 1024  # status line plus headers; a real peer sends a few hundred
RECV_SIZE = 64 * 1024
READING = "reading the body"
WAITING = "waiting for the status and headers"

T = TypeVar("T")


@dataclass(frozen=True)
class PeerAnswer:
    """A peer's whole answer: who it says it is, its report version and its shards."""

    node: str
    version: int
    shards: tuple[ShardReport, ...]
    peer_cert: dict[str, Any] | None  # the server's getpeercert() over TLS, else None


class PeerSession:
    """One peer supervisor at host:port, over one connection kept between requests.

    With `ssl_context`, over TLS, the certificate checked against `server_hostname`
    (default: host); an answer's `peer_cert` is the certificate of the connection it came
    on. Not for concurrent use: one request at a time. close() when done."""

    def __init__(self, host: str, port: int, *, ssl_context: ssl.SSLContext | None = None,
                 server_hostname: str | None = None, max_bytes: int = 1 << 20,
                 clock: Callable[[], float] = time.monotonic, keep: bool = True) -> None:
        _check_arguments(host, port, 1.0, None, 0.0, max_bytes)
        self.host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        self.port = port
        self.where = f"[{self.host}]:{port}" if ":" in self.host else f"{self.host}:{port}"
        self.ssl_context = ssl_context
        self.server_hostname = server_hostname or self.host
        self.max_bytes = max_bytes
        self.clock = clock
        self.keep = keep  # False: `Connection: close`, one request per connection
        self.handshakes = 0  # TLS handshakes made, and of them how many resumed a session
        self.resumed = 0
        self._channel: _Channel | None = None
        self._tls_session: ssl.SSLSession | None = None

    async def fetch_shards(self, *, deadline: float, after: int | None = None,
                           wait: float = 0.0) -> PeerAnswer:
        """GET /v1/shards within `deadline` seconds in all. With `after`, a long-poll: the
        peer answers as soon as its version exceeds `after`, or after `wait` seconds;
        `deadline` must then exceed `wait` (by a margin for the network)."""
        _check_arguments(self.host, self.port, deadline, after, wait, self.max_bytes)
        target = (SHARDS_PATH if after is None
                  else f"{SHARDS_PATH}?after={after}&wait={_seconds(wait)}")
        body, peer_cert = await self._request(target, deadline)
        try:
            node, version, shards = parse_answer(wire_reader(self.where),
                                                 decode(self.where, body))
        except PeerError:
            self.close()  # a peer that sent that is not asked again on this connection
            raise
        return PeerAnswer(node, version, shards, peer_cert)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    async def _request(self, target: str, deadline: float
                       ) -> tuple[bytes, dict[str, Any] | None]:
        budget = _Budget(self.where, deadline, self.clock)
        try:
            if self._channel is not None:
                exchange = _Exchange(self._channel, budget, self.keep)
                try:
                    return await self._finish(exchange, target)
                except PeerError as exc:
                    # A kept connection the peer closed while it was idle (its keep-alive
                    # timeout, a restart) fails before any answer: once more on a new one.
                    # A GET that got no answer byte can be sent again.
                    if exc.kind != "closed" or exchange.answered:
                        raise
                    self.close()
            self._channel = await self._open(budget)
            return await self._finish(_Exchange(self._channel, budget, self.keep), target)
        except BaseException:
            self.close()  # never reuse a connection in an unknown state
            raise

    async def _finish(self, exchange: _Exchange, target: str
                      ) -> tuple[bytes, dict[str, Any] | None]:
        body, reusable = await exchange.run(target, self.max_bytes)
        channel = exchange.channel
        if channel.tls is not None and not channel.session_kept:
            # TLS 1.3 tickets arrive after the handshake, with the first answer. Read once
            # per connection: each read of `session` copies it out of OpenSSL, and was a
            # third of an idle supervisor's CPU at 64 peers (bench/scale.py, py-spy).
            session = channel.tls.session
            if session is not None:
                self._tls_session, channel.session_kept = session, True
        if not (self.keep and reusable):
            self.close()
        return body, channel.peer_cert

    async def _open(self, budget: _Budget) -> _Channel:
        sock = await _connect(self.host, self.port, budget)
        if self.ssl_context is None:
            return await _Channel.open(sock, budget.where)
        budget.phase = "in the TLS handshake"
        try:
            channel = await _Channel.open(sock, budget.where, self.ssl_context,
                                          self.server_hostname, self._tls_session)
        except (ssl.SSLError, ValueError) as exc:
            raise PeerError("tls", f"TLS with {self.where}: {_describe(exc)}") from None
        try:
            await channel.handshake(budget)
        except BaseException:
            channel.close()
            raise
        self.handshakes += 1
        self.resumed += bool(channel.tls is not None and channel.tls.session_reused)
        return channel


def fetch_shards(host: str, port: int, *, deadline: float, after: int | None = None,
                 wait: float = 0.0, ssl_context: ssl.SSLContext | None = None,
                 server_hostname: str | None = None, max_bytes: int = 1 << 20,
                 clock: Callable[[], float] = time.monotonic) -> PeerAnswer:
    """One GET /v1/shards on a connection of its own (PeerSession.fetch_shards), for a
    caller without an event loop. Raises PeerError on any failure of the peer or the
    network; ValueError on arguments out of range (the session checks them)."""
    session = PeerSession(host, port, ssl_context=ssl_context,
                          server_hostname=server_hostname, max_bytes=max_bytes, clock=clock,
                          keep=False)
    return run_once(session, session.fetch_shards(deadline=deadline, after=after, wait=wait))


def run_once(session: PeerSession, request: Coroutine[Any, Any, T]) -> T:
    """Run one request of `session` on an event loop of its own, then close it."""
    async def once() -> T:
        try:
            return await request
        finally:
            session.close()  # on the loop: the transport closes before the loop does

    try:
        return asyncio.run(once())
    finally:
        session.close()


# -- the exchange ------------------------------------------------------------------------


class _Budget:
    """One request's time, every step paid from it; out of it is a timeout naming the
    phase it ran out in."""

    def __init__(self, where: str, deadline: float, clock: Callable[[], float]) -> None:
        self.where = where
        self.deadline = deadline
        self.clock = clock
        self.ends = clock() + deadline
        self.phase = "resolving the name"

    def remaining(self) -> float:
        left = self.ends - self.clock()
        if left <= 0:
            self.timed_out()
        return left

    def timed_out(self) -> NoReturn:
        raise PeerError("timeout", f"{self.where}: no complete answer within "
                        f"{self.deadline:g} s (ran out while {self.phase})")

    async def wait(self, step: Awaitable[T]) -> T:
        """One step, waiting at most what is left: a peer that answers a byte at a time
        gets no fresh timeout per byte."""
        try:
            left = self.remaining()
        except PeerError:
            if isinstance(step, Coroutine):
                step.close()  # never started: nothing to wait for
            raise
        try:
            return await asyncio.wait_for(step, left)
        except asyncio.TimeoutError:
            self.timed_out()


async def _connect(host: str, port: int, budget: _Budget) -> socket.socket:
    addresses = await _resolve(host, port, budget)
    budget.phase = "connecting"
    loop = asyncio.get_running_loop()
    error: OSError | None = None
    for family, kind, proto, _, address in addresses:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            await budget.wait(loop.sock_connect(sock, address))
        except OSError as exc:
            sock.close()
            # asyncio says "Connect call failed (address)"; the errno says why
            error = OSError(exc.errno, os.strerror(exc.errno)) if exc.errno else exc
            continue
        except BaseException:
            sock.close()
            raise
        return sock
    raise PeerError("connect", f"cannot connect to {budget.where}: {_describe(error)}",
                    refused=error is not None and error.errno == errno.ECONNREFUSED)


async def _resolve(host: str, port: int, budget: _Budget) -> list[tuple[Any, ...]]:
    """getaddrinfo within the budget. An address literal (the usual peer) resolves at
    once; a name is looked up in a helper thread, because getaddrinfo cannot be
    interrupted and may sit in the resolver's own retries for tens of seconds. A lookup
    that outlives the budget is abandoned to finish on its own (daemon thread)."""
    budget.remaining()
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        pass
    else:
        try:
            return list(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                           flags=socket.AI_NUMERICHOST))
        except (OSError, UnicodeError) as exc:
            raise PeerError("connect", f"cannot resolve {budget.where}: "
                            f"{_describe(exc)}") from None
    loop = asyncio.get_running_loop()
    done: asyncio.Future[tuple[list[tuple[Any, ...]], BaseException | None]] = \
        loop.create_future()

    def settle(outcome: tuple[list[tuple[Any, ...]], BaseException | None]) -> None:
        if not done.done():
            done.set_result(outcome)

    def lookup() -> None:
        try:
            outcome: tuple[list[tuple[Any, ...]], BaseException | None] = (
                list(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)), None)
        except BaseException as exc:  # handed over to the caller's task
            outcome = ([], exc)
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(target=lookup, name=f"resolve {host}", daemon=True).start()
    result, failure = await budget.wait(done)
    if failure is not None or not result:
        reason = _describe(failure) if failure is not None else "no address"
        raise PeerError("connect", f"cannot resolve {budget.where}: {reason}")
    return result


class _Stream(asyncio.Protocol):
    """A connection's incoming bytes as they arrive. Reading stays registered with the
    loop for the connection's life: a kept connection costs no epoll change and no
    failed recv() per read (sock_recv spent three syscalls on each; bench/scale.py)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.ended = False  # the peer closed, or the connection was lost
        self.error: Exception | None = None
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) >= RECV_SIZE and not self._paused and self.transport is not None:
            # nobody reads it now: what the peer sends beyond this waits in the kernel
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.ended = True
        self._wake()
        return False  # close: we never send after the peer stopped

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self.error = exc
        self._wake()

    def take(self) -> bytes:
        data = bytes(self.buf)
        self.buf.clear()
        if self._paused and not self.ended and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def arrival(self, budget: _Budget) -> None:
        """Until bytes or the end arrive, within the budget."""
        while not self.buf and not self.ended:
            fut: asyncio.Future[None] = self.loop.create_future()
            self._waiter = fut
            timer = self.loop.call_later(budget.remaining(), _settle, fut)
            try:
                await fut
            finally:
                timer.cancel()
                self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None:
            _settle(self._waiter)


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _Channel:
    """A connected socket, under TLS through an SSLObject over memory buffers when given
    a context (resuming `session` if one is given). Built by open()."""

    def __init__(self, sock: socket.socket, stream: _Stream, where: str,
                 context: ssl.SSLContext | None = None, server_hostname: str = "",
                 session: ssl.SSLSession | None = None) -> None:
        self.sock = sock
        self.stream = stream
        self.where = where
        self.server_hostname = server_hostname
        self.peer_cert: dict[str, Any] | None = None
        self.session_kept = False  # its TLS session saved for the next connection
        self.http: h11.Connection | None = None  # its HTTP state, kept between requests
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self.tls = (context.wrap_bio(self._incoming, self._outgoing,
                                     server_hostname=server_hostname, session=session)
                    if context is not None else None)

    @classmethod
    async def open(cls, sock: socket.socket, where: str,
                   context: ssl.SSLContext | None = None, server_hostname: str = "",
                   session: ssl.SSLSession | None = None) -> _Channel:
        """Raises ssl.SSLError or ValueError for a context that cannot wrap (the socket
        is then closed)."""
        loop = asyncio.get_running_loop()
        stream = _Stream(loop)
        try:
            channel = cls(sock, stream, where, context, server_hostname, session)
            await loop.create_connection(lambda: stream, sock=sock)
        except BaseException:
            sock.close()
            raise
        return channel

    def close(self) -> None:
        # no TLS close_notify: it would wait on the peer, and we are done with it
        transport = self.stream.transport
        if transport is None or self.stream.loop.is_closed():
            self.sock.close()
        else:
            transport.abort()

    async def handshake(self, budget: _Budget) -> None:
        tls = self.tls
        if tls is None:
            return
        try:
            while True:
                try:
                    tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    self._flush()
                    await self._fill(budget)
            self._flush()
            cert = tls.getpeercert()
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            raise PeerError("tls", f"TLS handshake with {self.where} (as "
                            f"{self.server_hostname}) failed: {_describe(exc)}") from None
        self.peer_cert = dict(cert) if cert is not None else None

    async def send(self, data: bytes, budget: _Budget) -> None:
        """Hands `data` to the transport, which writes at once what the socket takes;
        a request is a few hundred bytes, so nothing waits here."""
        try:
            if self.tls is None:
                self._write(data)
                return
            self.tls.write(data)
            self._flush()
        except OSError as exc:
            raise self._failed(exc, budget) from None

    async def recv(self, budget: _Budget) -> bytes:
        """Some bytes of the answer; b"" once the peer closed the connection."""
        try:
            if self.tls is None:
                await self.stream.arrival(budget)
                return self._take()
            while True:
                try:
                    return self.tls.read(RECV_SIZE)
                except ssl.SSLWantReadError:
                    self._flush()
                    await self._fill(budget)
                except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                    return b""  # closed, with or without close_notify: the end either way
        except OSError as exc:
            raise self._failed(exc, budget) from None

    def _failed(self, exc: OSError, budget: _Budget) -> PeerError:
        if isinstance(exc, ssl.SSLError):
            return PeerError("tls", f"TLS with {self.where} failed while {budget.phase}: "
                             f"{_describe(exc)}")
        # A reset before any answer is the node's kernel too: its supervisor went away
        # with our request queued (a stop, a restart), as good as a refusal.
        return PeerError("closed", f"connection to {self.where} lost while {budget.phase}: "
                         f"{_describe(exc)}",
                         refused=exc.errno == errno.ECONNRESET and budget.phase != READING)

    def _take(self) -> bytes:
        data = self.stream.take()
        error = self.stream.error
        if not data and error is not None:
            raise error if isinstance(error, OSError) else OSError(str(error))
        return data

    async def _fill(self, budget: _Budget) -> None:
        await self.stream.arrival(budget)
        data = self._take()
        if data:
            self._incoming.write(data)
        else:
            self._incoming.write_eof()

    def _flush(self) -> None:
        data = self._outgoing.read()
        if data:
            self._write(data)

    def _write(self, data: bytes) -> None:
        transport = self.stream.transport
        if transport is None or transport.is_closing():
            error = self.stream.error
            raise error if isinstance(error, OSError) else ConnectionResetError(
                "the connection is closed")
        transport.write(data)


class _Exchange:
    """One request and its answer on a channel (h11)."""

    def __init__(self, channel: _Channel, budget: _Budget, keep: bool) -> None:
        self.channel = channel
        self.budget = budget
        self.keep = keep
        self.answered = False  # a byte of the answer arrived
        self.where = budget.where

    async def run(self, target: str, max_bytes: int) -> tuple[bytes, bool]:
        """The answer's body, and whether the connection may carry another request."""
        budget, channel = self.budget, self.channel
        conn = channel.http
        if conn is None:
            conn = channel.http = h11.Connection(h11.CLIENT,
                                                 max_incomplete_event_size=MAX_HEADER_BYTES)
        else:  # reused only after a complete exchange (PeerSession._finish)
            conn.start_next_cycle()
        headers = [("Host", self.where), ("User-Agent", USER_AGENT),
                   ("Accept", "application/json")]
        if not self.keep:
            headers.append(("Connection", "close"))
        request = conn.send(h11.Request(method="GET", target=target, headers=headers))
        request = (request or b"") + (conn.send(h11.EndOfMessage()) or b"")
        budget.phase = "sending the request"
        await channel.send(request, budget)
        budget.phase = WAITING
        body = bytearray()
        closed = False
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                if closed:
                    got = (f" ({len(body)} body bytes received)" if budget.phase == READING
                           else self.refusal_hint())
                    raise PeerError("closed", f"{self.where} closed the connection while "
                                    f"{budget.phase}{got}") from None
                raise PeerError("malformed", f"{self.where}: not a valid HTTP answer: "
                                f"{_describe(exc)}") from None
            if event is h11.NEED_DATA:
                data = await channel.recv(budget)
                self.answered = self.answered or bool(data)
                closed = not data
                conn.receive_data(data)
            elif isinstance(event, h11.InformationalResponse):
                continue  # 1xx: the real status follows
            elif isinstance(event, h11.Response):
                self.check_status(event, max_bytes)
                budget.phase = READING
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > max_bytes:
                    raise PeerError("too-large", f"{self.where}: the answer exceeds "
                                    f"{max_bytes} bytes")
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body), (conn.our_state is h11.DONE
                                     and conn.their_state is h11.DONE)
            else:  # ConnectionClosed before a response, or PAUSED (never for a client)
                raise PeerError("closed", f"{self.where} closed the connection while "
                                f"{budget.phase}{self.refusal_hint()}")

    def refusal_hint(self) -> str:
        """Why a TLS peer closes before any answer, most likely: with TLS 1.3 the client's
        handshake ends before the server has checked the client's certificate, so a
        server that refuses it shows here, as a closed connection."""
        if self.channel.tls is None or self.budget.phase != WAITING:
            return ""
        return (" right after the TLS handshake: it does not accept this node's certificate "
                "(another CA?), or it restarted")

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
