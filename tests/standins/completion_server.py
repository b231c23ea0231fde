"""Stand-in for a serving engine that drains on SIGTERM, as vLLM does with
--shutdown-timeout: the drain tests' engine.

    completion_server.py --port P [--host H] [--delay SECONDS] [--slow-health SECONDS]

- POST /v1/completions: answered after --delay seconds with an OpenAI-style JSON body
  (`usage.completion_tokens` = the request's max_tokens);
- GET /health: 200 (after --slow-health seconds while SIGUSR2 has made it slow: a
  saturated engine's health endpoint, its requests and metrics answering on; a second
  SIGUSR2 makes it fast again);
- GET /metrics: completion_steps_total (one per answered request) and
  completion_running (requests in flight), for the spec's `progress`;
- SIGTERM: stops accepting at once (the listening socket is closed: a new connection is
  refused), finishes every request in flight, then exits 0. It prints
  `SIGTERM at MONOTONIC with N in flight` and `drained: exiting`, so a test can compare
  the moment with its own CLOCK_MONOTONIC (which every network namespace shares);
- SIGUSR1: exits 0 at once, dropping what it has (an engine that ended on its own, as
  vLLM's API server exits 0 after its engine core died).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Server(ThreadingHTTPServer):
    daemon_threads = False  # server_close() joins the request threads: the drain
    block_on_close = True

    def __init__(self, address: tuple[str, int], delay: float) -> None:
        super().__init__(address, Handler)
        self.delay = delay
        self.health_delay = 0.0  # SIGUSR2 toggles it with --slow-health
        self.lock = threading.Lock()
        self.running = 0
        self.steps = 0

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that hung up is no error of ours


class Handler(BaseHTTPRequestHandler):
    server: Server

    def _send(self, body: bytes, kind: str = "application/json") -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            time.sleep(self.server.health_delay)
            self._send(b"")
        elif self.path == "/metrics":
            with self.server.lock:
                running, steps = self.server.running, self.server.steps
            self._send((
                "# TYPE completion_steps_total counter\n"
                f"completion_steps_total {steps}\n"
                "# TYPE completion_running gauge\n"
                f"completion_running {running}\n").encode(), "text/plain; version=0.0.4")
        else:
            self.send_error(404)

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            self.send_error(404)
            return
        with self.server.lock:
            self.server.running += 1
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0")))
                              or b"{}")
            tokens = int(body.get("max_tokens", 16))
            time.sleep(self.server.delay)
            self._send(json.dumps({
                "object": "text_completion", "model": "stand-in",
                "choices": [{"index": 0, "text": " x" * tokens, "finish_reason": "length"}],
                "usage": {"completion_tokens": tokens}}).encode())
        finally:
            with self.server.lock:
                self.server.running -= 1
                self.server.steps += 1

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--delay", type=float, default=0.5)
    parser.add_argument("--slow-health", type=float, default=5.0)
    args = parser.parse_args()
    server = Server((args.host, args.port), args.delay)
    # The signals are blocked before any thread starts (threads inherit the mask) and taken
    # with sigwait(): with a Python handler, a SIGTERM the kernel hands to a request's
    # thread runs the handler only once the main thread next runs Python code, and a main
    # thread blocked in Event.wait() never did (a CI run: no drain, SIGKILL 22 s later).
    signals = {signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    loop = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    loop.start()
    print(f"serving HTTP on {args.host}:{args.port}", flush=True)
    while (taken := signal.sigwait(signals)) == signal.SIGUSR2:
        server.health_delay = 0.0 if server.health_delay else args.slow_health
        print(f"health answers after {server.health_delay:g} s", flush=True)
    if taken == signal.SIGUSR1:
        os._exit(0)
    with server.lock:
        running = server.running
    print(f"SIGTERM at {time.monotonic():.3f} with {running} in flight", flush=True)
    server.shutdown()  # no more accepts
    loop.join()
    server.server_close()  # closes the socket (refused from now on), joins the requests
    print(f"drained: exiting at {time.monotonic():.3f}", flush=True)


if __name__ == "__main__":
    main()
