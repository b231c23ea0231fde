"""Stand-in for `vllm serve ... --distributed-executor-backend ray` (no GPU, no weights):
connects to the Ray cluster at RAY_ADDRESS as vLLM does, waits until the cluster has
one alive node per pipeline stage, and only then answers /health and /v1/models on
--host/--port. Like vLLM, /health then stays 200 even if a worker node dies later
(vllm-project/vllm#16259). /stand-in/nodes reports Ray's alive node count for tests.
On SIGTERM it stops as vllm serve's API server does (see _terminated).

Run as: <prefix>/bin/vllm serve MODEL --host H --port P --pipeline-parallel-size N ...
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import ray


def _terminated(*_: object) -> None:
    # As vllm serve's API server does: SIGTERM becomes KeyboardInterrupt("terminated"),
    # which Python, unhandled, turns into death by SIGINT (a clean stop for systemd).
    raise KeyboardInterrupt("terminated")


def alive_nodes() -> int:
    nodes: list[dict[str, object]] = ray.nodes()  # type: ignore[no-untyped-call]
    return sum(1 for node in nodes if node.get("Alive"))


class Handler(BaseHTTPRequestHandler):
    model = ""

    def do_GET(self) -> None:
        if self.path == "/health":
            body = b""
        elif self.path == "/v1/models":
            body = json.dumps({"object": "list", "data": [
                {"id": self.model, "object": "model", "owned_by": "vllm"}]}).encode()
        elif self.path == "/stand-in/nodes":
            body = json.dumps({"alive": alive_nodes()}).encode()
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(prog="vllm")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("model")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--distributed-executor-backend", default="mp")
    args, _ = parser.parse_known_args()
    if args.distributed_executor_backend != "ray":
        sys.exit("this stand-in only plays vllm serve on Ray")
    ray.init(address=os.environ["RAY_ADDRESS"], logging_level=logging.WARNING)
    signal.signal(signal.SIGTERM, _terminated)  # after ray.init, which sets its own
    wanted = args.pipeline_parallel_size
    while alive_nodes() < wanted:  # vLLM blocks until the placement group fits
        print(f"waiting for {wanted} Ray nodes, have {alive_nodes()}", flush=True)
        time.sleep(1)
    Handler.model = args.model
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"serving {args.model} on {args.host}:{args.port} with {wanted} Ray nodes",
          flush=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # Short sleeps: Python runs a signal's handler in the main thread only, once it runs
    # Python code again; a SIGTERM the kernel hands to another thread (Ray's, the
    # server's) would leave an hour-long sleep unaware of it.
    while True:
        time.sleep(0.25)


if __name__ == "__main__":
    main()
