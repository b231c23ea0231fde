#!/usr/bin/python3
"""Stand-in for a hostile or broken peer supervisor: serves one bad behaviour on
HOST:PORT to every connection, for tests of the supervisor's peer client.

    hostile_peer.py --listen HOST:PORT --mode MODE [--report JSON] [--location URL]
                    [--interval S] [--flood-bytes N] [--record FILE]

Modes:
  lie           200 with --report (default: a plausible report, every rank ready)
  redirect      302 to --location (default http://127.0.0.1:9/v1/shards)
  drip          a complete 200 answer, one byte every --interval seconds (default 0.5),
                from the status line on
  hang          reads the request, then says nothing and keeps the connection open
  huge          200 with Content-Length: 10**12, then zeros as fast as the client reads
  malformed     200 with --report sent as is (default: a report with version true)
  flood         200, chunked, --flood-bytes (default 50 MB) as fast as the client reads
  proxy-record  a fake HTTP proxy: appends one JSON line per connection (peer address,
                first request line) to --record (and stderr), answers 502

Once listening it prints `listening on HOST:PORT` (the real port when PORT is 0).
Stdlib only: it runs under /usr/bin/python3, in network namespaces. Exits 0 on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable

MODES = ("lie", "redirect", "drip", "hang", "huge", "malformed", "flood", "proxy-record")
MAX_CONNECTIONS = 100  # a bounded stand-in: more at once are closed unanswered
IO_TIMEOUT = 60.0

DEFAULT_LIE = {"node": "gpu-a2", "version": 1, "shards": [
    {"replica": "llama-70b", "rank": 1, "node": "gpu-a2", "state": "ready",
     "reason": "all units up for 31 s", "generation": "3f2a9c", "serving": False}]}
DEFAULT_MALFORMED = {"node": "gpu-a2", "version": True, "shards": []}


def read_head(conn: socket.socket) -> bytes:
    """The request line and headers (bounded; whatever came when the client stops)."""
    data = b""
    while b"\r\n\r\n" not in data and len(data) < 64 * 1024:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def answer(body: bytes, status: str = "200 OK", headers: str = "") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n{headers}\r\n"
            ).encode() + body


def serve_flood(conn: socket.socket, total: int) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
    chunk = b"[" * 65536
    framed = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    sent = 0
    while sent < total:
        conn.sendall(framed)
        sent += len(chunk)
    conn.sendall(b"0\r\n\r\n")


def serve_huge(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000000000000\r\nConnection: close\r\n\r\n")
    zeros = b"0" * 65536
    while True:
        conn.sendall(zeros)


def hold(conn: socket.socket) -> None:
    """Keep the connection until the client closes it (or we are terminated)."""
    conn.settimeout(None)
    while conn.recv(4096):
        pass


def make_handler(args: argparse.Namespace) -> Callable[[socket.socket, str], None]:
    record_lock = threading.Lock()

    def handle(conn: socket.socket, peer: str) -> None:
        mode = args.mode
        if mode == "proxy-record":
            head = read_head(conn)
            line = head.split(b"\r\n", 1)[0].decode("latin-1")
            entry = json.dumps({"peer": peer, "first_line": line, "time": time.time()})
            with record_lock:
                print(f"proxy-record: {entry}", file=sys.stderr, flush=True)
                if args.record:
                    with open(args.record, "a", encoding="utf-8") as out:
                        out.write(entry + "\n")
            conn.sendall(answer(b"", "502 Bad Gateway"))
            return
        read_head(conn)
        if mode in ("lie", "malformed"):
            default = DEFAULT_LIE if mode == "lie" else DEFAULT_MALFORMED
            body = args.report.encode() if args.report is not None else json.dumps(
                default).encode()
            conn.sendall(answer(body))
        elif mode == "redirect":
            conn.sendall(answer(b"", "302 Found", f"Location: {args.location}\r\n"))
        elif mode == "drip":
            data = answer(args.report.encode() if args.report is not None
                          else json.dumps(DEFAULT_LIE).encode())
            for i in range(len(data)):
                conn.sendall(data[i:i + 1])
                time.sleep(args.interval)
        elif mode == "hang":
            hold(conn)
        elif mode == "huge":
            serve_huge(conn)
        elif mode == "flood":
            serve_flood(conn, args.flood_bytes)

    return handle


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--listen", type=parse_listen, required=True, metavar="HOST:PORT")
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--report", help="the JSON body for lie, malformed and drip")
    parser.add_argument("--location", default="http://127.0.0.1:9/v1/shards")
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--flood-bytes", type=int, default=50_000_000)
    parser.add_argument("--record", help="proxy-record: append one JSON line per connection")
    args = parser.parse_args()

    def terminated(*_: object) -> None:
        # os._exit, not SystemExit: an exception raised inside threading's own locks
        # (Thread.start waits on one) turned into "release unlocked lock", exit 1.
        os._exit(0)

    signal.signal(signal.SIGTERM, terminated)
    host, port = args.listen
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server = socket.create_server((host, port), family=family, backlog=64)
    bound = server.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    print(f"listening on {shown}:{bound}", flush=True)
    handle = make_handler(args)
    live = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def serve(conn: socket.socket, peer: str) -> None:
        try:
            with conn:
                conn.settimeout(IO_TIMEOUT)
                handle(conn, peer)
        except OSError:
            pass  # the client hung up or timed out on us: for most modes, the point
        finally:
            live.release()

    # Python runs a signal's handler in the main thread only: a SIGTERM the kernel hands
    # to a connection's thread leaves a main thread blocked in accept() unaware (a CI run
    # waited 5 s for it to exit). Waking every half second, it runs the handler.
    server.settimeout(0.5)
    while True:
        try:
            conn, address = server.accept()
        except TimeoutError:
            continue
        if not live.acquire(blocking=False):
            conn.close()
            continue
        peer = f"{address[0]}:{address[1]}"
        threading.Thread(target=serve, args=(conn, peer), daemon=True).start()


if __name__ == "__main__":
    main()
