"""Prometheus metrics of the supervisor, in a registry of its own (prometheus_client).

Filled by the reconcile loop after each judgement and rendered on request: formatting is
prometheus_client's, serving is the API's. Series of replicas that left the spec are
removed when the spec is reloaded, so nothing stale stays exported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from llmgw_systemd.health.rules import STATES, State


class _StatsCollector(Collector):
    """Counters kept elsewhere (the HTTP servers' own), read at scrape time."""

    def __init__(self, source: Callable[[], Mapping[str, Mapping[str, int]]]) -> None:
        self.source = source

    def collect(self) -> Iterable[CounterMetricFamily]:
        family = CounterMetricFamily("llmgw_http_events", "HTTP server events by listener",
                                     labels=["listener", "event"])
        for listener, stats in sorted(self.source().items()):
            for event, value in sorted(stats.items()):
                if event != "open":
                    family.add_metric([listener, event], value)
        yield family


class SupervisorMetrics:
    def __init__(self, http_stats: Callable[[], Mapping[str, Mapping[str, int]]]) -> None:
        self.registry = CollectorRegistry()
        self.content_type = CONTENT_TYPE_LATEST
        r = self.registry
        self.replica_state = Gauge("llmgw_replica_state", "1 for the replica's current state",
                                   ["replica", "state"], registry=r)
        self.shard_state = Gauge("llmgw_shard_state", "1 for this node's shard's state",
                                 ["replica", "rank", "state"], registry=r)
        self.unit_restarts = Gauge("llmgw_unit_restarts", "systemd's NRestarts of a unit",
                                   ["replica", "unit"], registry=r)
        self.group_restarts = Gauge("llmgw_group_restarts", "group restarts of this node's "
                                    "shard within the budget window", ["replica"], registry=r)
        self.probe_seconds = Histogram("llmgw_probe_seconds", "HTTP health probe latency",
                                       ["replica"], registry=r)
        self.completion_seconds = Histogram(
            "llmgw_generation_check_seconds", "one-token completion latency (the generation "
            "check)", ["replica"], registry=r)
        self.peer_failures = Counter("llmgw_peer_fetch_failures", "failed fetches of a peer "
                                     "supervisor's reports, by kind", ["peer", "kind"],
                                     registry=r)
        self.ignored_reports = Counter("llmgw_peer_reports_ignored", "peer reports refused: "
                                       "from a node the rank is not assigned to, or "
                                       "unauthenticated", ["replica"], registry=r)
        self.systemd_up = Gauge("llmgw_systemd_reachable", "1 when systemd answers over D-Bus",
                                registry=r)
        self.dbus_reads = Counter("llmgw_dbus_reads", "bulk reads of unit state from systemd "
                                  "(signals trigger them; a read must never cause one)",
                                  registry=r)
        self.http_open = Gauge("llmgw_http_connections", "open API connections",
                               ["listener"], registry=r)
        self.http_stats = http_stats
        r.register(_StatsCollector(http_stats))
        self.replicas: set[str] = set()

    def forget_others(self, replicas: Iterable[str]) -> None:
        """Drop every series of replicas not in `replicas` (they left the spec)."""
        keep = set(replicas)
        gone = self.replicas - keep
        self.replicas = keep
        if not gone:
            return
        for metric in (self.replica_state, self.shard_state, self.unit_restarts,
                       self.group_restarts, self.probe_seconds, self.completion_seconds,
                       self.ignored_reports):
            for labels in _label_sets(metric):
                if labels and labels[0] in gone:
                    metric.remove(*labels)

    def forget_peers(self, peers: Iterable[str]) -> None:
        keep = set(peers)
        for labels in _label_sets(self.peer_failures):
            if labels[0] not in keep:
                self.peer_failures.remove(*labels)

    def set_replica(self, name: str, state: State, group_restarts: int) -> None:
        self.replicas.add(name)
        for s in STATES:
            self.replica_state.labels(name, s).set(state == s)
        self.group_restarts.labels(name).set(group_restarts)

    def set_shard(self, name: str, rank: int, state: State,
                  units: Sequence[tuple[str, int]]) -> None:
        for s in STATES:
            self.shard_state.labels(name, str(rank), s).set(state == s)
        for unit, restarts in units:
            self.unit_restarts.labels(name, unit).set(restarts)

    def render(self) -> tuple[bytes, str]:
        for listener, stats in self.http_stats().items():
            self.http_open.labels(listener).set(stats.get("open", 0))
        return bytes(generate_latest(self.registry)), self.content_type


def _label_sets(metric: Gauge | Counter | Histogram) -> list[tuple[str, ...]]:
    # prometheus_client keeps its children by label values; no public listing exists
    with metric._lock:
        return [tuple(labels) for labels in metric._metrics]
