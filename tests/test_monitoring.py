"""The Prometheus rules and the Grafana dashboard shipped in the packages
(packaging/monitoring/): the rules valid for Prometheus's own checker, every alert's cases
passing under `promtool test rules` (tests/monitoring/rules_test.yml), and every series
the rules and the dashboard read one the supervisor exports. Debian's prometheus package
provides promtool (scripts/setup --test). That each query returns series from a real
scrape of a real supervisor is tests/integration/test_prometheus.py's."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from llmgw_systemd.health.events import GROUP_RESTART, KINDS, Event
from llmgw_systemd.supervisor.http.metrics import Figures, ReplicaFigures, SupervisorMetrics

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "packaging" / "monitoring" / "llmgw-rules.yml"
RULES_TEST = ROOT / "tests" / "monitoring" / "rules_test.yml"
DASHBOARD = ROOT / "packaging" / "monitoring" / "llmgw-dashboard.json"
# a metric name of ours, not a recording rule's (those are level:metric:operation)
SERIES = re.compile(r"(?<![:\w])llmgw_[a-z_]+(?![:\w])")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    assert tool, "promtool not found: scripts/setup --test installs Debian's prometheus"
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=120,
                          check=False, cwd=RULES_TEST.parent)


def test_promtool_checks_the_rules() -> None:
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_alert_fires_when_it_should_and_only_then() -> None:
    done = promtool("test", "rules", RULES_TEST.name)
    assert done.returncode == 0, done.stdout + done.stderr
    tested = set(re.findall(r"alertname: (\w+)", RULES_TEST.read_text()))
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"]
              for r in g["rules"] if "alert" in r}
    assert alerts == tested, f"alerts without a case: {sorted(alerts - tested)}"


def exported_names() -> set[str]:
    """Every series name the supervisor's /metrics can hold."""
    figures = Figures((ReplicaFigures("r", "ready", 0, 0, "ready", (("u.service", 0),)),),
                      ("peer",), systemd_reachable=True)
    metrics = SupervisorMetrics(lambda: figures, lambda: {"api": {"open": 1}})
    body, _ = metrics.render()
    names: set[str] = set()
    for family in text_string_to_metric_families(body.decode()):  # type: ignore[no-untyped-call]
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                    }.get(family.type, ("",))
        names.update(family.name + s for s in suffixes)
    return names


def test_the_rules_read_only_what_the_supervisor_exports() -> None:
    exported = exported_names()
    read: set[str] = set()
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            read.update(SERIES.findall(rule["expr"]))
    assert read, "no series found in the rules"
    assert read <= exported, f"not exported: {sorted(read - exported)}"


def dashboard_queries() -> list[str]:
    """Every panel's and variable's query, as the dashboard holds it."""
    board = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in board["panels"] for t in p["targets"]]
    queries += [v["definition"] for v in board["templating"]["list"] if "definition" in v]
    return queries


def test_the_dashboard_reads_only_what_the_supervisor_exports() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "replica"}
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    assert all(p["description"] and p["targets"] for p in panels), "a panel says what it is"
    read = {name for q in dashboard_queries() for name in SERIES.findall(q)}
    exported = exported_names()
    assert read <= exported, f"not exported: {sorted(read - exported)}"
    # what the issue asks a replica's page to show
    for series in ("llmgw_replica_state", "llmgw_replica_routable", "llmgw_shard_state",
                   "llmgw_unit_restarts", "llmgw_group_restarts", "llmgw_stall_restarts_total",
                   "llmgw_probe_seconds_bucket", "llmgw_generation_check_seconds_bucket",
                   "llmgw_peer_fetch_failures_total"):
        assert series in read, series


def test_the_journalctl_an_alert_points_at_filters_by_fields_the_events_carry() -> None:
    """`journalctl KEY=value` in a description finds something only if the supervisor's
    events carry KEY (health/events.py) and, for LLMGW_EVENT=, that kind."""
    every = Event(GROUP_RESTART, "m", "r", "n", 0, "ready", "why").fields()
    fields = {key for key, _ in every}
    said = [r["annotations"]["description"] for g in yaml.safe_load(RULES.read_text())["groups"]
            for r in g["rules"] if "alert" in r]
    filters = [match for text in said for command in re.findall(r"`(journalctl [^`]*)`", text)
               for match in re.findall(r"\b([A-Z_]+)=(\S+)", command)]
    assert filters, "no alert points at journal fields"
    assert {key for key, _ in filters} <= fields, filters
    assert {value for key, value in filters if key == "LLMGW_EVENT"} <= set(KINDS), filters
