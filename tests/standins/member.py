#!/usr/bin/python3
"""Stand-in for a rank that joins the rendezvous head (a Ray worker, a headless vLLM
rank): connects to HOST:PORT and stays up while the connection lasts; exits 1 when the
head goes away, as a worker that lost its head does. Optionally serves HTTP (/health,
/v1/models) once joined, as a serving rank does.

    member.py --join HOST:PORT [--http-port P] [--http-host H] [--exit-on-term N]
              [--child-lingers S]

With --child-lingers it keeps a child process, as vllm serve keeps its engine core,
that takes S seconds to exit after SIGTERM: when the main process exits, the unit stays
deactivating that long while systemd stops the rest of its cgroup.
"""

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/health":
            body = b""
        elif self.path == "/v1/models":
            body = json.dumps({"object": "list", "data": [{"id": "stand-in"}]}).encode()
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--join", required=True)
    parser.add_argument("--http-port", type=int)
    parser.add_argument("--http-host", default="0.0.0.0")
    parser.add_argument("--exit-on-term", type=int,
                        help="exit with this status on SIGTERM (some engines exit non-zero)")
    parser.add_argument("--child-lingers", type=float)
    args = parser.parse_args()
    if args.child_lingers is not None and os.fork() == 0:
        linger = args.child_lingers
        def slow_exit(*_: object) -> None:
            time.sleep(linger)
            os._exit(0)
        signal.signal(signal.SIGTERM, slow_exit)
        while True:
            time.sleep(3600)
    if args.exit_on_term is not None:
        status = args.exit_on_term
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(status))
    host, _, port = args.join.rpartition(":")
    conn = socket.create_connection((host.strip("[]"), int(port)), timeout=10)
    # Woken every half second: Python runs a signal's handler in the main thread only,
    # once it runs Python code again; a SIGTERM the kernel hands to the HTTP server's
    # thread would leave a main thread blocked in recv() unaware of it.
    conn.settimeout(0.5)
    print(f"joined {args.join}", flush=True)
    if args.http_port:
        server = ThreadingHTTPServer((args.http_host, args.http_port), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        print(f"serving HTTP on {args.http_host}:{args.http_port}", flush=True)
    while True:
        try:
            if not conn.recv(4096):
                break
        except TimeoutError:
            continue
    print(f"lost {args.join}", flush=True)
    sys.exit(1)


if __name__ == "__main__":
    main()
