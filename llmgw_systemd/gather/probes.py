"""HTTP probes of serving ranks (an I/O shell; the verdict is health's).

Each probe is one request on a connection of its own, bounded as a whole by its timeout
(a server that drips its answer a byte at a time gets no fresh timeout per byte), parsed
by h11. The daemon awaits them on its event loop; `llmgw-systemd status` calls
http_probe, which runs one on an event loop of its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import h11

from llmgw_systemd.health.rules import NO_ANSWER, Probe

BODY_MAX = 65536  # bytes of an answer read; more is not a health answer
METRICS_MAX = 4 * 1024 * 1024  # bytes of a metrics page (engine_metrics.MAX_METRICS_BYTES)
_HEAD_MAX = 16 * 1024  # status line and headers
_RECV = 65536
USER_AGENT = "llmgw-supervisor"


async def _request(host: str, port: int, method: str, path: str, timeout: float,
                   body: bytes | None = None, limit: int = BODY_MAX
                   ) -> tuple[int, bytes, float] | Probe:
    """One request within timeout: (status, body (at most limit + 1 bytes), milliseconds),
    or why it failed."""
    started = time.monotonic()
    try:
        status, raw = await asyncio.wait_for(
            _exchange(host, port, method, path, body, limit), timeout)
    except asyncio.TimeoutError:
        return Probe(False, f"{NO_ANSWER} {timeout:g} s")
    except OSError as exc:
        # asyncio says "Connect call failed (address)"; the errno says why
        reason = os.strerror(exc.errno) if exc.errno else (exc.strerror or str(exc))
        return Probe(False, reason or type(exc).__name__)
    except h11.ProtocolError as exc:
        return Probe(False, f"bad HTTP answer: {type(exc).__name__}")
    return status, raw, (time.monotonic() - started) * 1000


async def _exchange(host: str, port: int, method: str, path: str, body: bytes | None,
                    limit: int) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=_HEAD_MAX)
        shown = f"[{host}]" if ":" in host else host
        headers = [("Host", f"{shown}:{port}"), ("User-Agent", USER_AGENT),
                   ("Connection", "close")]
        if body is not None:
            headers += [("Content-Type", "application/json"),
                        ("Content-Length", str(len(body)))]
        out = conn.send(h11.Request(method=method, target=path, headers=headers)) or b""
        if body is not None:
            out += conn.send(h11.Data(data=body)) or b""
        out += conn.send(h11.EndOfMessage()) or b""
        writer.write(out)
        await writer.drain()
        status = 0
        raw = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(_RECV))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                raw += event.data
                if len(raw) > limit:
                    break  # enough to say it is too much
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
        if not status:
            raise h11.RemoteProtocolError("closed before a status line")
        return status, bytes(raw[:limit + 1])
    finally:
        writer.close()


async def probe_http(host: str, port: int, path: str, timeout: float) -> Probe:
    """GET path; ok only on HTTP 200 within timeout (a hung server is not healthy)."""
    answer = await _request(host, port, "GET", path, timeout)
    if isinstance(answer, Probe):
        return answer
    status, _, took = answer
    if status != 200:
        return Probe(False, f"HTTP {status} in {took:.0f} ms")
    return Probe(True, f"HTTP 200 in {took:.0f} ms")


def http_probe(host: str, port: int, path: str, timeout: float) -> Probe:
    """probe_http for a caller without an event loop."""
    return asyncio.run(probe_http(host, port, path, timeout))


async def probe_completion(host: str, port: int, model: str | None, timeout: float
                           ) -> Probe:
    """POST a one-token completion; ok only on HTTP 200 with a choice within timeout
    (the whole request: a server that accepts and then stalls is not generating). With
    no model (engine: command) the request names none: the server serves its own."""
    request: dict[str, object] = {"prompt": "ping", "max_tokens": 1, "temperature": 0}
    if model is not None:
        request = {"model": model, **request}
    body = json.dumps(request).encode()
    answer = await _request(host, port, "POST", "/v1/completions", timeout, body)
    if isinstance(answer, Probe):
        return answer
    status, raw, took = answer
    if status != 200:
        return Probe(False, f"HTTP {status} in {took:.0f} ms")
    try:
        choices = json.loads(raw)["choices"] if len(raw) <= BODY_MAX else None
    except (ValueError, TypeError, KeyError):
        choices = None
    if not isinstance(choices, list) or not choices:
        return Probe(False, f"HTTP 200 without a completion in {took:.0f} ms")
    return Probe(True, f"answered in {took:.0f} ms")


async def fetch_metrics(host: str, port: int, path: str, timeout: float) -> str | Probe:
    """GET the engine's metrics page: its text, or why not (a Probe that failed)."""
    answer = await _request(host, port, "GET", path, timeout, limit=METRICS_MAX)
    if isinstance(answer, Probe):
        return answer
    status, raw, took = answer
    if status != 200:
        return Probe(False, f"HTTP {status} in {took:.0f} ms")
    if len(raw) > METRICS_MAX:
        return Probe(False, f"metrics page over {METRICS_MAX // 1024} KiB")
    return raw.decode("utf-8", "replace")
