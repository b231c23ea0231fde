"""The shipped rules and dashboard against a real Prometheus (Debian's package, started
here by hand with its own configuration, stopped by PID) scraping two real supervisors,
while a replica goes ready, loses a member, restarts as a group, loses it again with its
group-restart budget spent, and comes back once the budget's window lets it.

Every dashboard query and every series a rule reads returns series; every recording rule
does; "not routable" goes pending, fires and resolves; "budget spent" fires. The rules are
the shipped file with its `for:` durations shortened (the test's own copy); everything
else about them is as shipped."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import yaml
from specs import PYTHON, free_port, head_argv, member_argv, write, yaml_list
from supervisors import ApiReader, SupervisorProcess, stop_and_show
from systemd_harness import STANDINS, Nodes, wait_until

from llmgw_systemd.spec.endpoint import SUPERVISOR_PORT

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "packaging" / "monitoring" / "llmgw-rules.yml"
DASHBOARD = ROOT / "packaging" / "monitoring" / "llmgw-dashboard.json"
TARGET, ENGINE = "llmgw-rep.target", "llmgw-rep-engine.service"
WINDOW = 120  # group_restart.window: the second death waits this long for its restart
SELECTOR = re.compile(r"(?<![:\w])(?:llmgw_[a-z_]+|up)(?:\{[^}]*\})?(?![:\w(])")


def spec(path: Path, nodes: Nodes, http: int, head: int) -> Path:
    leader, worker = nodes.address("node-a"), nodes.address("node-b")
    engine = [PYTHON, str(STANDINS / "stepping_engine.py"), "--port", str(http),
              "--host", "0.0.0.0"]
    # a start takes at most stop 7 + rendezvous 5 + 30 + group delay 1 + stability 1 = 44 s
    return write(path, f"""\
replicas:
  - name: rep
    engine: command
    port: {http}
    rendezvous_timeout: 5
    stop_timeout: 7
    drain: {{delay: 1, timeout: 1}}
    restart: {{delay: 1, burst: 20, interval: 900}}
    health: {{interval: 1, timeout: 1, stability: 1, generation: {{interval: 1, timeout: 2}}}}
    group_restart: {{delay: 1, max_delay: 2, budget: 1, window: {WINDOW}}}
    nodes:
      - {{name: node-a, address: {leader}}}
      - {{name: node-b, address: {worker}}}
    ranks:
      - commands:
          - name: head
            argv: {yaml_list(head_argv(head, "0.0.0.0", path.parent / "head.pids"))}
            binds: [{head}]
          - argv: {yaml_list(engine)}
            wait_for: ["{leader}:{head}"]
      - commands:
          - argv: {yaml_list(member_argv(f"{leader}:{head}"))}
            wait_for: ["{leader}:{head}"]
""")


class Prometheus:
    """A Prometheus server in node-a's namespace, scraping both supervisors every second
    and evaluating the rules every second."""

    def __init__(self, nodes: Nodes, tmp_path: Path) -> None:
        manager = nodes["node-a"]
        assert manager.netns is not None
        binary = shutil.which("prometheus")
        assert binary, "prometheus not found: scripts/setup --test installs Debian's"
        rules = tmp_path / "rules.yml"
        # the shipped rules, their waits shortened to what a test can sit through
        rules.write_text(re.sub(r"for: \d+m", "for: 2s", RULES.read_text()))
        self.address = f"{nodes.address('node-a')}:{free_port()}"
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": "llmgw-supervisor", "static_configs": [{
                "targets": [f"{nodes.address(n)}:{SUPERVISOR_PORT}"
                            for n in ("node-a", "node-b")]}]}]}))
        self.log = tmp_path / "prometheus.log"
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                ["ip", "netns", "exec", manager.netns.name, binary,
                 f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                 f"--web.listen-address={self.address}"],
                stdout=out, stderr=subprocess.STDOUT)
        self.reader = ApiReader(manager, "node-a", f"http://{self.address}")
        wait_until(lambda: self.get("/-/ready")[0] == 200, 60, "Prometheus to be ready")

    def get(self, path: str) -> tuple[int, Any]:
        return self.reader.get(path, timeout=5)

    def query(self, expr: str) -> list[dict[str, Any]]:
        status, body = self.get(f"/api/v1/query?query={quote(expr)}")
        assert status == 200 and body["status"] == "success", (expr, status, body)
        return list(body["data"]["result"])

    def alerts(self, name: str) -> list[dict[str, Any]]:
        status, body = self.get("/api/v1/alerts")
        assert status == 200, body
        return [a for a in body["data"]["alerts"] if a["labels"]["alertname"] == name]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture
def watched(two_nodes: Nodes, tmp_path: Path
            ) -> Iterator[tuple[SupervisorProcess, SupervisorProcess, Prometheus]]:
    path = spec(tmp_path / "spec.yaml", two_nodes, free_port(), free_port())
    leader, worker = two_nodes["node-a"], two_nodes["node-b"]
    leader.render(path, "node-a")
    worker.render(path, "node-b")
    sups = [SupervisorProcess(m, n, path, listen=f"{two_nodes.address(n)}:{SUPERVISOR_PORT}")
            for m, n in ((leader, "node-a"), (worker, "node-b"))]
    prometheus: Prometheus | None = None
    try:
        worker.systemctl("start", TARGET)
        leader.systemctl("start", TARGET)
        prometheus = Prometheus(two_nodes, tmp_path)
        yield sups[0], sups[1], prometheus
    finally:
        if prometheus is not None:
            prometheus.stop()
            print("===== prometheus log\n" + prometheus.log.read_text(errors="replace")[-3000:])
        stop_and_show(sups)


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in board["panels"] for t in p["targets"]]
    queries += [v["definition"].replace("label_values(", "group by (replica) (")
                .replace(", replica)", ")")
                for v in board["templating"]["list"] if "definition" in v]
    return [q.replace("$replica", "rep").replace("$__rate_interval", "15s") for q in queries]


def rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_prometheus_sees_what_the_dashboard_and_the_rules_read(
        watched: tuple[SupervisorProcess, SupervisorProcess, Prometheus]) -> None:
    a, b, prometheus = watched
    a.wait_state("rep", "ready", 90, settled=True)
    wait_until(lambda: len(prometheus.query('up{job="llmgw-supervisor"} == 1')) == 2, 30,
               "Prometheus to scrape both supervisors")

    b.manager.kill_main(ENGINE)  # a member dies: the replica restarts as a group
    a.wait_state("rep", "ready", 90, restarts=1, settled=True)
    b.wait_state("rep", "ready", 30)
    time.sleep(3)  # scrapes and rule evaluations of the replica back after its restart

    empty = [q for q in dashboard_queries() if not prometheus.query(q)]
    assert not empty, f"dashboard queries without series: {empty}"
    recorded = [r["record"] for r in rules() if "record" in r]
    assert recorded and not [r for r in recorded if not prometheus.query(r)], recorded
    selectors = {s for r in rules() if "alert" in r for s in SELECTOR.findall(r["expr"])}
    assert 'up{job="llmgw-supervisor"}' in selectors and "llmgw_systemd_reachable" in selectors
    empty = sorted(s for s in selectors if not prometheus.query(s))
    assert not empty, f"series the alerts read, without series: {empty}"
    assert not prometheus.alerts("LlmgwReplicaNotRoutable")  # its restart was within its start

    b.manager.kill_main(ENGINE)  # again: the budget (1) is spent, nobody restarts it
    a.wait_state("rep", "failed", 30, reason="group restart budget spent")

    def state(name: str) -> str | None:
        found = prometheus.alerts(name)
        return str(found[0]["state"]) if found else None

    # it has no `for:`: firing at the first evaluation, while the window still holds the
    # restart (checked after LlmgwReplicaNotRoutable, a loaded CI run saw the window end)
    wait_until(lambda: state("LlmgwGroupRestartBudgetSpent") == "firing", 30,
               "LlmgwGroupRestartBudgetSpent to fire")
    # not routable for longer than its start time (44 s), then for: (2 s here)
    wait_until(lambda: state("LlmgwReplicaNotRoutable") == "pending", 90,
               "LlmgwReplicaNotRoutable to be pending")
    wait_until(lambda: state("LlmgwReplicaNotRoutable") == "firing", 30,
               "LlmgwReplicaNotRoutable to fire")
    firing = prometheus.alerts("LlmgwReplicaNotRoutable")[0]
    assert firing["labels"]["replica"] == "rep" and firing["labels"]["severity"] == "page"
    assert "llmgw-systemd status --cluster rep" in firing["annotations"]["description"]

    # the window lets one more restart: it comes back, and the alerts resolve
    a.wait_state("rep", "ready", WINDOW + 90, settled=True)
    wait_until(lambda: state("LlmgwReplicaNotRoutable") is None
               and state("LlmgwGroupRestartBudgetSpent") is None, 30,
               "the alerts to resolve")
