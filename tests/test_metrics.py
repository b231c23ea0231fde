"""The supervisor's metrics (supervisor/http/metrics.py): built per scrape from the last
published judgement, so what is exported is exactly what that judgement holds."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmgw_systemd.supervisor.http.metrics import (
    Figures,
    ReplicaFigures,
    SupervisorMetrics,
    unroutable_since,
)


def samples(metrics: SupervisorMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, kind = metrics.render()
    assert kind.startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(  # type: ignore[no-untyped-call]
                body.decode())
            for s in family.samples}


def figures(*names: str, reachable: bool = True, peers: tuple[str, ...] = ()) -> Figures:
    return Figures(tuple(ReplicaFigures(n, "ready", 1, 0, "degraded",
                                        (("llmgw-x-engine.service", 3),)) for n in names),
                   peers, systemd_reachable=reachable)


def test_series_follow_the_last_judgement() -> None:
    current = [figures("a", "b", peers=("n2",))]
    metrics = SupervisorMetrics(lambda: current[0], lambda: {"api": {"open": 2, "evicted": 5}})
    metrics.probe_seconds.observe("a", 0.003)
    metrics.probe_seconds.observe("a", 3.0)
    metrics.peer_failures.inc("n2", "timeout")
    metrics.peer_failures.inc("n3", "connect")  # a peer the judgement does not fetch from
    metrics.ignored_reports.inc("b")
    got = samples(metrics)
    assert got[("llmgw_replica_state", (("replica", "a"), ("state", "ready")))] == 1
    assert got[("llmgw_replica_state", (("replica", "a"), ("state", "failed")))] == 0
    assert got[("llmgw_shard_state", (("rank", "0"), ("replica", "b"),
                                      ("state", "degraded")))] == 1
    assert got[("llmgw_unit_restarts", (("replica", "a"),
                                        ("unit", "llmgw-x-engine.service")))] == 3
    assert got[("llmgw_group_restarts", (("replica", "b"),))] == 1
    assert got[("llmgw_probe_seconds_count", (("replica", "a"),))] == 2
    assert got[("llmgw_probe_seconds_bucket", (("le", "0.005"), ("replica", "a")))] == 1
    assert got[("llmgw_probe_seconds_bucket", (("le", "+Inf"), ("replica", "a")))] == 2
    assert got[("llmgw_probe_seconds_sum", (("replica", "a"),))] == 3.003
    assert got[("llmgw_peer_fetch_failures_total", (("kind", "timeout"), ("peer", "n2")))] == 1
    assert ("llmgw_peer_fetch_failures_total", (("kind", "connect"), ("peer", "n3"))) not in got
    assert got[("llmgw_peer_reports_ignored_total", (("replica", "b"),))] == 1
    # counters are there at 0 before their first count, so increase() sees that one too
    assert got[("llmgw_peer_reports_ignored_total", (("replica", "a"),))] == 0
    assert got[("llmgw_peer_fetch_failures_total", (("kind", "tls"), ("peer", "n2")))] == 0
    assert got[("llmgw_stall_restarts_total", (("replica", "a"),))] == 0
    assert got[("llmgw_drains_total", (("event", "cut-short"), ("replica", "b")))] == 0
    assert got[("llmgw_drain_cut_short_requests_total", (("replica", "a"),))] == 0
    assert got[("llmgw_systemd_reachable", ())] == 1
    assert got[("llmgw_dbus_reads_total", ())] == 0
    assert got[("llmgw_http_connections", (("listener", "api"),))] == 2
    assert got[("llmgw_http_events_total", (("event", "evicted"), ("listener", "api")))] == 5

    # replica a leaves the spec, b stays; systemd goes away
    current[0] = figures("b", reachable=False)
    metrics.dbus_reads.inc()
    got = samples(metrics)
    assert not [k for k in got if ("replica", "a") in k[1]], "a series of a departed replica"
    assert got[("llmgw_replica_state", (("replica", "b"), ("state", "ready")))] == 1
    assert got[("llmgw_systemd_reachable", ())] == 0
    assert got[("llmgw_dbus_reads_total", ())] == 1
    assert not [k for k in got if k[0].startswith("llmgw_peer_fetch")], "a departed peer"
    # and comes back: it starts from nothing, not from its old observations
    current[0] = figures("a", "b")
    got = samples(metrics)
    assert ("llmgw_probe_seconds_count", (("replica", "a"),)) not in got


def test_what_the_alerts_compare_is_exported() -> None:
    """The "not routable for longer than its start" and "budget spent" alerts compare
    series the supervisor exports (packaging/prometheus/llmgw-rules.yml)."""
    import time

    since = time.monotonic() - 30
    current = Figures((ReplicaFigures("a", "failed", 2, 0, "failed", (), routable=False,
                                      unroutable_since=since, ready_within=123,
                                      group_budget=6),
                       ReplicaFigures("b", "ready", 0, 1, "ready", (), routable=True,
                                      ready_within=99, group_budget=3)))
    got = samples(SupervisorMetrics(lambda: current, dict))
    assert 30 <= got[("llmgw_replica_unroutable_seconds", (("replica", "a"),))] < 60
    assert got[("llmgw_replica_unroutable_seconds", (("replica", "b"),))] == 0
    assert got[("llmgw_replica_ready_within_seconds", (("replica", "a"),))] == 123
    assert got[("llmgw_group_restart_budget", (("replica", "b"),))] == 3
    assert got[("llmgw_replica_routable", (("replica", "a"),))] == 0


@pytest.mark.parametrize(("routable", "before", "expected"), [
    (True, None, None),  # routable: no since
    (True, 5.0, None),  # routable again: forgotten
    (False, None, 100.0),  # first seen not routable: from now
    (False, 5.0, 5.0),  # still not routable: kept
    (False, "routable", 100.0),  # just stopped being routable: from now
])
def test_unroutable_since(routable: bool, before: float | str | None,
                          expected: float | None) -> None:
    last = (None if before is None else
            ReplicaFigures("a", "ready", 0, 0, "ready", (), routable=True) if before == "routable"
            else ReplicaFigures("a", "failed", 0, 0, "failed", (),
                                unroutable_since=float(before)))
    assert unroutable_since(routable, last, 100.0) == expected


def test_each_serving_endpoint_is_exported() -> None:
    """A replica with several serving endpoints (data parallel, hybrid) has one series per
    endpoint, routable as the replica is; a replica with none has none."""
    current = Figures((
        ReplicaFigures("dp", "ready", 0, 0, "ready", (), routable=True,
                       endpoints=(("dp.0", "a", 8000), ("dp.1", "b", 8000))),
        ReplicaFigures("tp", "degraded", 0, 0, "degraded", (), routable=False,
                       endpoints=(("tp.0", "a", 8001),)),
        ReplicaFigures("batch", "ready", 0, 0, "ready", (), routable=True)))
    got = {labels: value for (name, labels), value in
           samples(SupervisorMetrics(lambda: current, dict)).items()
           if name == "llmgw_endpoint_routable"}
    assert got == {
        (("endpoint", "dp.0"), ("node", "a"), ("port", "8000"), ("replica", "dp")): 1,
        (("endpoint", "dp.1"), ("node", "b"), ("port", "8000"), ("replica", "dp")): 1,
        (("endpoint", "tp.0"), ("node", "a"), ("port", "8001"), ("replica", "tp")): 0}
