"""llmgw-supervisor: replica health from systemd over D-Bus, group restarts, API, metrics.

Everything it reports is rebuilt from systemd and from the peers' own reports; the only
state it keeps is what cannot be read back (probe results, when a replica last was
ready, the times of its own group restarts), so a restarted supervisor loses nothing
that matters. Threads: the D-Bus signal loop (a trigger only), probes and peer fetches
(each bounded by a timeout), the HTTP server, and the reconcile loop that owns the state.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from . import health as states
from .errors import LlmgwError
from .grouprestart import GIVE_UP, NOW, decide
from .health import Health, Probe, RankReport, replica_health
from .sdnotify import notify, watchdog_interval
from .shards import LocalShard, ShardStatus, local_shards, probe_shard, read_status
from .sources import read_documents, spec_files
from .spec import Replica, Spec, build_spec
from .systemd_dbus import BusError, SystemdBus

API_VERSION = "v1"


@dataclass(frozen=True)
class SupervisorConfig:
    specs: tuple[str, ...]
    node: str
    user: bool = False
    listen_host: str = "127.0.0.1"
    listen_port: int = 9470
    peer_port: int = 9470
    reconcile_interval: float = 5.0  # the slow timer; signals trigger sooner
    # One stop sends ~5 signals: they coalesce (a burst during a reconcile causes one
    # more); an extra delay here would only add to the detection latency.
    debounce: float = 0.0
    peer_interval: float = 0.5
    peer_timeout: float = 2.0
    dbus_timeout: float = 5.0


def log(message: str) -> None:
    print(f"llmgw-supervisor: {message}", file=sys.stderr, flush=True)


@dataclass
class ReplicaView:
    """What the supervisor knows about one replica with a shard on this node."""

    health: Health
    ranks: list[RankReport]
    restarts: list[float] = field(default_factory=list)
    failing_since: float | None = None
    ready_generations: dict[int, int] | None = None  # the baseline a death is seen from
    candidate: dict[int, int] | None = None  # generations settling into a baseline
    ready_since: float | None = None
    next_restart: str = ""


class Supervisor:
    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self.bus = SystemdBus(user=config.user, timeout=config.dbus_timeout)
        self.lock = threading.RLock()
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.spec: Spec | None = None
        self.spec_stamp: tuple[tuple[str, float], ...] = ()
        self.shards: list[LocalShard] = []
        self.statuses: dict[str, ShardStatus] = {}
        self.generations: dict[str, int] = {}
        self.probes: dict[str, Probe | None] = {}
        self.probe_due: dict[str, float] = {}
        self.ready_invocation: dict[str, int] = {}  # replica -> engine start it was ready in
        self.peers: dict[tuple[str, int], tuple[float, RankReport, int]] = {}
        self.replicas: dict[str, ReplicaView] = {}
        self.bus_error: str = ""
        self.last_full = 0.0
        self.probe_changed: set[str] = set()
        self.version = 0  # bumped by every reconcile: API answers are cached per version
        self.api_cache: dict[str, tuple[int, bytes]] = {}
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="probe")
        self.in_flight: set[str] = set()
        self.metrics = _Metrics()
        self.server: ThreadingHTTPServer | None = None

    # -- configuration ------------------------------------------------------------------

    def load_spec(self) -> None:
        """(Re)read the specs when they changed; a bad spec keeps the last good one."""
        try:
            files = spec_files(self.config.specs)
            stamp = tuple((f, os.stat(f).st_mtime) for f in files)
        except (OSError, LlmgwError) as exc:
            stamp = (("error", 0.0),)
            if self.spec is None:
                raise LlmgwError(f"cannot read the spec: {exc}") from None
        if stamp == self.spec_stamp:
            return
        self.spec_stamp = stamp
        try:
            spec = build_spec(read_documents(self.config.specs))
            shards = local_shards(spec, self.config.node)
        except LlmgwError as exc:
            if self.spec is None:
                raise
            log(f"spec reload failed, keeping the last good configuration: {exc}")
            return
        with self.lock:
            self.spec, self.shards = spec, shards
            names = {s.replica.name for s in shards}
            for table in (self.statuses, self.probes, self.probe_due, self.replicas):
                for gone in set(table) - names:
                    del table[gone]
        log(f"watching {len(shards)} shard(s) on node {self.config.node}: "
            f"{', '.join(s.replica.name for s in shards) or 'none'}")

    # -- the loop -----------------------------------------------------------------------

    def run(self) -> None:
        self.load_spec()
        self._start_http()
        self._watch()
        threading.Thread(target=self._probe_loop, name="probes", daemon=True).start()
        threading.Thread(target=self._peer_loop, name="peers", daemon=True).start()
        self.reconcile()
        notify("READY=1")
        ping = watchdog_interval()
        last_ping = 0.0
        while not self.stopping.is_set():
            timeout = self.config.reconcile_interval
            if ping is not None:
                timeout = min(timeout, ping)
            if self.wake.wait(timeout) and self.config.debounce:
                time.sleep(self.config.debounce)
            self.wake.clear()
            self.load_spec()
            self.reconcile()
            if ping is not None and time.monotonic() - last_ping >= ping:
                notify("WATCHDOG=1")
                last_ping = time.monotonic()

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()
        if self.server is not None:
            self.server.shutdown()
        self.bus.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _watch(self) -> None:
        try:
            self.bus.watch(lambda _path: self.wake.set())
        except BusError as exc:
            self.bus_error = str(exc)
            log(f"cannot watch systemd yet: {exc}")

    def reconcile(self) -> None:
        """Read systemd and judge. On a slow tick, everything; on signals, only the
        shards whose units signalled (one stop of one unit costs a read of 3 units, not
        of every unit on the node)."""
        now = time.monotonic()
        slow_tick = now - self.last_full >= self.config.reconcile_interval
        with self.lock:
            shards = list(self.shards)
            probes = dict(self.probes)
            was_ready = frozenset(r for r, inv in self.ready_invocation.items()
                                  if inv == self.generations.get(r))
        try:
            if slow_tick:
                self.bus.resubscribe()  # cheap; signals come back after a daemon-reexec
            changed = self.bus.changed_units()
            with self.lock:
                probed, self.probe_changed = self.probe_changed, set()
            if not slow_tick and changed is not None and not self.bus_error:
                shards = [s for s in shards if s.replica.name in probed or
                          changed & {s.plan.target.name, *s.members}]
            else:
                self.last_full = now
            if shards and not slow_tick and not self.bus_error:
                # a first look from the bulk call alone, published at once: this is what
                # makes a dead member visible within milliseconds of systemd's signal
                self._publish(read_status(self.bus, shards, probes, was_ready,
                                          properties=False), time.monotonic(),
                              all_replicas=False)
            statuses = read_status(self.bus, shards, probes, was_ready) if shards else []
            if self.bus_error:
                log("systemd is reachable again")
                self.bus_error = ""
                self._watch()  # a new connection needs Subscribe() again
        except BusError as exc:
            if not self.bus_error:
                log(f"lost systemd: {exc}")
            self.bus_error = str(exc)
            self.bus.reconnect()
            statuses = []
        self._publish(statuses, time.monotonic())
        self.metrics.update(self)
        ready = sum(1 for v in self.replicas.values() if v.health.state == states.READY)
        notify(f"STATUS={len(self.replicas)} replica(s), {ready} ready"
               + (f"; systemd unreachable: {self.bus_error}" if self.bus_error else ""))

    def _publish(self, statuses: Sequence[ShardStatus], now: float, *,
                 all_replicas: bool = True) -> None:
        with self.lock:
            for status in statuses:
                self.statuses[status.replica] = status
                self.generations[status.replica] = max(
                    (u.active_enter_usec for u in status.units[1:]), default=0)
            if self.bus_error:
                self.statuses = {}
            touched = {s.replica for s in statuses}
            for shard in self.shards:
                if all_replicas or shard.replica.name in touched:
                    self._judge_replica(shard, now)
            self.version += 1

    # -- replica health and group restarts (under self.lock) ----------------------------

    def _local_report(self, shard: LocalShard) -> RankReport:
        status = self.statuses.get(shard.replica.name)
        if status is None:
            reason = f"systemd unreachable: {self.bus_error}" if self.bus_error else "no data"
            return RankReport(shard.plan.rank, shard.plan.node, states.UNKNOWN, reason)
        return RankReport(status.rank, status.node, status.health.state, status.health.reason)

    def _judge_replica(self, shard: LocalShard, now: float) -> None:
        replica = shard.replica
        reports = [self._local_report(shard)]
        generations = {shard.plan.rank: self.generations.get(replica.name, 0)}
        for rank, node in enumerate(replica.nodes):
            if rank == shard.plan.rank:
                continue
            seen = self.peers.get((replica.name, rank))
            stale = 3 * self.config.peer_interval + self.config.peer_timeout
            if seen is None:
                reports.append(RankReport(rank, node.name, states.UNKNOWN,
                                          f"no report yet from the supervisor on {node.name}"))
            elif now - seen[0] > stale and seen[1].state != states.UNKNOWN:
                age = now - seen[0]
                reports.append(RankReport(rank, node.name, states.UNKNOWN, "report from the "
                                          f"supervisor on {node.name} is {age:.0f} s old"))
            else:
                reports.append(seen[1])
                generations[rank] = seen[2]
        health = replica_health(reports, len(replica.nodes))
        view = self.replicas.setdefault(replica.name, ReplicaView(health, reports))
        view.ranks = sorted(reports, key=lambda r: r.rank)
        if health.state == states.STOPPED:
            view.failing_since, view.ready_generations, view.health = None, None, health
            return
        # A rank restarted if its units started again since the replica was ready; a
        # stopped rank is not one (it was stopped, and its units may be unloaded).
        baseline = view.ready_generations
        running = {r.rank for r in reports if r.state not in (states.STOPPED, states.UNKNOWN)}
        restarted = sorted(k for k, gen in (baseline or {}).items()
                           if k in running and generations.get(k, gen) not in (0, gen))
        failed = [r.rank for r in reports if r.state == states.FAILED]
        if restarted and not failed and all(k in restarted for k in range(len(replica.nodes))):
            restarted = []  # every rank started afresh (or the only one did): nothing stale
        if not restarted and not failed:
            if health.state == states.READY:
                view.failing_since, view.next_restart = None, ""
                if baseline is None:
                    self._settle(view, replica, generations, now)
                else:
                    view.ready_generations = generations
            else:
                view.candidate, view.ready_since = None, None
            view.health = health
            return
        # A rank died (it failed, or restarted since the replica was last ready): the
        # others hold state that died with it (a Ray placement group, a torch process
        # group), so every rank restarts together, with backoff and a budget.
        died = "; ".join([*(f"rank {k} restarted" for k in restarted),
                          *(f"rank {k} failed" for k in failed)])
        if view.failing_since is None:
            view.failing_since = now
        decision = decide(replica.group_restart, tuple(view.restarts), view.failing_since, now)
        if decision.action == GIVE_UP:
            view.health = Health(states.FAILED, f"{died}; {decision.reason}")
            view.next_restart = ""
            return
        state = states.FAILED if failed else states.DEGRADED
        view.health = Health(state, f"{died}; {decision.reason}")
        view.next_restart = decision.reason
        if decision.action == NOW:
            mine = shard.plan.rank
            fresh = mine in restarted and reports[0].state != states.FAILED
            self._group_restart(shard, view, now, decision.reason, skip=fresh)

    def _settle(self, view: ReplicaView, replica: Replica, generations: dict[int, int],
                now: float) -> None:
        """Take the generations a replica is ready with as the baseline only once they
        held still for a while: right after a (group) restart, peer reports lag by up to
        a poll, and a rank that lost its rendezvous restarts a little later on its own;
        neither may count as a new death."""
        settle = (3 * self.config.peer_interval + self.config.peer_timeout
                  + replica.restart.delay + 1)
        if view.candidate != generations:
            view.candidate, view.ready_since = dict(generations), now
        elif view.ready_since is not None and now - view.ready_since >= settle:
            view.ready_generations = dict(generations)

    def _group_restart(self, shard: LocalShard, view: ReplicaView, now: float,
                       why: str, *, skip: bool) -> None:
        """Restart this node's shard; every rank's supervisor does the same for its own.
        A shard that already restarted since the replica was ready is fresh: left as is."""
        target = shard.plan.target.name
        if skip:
            log(f"{shard.replica.name}: a rank died; this node's shard already restarted "
                f"({why})")
        else:
            log(f"{shard.replica.name}: a rank died; restarting this node's shard "
                f"({target}): {why}")
            try:
                self.bus.restart(target)
            except BusError as exc:
                log(f"{shard.replica.name}: restart of {target} failed: {exc}")
                return
        view.restarts.append(now)
        view.failing_since = None
        # the next settled ready state sets the new baseline
        view.ready_generations, view.candidate, view.ready_since = None, None, None
        self.metrics.group_restarts.labels(replica=shard.replica.name).inc()

    # -- probes and peers ----------------------------------------------------------------

    def _probe_loop(self) -> None:
        while not self.stopping.wait(0.2):
            now = time.monotonic()
            with self.lock:
                due = [s for s in self.shards if s.serving and s.replica.name not in
                       self.in_flight and self.probe_due.get(s.replica.name, 0) <= now]
                for shard in due:
                    self.in_flight.add(shard.replica.name)
                    self.probe_due[shard.replica.name] = now + shard.replica.health.interval
            for shard in due:
                self.pool.submit(self._probe, shard)

    def _probe(self, shard: LocalShard) -> None:
        name = shard.replica.name
        try:
            started = time.monotonic()
            result = probe_shard(shard)
            self.metrics.probe_seconds.labels(replica=name).observe(time.monotonic() - started)
            with self.lock:
                old = self.probes.get(name)
                changed = (old is None) != (result is None) or (
                    old is not None and result is not None and old.ok != result.ok)
                self.probes[name] = result
                if result is not None and result.ok and name in self.generations:
                    self.ready_invocation[name] = self.generations[name]
            if changed:
                with self.lock:
                    self.probe_changed.add(name)
                self.wake.set()
        finally:
            with self.lock:
                self.in_flight.discard(name)

    def _peer_loop(self) -> None:
        while not self.stopping.wait(self.config.peer_interval):
            with self.lock:
                peers = {(n.address, n.name) for s in self.shards
                         for rank, n in enumerate(s.replica.nodes) if rank != s.plan.rank}
            for address, node in peers:
                key = f"peer:{address}"
                with self.lock:
                    if key in self.in_flight:
                        continue
                    self.in_flight.add(key)
                self.pool.submit(self._fetch_peer, address, node, key)

    def _fetch_peer(self, address: str, node: str, key: str) -> None:
        host = f"[{address}]" if ":" in address else address
        url = f"http://{host}:{self.config.peer_port}/{API_VERSION}/shards"
        now = time.monotonic()
        try:
            with urllib.request.urlopen(url, timeout=self.config.peer_timeout) as resp:
                shards = json.loads(resp.read(1 << 20))
            reports = [(s["replica"], int(s["rank"]), RankReport(
                int(s["rank"]), str(s["node"]), str(s["state"]), str(s["reason"])),
                int(s.get("generation", 0))) for s in shards]
        except (OSError, ValueError, KeyError, TypeError, urllib.error.URLError) as exc:
            reason = getattr(exc, "reason", None) or exc
            with self.lock:
                for shard in self.shards:
                    for rank, n in enumerate(shard.replica.nodes):
                        if n.address == address and rank != shard.plan.rank:
                            old = self.peers.get((shard.replica.name, rank))
                            self.peers[(shard.replica.name, rank)] = (
                                now, RankReport(rank, node, states.UNKNOWN,
                                                f"supervisor on {node} unreachable: {reason}"),
                                old[2] if old else 0)
            self.wake.set()
            return
        finally:
            with self.lock:
                self.in_flight.discard(key)
        changed = False
        with self.lock:
            for replica, rank, report, generation in reports:
                old = self.peers.get((replica, rank))
                if old is None or old[1] != report or old[2] != generation:
                    changed = True
                self.peers[(replica, rank)] = (now, report, generation)
        if changed:
            self.wake.set()

    # -- HTTP API -----------------------------------------------------------------------

    def shards_json(self) -> list[dict[str, Any]]:
        with self.lock:
            out = []
            for shard in self.shards:
                status = self.statuses.get(shard.replica.name)
                report = self._local_report(shard)
                out.append({
                    "replica": shard.replica.name, "rank": shard.plan.rank,
                    "ranks": shard.plan.ranks, "node": shard.plan.node,
                    "serving": shard.serving, "state": report.state, "reason": report.reason,
                    "generation": self.generations.get(shard.replica.name, 0),
                    "units": {u.name: {"active": u.active_state, "sub": u.sub_state,
                                       "result": u.result, "restarts": u.n_restarts}
                              for u in (status.units if status else ())},
                })
            return out

    def replicas_json(self, only: Sequence[str] | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [{
                "name": name, "state": view.health.state, "reason": view.health.reason,
                "ranks": [{"rank": r.rank, "node": r.node, "state": r.state,
                           "reason": r.reason} for r in view.ranks],
                "group_restarts": len(view.restarts), "next_restart": view.next_restart,
                # ready long enough that a rank's restart from here on is a death
                "settled": view.ready_generations is not None,
            } for name, view in sorted(self.replicas.items()) if only is None or name in only]

    def _start_http(self) -> None:
        supervisor = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "llmgw-supervisor"

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0].rstrip("/")
                if path == "/metrics":
                    body, kind = supervisor.metrics.render(), supervisor.metrics.content_type
                    self._send(200, body, kind)
                    return
                if path == f"/{API_VERSION}/shards":
                    self._cached(path, supervisor.shards_json)
                elif path == f"/{API_VERSION}/replicas":
                    self._cached(path, supervisor.replicas_json)
                elif path.startswith(f"/{API_VERSION}/replicas/"):
                    name = path.rsplit("/", 1)[1]
                    if name in supervisor.replicas:
                        self._cached(path, lambda: supervisor.replicas_json([name])[0])
                    else:
                        self._json(404, {"error": f"no replica '{name}' on this node"})
                else:
                    self._json(404, {"error": "not found"})

            def do_POST(self) -> None:
                self._json(405, {"error": "read-only API"})

            do_PUT = do_DELETE = do_PATCH = do_POST  # noqa: N815

            def _json(self, status: int, data: object) -> None:
                self._send(status, json.dumps(data, indent=1).encode(), "application/json")

            def _cached(self, key: str, build: Any) -> None:
                version = supervisor.version
                hit = supervisor.api_cache.get(key)
                if hit is None or hit[0] != version:
                    hit = (version, json.dumps(build(), indent=1).encode())
                    supervisor.api_cache[key] = hit
                self._send(200, hit[1], "application/json")

            def _send(self, status: int, body: bytes, kind: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        ThreadingHTTPServer.daemon_threads = True
        self.server = ThreadingHTTPServer((self.config.listen_host, self.config.listen_port),
                                          Handler)
        threading.Thread(target=self.server.serve_forever, name="http", daemon=True).start()
        log(f"API on http://{self.config.listen_host}:{self.config.listen_port}/{API_VERSION}/")


class _Metrics:
    """Prometheus metrics in a registry of our own."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        from prometheus_client.exposition import CONTENT_TYPE_LATEST

        self.registry = CollectorRegistry()
        self.content_type = CONTENT_TYPE_LATEST
        self.replica_state = Gauge("llmgw_replica_state", "1 for the replica's current state",
                                   ["replica", "state"], registry=self.registry)
        self.shard_state = Gauge("llmgw_shard_state", "1 for this node's shard's current state",
                                 ["replica", "rank", "state"], registry=self.registry)
        self.unit_restarts = Gauge("llmgw_unit_restarts", "systemd's NRestarts of a unit",
                                   ["unit"], registry=self.registry)
        self.group_restarts = Counter("llmgw_group_restarts", "group restarts this "
                                      "supervisor made", ["replica"], registry=self.registry)
        self.probe_seconds = Histogram("llmgw_probe_seconds", "HTTP health probe latency",
                                       ["replica"], registry=self.registry)
        self.systemd_up = Gauge("llmgw_systemd_reachable", "1 when systemd answers over D-Bus",
                                registry=self.registry)

    def update(self, supervisor: Supervisor) -> None:
        with supervisor.lock:
            for name, view in supervisor.replicas.items():
                for state in states.STATES:
                    self.replica_state.labels(name, state).set(view.health.state == state)
            for status in supervisor.statuses.values():
                for state in states.STATES:
                    self.shard_state.labels(status.replica, str(status.rank), state).set(
                        status.health.state == state)
                for unit in status.units:
                    if unit.name.endswith(".service"):
                        self.unit_restarts.labels(unit.name).set(unit.n_restarts)
            self.systemd_up.set(0 if supervisor.bus_error else 1)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return bytes(generate_latest(self.registry))


def serve(config: SupervisorConfig, stop_signals: Sequence[int] = ()) -> None:
    """Run until a stop signal; the entry point turns errors into exit statuses."""
    import signal

    supervisor = Supervisor(config)

    def request_stop(*_: object) -> None:
        supervisor.stopping.set()
        supervisor.wake.set()

    def request_reload(*_: object) -> None:
        supervisor.spec_stamp = ()  # read the specs again even if no mtime changed
        supervisor.wake.set()

    for sig in stop_signals:
        signal.signal(sig, request_stop)
    signal.signal(signal.SIGHUP, request_reload)  # systemctl kill -s HUP llmgw-supervisor
    try:
        supervisor.run()
    finally:
        supervisor.stop()
