"""Stand-in for a serving engine that publishes its progress as vLLM does (a step counter
and the requests running and waiting on /metrics, Prometheus text), for the stall and
busy tests of the supervisor. One "engine step" every 50 ms while work is pending.

    stepping_engine.py --port P [--host H]

- /health: 200 always, as vLLM's API server answers while a TP worker hangs;
- /v1/completions: queued as work; answered after --steps-per-answer steps;
- /metrics: stepping_steps_total, stepping_running, stepping_waiting;
- SIGUSR1 freezes the stepping loop (a worker stuck in a collective): /health stays 200,
  the pending work stays, no step runs, completions wait forever;
- SIGUSR2 toggles a saturating background load (six long requests that never end): the
  steps keep running but each completion waits behind them for --busy-wait seconds.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Engine:
    def __init__(self, steps_per_answer: int, busy_wait: float) -> None:
        self.lock = threading.Condition()
        self.steps = 0
        self.running = 0
        self.background = 0
        self.frozen = False
        self.steps_per_answer = steps_per_answer
        self.busy_wait = busy_wait

    def loop(self) -> None:
        while True:
            time.sleep(0.05)
            with self.lock:
                if not self.frozen and self.running + self.background > 0:
                    self.steps += 1
                    self.lock.notify_all()

    def complete(self) -> None:
        with self.lock:
            self.running += 1
            try:
                wait = self.busy_wait if self.background else 0.0
                until = self.steps + self.steps_per_answer
                deadline = time.monotonic() + wait
                while self.steps < until or time.monotonic() < deadline:
                    self.lock.wait(0.05)
            finally:
                self.running -= 1

    def metrics(self) -> bytes:
        with self.lock:
            running, waiting = self.running + self.background, 0
            steps = self.steps
        return (
            "# HELP stepping_steps_total engine steps\n# TYPE stepping_steps_total counter\n"
            f"stepping_steps_total{{model=\"m\"}} {steps}\n"
            "# HELP stepping_running requests running\n# TYPE stepping_running gauge\n"
            f"stepping_running{{model=\"m\"}} {running}\n"
            "# HELP stepping_waiting requests waiting\n# TYPE stepping_waiting gauge\n"
            f"stepping_waiting{{model=\"m\"}} {waiting}\n").encode()


class Handler(BaseHTTPRequestHandler):
    engine: Engine  # set in main()

    def _send(self, body: bytes, kind: str = "application/json") -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(b"")
        elif self.path == "/metrics":
            self._send(self.engine.metrics(), "text/plain; version=0.0.4")
        else:
            self.send_error(404)

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            self.send_error(404)
            return
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.engine.complete()
        self._send(json.dumps({"choices": [{"text": " ok", "index": 0}]}).encode())

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--steps-per-answer", type=int, default=3)
    parser.add_argument("--busy-wait", type=float, default=3.0)
    args = parser.parse_args()
    Handler.engine = Engine(args.steps_per_answer, args.busy_wait)
    serve(Handler.engine, Handler, args.host, args.port)


def serve(engine: Engine, handler: type[BaseHTTPRequestHandler], host: str, port: int
          ) -> None:
    """Step and serve until killed: SIGUSR1 freezes the steps, SIGUSR2 toggles a
    saturating background load (shared with the SGLang stand-in)."""
    def freeze(*_: object) -> None:
        engine.frozen = True
        print("frozen: no step from now on", flush=True)

    def busy(*_: object) -> None:
        engine.background = 0 if engine.background else 6
        print(f"background load: {engine.background} requests", flush=True)

    signal.signal(signal.SIGUSR1, freeze)
    signal.signal(signal.SIGUSR2, busy)
    threading.Thread(target=engine.loop, daemon=True).start()
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    print(f"serving HTTP on {host}:{port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
