"""The supervisor under faults, on one node (loopback only): a hanging probe, a hanging
peer, daemon-reload and daemon-reexec, the bus going away, a spec edited into
something broken, and the supervisor itself restarted."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from installed import BIN_DIR
from specs import free_port, one_node_shard, write
from systemd_harness import STANDINS, UserManager, wait_until

pytestmark = pytest.mark.integration

SUPERVISOR = str(BIN_DIR / "llmgw-supervisor")
TARGET, ENGINE = "llmgw-shard.target", "llmgw-shard-engine.service"


SYSTEMD_GRACE = 4  # seconds the last read stands while systemd does not answer


class LocalSupervisor:
    def __init__(self, manager: UserManager, spec: Path, port: int) -> None:
        self.manager, self.spec, self.port = manager, spec, port
        self.log = manager.state / "supervisor.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen(
            [SUPERVISOR, "--user", "--node", "node", "--listen", f"127.0.0.1:{self.port}",
             "--systemd-grace", str(SYSTEMD_GRACE), "--state-dir",
             str(self.manager.state / "supervisor-state"), str(self.spec)],
            env=self.manager.env, stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_until(lambda: self.get("/v1/shards") is not None, 20, "the supervisor's API")

    def get(self, path: str, timeout: float = 3) -> object:
        try:
            url = f"http://127.0.0.1:{self.port}{path}"
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                return json.loads(resp.read())
        except (OSError, ValueError):
            return None

    def replica(self, name: str = "shard") -> dict[str, object]:
        data = self.get(f"/v1/replicas/{name}")
        assert isinstance(data, dict), data
        return data

    def wait(self, state: str | tuple[str, ...], reason: str = "", timeout: float = 60
             ) -> dict[str, object]:
        states = (state,) if isinstance(state, str) else state

        def check() -> dict[str, object] | None:
            data = self.get("/v1/replicas/shard")
            ok = isinstance(data, dict) and data["state"] in states and reason in str(
                data["reason"])
            return data if ok else None  # type: ignore[return-value]

        return wait_until(check, timeout, f"the replica to be {state} ({reason})")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.alive():
            assert self.process is not None
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=15)


@pytest.fixture
def supervised(one_node: UserManager, tmp_path: Path) -> Iterator[LocalSupervisor]:
    """A stand-in shard on one node (serving HTTP), started, with its supervisor."""
    spec = one_node_shard(tmp_path / "spec.yaml", name="shard", http=free_port(),
                          head=free_port(), pid_file=tmp_path / "pids", delay=1)
    spec.write_text(spec.read_text() + "    health: {interval: 1, timeout: 1, stability: 1}\n")
    one_node.render(spec, "node")
    one_node.systemctl("start", TARGET)
    sup = LocalSupervisor(one_node, spec, free_port())
    try:
        yield sup
    finally:
        sup.stop()
        print(sup.log.read_text(errors="replace")[-3000:])


def test_survives_daemon_reload_and_reexec(supervised: LocalSupervisor) -> None:
    supervised.wait("ready")
    supervised.manager.systemctl("daemon-reload")
    supervised.manager.systemctl("daemon-reexec")
    wait_until(lambda: supervised.manager.state_of(ENGINE)[0] == "active", 20, "the manager")
    supervised.wait("ready")
    supervised.manager.kill_main(ENGINE)  # signals must still arrive (Subscribe() again)
    supervised.wait(("degraded", "failed", "starting"))  # not ready: the death was seen
    supervised.wait("ready")
    assert supervised.alive()


def test_survives_the_bus_going_away(supervised: LocalSupervisor) -> None:
    supervised.wait("ready")
    supervised.manager.systemctl("stop", "dbus.service", "dbus.socket")
    # its last read stands for the grace (its engine's process still runs), then not
    wait_until(lambda: "unreachable" in str(supervised.replica()["reason"]),
               30 + SYSTEMD_GRACE, "the supervisor to notice it lost systemd")
    assert supervised.alive()  # GLib would have SIGTERMed it
    supervised.manager.systemctl("start", "dbus.socket")
    supervised.wait("ready", timeout=60)


def test_a_hanging_probe_is_not_health(one_node: UserManager, tmp_path: Path) -> None:
    port = free_port()
    spec = write(tmp_path / "spec.yaml", f"""\
replicas:
  - name: shard
    engine: command
    port: {port}
    health: {{interval: 1, timeout: 1, stability: 1}}
    nodes: [{{name: node, address: 127.0.0.1}}]
    ranks:
      - commands: [{{argv: [/usr/bin/python3, {STANDINS}/hanging_server.py, 127.0.0.1,
                            "{port}"]}}]
""")
    one_node.render(spec, "node")
    one_node.systemctl("start", TARGET)
    sup = LocalSupervisor(one_node, spec, free_port())
    try:
        seen = sup.wait("starting", "no answer within 1 s")
        assert "health endpoint not answering yet" in str(seen["reason"])
        started = time.monotonic()
        assert sup.get("/v1/replicas", timeout=5) is not None  # the API is not held up
        assert time.monotonic() - started < 5
    finally:
        sup.stop()


def test_a_hanging_peer_is_unknown_not_ready(one_node: UserManager, tmp_path: Path) -> None:
    api = free_port()
    hanging = subprocess.Popen([sys.executable, str(STANDINS / "hanging_server.py"),
                                "127.0.0.2", str(api)])  # the peer's API: never answers
    http = free_port()
    spec = write(tmp_path / "spec.yaml", f"""\
replicas:
  - name: shard
    engine: command
    port: {http}
    health: {{path: /, interval: 1, timeout: 1, stability: 1}}
    nodes:
      - {{name: node, address: 127.0.0.1}}
      - {{name: ghost, address: 127.0.0.2}}
    ranks:
      - commands: [{{argv: [/usr/bin/python3, -m, http.server, --bind, 127.0.0.1, "{http}"]}}]
      - commands: [{{argv: [/usr/bin/sleep, infinity]}}]
""")
    one_node.render(spec, "node")
    one_node.systemctl("start", TARGET)
    sup = LocalSupervisor(one_node, spec, api)
    try:
        seen = sup.wait("degraded", "rank 1 on ghost: supervisor on ghost unreachable")
        assert "no complete answer within 2 s" in str(seen["reason"])
        shards = sup.get("/v1/shards")
        assert isinstance(shards, dict) and shards["shards"][0]["state"] == "ready"
    finally:
        sup.stop()
        hanging.kill()
        hanging.wait(timeout=10)


def test_a_broken_spec_keeps_the_last_good_one(supervised: LocalSupervisor) -> None:
    supervised.wait("ready")
    good = supervised.spec.read_text()
    supervised.spec.write_text(good.replace("engine: command", "engine: comand"))
    wait_until(lambda: "keeping the last good configuration" in supervised.log.read_text(),
               30, "the supervisor to refuse the broken spec")
    assert "did you mean 'command'" in supervised.log.read_text()
    assert supervised.replica()["state"] == "ready"
    supervised.spec.write_text(good.replace("name: shard", "name: renamed"))
    wait_until(lambda: supervised.get("/v1/replicas/renamed") is not None, 30,
               "the edited spec to take effect")
    assert supervised.get("/v1/replicas/shard") is None


def test_a_bad_file_in_the_folder_costs_only_its_own_replicas(one_node: UserManager,
                                                              tmp_path: Path) -> None:
    """As the generator does: the other files' replicas are watched, the bad one named."""
    folder = tmp_path / "replicas.d"
    folder.mkdir()
    spec = one_node_shard(folder / "a.yaml", name="shard", http=free_port(),
                          head=free_port(), pid_file=tmp_path / "pids", delay=1)
    spec.write_text(spec.read_text() + "    health: {interval: 1, timeout: 1, stability: 1}\n")
    (folder / "b.yaml").write_text("replicas:\n  - name: other\n    engine: vllm\n")
    one_node.render(spec, "node")
    one_node.systemctl("start", TARGET)
    sup = LocalSupervisor(one_node, folder, free_port())
    try:
        sup.wait("ready")
        assert (f"spec: {folder / 'b.yaml'}:2: replicas[0]: missing required key 'nodes' "
                "(not watching this file's replicas)") in sup.log.read_text()
    finally:
        sup.stop()


def test_sighup_rereads_the_spec_and_keeps_running(supervised: LocalSupervisor) -> None:
    supervised.wait("ready")
    assert supervised.process is not None
    supervised.process.send_signal(signal.SIGHUP)  # systemctl kill -s HUP ...
    wait_until(lambda: supervised.log.read_text().count("watching 1 shard(s)") == 2, 20,
               "the spec to be read again")
    assert supervised.alive()
    supervised.wait("ready")


def test_a_restarted_supervisor_rebuilds_from_systemd(supervised: LocalSupervisor) -> None:
    supervised.wait("ready")
    engine = supervised.manager.show(ENGINE, "MainPID")["MainPID"]
    supervised.stop()
    supervised.start()
    supervised.wait("ready")
    assert supervised.manager.show(ENGINE, "MainPID")["MainPID"] == engine  # untouched


def test_runs_as_a_notify_unit_with_a_watchdog(one_node: UserManager, tmp_path: Path) -> None:
    """As its shipped unit runs it: Type=notify (active only once READY=1 came), STATUS=
    shown by systemctl, and WATCHDOG=1 pings that keep a short WatchdogSec= satisfied."""
    spec = one_node_shard(tmp_path / "spec.yaml", name="shard", http=free_port(),
                          head=free_port(), pid_file=tmp_path / "pids", delay=1)
    spec.write_text(spec.read_text() + "    health: {interval: 1, timeout: 1, stability: 1}\n")
    one_node.render(spec, "node")
    one_node.systemctl("start", TARGET)
    unit = "llmgw-test-supervisor.service"
    run = subprocess.run(
        ["systemd-run", "--user", f"--unit={unit}", "--property=Type=notify",
         "--property=NotifyAccess=main", "--property=WatchdogSec=2",
         SUPERVISOR, "--user", "--node", "node", "--listen", f"127.0.0.1:{free_port()}",
         "--state-dir", str(tmp_path / "supervisor-state"), str(spec)], env=one_node.env,
        capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr  # systemd-run waits for READY=1 on notify units
    assert one_node.state_of(unit) == ("active", "running")
    wait_until(lambda: "1 replica(s), 1 ready" in one_node.show(unit, "StatusText")[
        "StatusText"], 30, "STATUS= to report the replica ready")
    time.sleep(5)  # more than two watchdog periods: a missed ping would kill it
    info = one_node.show(unit, "ActiveState", "NRestarts", "Result")
    assert info == {"ActiveState": "active", "NRestarts": "0", "Result": "success"}, info
    one_node.systemctl("stop", unit)


def test_metrics_of_a_replica_that_left_the_spec_go(supervised: LocalSupervisor) -> None:
    supervised.wait("ready")
    assert 'replica="shard"' in metrics_text(supervised.port)
    supervised.spec.write_text(supervised.spec.read_text().replace("name: shard",
                                                                   "name: renamed"))
    wait_until(lambda: supervised.get("/v1/replicas/renamed") is not None, 30,
               "the edited spec to take effect")
    text = metrics_text(supervised.port)
    assert 'replica="renamed"' in text and 'replica="shard"' not in text


def test_the_api_speaks_exactly_its_routes(supervised: LocalSupervisor) -> None:
    supervised.wait("ready")
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", supervised.port, timeout=5)
    cases = [("GET", "/v1/replicas/shard", 200), ("HEAD", "/v1/replicas/shard", 200),
             ("POST", "/v1/replicas", 405), ("DELETE", "/v1/shards", 405),
             ("GET", "/v1/replicas/", 404), ("GET", "/v1/replicas/NOT_A_NAME", 404),
             ("GET", "/v1/replicas/shard/", 404), ("GET", "/v1/shards?after=x", 400),
             ("GET", "/v1/shards?bogus=1", 400), ("GET", "/etc/passwd", 404)]
    for method, path, status in cases:
        conn.request(method, path)
        response = conn.getresponse()
        body = response.read()
        assert response.status == status, (method, path, response.status, body)
        assert response.getheader("Server") == "llmgw-supervisor"
        if method == "HEAD":
            assert body == b"" and int(response.getheader("Content-Length") or 0) > 0
        if status == 405:
            assert response.getheader("Allow") == "GET, HEAD"
            conn.close()
    conn.close()
    assert "Traceback" not in supervised.log.read_text()


def test_listens_on_ipv6(one_node: UserManager, tmp_path: Path) -> None:
    spec = one_node_shard(tmp_path / "spec.yaml", name="shard", http=free_port(),
                          head=free_port(), pid_file=tmp_path / "pids", delay=1)
    one_node.render(spec, "node")
    port = free_port()
    proc = subprocess.Popen(
        [SUPERVISOR, "--user", "--node", "node", "--listen", f"[::1]:{port}",
         "--state-dir", str(tmp_path / "state"), str(spec)], env=one_node.env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def answered() -> bool:
            try:
                with urllib.request.urlopen(f"http://[::1]:{port}/v1/shards",
                                            timeout=3) as resp:
                    return bool(json.loads(resp.read())["node"] == "node")
            except OSError:
                return False

        wait_until(answered, 20, "the API on [::1]")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())
