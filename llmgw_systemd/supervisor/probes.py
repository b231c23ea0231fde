"""HTTP health probes of serving ranks (an I/O shell; the verdict is health's)."""

from __future__ import annotations

import http.client
import json
import time

from llmgw_systemd.health.rules import NO_ANSWER, Probe

BODY_MAX = 65536  # bytes of an answer read; more is not a health answer


def _request(host: str, port: int, method: str, path: str, timeout: float,
             body: bytes | None = None, limit: int = BODY_MAX
             ) -> tuple[int, bytes, float] | Probe:
    """One request within timeout: (status, body, milliseconds), or why it failed."""
    started = time.monotonic()
    headers = {"User-Agent": "llmgw-supervisor"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        raw = response.read(limit + 1)
    except TimeoutError:
        return Probe(False, f"{NO_ANSWER} {timeout:g} s")
    except OSError as exc:
        return Probe(False, exc.strerror or str(exc) or type(exc).__name__)
    except http.client.HTTPException as exc:
        return Probe(False, f"bad HTTP answer: {type(exc).__name__}")
    finally:
        conn.close()
    return response.status, raw, (time.monotonic() - started) * 1000


def http_probe(host: str, port: int, path: str, timeout: float) -> Probe:
    """GET path; ok only on HTTP 200 within timeout (a hung server is not healthy)."""
    answer = _request(host, port, "GET", path, timeout)
    if isinstance(answer, Probe):
        return answer
    status, _, took = answer
    if status != 200:
        return Probe(False, f"HTTP {status} in {took:.0f} ms")
    return Probe(True, f"HTTP 200 in {took:.0f} ms")


def completion_probe(host: str, port: int, model: str | None, timeout: float) -> Probe:
    """POST a one-token completion; ok only on HTTP 200 with a choice within timeout
    (the whole request: a server that accepts and then stalls is not generating). With
    no model (engine: command) the request names none: the server serves its own."""
    request: dict[str, object] = {"prompt": "ping", "max_tokens": 1, "temperature": 0}
    if model is not None:
        request = {"model": model, **request}
    body = json.dumps(request).encode()
    answer = _request(host, port, "POST", "/v1/completions", timeout, body)
    if isinstance(answer, Probe):
        return answer
    status, raw, took = answer
    if took > timeout * 1000:
        return Probe(False, f"{NO_ANSWER} {timeout:g} s")
    if status != 200:
        return Probe(False, f"HTTP {status} in {took:.0f} ms")
    try:
        choices = json.loads(raw)["choices"] if len(raw) <= BODY_MAX else None
    except (ValueError, TypeError, KeyError):
        choices = None
    if not isinstance(choices, list) or not choices:
        return Probe(False, f"HTTP 200 without a completion in {took:.0f} ms")
    return Probe(True, f"answered in {took:.0f} ms")


METRICS_MAX = 4 * 1024 * 1024  # bytes of a metrics page (engine_metrics.MAX_METRICS_BYTES)


def metrics_fetch(host: str, port: int, path: str, timeout: float) -> str | Probe:
    """GET the engine's metrics page: its text, or why not (a Probe that failed)."""
    answer = _request(host, port, "GET", path, timeout, limit=METRICS_MAX)
    if isinstance(answer, Probe):
        return answer
    status, raw, took = answer
    if took > timeout * 1000:  # a slow drip of bytes is no answer either
        return Probe(False, f"{NO_ANSWER} {timeout:g} s")
    if status != 200:
        return Probe(False, f"HTTP {status} in {took:.0f} ms")
    if len(raw) > METRICS_MAX:
        return Probe(False, f"metrics page over {METRICS_MAX // 1024} KiB")
    return raw.decode("utf-8", "replace")
