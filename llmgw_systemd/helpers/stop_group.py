"""llmgw-stop-group: the ExecStop= of vLLM and Ray units. SIGTERM to every process of the
unit's control group (or, with --main-first, to its main process only), then SIGKILL to
whatever is left after a grace period.

Why (docs/engines.md): a vLLM rank blocked in its rendezvous (rank 0 of mp waiting for
its peers, inside torch's TCPStore) does not act on SIGTERM. Left to systemd, the SIGKILL
would come only when TimeoutStopSec= runs out, and the unit would end failed with
Result=timeout. Done here, inside the stop, the unit ends inactive: the units count
SIGKILL of the main process as a clean exit. It starts fast (standard library only):
systemd runs it on every stop. `systemctl stop` still waits for it, bounded by
TimeoutStopSec=, which stays the backstop.

    llmgw-stop-group --grace SECONDS [--failure-grace SECONDS] [--main-first]
                     [--health URL --unserved-grace SECONDS]
                     [--drain REPLICA --supervisor HOST:PORT --drain-delay S
                      --drain-timeout S [--serving]]

--drain (every engine unit): before any signal, the drain step (health/drain.py). It asks
the local supervisor (GET /v1/replicas/REPLICA on --supervisor, plain HTTP on loopback)
whether this stop is planned: then the replica is out of rotation for --drain-delay
seconds before anything is signalled, and a worker rank (no --serving) also waits, for
at most --drain-timeout more, until the serving rank has nothing in flight. A stop whose
main process is gone, one that systemd passes on from a dead member, and the supervisor's
own group restart go at once; with no supervisor answering, the delay alone. The drain's
time comes out of --grace: the last SIGKILL stays inside TimeoutStopSec=.

--health (the serving rank's unit): a rank that does not answer GET URL with 200 within
a second when the stop begins has served nothing in this start, or can serve nothing
now: it has nothing to drain, and gets --unserved-grace instead of --grace. vLLM ignores
SIGTERM while it waits for its peers or for Ray's placement group, and a stop then took
the whole grace (25.4 s for an mp rank 0, 27.0 s for a Ray leader; docs/engines.md). A
rank that answers keeps its drain.

--main-first is KillMode=mixed's order, for `ray start` units and for a serving rank
whose main process drains: the main process alone gets SIGTERM and stops its own
children (a Ray head signalled together with its GCS takes 30 s longer; vLLM's engine
core signalled together with its API server dies under the requests the server is
draining); once it is gone, or still there after the grace (a worker stopped while it
joins ignores SIGTERM), whatever is left is SIGKILLed, inside the stop (docs/engines.md).

Failures never wait (issue 42). A stop whose main process is gone when it begins, and,
with --drain, the supervisor's group restart or a member's death, have nothing in flight
to finish: what is left of the group is SIGKILLed at once (after --failure-grace of
SIGTERM where SIGKILL would end the unit failed). In every stop, once the main process is
gone, what is left is SIGKILLed at once: vLLM's workers outlived their main process by
the whole grace. The grace counts from this helper's own start (the process's start
time, not the interpreter's first line), so the last SIGKILL and its reaping stay inside
TimeoutStopSec= (units/plan.py, stop_budget) on a loaded node too.

Exit 0 once no other process is left in the group; 1 if some survived SIGKILL (then
systemd's own SIGKILL follows), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import signal
import sys
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path

from llmgw_systemd import __version__
from llmgw_systemd.health.drain import (
    DRAINED,
    DRAINING,
    GROUP_RESTART,
    PLANNED,
    Phase,
    Stopping,
    StopView,
    step,
)
from llmgw_systemd.helpers.local_api import ask_replica

PROG = "llmgw-stop-group"
CGROUP_FS = Path("/sys/fs/cgroup")
POLL = 0.1  # seconds between looks at the group
# seconds for SIGKILLed processes to be reaped: inside units/plan.py's STOP_MARGIN, with
# the rest of it for systemd's own start of this helper
KILL_WAIT = 3.0
HEALTH_TIMEOUT = 1.0  # seconds a serving rank has to answer its health check at the stop
ASK_TIMEOUT = 0.5  # seconds the local supervisor has to answer the drain step
ASK_EVERY = 0.25  # seconds between the drain step's questions


def own_cgroups(proc_self_cgroup: str) -> list[Path]:
    """Where this process's cgroup lives in each mounted hierarchy that tracks units: the
    unified one (cgroup v2, or its mount beside v1 on a hybrid system) and systemd's own
    v1 hierarchy (name=systemd)."""
    groups: list[Path] = []
    for line in proc_self_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            groups += [CGROUP_FS / path.lstrip("/"), CGROUP_FS / "unified" / path.lstrip("/")]
        elif controllers == "name=systemd":
            groups.append(CGROUP_FS / "systemd" / path.lstrip("/"))
    return [g for g in groups if (g / "cgroup.procs").is_file()]


def members(groups: Sequence[Path]) -> set[int]:
    pids: set[int] = set()
    for group in groups:
        for procs in group.rglob("cgroup.procs"):
            try:
                pids.update(int(p) for p in procs.read_text().split())
            except OSError:
                continue  # a child group went away meanwhile
    pids.discard(os.getpid())
    # A hierarchy shared with a parent PID namespace (the unified one in a booted
    # container) lists the processes this namespace cannot see as 0: kill(0) would
    # signal our own process group, this helper included (seen: it SIGTERMed, then
    # SIGKILLed itself, and the unit ended failed).
    return {pid for pid in pids if pid > 0}


def signal_all(pids: set[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # gone meanwhile
            os.kill(pid, sig)


def terminate(pids: set[int]) -> None:
    """SIGTERM, then SIGCONT as systemd does: a stopped process (SIGSTOP, a debugger's
    freeze) acts on SIGTERM only once it runs again."""
    signal_all(pids, signal.SIGTERM)
    signal_all(pids, signal.SIGCONT)


def stop_group(groups: Sequence[Path], grace: float, main_pid: int = 0) -> bool:
    """SIGTERM to all, wait up to grace for them to go (or, with main_pid, for the main
    process to go: what outlives it has nothing left to save), SIGKILL the rest; True
    once empty."""
    terminate(members(groups))
    return _then_kill(groups, time.monotonic() + grace, main_pid, f"{grace:.0f} s after "
                      "SIGTERM")


def _then_kill(groups: Sequence[Path], kill_at: float, main_pid: int, when: str) -> bool:
    """Wait until the group is empty, its main process (when known) is gone, or
    kill_at; then SIGKILL whatever is left. True once empty."""
    while members(groups) and time.monotonic() < kill_at:
        if main_pid and not _running(main_pid, groups):
            break
        time.sleep(POLL)
    left = members(groups)
    if not left:
        return True
    why = (f"the main process is gone; SIGKILL to the {len(left)} process(es) left"
           if main_pid and not _running(main_pid, groups) else
           f"{len(left)} process(es) still running {when}; sending SIGKILL")
    print(f"{PROG}: {why}", flush=True)
    return not kill_group(groups)


def kill_group(groups: Sequence[Path]) -> set[int]:
    """SIGKILL every member until the group is empty or KILL_WAIT ran out; who is left."""
    deadline = time.monotonic() + KILL_WAIT
    left = members(groups)
    while left and time.monotonic() < deadline:
        signal_all(left, signal.SIGKILL)
        time.sleep(POLL)
        left = members(groups)
    return left


def stop_main_first(groups: Sequence[Path], main_pid: int, grace: float) -> bool:
    """SIGTERM to the main process, wait up to grace for it to go (it stops its own
    children), then SIGKILL whatever is left in the group, as KillMode=mixed does; True
    once the group is empty."""
    terminate({main_pid})
    return _then_kill(groups, time.monotonic() + grace, main_pid, f"{grace:.0f} s after "
                      "SIGTERM")


def kill_now(groups: Sequence[Path], grace: float, main_pid: int) -> bool:
    """A failure's stop: nothing in flight to finish. SIGKILL at once (grace 0), or
    SIGTERM and SIGKILL after grace; True once the group is empty."""
    if grace <= 0:
        return not kill_group(groups)
    return stop_group(groups, grace, main_pid)


def _running(pid: int, groups: Sequence[Path]) -> bool:
    """Whether pid is still a live (not zombie) member of the group."""
    if pid not in members(groups):
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def answers_health(url: str, timeout: float = HEALTH_TIMEOUT) -> bool:
    """Whether GET url answers HTTP 200 within timeout (connect and answer)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        return False
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        conn.request("GET", parts.path or "/", headers={"User-Agent": PROG})
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def ask_supervisor(address: str, replica: str, timeout: float = ASK_TIMEOUT
                   ) -> StopView | None:
    """What the local supervisor says of the replica, for the drain step; None when it
    does not answer, or not as expected."""
    data = ask_replica(address, replica, timeout, PROG)
    return view_of(data) if data is not None else None


def view_of(data: object) -> StopView | None:
    """The drain step's view of a /v1/replicas/NAME answer (None if it is not one)."""
    if not isinstance(data, dict) or not isinstance(data.get("routable"), bool):
        return None
    stoppings: dict[object, Stopping] = {PLANNED: PLANNED, GROUP_RESTART: GROUP_RESTART}
    phases: dict[object, Phase] = {DRAINING: DRAINING, DRAINED: DRAINED}
    stopping = stoppings.get(data.get("stopping"))
    drain = data.get("drain")
    phase = None
    drained_for = 0.0
    if isinstance(drain, dict):
        phase = phases.get(drain.get("phase"))
        age = drain.get("for")
        if isinstance(age, (int, float)) and not isinstance(age, bool):
            drained_for = max(0.0, float(age))
    return StopView(data["routable"], stopping, phase, drained_for)


def drain_first(args: argparse.Namespace, main_alive: bool, kill_at: float) -> bool:
    """The drain step: wait as health/drain.py says, asking the local supervisor, at the
    latest until kill_at; whether the stop is a failure's (nothing to save)."""
    started = time.monotonic()
    said = ""
    job: str | None = None
    while True:
        view = ask_supervisor(args.supervisor, args.drain) if main_alive else None
        unseen = view is None or (view.phase is None and view.stopping is None
                                  and not view.routable)
        if unseen and main_alive and job is None and args.target is not None:
            job = target_job(args.target, user=args.user)  # once: systemd's own word
        decision = step(view, time.monotonic() - started, args.drain_delay,
                        args.drain_timeout, serving=args.serving, main_alive=main_alive,
                        target_job=job)
        if decision.reason != said:
            print(f"{PROG}: {args.drain}: {decision.reason}", flush=True)
            said = decision.reason
        if decision.go or time.monotonic() >= kill_at:
            return decision.failure
        time.sleep(ASK_EVERY)


def began_at() -> float:
    """When this process started, on time.monotonic()'s clock: systemd's stop timeout
    began about then, and a loaded node can take a second or more to get from there to
    this interpreter's first line."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic()
    return time.monotonic() - min(max(age, 0.0), 60.0)


def target_job(target: str, *, user: bool) -> str | None:
    """The type of the job systemd has queued on the target ("" for none), from
    `systemctl list-jobs`; None when systemctl does not answer within a second."""
    import subprocess  # only when the supervisor cannot say whether the stop is planned

    argv = ["systemctl", *(["--user"] if user else []), "list-jobs", "--no-legend",
            "--plain", "--no-pager", target]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=1.0, check=True,
                             stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[1] == target:
            return fields[2]
    return ""


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_deadline(kill_at: float, now: float, unserved_grace: float | None,
                  serving: bool | None) -> float:
    """When the last SIGKILL comes: at kill_at (the grace from this helper's start), or,
    for a unit known not to serve, unserved_grace from now if that is sooner."""
    if unserved_grace is None or serving is None or serving:
        return kill_at
    return min(kill_at, now + unserved_grace)


def build_parser() -> argparse.ArgumentParser:
    """The arguments (also read by scripts/manpages.py for the man page and completion)."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="SIGTERM every process of this unit's control group, then "
        "SIGKILL whatever is left after --grace seconds (an ExecStop= helper).")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("--grace", type=float, required=True,
                        help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--failure-grace", type=float, default=0.0, metavar="SECONDS",
                        help="seconds between SIGTERM and SIGKILL in a failure's stop (the "
                        "supervisor's group restart, a member's death): 0, the default, "
                        "SIGKILLs at once; for engines whose SIGKILL would end the unit "
                        "failed")
    parser.add_argument("--main-first", action="store_true",
                        help="SIGTERM only the main process ($MAINPID), as KillMode=mixed "
                        "does; SIGKILL the group if it outlives the grace")
    parser.add_argument("--health", metavar="URL",
                        help="the unit's own health check (http://HOST:PORT/PATH): if it "
                        "does not answer 200 within a second, the stop uses "
                        "--unserved-grace")
    parser.add_argument("--unserved-grace", type=float, metavar="SECONDS",
                        help="seconds between SIGTERM and SIGKILL for a unit that does "
                        "not answer --health (nothing to drain)")
    parser.add_argument("--drain", metavar="REPLICA",
                        help="drain first: a planned stop keeps the replica out of rotation "
                        "for --drain-delay before any signal (docs/supervisor.md, Drain)")
    parser.add_argument("--supervisor", metavar="HOST:PORT",
                        help="the local supervisor's plain HTTP API (with --drain)")
    parser.add_argument("--drain-delay", type=float, metavar="SECONDS",
                        help="seconds out of rotation before any signal (with --drain)")
    parser.add_argument("--drain-timeout", type=float, metavar="SECONDS",
                        help="seconds the requests in flight may take (with --drain)")
    parser.add_argument("--target", metavar="UNIT",
                        help="the replica's target: with no supervisor answering, a stop "
                        "without a stop or restart job on it is a failure (with --drain)")
    parser.add_argument("--user", action="store_true",
                        help="the units run under a user manager (systemctl --user)")
    parser.add_argument("--serving", action="store_true",
                        help="this unit serves HTTP: it drains on SIGTERM itself, so it "
                        "waits only the delay (with --drain)")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("grace", "failure_grace", "unserved_grace", "drain_delay", "drain_timeout"):
        value = getattr(args, name)
        if value is not None and not 0 <= value <= 86400:
            parser.error(f"--{name.replace('_', '-')} must be 0 to 86400 seconds")
    if (args.health is None) != (args.unserved_grace is None):
        parser.error("--health and --unserved-grace go together")
    if args.health is not None and not args.health.startswith("http://"):
        parser.error(f"--health: expected http://HOST:PORT/PATH; got '{args.health}'")
    drain_args = (args.supervisor, args.drain_delay, args.drain_timeout)
    if args.drain is None and (any(a is not None for a in drain_args) or args.serving
                               or args.target is not None):
        parser.error("--supervisor, --drain-delay, --drain-timeout, --target and --serving "
                     "go with --drain")
    if args.drain is not None and any(a is None for a in drain_args):
        parser.error("--drain needs --supervisor, --drain-delay and --drain-timeout")
    if args.supervisor is not None and not _is_address(args.supervisor):
        parser.error(f"--supervisor: expected HOST:PORT; got '{args.supervisor}'")
    groups = own_cgroups(Path("/proc/self/cgroup").read_text())
    if not groups:
        print(f"{PROG}: cannot find this unit's control group", file=sys.stderr)
        sys.exit(1)
    began = began_at()
    main_text = os.environ.get("MAINPID", "")
    main_pid = int(main_text) if main_text.isdigit() and int(main_text) > 1 else 0
    main_alive = bool(main_pid) and _exists(main_pid)
    kill_at = began + args.grace
    failure = not main_alive  # systemd names no main process: it is gone
    if args.drain is not None:
        failure = drain_first(args, main_alive, kill_at) or failure
    elif failure:
        print(f"{PROG}: the main process is gone (a failure): nothing to save", flush=True)
    if failure:
        grace = args.failure_grace if main_alive else 0.0
        if grace <= 0:
            print(f"{PROG}: SIGKILL to what is left at once", flush=True)
        sys.exit(0 if kill_now(groups, grace, main_pid if main_alive else 0) else 1)
    # asked before any signal: once SIGTERMed, a serving rank stops answering
    serving = answers_health(args.health, min(HEALTH_TIMEOUT, max(0.1, kill_at
                                                                  - time.monotonic()))) \
        if args.health is not None else None
    kill_at = kill_deadline(kill_at, time.monotonic(), args.unserved_grace, serving)
    if serving is False:
        print(f"{PROG}: {args.health} does not answer: nothing to drain, SIGKILL after "
              f"{max(0.0, kill_at - time.monotonic()):.1f} s", flush=True)
    grace = max(0.0, kill_at - time.monotonic())
    signalled = time.monotonic()
    empty = (stop_main_first(groups, main_pid, grace) if args.main_first
             else stop_group(groups, grace, main_pid))
    # in the journal: what a stop takes after SIGTERM (the budget's EXIT_GRACE)
    print(f"{PROG}: {'every process gone' if empty else 'processes left'} "
          f"{time.monotonic() - signalled:.1f} s after SIGTERM, "
          f"{time.monotonic() - began:.1f} s into the stop", flush=True)
    sys.exit(0 if empty else 1)


def _is_address(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


if __name__ == "__main__":
    main()
