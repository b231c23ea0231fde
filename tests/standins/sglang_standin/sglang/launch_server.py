"""Stand-in for SGLang 0.5.23's server, at its interface, for the tests that cannot run
SGLang (no GPU): `python -m sglang.launch_server` with PYTHONPATH at this package's
parent. What it copies from SGLang (sglang/srt/entrypoints/http_server.py,
observability/metrics_collector.py, scheduler_components/metrics_reporter.py):

- its arguments as rendered (--model-path, --host, --port, --tp-size, --nnodes,
  --node-rank, --dist-init-addr, --enable-metrics; others are taken and ignored: the
  real parser checks the rendered lines in tests/engines/test_engine_sglang_args.py);
- /health and /health_generate: 503 while starting; then a one-token request, answered
  200 as soon as the scheduler sent anything back after the check began (checked once a
  second), 503 after SGLANG_HEALTH_CHECK_TIMEOUT (20 s) without;
- /metrics only with --enable-metrics (404 without), its names and labels:
  sglang:realtime_tokens_total{mode=prefill_compute|decode} (every prefill the
  scheduler runs, every decode step), sglang:num_running_reqs and sglang:num_queue_reqs
  (gauges, true when idle);
- /v1/completions and /v1/models; ranks >= 1 serve no HTTP.

The stepping engine is tests/standins/stepping_engine.py's (one step every 50 ms while
work is pending); SIGUSR1 freezes the scheduler (no step, no gauge update), SIGUSR2
toggles a saturating background load."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/standins
from stepping_engine import Engine, serve

HEALTH_CHECK_TIMEOUT = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))
LABELS = 'engine_type="unified",model_name="{model}",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
PROMPT_TOKENS = 4


class Sglang(Engine):
    """The stepping engine, counted as SGLang counts: prefill tokens when the scheduler
    runs the prefill, decode tokens per step (one per running request); gauges set at
    each step, so a frozen scheduler leaves them as they were."""

    def __init__(self, model: str) -> None:
        super().__init__(steps_per_answer=3, busy_wait=4.0)
        self.model = model
        self.prefill = 0
        self.admitted = 0  # prompt tokens queued, not yet prefilled
        self.decode = 0
        self.gauges = (0, 0)
        self.last_output = 0.0  # monotonic time the scheduler last sent something back

    def loop(self) -> None:
        while True:
            time.sleep(0.05)
            with self.lock:
                if self.frozen:
                    continue
                work = self.running + self.background
                # a prefill counts when the scheduler runs it, not when it is queued
                self.prefill += self.admitted
                self.admitted = 0
                if work > 0:
                    self.steps += 1
                    self.decode += work
                    self.last_output = time.monotonic()
                    self.lock.notify_all()
                self.gauges = (work, 0)

    def complete(self) -> None:
        with self.lock:
            self.admitted += PROMPT_TOKENS
        super().complete()

    def health(self) -> int:
        """SGLang's health_generate: a one-token request, 200 once anything came back."""
        asked = time.monotonic()
        threading.Thread(target=self.complete, daemon=True).start()
        while time.monotonic() < asked + HEALTH_CHECK_TIMEOUT:
            time.sleep(1)
            if self.last_output > asked:
                return 200
        return 503

    def metrics(self) -> bytes:
        with self.lock:
            prefill, decode, (running, queued) = self.prefill, self.decode, self.gauges
        labels = LABELS.format(model=self.model)
        return (
            "# HELP sglang:num_running_reqs The number of running requests.\n"
            "# TYPE sglang:num_running_reqs gauge\n"
            f"sglang:num_running_reqs{{{labels}}} {float(running)}\n"
            "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.\n"
            "# TYPE sglang:num_queue_reqs gauge\n"
            f"sglang:num_queue_reqs{{{labels}}} {float(queued)}\n"
            "# HELP sglang:realtime_tokens_total Total number of tokens processed.\n"
            "# TYPE sglang:realtime_tokens_total counter\n"
            f'sglang:realtime_tokens_total{{{labels},mode="prefill_compute"}} {float(prefill)}\n'
            f'sglang:realtime_tokens_total{{{labels},mode="decode"}} {float(decode)}\n'
        ).encode()


class Handler(BaseHTTPRequestHandler):
    engine: Sglang
    metrics_on = False
    up_at = 0.0

    def _send(self, status: int, body: bytes = b"", kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path in ("/health", "/health_generate"):
            self._send(503 if time.monotonic() < self.up_at else self.engine.health())
        elif path == "/metrics" and self.metrics_on:
            self._send(200, self.engine.metrics(), "text/plain; version=0.0.4")
        elif path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [
                {"id": self.engine.model, "object": "model"}]}).encode())
        else:
            self._send(404, b'{"detail":"Not Found"}')

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            self._send(404, b'{"detail":"Not Found"}')
            return
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if time.monotonic() < self.up_at:
            self._send(503)
            return
        self.engine.complete()
        self._send(200, json.dumps({"object": "text_completion", "model": self.engine.model,
                                    "choices": [{"index": 0, "text": " ok",
                                                 "finish_reason": "length"}]}).encode())

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(prog="sglang.launch_server (stand-in)")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--enable-metrics", action="store_true")
    parser.add_argument("--served-model-name")
    args, _ = parser.parse_known_args()
    if args.node_rank > 0:  # SGLang's ranks >= 1 run schedulers only, no HTTP
        print("stand-in: rank >= 1, no HTTP server", flush=True)
        while True:
            time.sleep(3600)
    Handler.engine = Sglang(args.served_model_name or args.model_path)
    Handler.metrics_on = args.enable_metrics
    Handler.up_at = time.monotonic() + float(os.environ.get("LLMGW_STANDIN_START", "1"))
    serve(Handler.engine, Handler, args.host, args.port)


if __name__ == "__main__":
    main()
