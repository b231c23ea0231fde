"""Scale: one real supervisor among N-1 simulated peer nodes, for N = 2 ... 64.

The real supervisor runs under a real systemd user manager with its own shard (rank 0 of
a replica of N ranks) real; the other N-1 nodes are simulated in this process, on one
asyncio loop: each listens on its own loopback address with its own certificate from
the cluster CA, answers GET /v1/shards in the documented wire format (the long-poll
honoured, keep-alive honoured) and polls the real supervisor as a real peer does, with
its client certificate. Each peer polls as the code under test does: a new connection
(and TLS handshake) per poll for a supervisor that sends `Connection: close`, one kept
connection otherwise.

For each N, the code of a baseline revision (--baseline, a git ref of this repository)
and the working tree's, side by side in one run:
- idle CPU of the supervisor (% of one core) over --idle seconds, its RSS and threads,
  its open sockets, and the TLS handshakes per second it takes part in (as client and as
  server) and how many of them resumed a session;
- remote death: one simulated rank reports `failed`; the time until the real
  supervisor's API (GET /v1/replicas/wide on its local listener, polled every ms over
  one connection) no longer says ready: median, p99 and max over --deaths deaths.

With --real N,...: also N real supervisors, each on its own user manager in its own
network namespace (a bridge in a namespace of its own, no link to the root one), their
shards real: the mean idle CPU, and SIGKILL of a rank's engine on another node until
node 0's API says so.

Needs root (private systemd user managers, namespaces). Run:
    .venv/bin/python bench/scale.py [--baseline REF] [--sizes 2,8,16,32,64] [--real 4]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import functools
import http.client
import json
import os
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / d) for d in ("", "support", "integration", "engines")]


from certs import cluster  # noqa: E402
from specs import free_port  # noqa: E402
from systemd_harness import (  # noqa: E402
    UserManager,
    make_network,
    remove_network,
    wait_until,
)

from llmgw_systemd.gather.tls import TlsFiles  # noqa: E402
from llmgw_systemd.supervisor.config import SupervisorConfig  # noqa: E402

REPLICA = "wide"
GENERATION = "5ca1e"  # what every simulated rank reports as its engine's start
PEER_WAIT = SupervisorConfig.peer_wait  # the long-poll wait a real peer asks for
PORT = SupervisorConfig.listen_port  # the real nodes' API, each in its own namespace
CLONE_NEWNET = 0x40000000


def address(rank: int) -> str:
    return f"127.0.1.{rank + 1}"


def node_name(rank: int) -> str:
    return f"n{rank:02d}"


def spec_text(nodes: int, group_restart_delay: int = 3600) -> str:
    listed = ", ".join(f"{{name: {node_name(r)}, address: {address(r)}}}"
                       for r in range(nodes))
    rank = "{commands: [{argv: [/usr/bin/sleep, infinity]}]}"
    return "\n".join([
        "replicas:", f"  - name: {REPLICA}", "    engine: command", "    serving_rank: null",
        "    restart: {delay: 1, burst: 1000, interval: 100000}",
        "    health: {stability: 0}",
        # a simulated rank's death must not set off a group restart inside a trial (it
        # comes back by itself); a real one's must, at once, for the next trial
        f"    group_restart: {{delay: {group_restart_delay}, max_delay: "
        f"{group_restart_delay}, budget: 1000, window: 100000}}",
        f"    nodes: [{listed}]", f"    ranks: [{', '.join([rank] * nodes)}]"]) + "\n"


# -- the simulated peers ---------------------------------------------------------------


@dataclass
class Counters:
    server_handshakes: int = 0
    server_resumed: int = 0
    client_handshakes: int = 0
    client_resumed: int = 0
    requests_served: int = 0
    polls: int = 0

    def snapshot(self) -> tuple[int, int, int, int, int, int]:
        return (self.server_handshakes, self.server_resumed, self.client_handshakes,
                self.client_resumed, self.requests_served, self.polls)


@dataclass
class SimNode:
    rank: int
    tls: TlsFiles
    state: str = "ready"
    version: int = 1
    digest: str = ""
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # its engine started ten minutes ago and runs on: each answer's clock moves on, so
    # how long it has run grows from answer to answer, as a real peer's does
    started: int = field(default_factory=lambda: max(0, int(time.monotonic()) - 600))

    def report(self) -> bytes:
        clock = int(time.monotonic())
        return json.dumps({
            "node": node_name(self.rank), "version": self.version, "clock": clock,
            "shards": [{"replica": REPLICA, "rank": self.rank, "node": node_name(self.rank),
                        "state": self.state, "reason": "simulated", "generation": GENERATION,
                        "serving": False, "started": self.started,
                        "draining": None, "drained": False,
                        "spec": {"loaded": self.digest, "running": self.digest}}]}).encode()

    def bump(self, state: str) -> None:
        self.state, self.version = state, self.version + 1
        self.changed.set()
        self.changed = asyncio.Event()


class Simulator:
    """N-1 simulated nodes on one asyncio loop in a thread."""

    def __init__(self, nodes: list[SimNode], real: tuple[str, int]) -> None:
        self.nodes, self.real = nodes, real
        # whether the real supervisor keeps its connections to peers: learnt from its
        # first request, and then done the same way towards it
        self.keep_alive: bool | None = None
        self.learnt: asyncio.Event | None = None
        self.count = Counters()
        self.loop = asyncio.new_event_loop()
        self.servers: list[asyncio.Server] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self, port: int) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(port), self.loop).result(60)

    def call(self, fn: object, *args: object) -> None:
        self.loop.call_soon_threadsafe(fn, *args)  # type: ignore[arg-type]

    def stop(self) -> None:
        async def _stop() -> None:
            for server in self.servers:
                server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        asyncio.run_coroutine_threadsafe(_stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)

    async def _start(self, port: int) -> None:
        self.learnt = asyncio.Event()
        for node in self.nodes:
            node.changed = asyncio.Event()  # bound to this loop
            server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH,
                                                    cafile=node.tls.ca)
            server_ctx.load_cert_chain(node.tls.cert, node.tls.key)
            server_ctx.verify_mode = ssl.CERT_REQUIRED
            self.servers.append(await asyncio.start_server(
                functools.partial(self._serve, node), address(node.rank), port,
                ssl=server_ctx))
            client_ctx = ssl.create_default_context(cafile=node.tls.ca)
            client_ctx.load_cert_chain(node.tls.cert, node.tls.key)
            self.tasks.append(asyncio.create_task(self._poll(node, client_ctx)))

    async def _serve(self, node: SimNode, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        tls = writer.get_extra_info("ssl_object")
        self.count.server_handshakes += 1
        self.count.server_resumed += bool(tls is not None and tls.session_reused)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                target = lines[0].split(" ")[1]
                close = any(line.lower() == "connection: close" for line in lines[1:])
                if self.keep_alive is None and self.learnt is not None:
                    self.keep_alive = not close
                    self.learnt.set()
                query = parse_qs(urlsplit(target).query)
                if "after" in query:
                    after, wait = int(query["after"][0]), float(query["wait"][0])
                    if node.version <= after:
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(node.changed.wait(), wait)
                body = node.report()
                self.count.requests_served += 1
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             + f"Content-Length: {len(body)}\r\n".encode()
                             + (b"Connection: close\r\n" if close else b"") + b"\r\n" + body)
                await writer.drain()
                if close:
                    break
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                IndexError, ValueError):
            pass
        finally:
            writer.close()

    async def _poll(self, node: SimNode, context: ssl.SSLContext) -> None:
        """Long-polls the real supervisor as a real peer does."""
        host, port = self.real
        assert self.learnt is not None
        await self.learnt.wait()
        after: int | None = None
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        while True:
            try:
                if conn is None:
                    conn = await asyncio.wait_for(asyncio.open_connection(
                        host, port, ssl=context, server_hostname=node_name(0)), 10)
                    tls = conn[1].get_extra_info("ssl_object")
                    self.count.client_handshakes += 1
                    self.count.client_resumed += bool(tls is not None and tls.session_reused)
                reader, writer = conn
                query = "" if after is None else f"?after={after}&wait={PEER_WAIT:g}"
                close = "" if self.keep_alive else "Connection: close\r\n"
                writer.write(f"GET /v1/shards{query} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                             f"User-Agent: llmgw-supervisor\r\nAccept: application/json\r\n"
                             f"{close}\r\n".encode())
                await writer.drain()
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), PEER_WAIT + 10)
                length = next(int(line.split(":", 1)[1]) for line in
                              head.decode("latin-1").split("\r\n")
                              if line.lower().startswith("content-length:"))
                body = await asyncio.wait_for(reader.readexactly(length), 10)
                after = int(json.loads(body)["version"])
                self.count.polls += 1
                if not self.keep_alive or b"connection: close" in head.lower():
                    writer.close()
                    conn = None
            except asyncio.CancelledError:
                raise
            except Exception:  # the supervisor restarting, or not up yet
                if conn is not None:
                    conn[1].close()
                conn, after = None, None
                await asyncio.sleep(0.25)


# -- one supervisor under measure ---------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def status_field(pid: int, name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return int(line.split()[1])
    return 0


def sockets(pid: int) -> int:
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            count += os.readlink(fd).startswith("socket:")
    return count


class ApiPoller:
    """GET /v1/replicas/wide on the local listener every `interval` s over one kept
    connection; notes when it first stops saying ready once armed."""

    def __init__(self, port: int, interval: float = 0.001) -> None:
        self.port, self.interval = port, interval
        self.state = ""
        self.armed = False
        self.left_ready: float | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        while not self.stop.is_set():
            try:
                conn.request("GET", f"/v1/replicas/{REPLICA}")
                self.state = str(json.loads(conn.getresponse().read()).get("state"))
            except (OSError, ValueError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                self.state = "error"
                time.sleep(0.05)
            if self.armed and self.state != "ready" and self.left_ready is None:
                self.left_ready = time.perf_counter()
            time.sleep(self.interval)


@dataclass
class Figures:
    cpu: float = 0.0
    rss: float = 0.0
    threads: int = 0
    sockets: int = 0
    handshakes: float = 0.0
    resumed: int = 0
    requests: float = 0.0
    deaths: list[float] = field(default_factory=list)


def baseline_tree(ref: str, into: Path) -> Path:
    """The package as it was at `ref`, extracted (git archive) for PYTHONPATH."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "llmgw_systemd"],
                             capture_output=True, check=True, timeout=60).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True, timeout=60)
    return into


def measure(code: Path, nodes: int, tmp: Path, options: argparse.Namespace) -> Figures:
    tmp.mkdir(parents=True)
    files = cluster(tmp / "tls", [(node_name(r), address(r)) for r in range(nodes)])
    spec = tmp / "spec.yaml"
    spec.write_text(spec_text(nodes))
    manager = UserManager(f"llmgw-scale-{os.getpid()}-{nodes}-{tmp.name}", tmp / "node")
    manager.start()
    supervisor: subprocess.Popen[bytes] | None = None
    sim: Simulator | None = None
    poller: ApiPoller | None = None
    out = Figures()
    try:
        manager.render(spec, node_name(0))
        manager.systemctl("start", f"llmgw-{REPLICA}.target")
        port, local = free_port(), free_port()
        mine = files[node_name(0)]
        argv = [sys.executable, "-c", "import sys; sys.argv[0] = 'llmgw-supervisor'; "
                "from llmgw_systemd.cli import supervisor_main; supervisor_main()",
                "--user", "--node", node_name(0), "--listen", f"{address(0)}:{port}",
                "--local", f"127.0.0.1:{local}", "--state-dir", str(tmp / "state"),
                "--tls-cert", mine.cert, "--tls-key", mine.key, "--tls-ca", mine.ca,
                str(spec)]
        env = {**manager.env, "PYTHONPATH": str(code)}
        # cwd: `python -c` puts the working directory first on sys.path, before
        # PYTHONPATH: run from this repository, the baseline would import today's code
        with open(tmp / "supervisor.log", "wb") as errors:
            supervisor = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                                          stderr=errors, cwd=tmp)
        wait_until(lambda: _own_digest(local), 60, "the supervisor's API")
        sims = [SimNode(r, files[node_name(r)], digest=_own_digest(local) or "")
                for r in range(1, nodes)]
        sim = Simulator(sims, (address(0), port))
        sim.start(port)
        poller = ApiPoller(local)
        wait_until(lambda: poller is not None and poller.state == "ready", 120,
                   f"{REPLICA} ready with {nodes} nodes")
        time.sleep(options.settle)

        before_cpu, before = cpu_seconds(supervisor.pid), sim.count.snapshot()
        poller.interval = 0.5  # the measuring poll must not be what is measured
        time.sleep(options.idle)
        after_cpu, after = cpu_seconds(supervisor.pid), sim.count.snapshot()
        out.cpu = (after_cpu - before_cpu) / options.idle * 100
        out.rss = status_field(supervisor.pid, "VmRSS") / 1024
        out.threads = status_field(supervisor.pid, "Threads")
        out.sockets = sockets(supervisor.pid)
        deltas = [b - a for a, b in zip(before, after)]
        out.handshakes = (deltas[0] + deltas[2]) / options.idle
        out.resumed = deltas[1] + deltas[3]
        out.requests = (deltas[4] + deltas[5]) / options.idle
        poller.interval = 0.001

        for trial in range(options.deaths if nodes > 1 else 0):
            victim = sims[trial % len(sims)]
            wait_until(lambda: poller is not None and poller.state == "ready", 60, "ready")
            time.sleep(0.2)
            poller.left_ready, poller.armed = None, True
            started = time.perf_counter()
            sim.call(victim.bump, "failed")
            wait_until(lambda: poller is not None and poller.left_ready is not None, 30,
                       "the API to see the death", interval=0.001)
            assert poller.left_ready is not None
            out.deaths.append(poller.left_ready - started)
            poller.armed = False
            sim.call(victim.bump, "ready")
        return out
    finally:
        if poller is not None:
            poller.stop.set()
        if supervisor is not None:
            supervisor.send_signal(signal.SIGTERM)
            supervisor.wait(timeout=30)
        if sim is not None:
            sim.stop()
        manager.stop()


def supervisor_argv(node: int, listen: str, local: int, state: Path, tls: TlsFiles,
                    spec: Path, netns: str | None = None) -> list[str]:
    argv = [sys.executable, "-c", "import sys; sys.argv[0] = 'llmgw-supervisor'; "
            "from llmgw_systemd.cli import supervisor_main; supervisor_main()",
            "--user", "--node", node_name(node), "--listen", listen,
            "--local", f"127.0.0.1:{local}", "--state-dir", str(state),
            "--tls-cert", tls.cert, "--tls-key", tls.key, "--tls-ca", tls.ca, str(spec)]
    return ["nsenter", f"--net=/run/netns/{netns}", *argv] if netns else argv


def measure_real(code: Path, nodes: int, tmp: Path, options: argparse.Namespace) -> Figures:
    """N real supervisors, each on its own user manager in its own network namespace,
    their shards real: idle CPU (the mean of all; `threads` and `sockets` of node 0),
    and SIGKILL of a rank's engine on another node until node 0's API says so."""
    tmp.mkdir(parents=True)
    tag = f"sc{os.getpid() % 1000}{nodes}{tmp.name[0]}"
    managers: list[UserManager] = []
    sups: list[subprocess.Popen[bytes]] = []
    poller = None
    out = Figures()
    try:
        network = make_network(tag, nodes)
        files = cluster(tmp / "tls", [(node_name(r), ns.address)
                                      for r, ns in enumerate(network)])
        spec = tmp / "spec.yaml"
        spec.write_text(spec_text(nodes, group_restart_delay=1).replace("127.0.1.", "192.0.2."))
        local = free_port()
        for rank, ns in enumerate(network):
            manager = UserManager(f"llmgw-scale-{tag}-{rank}", tmp / f"node{rank}", netns=ns)
            managers.append(manager)
            manager.start()
            manager.render(spec, node_name(rank))
            manager.systemctl("start", f"llmgw-{REPLICA}.target")
        for rank, (manager, ns) in enumerate(zip(managers, network)):
            env = {**manager.env, "PYTHONPATH": str(code)}
            with open(tmp / f"supervisor-{rank}.log", "wb") as errors:
                sups.append(subprocess.Popen(
                    supervisor_argv(rank, f"{ns.address}:{PORT}", local, tmp / f"state{rank}",
                                    files[node_name(rank)], spec, ns.name),
                    env=env, stdout=subprocess.DEVNULL, stderr=errors, cwd=tmp))
        poller = NetnsPoller(network[0].name, local)
        wait_until(lambda: poller is not None and poller.state == "ready", 180,
                   f"{REPLICA} ready on {nodes} real nodes")
        time.sleep(options.settle)
        pids = [s.pid for s in sups]  # nsenter execs the supervisor: the same PID
        poller.interval = 0.5
        before = [cpu_seconds(pid) for pid in pids]
        time.sleep(options.idle)
        used = [cpu_seconds(pid) - b for pid, b in zip(pids, before)]
        out.cpu = statistics.mean(used) / options.idle * 100
        out.rss = status_field(pids[0], "VmRSS") / 1024
        out.threads = status_field(pids[0], "Threads")
        out.sockets = sockets(pids[0])
        poller.interval = 0.001
        for trial in range(options.deaths):
            victim = managers[1 + trial % (nodes - 1)]
            wait_until(lambda: poller is not None and poller.state == "ready", 120, "ready")
            time.sleep(0.2)
            pid = int(victim.show(f"llmgw-{REPLICA}-engine.service", "MainPID")["MainPID"])
            poller.left_ready, poller.armed = None, True
            started = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: poller is not None and poller.left_ready is not None, 30,
                       "node 0's API to see the death", interval=0.001)
            assert poller.left_ready is not None
            out.deaths.append(poller.left_ready - started)
            poller.armed = False
        return out
    finally:
        if poller is not None:
            poller.stop.set()
        for sup in sups:
            sup.send_signal(signal.SIGTERM)
            sup.wait(timeout=30)
        for manager in managers:
            manager.stop()
        remove_network(tag)


class NetnsPoller(ApiPoller):
    """ApiPoller from inside a network namespace (its thread only enters it)."""

    def __init__(self, netns: str, port: int) -> None:
        self.netns = netns
        super().__init__(port)

    def run(self) -> None:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        fd = os.open(f"/run/netns/{self.netns}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns {self.netns}")
        finally:
            os.close(fd)
        super().run()


def _get(port: int, path: str) -> object:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        data = json.loads(response.read())
        return data if response.status == 200 else None
    finally:
        conn.close()


def _own_digest(local: int) -> str | None:
    """This node's units' spec digest, as its supervisor reports it (None: not up)."""
    try:
        data = _get(local, "/v1/shards")
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not data.get("shards"):
        return None
    return str(data["shards"][0].get("spec", {}).get("loaded", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--baseline", default="ba4965f",
                        help="git ref of the code to compare with (default: before the "
                             "supervisor's one runtime)")
    parser.add_argument("--sizes", default="2,8,16,32,64")
    parser.add_argument("--idle", type=float, default=20.0)
    parser.add_argument("--settle", type=float, default=5.0)
    parser.add_argument("--deaths", type=int, default=20)
    parser.add_argument("--real", default="",
                        help="comma-separated N: also N real supervisors in namespaces")
    parser.add_argument("--only", choices=("baseline", "now"),
                        help="measure one code only (for profiling it)")
    options = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sizes = [int(n) for n in options.sizes.split(",") if n]
    results: dict[tuple[str, int], Figures] = {}
    with tempfile.TemporaryDirectory(prefix="llmgw-scale-") as tmp:
        codes = {"baseline": baseline_tree(options.baseline, Path(tmp) / "baseline"),
                 "now": ROOT}
        if options.only:
            codes = {options.only: codes[options.only]}
        for nodes in sizes:
            for label, code in codes.items():
                results[(label, nodes)] = measure(code, nodes, Path(tmp) / f"{label}-{nodes}",
                                                  options)
                print(f"  measured {label} at N={nodes}", file=sys.stderr, flush=True)
        real = [int(n) for n in options.real.split(",") if n]
        for nodes in real:
            for label, code in codes.items():
                results[(f"{label} real", nodes)] = measure_real(
                    code, nodes, Path(tmp) / f"r{label}-{nodes}", options)
                print(f"  measured {label} with {nodes} real nodes", file=sys.stderr,
                      flush=True)

    def ms(values: list[float], q: float) -> str:
        if not values:
            return "-"
        return f"{sorted(values)[min(len(values) - 1, int(len(values) * q))] * 1000:.0f}"

    print(f"baseline: {options.baseline}; idle window {options.idle:g} s; "
          f"{options.deaths} deaths each")
    print(f"{'N':>3} {'code':13} {'CPU %':>6} {'RSS MB':>7} {'threads':>7} {'sockets':>7} "
          f"{'TLS hs/s':>8} {'resumed':>7} {'req/s':>6} {'death p50/p99/max ms':>21}")
    rows = [(label, nodes) for nodes in sizes for label in codes]
    rows += [(f"{label} real", nodes) for nodes in real for label in codes]
    if real:
        print("'real': N real supervisors (CPU: their mean; RSS, threads, sockets: node 0's)")
    for label, nodes in rows:
        f = results[(label, nodes)]
        deaths = (f"{statistics.median(f.deaths) * 1000:.0f}/{ms(f.deaths, 0.99)}/"
                  f"{max(f.deaths) * 1000:.0f}" if f.deaths else "-")
        print(f"{nodes:>3} {label:13} {f.cpu:>6.2f} {f.rss:>7.1f} {f.threads:>7} "
              f"{f.sockets:>7} {f.handshakes:>8.1f} {f.resumed:>7} {f.requests:>6.1f} "
              f"{deaths:>21}")


if __name__ == "__main__":
    main()
