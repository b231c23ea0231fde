"""llmgw-supervisor: the I/O shell around the pure rules in `health/judge.py`.

It gathers evidence (systemd over D-Bus, HTTP probes of this node's serving ranks, the
peer supervisors' reports), calls `judge` (health/judge.py) for each replica, carries out the
actions it returns (restart this node's shard), and publishes the result (JSON API,
metrics, sd_notify STATUS=). It decides nothing in the middle of I/O.

Three threads, whatever the number of peers and probes (docs/supervisor.md, "Threads"):
- reconcile (the main thread): owns the memory and the verdicts; woken by signals, probes
  and changed peer answers, and a slow timer; every D-Bus call in it has a timeout, and
  D-Bus calls are all it blocks on;
- dbus-signals: GLib's loop, a trigger only;
- the runtime (supervisor/runtime.py): one asyncio loop for all other I/O, each a task:
  the HTTP servers, one long-poll per peer node over a kept connection, one prober per
  serving shard and kind, the watchdog (pings systemd while the reconcile loop is alive,
  whatever D-Bus does). A task waits on its own socket, so a slow peer or probe delays
  no other.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import ipaddress
import os
import ssl
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from llmgw_systemd import __version__
from llmgw_systemd.errors import BusError, LlmgwError, PeerError, SpecError, StateError
from llmgw_systemd.gather import processes
from llmgw_systemd.gather.engine_metrics import read_progress
from llmgw_systemd.gather.peer_client import PeerSession
from llmgw_systemd.gather.probes import fetch_metrics, probe_completion, probe_http
from llmgw_systemd.gather.shard_reader import LocalShard, local_shards
from llmgw_systemd.gather.systemd_bus import SystemdBus
from llmgw_systemd.gather.tls import client_context, names_node, server_context
from llmgw_systemd.gather.wire import replica_rank, shard_report
from llmgw_systemd.health.drain import DrainEvent, DrainRequest
from llmgw_systemd.health.drain import events as drain_events
from llmgw_systemd.health.events import ignored_event, replica_events, restart_notes
from llmgw_systemd.health.evidence import (
    LocalEvidence,
    PeerEvidence,
    ProbeEvidence,
    carried_over,
    same_news,
)
from llmgw_systemd.health.judge import STALL, Memory, ReplicaPolicy, Verdict, judge, refused
from llmgw_systemd.health.progress import BUSY, ProgressReading, keep
from llmgw_systemd.health.rules import READY
from llmgw_systemd.health.unit_state import UnitState
from llmgw_systemd.helpers.listen_fds import (
    adopt,
    close_inherited,
    inherited_sockets,
    store,
    unstore,
    wanted_address,
)
from llmgw_systemd.helpers.sd_notify import notify, watchdog_interval
from llmgw_systemd.spec.document import Document
from llmgw_systemd.spec.endpoint import local_address
from llmgw_systemd.spec.files import read_each, spec_files
from llmgw_systemd.spec.model import Replica, Spec
from llmgw_systemd.spec.replicas import collect_spec, keep_last_good
from llmgw_systemd.supervisor import drain_requests, saved_evidence
from llmgw_systemd.supervisor.config import SupervisorConfig
from llmgw_systemd.supervisor.http import api
from llmgw_systemd.supervisor.http.metrics import (
    Figures,
    ReplicaFigures,
    SupervisorMetrics,
    unroutable_since,
)
from llmgw_systemd.supervisor.http.server import Changes, HttpServer, Request, Response
from llmgw_systemd.supervisor.journal import IDENTIFIER, STDERR, Journal
from llmgw_systemd.supervisor.rate_limited_log import RateLimitedLog
from llmgw_systemd.supervisor.runtime import Runtime
from llmgw_systemd.supervisor.state_file import (
    load_restarts,
    load_versions,
    save_restarts,
    save_versions,
)
from llmgw_systemd.units.plan import ready_within


def log(message: str) -> None:
    STDERR.write(f"{IDENTIFIER}: {message}")  # never blocks on a stopped journald


def since_exec() -> float | None:
    """Seconds since this process began (its start time in /proc/self/stat, in clock
    ticks since boot): how long the interpreter and the imports took, which a starved
    CPU stretches. None if unreadable."""
    try:
        with open("/proc/self/stat", encoding="ascii") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return time.clock_gettime(time.CLOCK_BOOTTIME) - started


def unit_names(shards: Sequence[LocalShard]) -> list[str]:
    """Every unit of the shards, target first: what is watched and read."""
    return [n for s in shards for n in (s.plan.target.name, *s.members)]


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


HEALTH, GENERATION, PROGRESS = "health", "generation", "progress"
# an engine unit in these states has a process of its current start
RUNNING = frozenset({"active", "activating", "deactivating", "reloading"})
KINDS = (HEALTH, GENERATION, PROGRESS)
# One replica's published part: (its shard report, its /v1/replicas body, what its
# /ready says, its figures for the metrics)
View = tuple[dict[str, Any], bytes, api.Readiness, ReplicaFigures]


def endpoints(replica: Replica) -> tuple[tuple[str, int], ...]:
    """Each serving endpoint of the replica: (its check name NAME.RANK, its rank)."""
    http = replica.http
    return () if http is None else tuple((api.endpoint_name(replica.name, rank), rank)
                                         for rank in http.ranks)


def engine_started(evidence: LocalEvidence | None) -> int | None:
    """When this shard's engine became active, in whole seconds of this node's monotonic
    clock (None: it is not active). Stable while it runs, so the report changes only
    when the engine does; peers read it against the answer's `clock`."""
    since = evidence.engine_since if evidence is not None else None
    return None if since is None or since <= 0 else int(since)


def _reads_progress(shard: LocalShard) -> bool:
    """Whether the supervisor reads this shard's progress: its serving rank, of an engine
    that says where (Http.progress). Stall detection uses it (when on), and a drain
    (health/drain.py) its count of requests in flight."""
    http = shard.replica.http
    return shard.serving and http is not None and http.progress is not None


class Task(abc.ABC):
    """One piece of the daemon's gathering: a coroutine run as a task on the runtime,
    with an event that wakes it before its timer ends (set from any thread)."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self.future: concurrent.futures.Future[None] | None = None
        # asyncio.Event binds to a loop at its first wait, so it can be made here
        self._poke = asyncio.Event()

    def start(self) -> None:
        self.future = self.supervisor.runtime.spawn(self._main())

    def stop(self) -> None:
        if self.future is not None:
            self.future.cancel()  # cancels the task on the loop

    def poke(self) -> None:
        self.supervisor.runtime.call(self._poke.set)

    async def sleep(self, seconds: float) -> None:
        """Until `seconds` pass or poke()."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._poke.wait(), max(0.0, seconds))
        self._poke.clear()

    async def _main(self) -> None:
        try:
            await self.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: said, never a silent end of the gathering
            log(f"internal error in {type(self).__name__}: {type(exc).__name__}: {exc}")
            raise

    @abc.abstractmethod
    async def run(self) -> None:
        """The task's body, until cancelled."""


class Prober(Task):
    """Probes one serving shard every interval, and at once when its generation changes:
    its health endpoint, or (each a prober of its own, so a slow answer never delays the
    health probe) a one-token completion, or its engine's metrics page (its progress)."""

    def __init__(self, supervisor: Supervisor, shard: LocalShard, kind: str) -> None:
        super().__init__(supervisor)
        self.shard, self.kind = shard, kind

    async def run(self) -> None:
        replica, sup = self.shard.replica, self.supervisor
        http = replica.http
        check = replica.health.generation
        interval = check.interval if self.kind == GENERATION and check else \
            replica.health.interval
        while http is not None:
            host, port = local_address(http.host), http.port
            generation = sup.generation_of(replica.name)
            if generation:
                started = time.monotonic()
                if self.kind == PROGRESS and http.progress is not None:
                    page = await fetch_metrics(host, port, http.progress.path,
                                               replica.health.timeout)
                    reading = (read_progress(page, http.progress, started)
                               if isinstance(page, str) else
                               ProgressReading(started, None, None, page.detail))
                    sup.add_reading(replica.name, replace(reading, generation=generation))
                    # a drain waits on the count of requests in flight: read it often
                    await self.sleep(DRAIN_READ_INTERVAL if sup.draining(replica.name)
                                     else interval)
                    continue
                if self.kind == GENERATION and check is not None:
                    result = await probe_completion(host, port, http.model, check.timeout)
                    sup.metrics.completion_seconds.observe(replica.name,
                                                           time.monotonic() - started)
                else:
                    result = await probe_http(host, port, replica.health.path,
                                              replica.health.timeout)
                    sup.metrics.probe_seconds.observe(replica.name,
                                                      time.monotonic() - started)
                sup.add_probe(replica.name, self.kind,
                              ProbeEvidence(result.ok, result.detail, generation, started))
            await self.sleep(interval)


MAX_FETCH_RATE = 20.0  # per peer node, per second
DRAIN_READ_INTERVAL = 0.5  # seconds between reads of the engine's metrics while draining
REQUESTS_CHECK = 1.0  # seconds between looks at the drain requests' folder
# How long a request to a supervisor that has not judged yet waits for its first verdict:
# below HAProxy's `timeout check 3s` (docs/loadbalancer.md), so a check gets an answer.
FIRST_VERDICT_WAIT = 2.5
FIRST_LOOKS = 4  # first looks from signals alone before the confirming read
COALESCE = 0.002  # seconds to wait for the rest of a burst of signals


class PeerFetcher(Task):
    """Long-polls one peer node's supervisor over a kept connection; every outcome
    becomes evidence."""

    def __init__(self, supervisor: Supervisor, node: str, address: str) -> None:
        super().__init__(supervisor)
        self.node, self.address = node, address

    async def run(self) -> None:
        sup, config = self.supervisor, self.supervisor.config
        session = PeerSession(self.address, config.peer_port,
                              ssl_context=sup.peer_context, server_hostname=self.address,
                              max_bytes=config.peer_max_bytes)
        after: int | None = None
        failures = 0
        started = -1.0
        try:
            while True:
                # at most MAX_FETCH_RATE fetches a second, even from a peer that ignores
                # the long-poll's wait or changes its version on every answer
                pause = started + 1 / MAX_FETCH_RATE - time.monotonic()
                if pause > 0:
                    await asyncio.sleep(pause)
                started = time.monotonic()
                try:
                    wait = config.peer_wait if after is not None else 0.0
                    answer = await session.fetch_shards(after=after, wait=wait,
                                                        deadline=wait + config.peer_timeout)
                except PeerError as exc:
                    failures += 1
                    after = None
                    sup.metrics.peer_failures.inc(self.node, exc.kind)
                    sup.limited_log(f"peer:{self.node}:{exc.kind}",
                                    f"peer {self.node} ({self.address}): {exc}")
                    sup.add_peer(PeerEvidence(self.node, time.monotonic(), False,
                                              error=str(exc), refused=exc.refused))
                    # back off, bounded: a dead peer costs one attempt every few seconds
                    await asyncio.sleep(min(0.25 * 2 ** min(failures, 5), 5.0))
                    continue
                failures = 0
                after = answer.version
                authenticated = (answer.peer_cert is not None and
                                 names_node(answer.peer_cert, self.node, self.address))
                sup.add_peer(PeerEvidence(self.node, time.monotonic(), authenticated,
                                          answer.shards))
        finally:
            session.close()


class Supervisor:
    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self.bus = SystemdBus(user=config.user, timeout=config.dbus_timeout)
        self.runtime = Runtime("runtime", on_error=self._on_loop_error)
        # one client context for every peer: a TLS session resumes only within its context
        self.peer_context: ssl.SSLContext | None = (
            client_context(config.tls) if config.tls is not None else None)
        self.lock = threading.Lock()  # guards the evidence tables below
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.spec: Spec | None = None
        self.spec_stamp: tuple[tuple[str, float], ...] = ()
        self.reload_requested = False
        self.shards: list[LocalShard] = []
        self.policies: dict[str, ReplicaPolicy] = {}
        # evidence, written by the gathering threads, read by reconcile
        self.local: dict[str, LocalEvidence] = {}
        self.probes: dict[str, ProbeEvidence] = {}
        self.completions: dict[str, ProbeEvidence] = {}
        self.readings: dict[str, tuple[ProgressReading, ...]] = {}  # progress.keep bounds
        self.peers: dict[str, PeerEvidence] = {}
        self.probe_woke: set[str] = set()
        # the reconcile thread's own
        self.memory: dict[str, Memory] = {}
        self.verdicts: dict[str, Verdict] = {}
        self.views: dict[str, View] = {}
        self.status = ""  # the last sd_notify STATUS= sent
        self.bus_error = ""
        self.last_full = 0.0
        self.heartbeat = time.monotonic()
        self.saved_restarts: dict[str, tuple[float, ...]] = {}
        # engine InvocationID -> the spec version its start began with (versions.py),
        # recorded at the first sight of each start; persisted, pruned to live starts
        self.started_with: dict[str, str] = {}
        self.saved_started_with: dict[str, str] = {}
        # replica -> the generation its serving rank answered in, saved at the last stop
        self.saved_served: dict[str, str] = {}
        self.probers: dict[tuple[str, str], Prober] = {}
        self.fetchers: dict[tuple[str, str], PeerFetcher] = {}
        self.changes = Changes()
        self.published = api.Published(config.node, 0)
        # set on the runtime's loop once the first verdict is published: until then a
        # request waits for it (FIRST_VERDICT_WAIT), so the API can accept, and finish
        # TLS handshakes, from the first moment of the process
        self.judged = asyncio.Event()
        self.servers: dict[str, HttpServer] = {}
        self.figures = Figures()  # what the metrics show: the last judgement's
        self.metrics = SupervisorMetrics(
            lambda: self.figures,
            lambda: {name: server.stats for name, server in self.servers.items()})
        self.limited_log = RateLimitedLog(log)
        self.journal = Journal(log)  # events with fields, when stderr is the journal
        self.requests: tuple[DrainRequest, ...] = ()  # operators' drains on this node
        self.requests_stamp = -1.0

    # -- configuration ------------------------------------------------------------------

    def _collect(self, documents: list[Document | SpecError]) -> Spec:
        """The replicas the generator would make units for (spec.collect_spec), each
        file's error logged once per change. A file that turns bad while we run keeps
        its last good replicas: a typo in an edit must not make a running replica
        vanish from its peers' view. With nothing good at start, the first error is
        the supervisor's (exit 2)."""
        spec, errors = collect_spec(documents)
        if errors and not spec.replicas and self.spec is None:
            raise errors[0]
        for error in errors:
            log(f"spec: {error} ("
                f"{'keeping the last good configuration of' if self.spec else 'not watching'}"
                " this file's replicas)")
        return keep_last_good(spec, errors, self.spec)

    def load_spec(self) -> None:
        """(Re)read the specs when they changed; a bad spec keeps the last good one."""
        try:
            files = spec_files(self.config.specs)
            stamp = tuple((f, os.stat(f).st_mtime) for f in files)
        except (OSError, LlmgwError) as exc:
            stamp = (("error", 0.0),)
            if self.spec is None:
                raise LlmgwError(f"cannot read the spec: {exc}") from None
        if stamp == self.spec_stamp and not self.reload_requested:
            return
        self.spec_stamp, self.reload_requested = stamp, False
        try:
            spec = self._collect(read_each(self.config.specs))
            shards = local_shards(spec, self.config.node)
        except LlmgwError as exc:
            if self.spec is None:
                raise
            log(f"spec reload failed, keeping the last good configuration: {exc}")
            return
        self.spec, self.shards = spec, shards
        self.policies = {s.replica.name: self._policy(s) for s in shards}
        names = set(self.policies)
        with self.lock:
            for table in (self.local, self.probes, self.completions, self.readings):
                for gone in set(table) - names:
                    del table[gone]
        for gone in set(self.memory) - names:
            del self.memory[gone]
        for gone in set(self.verdicts) - names:
            del self.verdicts[gone]
        for gone in set(self.views) - names:
            del self.views[gone]
        for name in names - set(self.memory):
            self.memory[name] = Memory(restarts=self._restarts_from_disk(name),
                                       served=self.saved_served.pop(name, None))
        self._sync_tasks()
        with self.lock:
            peers = {node for node, _ in self.fetchers}
            for gone in set(self.peers) - peers:
                del self.peers[gone]
        self.last_full = 0.0  # read every unit again
        log(f"watching {len(shards)} shard(s) on node {self.config.node}: "
            f"{', '.join(s.replica.name for s in shards) or 'none'}")
        if self.bus_error == "":
            self._watch()

    def _policy(self, shard: LocalShard) -> ReplicaPolicy:
        replica, config = shard.replica, self.config
        check = replica.health
        settle = config.peer_wait + config.peer_timeout + replica.restart.delay + 1.0
        return ReplicaPolicy(
            name=replica.name, nodes=tuple(n.name for n in replica.nodes),
            rank=shard.plan.rank, serving=shard.serving, stability=check.stability,
            # A result is stamped when its probe started and may arrive a timeout later;
            # the next one starts an interval after that and may take a timeout too.
            probe_fresh=check.interval + 2 * check.timeout + 1.0,
            peer_fresh=config.peer_wait + config.peer_timeout + 1.0,
            peer_grace=config.peer_grace, systemd_grace=config.systemd_grace,
            settle=settle,
            rejoin_after=(replica.stop_timeout + settle
                          if replica.engine.follows_leader(len(replica.nodes)) else None),
            restart_hold=replica.stop_timeout + settle,
            drain_delay=replica.drain.delay, drain_timeout=replica.drain.timeout,
            target=shard.plan.target.name,
            serving_ranks=replica.http.ranks if replica.http is not None else (),
            group_restart=replica.group_restart, require_auth=config.tls is not None,
            follows_leader=replica.engine.follows_leader(len(replica.nodes)),
            completion_fresh=(check.generation.interval + 2 * check.generation.timeout + 1.0
                              if check.generation is not None else None),
            stall_after=float(check.stall_after) if _reads_progress(shard) else 0.0,
            health_generates=(replica.http is not None
                              and check.path in replica.http.generating_paths),
            probe_timeouts=check.timeouts)

    def _sync_tasks(self) -> None:
        """One prober per serving shard and kind, one fetcher per peer node: tasks on the
        runtime, started and stopped as the spec changes."""
        wanted_probes = {(s.replica.name, kind): s for s in self.shards
                         if s.serving and s.replica.http is not None
                         for kind in KINDS
                         if kind == HEALTH
                         or (kind == GENERATION and s.replica.health.generation is not None)
                         or (kind == PROGRESS and _reads_progress(s))}
        wanted_peers = {(n.name, n.address) for s in self.shards
                        for rank, n in enumerate(s.replica.nodes) if rank != s.plan.rank}
        for name in list(self.probers):
            if name not in wanted_probes or self.probers[name].shard != wanted_probes[name]:
                self.probers.pop(name).stop()
        for key in list(self.fetchers):
            if key not in wanted_peers:
                self.fetchers.pop(key).stop()
        for key, shard in wanted_probes.items():
            if key not in self.probers:
                self.probers[key] = Prober(self, shard, key[1])
                self.probers[key].start()
        for node, address in sorted(wanted_peers - set(self.fetchers)):
            self.fetchers[(node, address)] = PeerFetcher(self, node, address)
            self.fetchers[(node, address)].start()

    # -- durable state -------------------------------------------------------------------

    def _restore_evidence(self) -> None:
        """Start from what the last supervisor of this boot knew when it stopped
        (saved_evidence): its probes, as taken and marked saved; the generations its
        serving ranks answered in; each peer's last answer, standing within the peer
        grace until that peer answers (judge.held_over)."""
        now = time.monotonic()
        config = self.config
        saved, warning = saved_evidence.take(config.evidence_dir, now,
                                             volatile=config.runtime_dir is not None)
        if warning:
            log(warning)
        if saved is None:
            return
        with self.lock:
            for (replica, kind), saved_probe in saved.probes.items():
                probe = carried_over(saved_probe, now, config.peer_grace)
                if probe is None:
                    continue
                marked = replace(probe, detail=saved_evidence.SAVED + probe.detail.removeprefix(
                    saved_evidence.SAVED))
                if kind == GENERATION:
                    self.completions[replica] = marked
                elif kind == HEALTH:
                    self.probes[replica] = marked
            for node, answer in saved.peers.items():
                self.peers[node] = PeerEvidence(
                    node, now, False, error="no answer yet since this supervisor started",
                    refused=True, last=answer)
        self.saved_served = dict(saved.served)
        log(f"starting from the evidence saved at the last stop: {len(saved.probes)} "
            f"probe(s), {len(saved.peers)} peer(s)")

    def _save_evidence(self) -> None:
        """What this supervisor knew, for the next one (saved_evidence); a failure to
        write is logged, never in the way of the stop."""
        with self.lock:
            probes = {**{(r, HEALTH): p for r, p in self.probes.items()},
                      **{(r, GENERATION): p for r, p in self.completions.items()}}
            # a failed fetch keeps the last answer that came through (add_peer)
            answers = {node: p.last if p.error else p for node, p in self.peers.items()}
        served = {name: m.served for name, m in list(self.memory.items()) if m.served}
        record = saved_evidence.SavedEvidence(
            saved_evidence.boot_id(), probes, served,
            {node: a for node, a in answers.items() if a is not None})
        try:
            saved_evidence.save(self.config.evidence_dir, record)
        except StateError as exc:
            log(f"warning: {exc}")

    def _restarts_from_disk(self, name: str) -> tuple[float, ...]:
        offset = time.monotonic() - time.time()  # wall-clock -> monotonic
        return tuple(t + offset for t in self.saved_restarts.get(name, ()))

    def _save_restarts(self) -> None:
        offset = time.time() - time.monotonic()
        record = {name: tuple(t + offset for t in memory.restarts)
                  for name, memory in self.memory.items() if memory.restarts}
        if record == self.saved_restarts:
            return
        try:
            save_restarts(self.config.state_dir, record)
        except StateError as exc:
            self.limited_log("state", f"{exc}")
            return
        self.saved_restarts = record

    # -- evidence in (any thread) ----------------------------------------------------------

    def generation_of(self, replica: str) -> str:
        """The generation a probe is taken for: the last read's, held or not (a probe
        through a systemd stall is what keeps a held read honest; the judge counts it
        only while that read stands)."""
        with self.lock:
            local = self.local.get(replica)
        return local.generation if local is not None else ""

    def add_probe(self, replica: str, kind: str, evidence: ProbeEvidence) -> None:
        with self.lock:
            (self.completions if kind == GENERATION else self.probes)[replica] = evidence
            self.probe_woke.add(replica)
        self.wake.set()

    def draining(self, replica: str) -> bool:
        verdict = self.verdicts.get(replica)
        return verdict is not None and verdict.drain is not None

    def load_requests(self) -> bool:
        """Read the operators' drain requests again if their folder changed; whether it
        did."""
        stamp = drain_requests.stamp(self.config.state_dir)
        if stamp == self.requests_stamp:
            return False
        self.requests_stamp = stamp
        requests, warnings = drain_requests.load(self.config.state_dir)
        for warning in warnings:
            self.limited_log(f"drain-request:{warning}", warning)
        if requests != self.requests:
            log("drain requests: " + ("; ".join(
                f"{r.replica or 'every replica on this node'} by {r.by} since {r.since}"
                for r in requests) or "none"))
        self.requests = requests
        return True

    def add_reading(self, replica: str, reading: ProgressReading) -> None:
        """One metrics reading of a serving rank: kept with the readings of the same
        generation, as far back as a verdict needs (progress.keep)."""
        policy = self.policies.get(replica)
        stall_after = policy.stall_after if policy is not None else 0.0
        with self.lock:
            kept = [r for r in self.readings.get(replica, ())
                    if r.generation == reading.generation]
            self.readings[replica] = keep((*kept, reading), now=reading.taken_at,
                                          stall_after=stall_after)
        self.wake.set()

    def add_peer(self, evidence: PeerEvidence) -> None:
        for policy in list(self.policies.values()):  # counted once per answer received
            for line in refused(policy, evidence):
                self.metrics.ignored_reports.inc(policy.name)
                said = self.limited_log.allow(f"ignored:{policy.name}:{evidence.source}")
                if said is not None:
                    event = ignored_event(policy.name, evidence.source, line)
                    self.journal.send(replace(event, message=event.message + said))
        with self.lock:
            before = self.peers.get(evidence.source)
            if evidence.error and before is not None:
                # a failure keeps the last answer that came through (judge.held_over)
                evidence = replace(evidence, last=before.last if before.error else before)
            self.peers[evidence.source] = evidence
        # an answer that says what the last one said only makes it fresher: the judge
        # needs it at its next turn, not now (at 64 nodes, 32 wake-ups a second)
        if not same_news(before, evidence):
            self.wake.set()

    # -- the loop -----------------------------------------------------------------------

    def run(self) -> None:
        took = since_exec()
        log(f"version {__version__}, pid {os.getpid()}"
            + (f", {took:.1f} s after exec ({time.process_time():.1f} s of CPU)"
               if took is not None else ""))
        self.saved_restarts, warning = load_restarts(self.config.state_dir)
        if warning:
            log(warning)
        self.started_with, warning = load_versions(self.config.state_dir)
        self.saved_started_with = dict(self.started_with)
        if warning:
            log(warning)
        self._restore_evidence()
        self.runtime.start()
        # Serving first (on the socket kept across a restart, docs/supervisor.md): the
        # clients that waited in its backlog meanwhile finish their TLS handshakes now,
        # and their requests get the first verdict below, not "no such replica".
        self._start_http()
        self.load_spec()
        self.load_requests()
        self.runtime.spawn(self._watchdog())
        self.reconcile()
        self.runtime.call(self.judged.set)
        notify("READY=1")
        due = time.monotonic() + self.config.reconcile_interval
        while not self.stopping.is_set():
            self.heartbeat = time.monotonic()
            STDERR.flush()  # lines the journal did not take when they were said
            # a drain request is a file: looked for every second, acted on at once
            woke = self.wake.wait(max(0.0, min(REQUESTS_CHECK, due - time.monotonic())))
            if self.stopping.is_set():
                break
            asked = self.load_requests()
            if not woke and not asked and time.monotonic() < due:
                continue
            self.wake.clear()
            due = time.monotonic() + self.config.reconcile_interval
            self.load_spec()
            self.reconcile()

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()
        # Saved while still answering: the API closes last of all that a restart waits
        # for, so the time nothing answers (its socket kept, docs/supervisor.md) is the
        # process's exit and the next one's start, not this one's tidying up.
        self._save_evidence()
        for server in self.servers.values():
            server.stop()
        self.runtime.stop()  # every task: probers, fetchers, the watchdog, connections
        self.bus.close()
        self.journal.close()

    async def _watchdog(self) -> None:
        """WATCHDOG=1 while the reconcile loop and the runtime are alive. Reconcile's
        D-Bus calls are bounded, so a stalled bus shows as 'systemd unreachable' in the
        API, not as a dead process; a runtime that stops turning stops the pings."""
        ping = watchdog_interval()
        if ping is None:
            return
        stuck = 3 * self.config.dbus_timeout + self.config.reconcile_interval + 5
        while not self.stopping.is_set():
            await asyncio.sleep(ping)
            if time.monotonic() - self.heartbeat < stuck:
                notify("WATCHDOG=1")

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]
                       ) -> None:
        """What a task on the runtime let escape: one rate-limited line. A client that
        hung up mid-TLS is no news."""
        exc = context.get("exception")
        if isinstance(exc, (ConnectionError, ssl.SSLError)):
            return
        detail = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        self.limited_log("runtime", f"runtime: {context.get('message', 'error')}{detail}")

    def _watch(self) -> None:
        try:
            self._watch_or_raise()
        except BusError as exc:
            self._lost(exc)

    def _lost(self, exc: BusError) -> None:
        """systemd did not answer: what it said last stands, within the systemd grace
        and while the kernel says its main processes run (judge.held_read)."""
        if not self.bus_error:
            log(f"lost systemd: {exc}")
        self.bus_error = str(exc)

    def reconcile(self) -> None:
        """Read what changed in systemd (on the slow tick: everything), then judge every
        replica and publish. A signal for one unit costs a read of its shard only."""
        now = time.monotonic()
        slow_tick = now - self.last_full >= self.config.reconcile_interval
        shards = list(self.shards)
        try:
            if self.bus_error:
                self.bus.recover()
                self._watch_or_raise()
            elif slow_tick:
                self.bus.resubscribe()  # cheap; signals come back after a daemon-reexec
            changed = self.bus.changed_units()
            if not slow_tick and changed is not None and not self.bus_error:
                shards = [s for s in shards if changed & {s.plan.target.name, *s.members}]
            else:
                self.last_full = now
            if shards:
                if not slow_tick:
                    # a first look from what the signals said, published at once: this
                    # is what makes a dead member visible within milliseconds. systemd
                    # sends a unit's Service and Unit changes back to back; the one that
                    # says it is no longer active may follow the one that woke us, so
                    # look again while more arrive (bounded) before the slower read.
                    for _ in range(FIRST_LOOKS):
                        self.wake.clear()
                        self._first_look(shards)
                        self._judge_and_publish(time.monotonic(),
                                                only={s.replica.name for s in shards})
                        if not self.wake.wait(COALESCE):
                            break
                self._read(shards, properties=True)
            if self.bus_error:
                log("systemd is reachable again")
                self.bus_error = ""
        except BusError as exc:
            self._lost(exc)
        self._judge_and_publish(time.monotonic())

    def _watch_or_raise(self) -> None:
        self.bus.watch(unit_names(self.shards), lambda _path: self.wake.set())

    def _first_look(self, shards: Sequence[LocalShard]) -> None:
        """What the signals said, published before the confirming read: the manager is
        busiest right after a death, and a call to it then takes longest."""
        states = self.bus.from_signals(unit_names(shards))
        if states is None:  # a unit never read yet: ask
            self._read(shards, properties=False)
        else:
            self._take(shards, states)

    def _read(self, shards: Sequence[LocalShard], *, properties: bool) -> None:
        self.metrics.dbus_reads.inc()
        self._take(shards, self.bus.snapshot(unit_names(shards), properties=properties))

    def _take(self, shards: Sequence[LocalShard], states: dict[str, UnitState]) -> None:
        read_at = time.monotonic()
        evidence = {s.replica.name: LocalEvidence(states[s.plan.target.name],
                                                  tuple(states[m] for m in s.members),
                                                  read_at,
                                                  self._running_digest(states[s.members[-1]]))
                    for s in shards}
        with self.lock:
            changed = [name for name, e in evidence.items()
                       if e.generation and (name not in self.local
                                            or self.local[name].generation != e.generation)]
            self.local.update(evidence)
        # a new start of the engine, or the first read of it: probe it now, not an
        # interval later
        for name in changed:
            for kind in KINDS:
                prober = self.probers.get((name, kind))
                if prober is not None:
                    prober.poke()

    def _running_digest(self, engine: UnitState) -> str:
        """The spec version this start of the engine began with: what its unit carried
        at the first sight of the start (a later daemon-reload does not change it)."""
        if not engine.invocation_id or engine.active_state not in RUNNING:
            return ""
        if engine.invocation_id not in self.started_with and engine.spec_digest:
            self.started_with[engine.invocation_id] = engine.spec_digest
        return self.started_with.get(engine.invocation_id, "")

    def _save_versions(self) -> None:
        """Persist the starts still running, when that record changed."""
        with self.lock:
            live = {e.members[-1].invocation_id for e in self.local.values() if e.members}
        record = {k: v for k, v in self.started_with.items() if k in live}
        self.started_with = record
        if record == self.saved_started_with:
            return
        try:
            save_versions(self.config.state_dir, record)
        except StateError as exc:
            self.limited_log("state", f"{exc}")
            return
        self.saved_started_with = record

    def _judge_and_publish(self, now: float, only: set[str] | None = None) -> None:
        """Judge every replica (or `only` these: the fast first look after a signal, so
        a death is published without rebuilding every other replica's answer)."""
        with self.lock:
            local, probes, peers = dict(self.local), dict(self.probes), dict(self.peers)
            completions, readings = dict(self.completions), dict(self.readings)
        # while systemd does not answer, the kernel's word on the processes it named
        gone = {name: processes.gone(e.members) for name, e in local.items()} \
            if self.bus_error else {}
        for shard in self.shards:
            name = shard.replica.name
            if only is not None and name not in only:
                continue
            policy = self.policies[name]
            before = self.verdicts.get(name)
            verdict = judge(policy, self.memory.get(name, Memory()), local=local.get(name),
                            systemd_error=self.bus_error, probe=probes.get(name),
                            completion=completions.get(name),
                            progress=readings.get(name, ()), peers=peers, now=now,
                            requests=self.requests, gone=gone.get(name, ()))
            self.memory[name] = verdict.memory
            self.verdicts[name] = verdict
            drains = self._count_drain(policy, before, verdict, now)
            for event in replica_events(name, policy.rank, self.config.node, before, verdict,
                                        drains):
                self.journal.send(event)
            if not restart_notes(before, verdict):  # a restart's notes are its event's line
                for note in verdict.notes:
                    log(note)
            for restart in verdict.actions:  # RestartShard is the only action
                if restart.cause == STALL:
                    self.metrics.stall_restarts.inc(name)
                target = shard.plan.target.name
                try:
                    self.bus.restart(target)
                except BusError as exc:
                    log(f"{name}: restart of {target} failed: {exc}")
        self._save_restarts()
        self._save_versions()
        self._publish(local, now, only)

    def _count_drain(self, policy: ReplicaPolicy, before: Verdict | None, verdict: Verdict,
                     now: float) -> tuple[DrainEvent, ...]:
        """A drain's start and end, counted on the node that counts the requests in
        flight (the first serving rank's; rank 0's when none serves); returned for the
        journal."""
        changes = drain_events(before.drain if before is not None else None, verdict.drain,
                               verdict.memory.drain, now)
        if policy.rank == min(policy.serving_ranks, default=0):
            for event in changes:
                self.metrics.count_drain(policy.name, event)
        return changes

    # -- publishing ----------------------------------------------------------------------

    def _view(self, shard: LocalShard, verdict: Verdict, evidence: LocalEvidence | None,
              now: float) -> View:
        """One replica's part of the API: its shard report, its replica body, its state,
        and its figures for the metrics."""
        name = shard.replica.name
        mine = verdict.ranks[shard.plan.rank]
        units = (evidence.target, *evidence.members) if evidence else ()
        report = shard_report(
            replica=name, rank=shard.plan.rank, ranks=shard.plan.ranks, node=shard.plan.node,
            serving=shard.serving, state=mine.state, reason=mine.reason,
            generation=evidence.generation if evidence else "",
            started=engine_started(evidence), draining=mine.draining, drained=mine.drained,
            loaded=evidence.loaded_digest if evidence else "",
            running=evidence.running_digest if evidence else "",
            units={u.name: {"active": u.active_state, "sub": u.sub_state,
                            "result": u.result, "restarts": u.n_restarts} for u in units})
        window = self.policies[name].group_restart.window
        recent = sum(1 for t in verdict.memory.restarts if now - t < window)
        http_port = shard.replica.http.port if shard.replica.http is not None else 0
        body = api.encode({
            "name": name, "state": verdict.health.state, "reason": verdict.health.reason,
            "ranks": [replica_rank(rank=r.rank, node=r.node, state=r.state, reason=r.reason,
                                   loaded=v.loaded, running=v.running)
                      for r, v in zip(verdict.ranks, verdict.versions)],
            # where it serves HTTP: each serving rank's node and port, with its own
            # routable check (GET /v1/replicas/NAME.RANK/ready), for a load balancer
            # that sends to each of them (docs/loadbalancer.md)
            "endpoints": [{"rank": rank, "node": node.name, "address": node.address,
                           "port": port, "check": check}
                          for check, rank in endpoints(shard.replica)
                          for node, port in ((shard.replica.nodes[rank], http_port),)],
            # "staged: N of M nodes" while ranks wait for the replica's group restart
            "staged": verdict.staged,
            "group_restarts": recent, "next_restart": verdict.next_restart,
            "settled": verdict.settled,
            # whether a gateway should send it new requests (GET .../ready says the same)
            "routable": verdict.routable,
            "drain": (None if verdict.drain is None or verdict.memory.drain is None else {
                "phase": verdict.drain.phase, "reason": verdict.drain.reason,
                "for": round(now - verdict.memory.drain.since, 3),
                "causes": list(verdict.memory.drain.causes),
                "in_flight": verdict.drain.in_flight,
                "cut_short": verdict.drain.cut_short}),
            # this node's shard: a planned stop of its target, or our group restart
            "stopping": verdict.stopping,
            # this node's serving rank, from its engine's progress (docs/supervisor.md)
            "busy": verdict.liveness is not None and verdict.liveness.verdict == BUSY,
            "progress": ({"verdict": verdict.liveness.verdict,
                          "reason": verdict.liveness.reason}
                         if verdict.liveness is not None else None),
            "systemd": "unreachable: " + self.bus_error if self.bus_error else "ok",
        })
        before = next((r for r in self.figures.replicas if r.name == name), None)
        figures = ReplicaFigures(name, verdict.health.state, recent, shard.plan.rank,
                                 mine.state, tuple((u.name, u.n_restarts) for u in units
                                                   if u.name.endswith(".service")),
                                 routable=verdict.routable,
                                 unroutable_since=unroutable_since(
                                     verdict.routable, before, now),
                                 ready_within=ready_within(shard.replica),
                                 group_budget=shard.replica.group_restart.budget,
                                 endpoints=tuple((check, shard.replica.nodes[rank].name,
                                                  http_port)
                                                 for check, rank in endpoints(shard.replica)))
        busy = " (busy)" if verdict.liveness is not None and verdict.liveness.verdict == BUSY \
            else ""
        http = shard.replica.http
        readiness = api.Readiness(verdict.routable, (
            f"ready{busy}: {verdict.health.reason}" if verdict.routable
            else f"{verdict.health.state}: {verdict.health.reason}"),
            http.ranks if http is not None else ())
        return report, body, readiness, figures

    def _publish(self, local: dict[str, LocalEvidence], now: float,
                 only: set[str] | None = None) -> None:
        for shard in self.shards:
            name = shard.replica.name
            verdict = self.verdicts.get(name)
            if verdict is not None and (only is None or name in only):
                self.views[name] = self._view(shard, verdict, local.get(name), now)
        views = [(s.replica.name, self.views[s.replica.name]) for s in self.shards
                 if s.replica.name in self.views]
        self.figures = Figures(tuple(figures for _, (_, _, _, figures) in views),
                               tuple(sorted({node for node, _ in self.fetchers})),
                               systemd_reachable=not self.bus_error)
        old = self.published
        fresh = tuple(report for _, (report, _, _, _) in views)
        version = old.version if fresh == old.shards else self.changes.version + 1
        bodies = {name: body for name, (_, body, _, _) in views}
        self.published = api.Published(self.config.node, version, fresh,
                                       b"[" + b",\n".join(bodies.values()) + b"]", bodies,
                                       {name: ready for name, (_, _, ready, _) in views})
        if version != old.version:
            self.changes.bump()
        ready = sum(1 for _, (_, _, _, figures) in views if figures.state == READY)
        status = (f"STATUS={len(views)} replica(s), {ready} ready"
                  + (f"; systemd unreachable: {self.bus_error}" if self.bus_error else ""))
        if status != self.status:
            notify(status)
            self.status = status

    # -- HTTP API -----------------------------------------------------------------------

    async def _handle(self, request: Request) -> Response:
        if not self.judged.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.judged.wait(), FIRST_VERDICT_WAIT)
            if not self.judged.is_set():
                return api.not_judged_yet()
        return await api.handle(request, lambda: self.published, self.changes,
                                self.metrics.render)

    def _start_http(self) -> None:
        """Serve the API, on the sockets systemd kept across a restart when they are for
        the same addresses (connections made meanwhile waited in their backlog), else on
        new ones, which go into systemd's store for the next restart."""
        config = self.config
        listeners: list[tuple[str, str, int, Any]] = []
        context = server_context(config.tls) if config.tls is not None else None
        listeners.append(("api", config.listen_host, config.listen_port, context))
        if config.local is not None:
            listeners.append(("local", config.local[0], config.local[1], None))
        inherited = inherited_sockets()
        wanted = {name: address for name, host, port, _ in listeners
                  if (address := wanted_address(host, port)) is not None}
        adoption = adopt(wanted, [item for item, _ in inherited])
        sockets = {item.fd: sock for item, sock in inherited}
        for item in adoption.drop:
            close_inherited(item, sockets.get(item.fd))
            unstore(item.name)
            log(f"dropped the kept socket '{item.name}' "
                f"({'not a listening TCP socket' if item.address is None else 'another address'})")
        for name, host, port, ssl_context in listeners:
            held = sockets.get(adoption.use[name]) if name in adoption.use else None
            server = HttpServer(host, port, self._handle, ssl_context=ssl_context,
                                max_connections=config.max_connections, log=log)
            server.attach(self.changes)
            server.start(self.runtime.loop, listener=held)
            self.servers[name] = server
            kept = held is not None or (name in wanted and store(name, server.listener))
            scheme = "https" if ssl_context is not None else "http"
            shown = f"[{host}]" if ":" in host else host
            log(f"API on {scheme}://{shown}:{server.address[1]}/{api.API_VERSION}/"
                + (" (TLS, client certificates required)" if ssl_context else "")
                + ("; the socket systemd kept across the restart" if held is not None
                   else "; kept by systemd across restarts" if kept else ""))
            if ssl_context is None and not is_loopback(host):
                log(f"warning: plain HTTP on {host}, a non-loopback address: peers are not "
                    "authenticated and anyone who answers there is believed; configure TLS "
                    "(--tls-cert/--tls-key/--tls-ca or LoadCredential=, docs/tls.md)")


def raise_fd_limit() -> None:
    """Soft RLIMIT_NOFILE up to the hard limit: connections are capped by the server, not
    by an accident of the default 1024."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def serve(config: SupervisorConfig, stop_signals: Sequence[int] = ()) -> None:
    """Run until a stop signal; the entry point turns errors into exit statuses."""
    import signal

    raise_fd_limit()
    # Several threads wake each other (signal -> reconcile -> API); CPython hands the GIL
    # over only every switch interval (5 ms by default) while another thread runs, which
    # was most of the time from a unit's death to the API saying so.
    sys.setswitchinterval(0.0005)
    supervisor = Supervisor(config)

    def request_stop(*_: object) -> None:
        supervisor.stopping.set()
        supervisor.wake.set()

    def request_reload(*_: object) -> None:
        supervisor.reload_requested = True  # read the specs again even if no mtime changed
        supervisor.wake.set()

    for sig in stop_signals:
        signal.signal(sig, request_stop)
    signal.signal(signal.SIGHUP, request_reload)  # systemctl reload llmgw-supervisor
    try:
        supervisor.run()
    finally:
        supervisor.stop()

