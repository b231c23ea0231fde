"""Prometheus metrics of the supervisor, built per scrape (prometheus_client's Collector).

Every scrape builds the series from the last judgement the daemon published (Figures,
immutable) and from a few running totals kept here; formatting is prometheus_client's,
serving is the API's. A replica or peer that left the spec is simply not in the next
judgement, so none of its series is exported: nothing needs to be forgotten, and no
private part of prometheus_client is touched.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from llmgw_systemd.errors import PEER_FAILURES
from llmgw_systemd.health.drain import CUT_SHORT, FINISHED, STARTED, DrainEvent
from llmgw_systemd.health.rules import STATES, State

# prometheus_client's default buckets (seconds), the usual ones for request latency
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
# drains last seconds to minutes: the delay, then the requests in flight
DRAIN_EVENTS = (STARTED, FINISHED, CUT_SHORT)
DRAIN_BUCKETS = (1.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True)
class ReplicaFigures:
    """One replica as the last judgement saw it, with this node's shard of it."""

    name: str
    state: State
    group_restarts: int  # within the budget's window
    rank: int
    shard_state: State
    unit_restarts: tuple[tuple[str, int], ...]  # (unit, systemd's NRestarts)
    routable: bool = False  # a gateway should send it new requests
    # since when (monotonic) it has not been routable, as this supervisor saw it: None
    # while routable; from the supervisor's start when it never was
    unroutable_since: float | None = None
    ready_within: int = 0  # how long a (re)start may take to be routable (units.plan)
    group_budget: int = 0  # group restarts allowed within the window (group_restart.budget)
    # its serving endpoints: (check name NAME.RANK, node, port), one per serving rank
    endpoints: tuple[tuple[str, str, int], ...] = ()


def unroutable_since(routable: bool, before: ReplicaFigures | None,
                     now: float) -> float | None:
    """When the replica stopped being routable: kept from the last figures while it stays
    so, `now` when it just stopped (or is first seen so), None while routable."""
    if routable:
        return None
    if before is not None and before.unroutable_since is not None:
        return before.unroutable_since
    return now


@dataclass(frozen=True)
class Figures:
    """What the daemon published after its last judgement."""

    replicas: tuple[ReplicaFigures, ...] = ()
    peers: tuple[str, ...] = ()  # the peer nodes it fetches from now
    systemd_reachable: bool = False


class Latencies:
    """Observations of one kind per replica, as a histogram's buckets (thread-safe)."""

    def __init__(self, buckets: tuple[float, ...] = BUCKETS) -> None:
        self.buckets = buckets
        self._lock = threading.Lock()
        self._by_replica: dict[str, tuple[list[int], float]] = {}

    def observe(self, replica: str, seconds: float) -> None:
        with self._lock:
            counts, total = self._by_replica.get(replica,
                                                 ([0] * (len(self.buckets) + 1), 0.0))
            index = next((i for i, le in enumerate(self.buckets) if seconds <= le),
                         len(self.buckets))
            counts[index] += 1
            self._by_replica[replica] = (counts, total + seconds)

    def family(self, name: str, doc: str, keep: Iterable[str]) -> HistogramMetricFamily:
        """The series of the replicas in `keep`; the others' observations are dropped."""
        keep = set(keep)
        family = HistogramMetricFamily(name, doc, labels=["replica"])
        with self._lock:
            for gone in set(self._by_replica) - keep:
                del self._by_replica[gone]
            for replica, (counts, total) in sorted(self._by_replica.items()):
                cumulative, buckets = 0, []
                for le, count in zip((*map(str, self.buckets), "+Inf"), counts):
                    cumulative += count
                    buckets.append((le, float(cumulative)))
                family.add_metric([replica], buckets, total)
        return family


class Counts:
    """Running totals by label values (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, ...], int] = {}

    def inc(self, *labels: str) -> None:
        with self._lock:
            self._counts[labels] = self._counts.get(labels, 0) + 1

    def family(self, name: str, doc: str, labels: list[str],
               keep: Callable[[tuple[str, ...]], bool] = lambda _: True,
               zeros: Iterable[tuple[str, ...]] = ()) -> CounterMetricFamily:
        """The totals whose labels `keep` accepts (the others are forgotten), and a 0 for
        each label set of `zeros` not counted yet: a counter that appears at 1 hides its
        first increase from increase() and rate(), and a dashboard finds no series."""
        family = CounterMetricFamily(name, doc, labels=labels)
        with self._lock:
            for key in [k for k in self._counts if not keep(k)]:
                del self._counts[key]
            counts = dict.fromkeys(zeros, 0)
            counts.update(self._counts)
            for key, value in sorted(counts.items()):
                family.add_metric(list(key), value)
            if not labels and not self._counts:
                family.add_metric([], 0)  # a plain counter is there from the start
        return family


class SupervisorMetrics(Collector):
    """The supervisor's metrics, in a registry of their own."""

    def __init__(self, figures: Callable[[], Figures],
                 http_stats: Callable[[], Mapping[str, Mapping[str, int]]]) -> None:
        self.figures = figures
        self.http_stats = http_stats
        self.probe_seconds = Latencies()
        self.completion_seconds = Latencies()
        self.peer_failures = Counts()  # (peer, kind)
        self.ignored_reports = Counts()  # (replica,)
        self.stall_restarts = Counts()  # (replica,)
        self.dbus_reads = Counts()  # ()
        self.drains = Counts()  # (replica, event: started, finished, cut-short)
        self.drain_seconds = Latencies(DRAIN_BUCKETS)
        self.cut_short_in_flight = Counts()  # (replica,): one per request left in flight
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self.content_type = CONTENT_TYPE_LATEST

    def collect(self) -> Iterable[Metric]:
        figures = self.figures()
        replicas = [r.name for r in figures.replicas]
        state = GaugeMetricFamily("llmgw_replica_state", "1 for the replica's current state",
                                  labels=["replica", "state"])
        shard = GaugeMetricFamily("llmgw_shard_state", "1 for this node's shard's state",
                                  labels=["replica", "rank", "state"])
        units = GaugeMetricFamily("llmgw_unit_restarts", "systemd's NRestarts of a unit",
                                  labels=["replica", "unit"])
        group = GaugeMetricFamily("llmgw_group_restarts", "group restarts of this node's "
                                  "shard within the budget window", labels=["replica"])
        routable = GaugeMetricFamily("llmgw_replica_routable", "1 while a gateway should send "
                                     "the replica new requests (GET /v1/replicas/NAME/ready "
                                     "answers 200)", labels=["replica"])
        unroutable = GaugeMetricFamily(
            "llmgw_replica_unroutable_seconds", "how long the replica has not been routable "
            "(0 while it is), as this supervisor saw it: counted from its own start at most",
            labels=["replica"])
        ready_within = GaugeMetricFamily(
            "llmgw_replica_ready_within_seconds", "how long a (re)start of the replica may "
            "take until it is routable: its stop, rendezvous, group restart delay and "
            "stability, from its spec", labels=["replica"])
        budget = GaugeMetricFamily(
            "llmgw_group_restart_budget", "group restarts allowed within the window "
            "(group_restart.budget); at llmgw_group_restarts the supervisor stops restarting",
            labels=["replica"])
        endpoint = GaugeMetricFamily(
            "llmgw_endpoint_routable", "1 while a gateway should send this serving endpoint "
            "of the replica new requests (GET /v1/replicas/ENDPOINT/ready answers 200): one "
            "per serving rank, on every node", labels=["replica", "endpoint", "node", "port"])
        now = time.monotonic()
        for r in figures.replicas:
            for check, node, port in r.endpoints:
                endpoint.add_metric([r.name, check, node, str(port)],
                                    1.0 if r.routable else 0.0)
            unroutable.add_metric([r.name], 0.0 if r.unroutable_since is None
                                  else round(max(0.0, now - r.unroutable_since), 3))
            ready_within.add_metric([r.name], r.ready_within)
            budget.add_metric([r.name], r.group_budget)
            for s in STATES:
                state.add_metric([r.name, s], 1.0 if r.state == s else 0.0)
                shard.add_metric([r.name, str(r.rank), s], 1.0 if r.shard_state == s else 0.0)
            for unit, restarts in r.unit_restarts:
                units.add_metric([r.name, unit], restarts)
            group.add_metric([r.name], r.group_restarts)
            routable.add_metric([r.name], 1.0 if r.routable else 0.0)
        yield from (state, shard, units, group, routable, unroutable, ready_within, budget,
                    endpoint)
        yield self.drains.family(
            "llmgw_drains", "drains of the replica by event: started (a planned stop or an "
            "operator's drain took it out of rotation), finished (nothing left in flight), "
            "cut-short (drain.timeout ran out first); counted by the serving rank's node",
            ["replica", "event"], keep=lambda k: k[0] in set(replicas),
            zeros=[(r, kind) for r in replicas for kind in DRAIN_EVENTS])
        yield self.drain_seconds.family("llmgw_drain_seconds", "how long drains took, from "
                                        "out of rotation to drained", replicas)
        yield self.cut_short_in_flight.family(
            "llmgw_drain_cut_short_requests", "requests still in flight when a drain was cut "
            "short by drain.timeout (as the engine counted them)", ["replica"],
            keep=lambda k: k[0] in set(replicas), zeros=[(r,) for r in replicas])
        yield self.probe_seconds.family("llmgw_probe_seconds", "HTTP health probe latency",
                                        replicas)
        yield self.completion_seconds.family(
            "llmgw_generation_check_seconds", "one-token completion latency (the generation "
            "check)", replicas)
        peers = set(figures.peers)
        yield self.peer_failures.family(
            "llmgw_peer_fetch_failures", "failed fetches of a peer supervisor's reports, by "
            "kind", ["peer", "kind"], keep=lambda k: k[0] in peers,
            zeros=[(p, kind) for p in sorted(peers) for kind in PEER_FAILURES])
        known = set(replicas)
        yield self.ignored_reports.family(
            "llmgw_peer_reports_ignored", "peer reports refused: from a node the rank is not "
            "assigned to, or unauthenticated", ["replica"], keep=lambda k: k[0] in known,
            zeros=[(r,) for r in replicas])
        yield self.stall_restarts.family(
            "llmgw_stall_restarts", "group restarts of this node's shard because its serving "
            "rank stalled: work pending and no engine step for health.stall_after",
            ["replica"], keep=lambda k: k[0] in known, zeros=[(r,) for r in replicas])
        yield GaugeMetricFamily("llmgw_systemd_reachable", "1 when systemd answers over D-Bus",
                                value=1.0 if figures.systemd_reachable else 0.0)
        yield self.dbus_reads.family("llmgw_dbus_reads", "bulk reads of unit state from "
                                     "systemd (signals trigger them; a read must never cause "
                                     "one)", [])
        stats = sorted(self.http_stats().items())
        connections = GaugeMetricFamily("llmgw_http_connections", "open API connections",
                                        labels=["listener"])
        events = CounterMetricFamily("llmgw_http_events", "HTTP server events by listener",
                                     labels=["listener", "event"])
        for listener, counts in stats:
            connections.add_metric([listener], counts.get("open", 0))
            for event, value in sorted(counts.items()):
                if event != "open":
                    events.add_metric([listener, event], value)
        yield connections
        yield events

    def count_drain(self, replica: str, event: DrainEvent) -> None:
        self.drains.inc(replica, event.kind)
        if event.kind == STARTED:
            return
        self.drain_seconds.observe(replica, event.seconds)
        for _ in range(int(event.in_flight or 0)):
            self.cut_short_in_flight.inc(replica)

    def render(self) -> tuple[bytes, str]:
        return bytes(generate_latest(self.registry)), self.content_type
