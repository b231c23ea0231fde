"""llmgw-wait-for-port: wait, with a deadline, until TCP addresses listen (or are free).

Runs as ExecStartPre= of a shard's unit, so it starts fast (no click, no jinja2) and
tells systemd what it is waiting for through STATUS= (shown by `systemctl status`).
Exit 0 when every address is ready, 1 on timeout, 2 on bad arguments, and 0 on SIGTERM:
systemd sends that only to stop the unit, never runs ExecStart= once a stop began, and
counts a start step killed by a signal as a failure, which would leave a unit stopped
while it waited `failed` (measured: docs/engines.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence

from llmgw_systemd import __version__
from llmgw_systemd.errors import BadInput
from llmgw_systemd.helpers.sd_notify import notify
from llmgw_systemd.spec.endpoint import Endpoint, parse_endpoint
from llmgw_systemd.spec.names import DIGEST_VAR, is_replica_name

PROG = "llmgw-wait-for-port"
ASK_TIMEOUT = 0.5  # seconds the local supervisor has to answer
ASK_EVERY = 1.0  # seconds between questions to it


def accepts(endpoint: Endpoint, timeout: float) -> str | None:
    """None when some address of the host accepts a TCP connection, else why not.

    The name is resolved on every call: DNS may come up after we start."""
    try:
        infos = socket.getaddrinfo(endpoint.host, endpoint.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"cannot resolve {endpoint.host}: {exc.strerror}"
    reason = "no address"
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.settimeout(max(timeout, 0.05))
            try:
                sock.connect(sockaddr)
                return None
            except OSError as exc:
                reason = exc.strerror or type(exc).__name__
    return reason


def is_free(endpoint: Endpoint) -> str | None:
    """None when the port could be bound there now (no listener), else why not."""
    family = socket.AF_INET6 if ":" in endpoint.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # Matches what servers do: TIME_WAIT leftovers must not count as busy.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((endpoint.host, endpoint.port))
        except OSError as exc:
            return exc.strerror or type(exc).__name__
    return None


def wait(endpoints: Sequence[Endpoint], timeout: float, interval: float, free: bool,
         gate: Callable[[], str] | None = None) -> int:
    """Until every endpoint is ready and the gate (if any) says "" in the same round;
    the gate is asked only once the ports are ready, and at most every ASK_EVERY s."""
    started = time.monotonic()
    deadline = started + timeout
    what = "to be free" if free else "to accept connections"
    reasons: dict[Endpoint, str] = {}
    held = ""  # why the gate holds the start
    asked = -ASK_EVERY
    while True:
        pending = []
        for endpoint in endpoints:
            remaining = deadline - time.monotonic()
            reason = is_free(endpoint) if free else accepts(endpoint, min(interval, remaining))
            if reason is not None:
                pending.append(endpoint)
                reasons[endpoint] = reason
        if not pending and gate is not None and time.monotonic() - asked >= ASK_EVERY:
            asked = time.monotonic()
            held = gate()
        if not pending and not held:
            notify("STATUS=")
            return 0
        waited = time.monotonic() - started
        names = ", ".join(str(e) for e in pending)
        waiting = f"{names} {what}" if pending else held
        if time.monotonic() >= deadline:
            detail = ("; ".join(f"{e}: {reasons[e]}" for e in pending) if pending
                      else "the ports are ready")
            line = f"{PROG}: gave up after {waited:.0f} s waiting for {waiting} ({detail})"
            notify(f"STATUS={line}")
            print(line, file=sys.stderr, flush=True)
            return 1
        notify(f"STATUS=Waiting for {waiting} ({waited:.0f} s of {timeout:g} s)")
        time.sleep(max(0.0, min(interval, deadline - time.monotonic())))


def version_gate(supervisor: str, replica: str, digest: str) -> Callable[[], str]:
    """Why this rank must not join rank 0 yet, from the local supervisor's view ("": go;
    also when no supervisor answers, or this unit carries no digest)."""
    # imported here, not at the top: http.client doubles the interpreter's start-up, and
    # a SIGTERM before main() installs its handler fails the unit (docs/engines.md)
    from llmgw_systemd.health.versions import leader_behind
    from llmgw_systemd.helpers.local_api import ask_replica, rank_versions

    said = ""

    def held() -> str:
        nonlocal said
        data = ask_replica(supervisor, replica, ASK_TIMEOUT, PROG) if digest else None
        reason = leader_behind(rank_versions(data), digest) if data is not None else ""
        if reason and reason != said:
            print(f"{PROG}: {replica}: {reason}", flush=True)
        said = reason
        return reason
    return held


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got '{text}'") from None
    if not 0 <= value <= 86400 * 7:
        raise argparse.ArgumentTypeError(f"expected 0 to 604800 seconds, got '{text}'")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The arguments (also read by scripts/manpages.py for the man page and completion)."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Wait until every HOST:PORT accepts TCP connections "
        "(or, with --free, until nothing listens there).")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("addresses", nargs="+", metavar="HOST:PORT",
                        help="address to wait for; IPv6 as [ADDR]:PORT")
    parser.add_argument("--timeout", type=_seconds, default=300.0,
                        help="give up after this many seconds (default 300)")
    # a try is one connect(): cheap, and every second of polling delays a whole shard
    parser.add_argument("--interval", type=_seconds, default=0.25,
                        help="seconds between tries (default 0.25)")
    parser.add_argument("--free", action="store_true",
                        help="wait until the ports can be bound (nobody listens) instead")
    parser.add_argument("--same-version", metavar="REPLICA",
                        help="also wait while the local supervisor sees rank 0 of REPLICA "
                        f"about to restart onto the version in ${DIGEST_VAR} (a rank > 0's "
                        "engine, docs/generator.md)")
    parser.add_argument("--supervisor", metavar="HOST:PORT",
                        help="the local supervisor's plain HTTP API (with --same-version)")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    # First of all: a stop may come at any moment (a SIGTERM during the interpreter's own
    # start-up, a few tens of ms, still kills it; docs/engines.md).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    parser = build_parser()
    args = parser.parse_args(argv)
    endpoints = []
    try:
        for text in args.addresses:
            parsed = parse_endpoint(text)
            if isinstance(parsed, str):
                raise BadInput(parsed)
            endpoints.append(parsed)
    except BadInput as exc:
        parser.error(str(exc))
    if args.interval <= 0:
        parser.error("--interval must be more than 0 seconds")
    gate = None
    if (args.same_version is None) != (args.supervisor is None):
        parser.error("--same-version and --supervisor go together")
    if args.same_version is not None:
        if args.free or not is_replica_name(args.same_version):
            parser.error(f"--same-version: expected a replica's name, without --free; got "
                         f"'{args.same_version}'")
        if isinstance(parse_endpoint(args.supervisor), str):
            parser.error(f"--supervisor: expected HOST:PORT; got '{args.supervisor}'")
        gate = version_gate(args.supervisor, args.same_version,
                            os.environ.get(DIGEST_VAR, ""))
    sys.exit(wait(endpoints, args.timeout, args.interval, args.free, gate))


if __name__ == "__main__":
    main()
