"""One log line per kind per interval, however often it happens (the supervisor's peer
failures, the HTTP server's errors): the rest are counted and said with the next line.
Thread-safe; the kinds kept are bounded."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

MAX_KINDS = 1000  # kinds come from the spec and the code, but stay bounded regardless


class RateLimitedLog:
    def __init__(self, log: Callable[[str], None], interval: float = 30.0) -> None:
        self._log = log
        self._interval = interval
        self._last: dict[str, tuple[float, int]] = {}  # kind -> (logged at, left out since)
        self._lock = threading.Lock()

    def __call__(self, kind: str, message: str) -> None:
        said = self.allow(kind)
        if said is None:
            return
        with contextlib.suppress(Exception):  # a broken log sink must not stop the caller
            self._log(message + said)

    def allow(self, kind: str) -> str | None:
        """None when this kind was said within the interval (counted, not said); else
        what to add to its message: how many were left out since, or ""."""
        now = time.monotonic()
        with self._lock:
            at, left_out = self._last.get(kind, (-1e18, 0))
            if now - at < self._interval:
                self._last[kind] = (at, left_out + 1)
                return None
            if len(self._last) >= MAX_KINDS:
                self._last.clear()
            self._last[kind] = (now, 0)
        return f" ({left_out} more like this not logged)" if left_out else ""
