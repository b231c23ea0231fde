"""Benchmark llmgw-supervisor against real systemd user managers (the test harness).

Prints, in one run, each figure beside its baseline measured in the same run:
- local death: SIGKILL of a unit's main process -> the supervisor's API no longer
  saying ready (followed by long-poll, GET /v1/shards?after=V), beside the raw D-Bus
  signal (SIGKILL -> the first PropertiesChanged for that unit that says it is no
  longer active, received by this process on the same bus) on the same kills; goal
  API <= 2x raw. The first signal of any kind is shown too (often it only says that
  MainPID changed);
- remote death: two nodes in network namespaces, a replica across them; SIGKILL of
  rank 1's engine on node-b -> node-a's API no longer saying the replica is ready
  (GET /v1/replicas/rep polled every 0.5 ms), beside node-b's own API polled the same
  way (the local path) on the same kills; goal remote median <= 100 ms;
- idle CPU of the supervisor watching --units units: all active; a mix of active,
  stopped, never started and not rendered; and the mix while 10 unrelated transient
  units a second come and go (goals 0.5 %, 0.5 %, 1 % of one core);
- its memory (RSS) at the end.

Needs root (it starts private systemd user managers and network namespaces). Run:
    .venv/bin/python bench/supervisor.py [--trials 30] [--idle 30] [--units 100]
"""

from __future__ import annotations

import argparse
import ctypes
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / d) for d in ("", "support", "integration", "engines")]

from specs import free_port  # noqa: E402
from systemd_harness import UserManager, make_network, remove_network, wait_until  # noqa: E402

BIN = Path(sys.executable).parent
CLONE_NEWNET = 0x40000000


def replica_lines(name: str, *, nodes: str = "[{name: node, address: 127.0.0.1}]",
                  ranks: int = 1) -> list[str]:
    return [f"  - name: {name}", "    engine: command", "    serving_rank: null",
            "    restart: {delay: 1, burst: 1000, interval: 100000}",
            "    health: {stability: 0}",
            "    group_restart: {delay: 1, max_delay: 1, budget: 1000, window: 100000}",
            f"    nodes: {nodes}",
            "    ranks: [" + ", ".join(["{commands: [{argv: [/usr/bin/sleep, infinity]}]}"]
                                       * ranks) + "]"]


def spec_text(names: list[str]) -> str:
    return "\n".join(["replicas:", *(line for n in names for line in replica_lines(n))]) + "\n"


def enter_netns(name: str) -> None:
    """Move the calling thread (only it) into a network namespace."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {name}")
    finally:
        os.close(fd)


class Poller:
    """Polls one supervisor's replica state over a keep-alive connection, in a thread
    (inside a namespace when given), and notes when it first stops being ready."""

    def __init__(self, host: str, port: int, replica: str, netns: str | None = None,
                 interval: float = 0.0005) -> None:
        self.host, self.port, self.replica, self.netns = host, port, replica, netns
        self.interval = interval
        self.state = ""
        self.left_ready: float | None = None
        self.armed = False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        if self.netns:
            enter_netns(self.netns)
        conn = http.client.HTTPConnection(self.host, self.port, timeout=5)
        deadline = time.monotonic() + 3600
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                conn.request("GET", f"/v1/replicas/{self.replica}")
                data = json.loads(conn.getresponse().read())
                self.state = str(data.get("state", "unknown"))
            except (OSError, ValueError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection(self.host, self.port, timeout=5)
                self.state = "error"
            if self.armed and self.state != "ready" and self.left_ready is None:
                self.left_ready = time.perf_counter()
            time.sleep(self.interval)


class LongPoller(Poller):
    """Follows one shard's state through the API's long-poll (GET /v1/shards?after=V):
    the answer leaves as soon as the state is published, and waiting costs the
    supervisor nothing, so the measurement does not load what it measures."""

    def run(self) -> None:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        version: int | None = None
        deadline = time.monotonic() + 3600
        while not self.stop.is_set() and time.monotonic() < deadline:
            query = "" if version is None else f"?after={version}&wait=5"
            try:
                conn.request("GET", f"/v1/shards{query}")
                data = json.loads(conn.getresponse().read())
            except (OSError, ValueError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
                version = None
                time.sleep(0.01)
                continue
            arrived = time.perf_counter()
            version = int(data["version"])
            for shard in data["shards"]:
                if shard["replica"] == self.replica:
                    self.state = str(shard["state"])
            if self.armed and self.state != "ready" and self.left_ready is None:
                self.left_ready = arrived


def start_supervisor(manager: UserManager, spec: Path, node: str, listen: str,
                     state: Path) -> subprocess.Popen[bytes]:
    argv = [str(BIN / "llmgw-supervisor"), "--user", "--node", node, "--listen", listen,
            "--state-dir", str(state), str(spec)]
    if manager.netns is not None:
        argv = ["nsenter", f"--net=/run/netns/{manager.netns.name}", *argv]
    return subprocess.Popen(argv, env=manager.env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def idle_cpu(pid: int, seconds: float, during: Callable[[threading.Event], None] | None = None
             ) -> float:
    done = threading.Event()
    worker = threading.Thread(target=during, args=(done,), daemon=True) if during else None
    before = cpu_seconds(pid)
    if worker:
        worker.start()
    time.sleep(seconds)
    used = cpu_seconds(pid) - before
    done.set()
    if worker:
        worker.join(timeout=30)
    return used / seconds * 100


@dataclass
class LocalFigures:
    raw: list[float] = field(default_factory=list)
    via_api: list[float] = field(default_factory=list)
    first_signal: list[float] = field(default_factory=list)
    idle: dict[str, tuple[int, float]] = field(default_factory=dict)  # case -> units, CPU %
    rss: float = 0.0


def local_part(options: argparse.Namespace, tmp: Path) -> LocalFigures:
    replicas = -(-options.units // 3)  # target + engine + restart unit each
    names = [f"bench-{i:03d}" for i in range(replicas)]
    manager = UserManager(f"llmgw-bench-{os.getpid()}", tmp / "node")
    manager.start()
    supervisor: subprocess.Popen[bytes] | None = None
    out = LocalFigures()
    try:
        spec = tmp / "spec.yaml"
        spec.write_text(spec_text(names))
        manager.render(spec, "node")
        manager.systemctl("start", *(f"llmgw-{n}.target" for n in names))
        port = free_port()
        supervisor = start_supervisor(manager, spec, "node", f"127.0.0.1:{port}",
                                      tmp / "state")
        poll = LongPoller("127.0.0.1", port, "bench-000")
        wait_until(lambda: poll.state == "ready", 120, "bench-000 ready")

        os.environ.update({k: manager.env[k] for k in ("XDG_RUNTIME_DIR",
                                                      "DBUS_SESSION_BUS_ADDRESS")})
        from llmgw_systemd.gather.systemd_bus import SystemdBus

        unit = "llmgw-bench-000-engine.service"
        seen: dict[str, float] = {}
        armed = threading.Event()

        def on_signal(_path: str) -> None:
            if not armed.is_set() or "sig" in seen:
                return
            seen.setdefault("any", time.perf_counter())
            states = bus.from_signals([unit])  # what the signals carried
            if states is not None and states[unit].active_state != "active":
                seen["sig"] = time.perf_counter()

        bus = SystemdBus(user=True)
        bus.watch([unit], on_signal)  # a match rule for that unit's path only
        raw: list[float] = []
        first_signal: list[float] = []
        via_api: list[float] = []
        for _ in range(options.trials):
            wait_until(lambda: poll.state == "ready", 30, "ready")
            pid = int(manager.show(unit, "MainPID")["MainPID"])
            assert pid > 1
            bus.snapshot([unit])  # the state the signals' changes apply to
            seen.clear()
            poll.left_ready = None
            armed.set()
            poll.armed = True
            started = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: poll.left_ready is not None and "sig" in seen, 10,
                       "the API and the raw signal", interval=0.001)
            assert poll.left_ready is not None
            via_api.append(poll.left_ready - started)
            raw.append(seen["sig"] - started)
            first_signal.append(seen["any"] - started)
            armed.clear()
            poll.armed = False
        bus.close()
        poll.stop.set()
        out.raw, out.via_api, out.first_signal = raw, via_api, first_signal

        wait_until(lambda: _all_ready(port, replicas), 120, "all ready again")
        time.sleep(2)
        units = len(manager.llmgw_units())
        out.idle["idle_active"] = (units, idle_cpu(supervisor.pid, options.idle))

        # the mix: a third stopped, and two more replicas: one never started, one in the
        # spec but not rendered
        third = names[: len(names) // 3]
        manager.systemctl("stop", *(f"llmgw-{n}.target" for n in third))
        supervisor.send_signal(signal.SIGTERM)
        supervisor.wait(timeout=20)
        mixed = tmp / "mixed.yaml"
        manager.render(write(mixed, spec_text([*names, "never-started"])), "node")
        mixed.write_text(spec_text([*names, "never-started", "not-rendered"]))
        supervisor = start_supervisor(manager, mixed, "node", f"127.0.0.1:{port}",
                                      tmp / "state")
        wait_until(lambda: _shards(port) == replicas + 2, 60, "the mixed spec watched")
        time.sleep(6)
        units = 3 * (replicas + 2)  # watched names; stopped units are not even loaded
        out.idle["idle_mixed"] = (units, idle_cpu(supervisor.pid, options.idle))

        def churn(done: threading.Event) -> None:
            i = 0
            while not done.is_set():
                subprocess.run(["systemd-run", "--user", "--quiet", f"--unit=churn-{i}",
                                "/bin/true"], env=manager.env, check=False, timeout=30,
                               capture_output=True)
                i += 1
                done.wait(0.1)

        out.idle["idle_churn"] = (units, idle_cpu(supervisor.pid, options.idle, churn))
        out.rss = rss_mb(supervisor.pid)
    finally:
        if supervisor is not None:
            supervisor.send_signal(signal.SIGTERM)
            supervisor.wait(timeout=20)
        manager.stop()
    return out


def remote_part(options: argparse.Namespace, tmp: Path) -> tuple[list[float], list[float]]:
    tag = f"b{os.getpid() % 1000}"
    managers: list[UserManager] = []
    sups: list[subprocess.Popen[bytes]] = []
    pollers: list[Poller] = []
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        network = make_network(tag, 2)
        nodes = "[{name: node-a, address: 192.0.2.1}, {name: node-b, address: 192.0.2.2}]"
        spec = tmp / "two.yaml"
        spec.write_text("\n".join(["replicas:", *replica_lines("rep", nodes=nodes, ranks=2)])
                        + "\n")
        for name, ns in zip(("node-a", "node-b"), network):
            manager = UserManager(f"llmgw-bench-{tag}-{name}", tmp / name, netns=ns)
            managers.append(manager)
            manager.start()
            manager.render(spec, name)
            manager.systemctl("start", "llmgw-rep.target")
            sups.append(start_supervisor(manager, spec, name, f"{ns.address}:9470",
                                         tmp / f"state-{name}"))
        pollers = [Poller(ns.address, 9470, "rep", netns=ns.name) for ns in network]
        remote: list[float] = []
        local: list[float] = []
        worker = managers[1]
        for _ in range(options.trials):
            wait_until(lambda: all(p.state == "ready" for p in pollers), 60, "both ready")
            pid = int(worker.show("llmgw-rep-engine.service", "MainPID")["MainPID"])
            assert pid > 1
            for poller in pollers:
                poller.left_ready, poller.armed = None, True
            started = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: all(p.left_ready is not None for p in pollers), 10,
                       "both APIs to see the death", interval=0.001)
            remote.append(pollers[0].left_ready - started)  # type: ignore[operator]
            local.append(pollers[1].left_ready - started)  # type: ignore[operator]
            for poller in pollers:
                poller.armed = False
        return remote, local
    finally:
        for poller in pollers:
            poller.stop.set()
        for sup in sups:
            sup.send_signal(signal.SIGTERM)
            sup.wait(timeout=20)
        for manager in managers:
            manager.stop()
        remove_network(tag)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _get(port: int, path: str) -> object:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def _shards(port: int) -> int:
    try:
        data = _get(port, "/v1/shards")
    except OSError:
        return -1
    assert isinstance(data, dict)
    return len(data["shards"])


def _all_ready(port: int, replicas: int) -> bool:
    try:
        data = _get(port, "/v1/shards")
    except OSError:
        return False
    assert isinstance(data, dict)
    shards = data["shards"]
    return len(shards) == replicas and all(s["state"] == "ready" for s in shards)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--idle", type=float, default=30.0)
    parser.add_argument("--units", type=int, default=100)
    parser.add_argument("--part", choices=("all", "local", "remote"), default="all",
                        help="run only the one-node part (latency, idle CPU, RSS) or only "
                             "the two-node part")
    options = parser.parse_args()
    # a SIGTERM unwinds like an exception, so every manager and namespace is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmp:
        local = (local_part(options, Path(tmp) / "one") if options.part != "remote"
                 else None)
        remote, remote_local = (remote_part(options, Path(tmp) / "two")
                                if options.part != "local" else ([], []))

    def ms(values: list[float]) -> str:
        return (f"{statistics.median(values) * 1000:>10.1f} "
                f"{sorted(values)[int(len(values) * 0.9)] * 1000:>8.1f} "
                f"{max(values) * 1000:>8.1f}")

    print(f"{'':34} {'median ms':>10} {'p90 ms':>8} {'max ms':>8}")
    if local is not None:
        raw, via_api = local.raw, local.via_api
        print(f"{'local: first D-Bus signal (any)':34} {ms(local.first_signal)}")
        print(f"{'local: raw signal: unit not active':34} {ms(raw)}")
        print(f"{'local: supervisor API':34} {ms(via_api)}")
        print("  API / raw (median): "
              f"{statistics.median(via_api) / statistics.median(raw):.2f} (goal <= 2)")
    if remote:
        print(f"{'remote: node-b API (local path)':34} {ms(remote_local)}")
        print(f"{'remote: node-a API (other node)':34} {ms(remote)}")
        print(f"  remote median: {statistics.median(remote) * 1000:.1f} ms (goal <= 100 ms), "
              f"{statistics.median(remote) / statistics.median(remote_local):.2f} x the "
              "local path")
    if local is not None:
        for key, label, goal in (("idle_active", "all active", 0.5),
                                 ("idle_mixed", "active/stopped/unstarted/unrendered", 0.5),
                                 ("idle_churn", "the mix + 10 transient units/s", 1.0)):
            units, cpu = local.idle[key]
            print(f"idle CPU, {label}, {units} units: {cpu:.2f} % of one core "
                  f"(goal <= {goal} %)")
        print(f"RSS: {local.rss:.1f} MB (goal <= 60 MB)")
    print(f"trials: {options.trials} each part; idle windows {options.idle:g} s")


if __name__ == "__main__":
    main()
