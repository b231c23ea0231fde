"""The unit graph under a real systemd, on one node (docs/design.md §1 and §3):
crashes take the whole shard down and bring it back, the restart budget ends a crash
loop, stop leaves nothing behind, a stale port holder fails the shard cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from specs import free_port, one_node_shard
from systemd_harness import UserManager, pid_alive, port_is_free, wait_until

pytestmark = pytest.mark.integration

TARGET = "llmgw-shard.target"
HEAD, ENGINE = "llmgw-shard-head.service", "llmgw-shard-engine.service"
RESTART = "llmgw-shard-restart.service"


def http_ok(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


class Shard:
    """The stand-in shard on one manager: a head sidecar and a serving member."""

    def __init__(self, manager: UserManager, tmp: Path, **policy: int) -> None:
        self.manager = manager
        self.http, self.head = free_port(), free_port()
        self.pid_file = tmp / "head.pids"
        self.spec = one_node_shard(tmp / "spec.yaml", name="shard", http=self.http,
                                   head=self.head, pid_file=self.pid_file, **policy)
        manager.render(self.spec, "node")

    def start(self) -> None:
        self.pid_file.unlink(missing_ok=True)
        self.manager.systemctl("start", TARGET)
        self.wait_up()

    def wait_up(self, timeout: float = 30) -> None:
        self.manager.wait_state(HEAD, "active", timeout)
        self.manager.wait_state(ENGINE, "active", timeout)
        wait_until(lambda: http_ok(self.http), timeout, "the shard to answer HTTP")

    def pids(self) -> tuple[int, int]:
        """(head main PID, PID of the head's daemonized child)."""
        wait_until(self.pid_file.exists, 10, "the head's PID file")
        main, daemon = (int(p) for p in self.pid_file.read_text().split())
        assert main > 1 and daemon > 1
        return main, daemon

    def main_pid(self, unit: str) -> int:
        return int(self.manager.show(unit, "MainPID")["MainPID"])

    def timestamp(self, unit: str, which: str) -> int:
        key = f"{which}TimestampMonotonic"
        return int(self.manager.show(unit, key)[key])

    def wait_down(self, timeout: float = 10) -> None:
        """Both members out of active, and no process left in either: the window of
        the restart delay, whichever of systemd's paths brings the shard back."""
        wait_until(lambda: all(self.manager.state_of(u)[0] != "active" and
                               not self.manager.unit_pids(u) for u in (HEAD, ENGINE)),
                   timeout, "the whole shard to be down")

    def assert_nothing_left(self, daemon_pid: int) -> None:
        for unit in (HEAD, ENGINE):
            assert self.manager.unit_pids(unit) == set(), f"{unit} left processes"
        assert not pid_alive(daemon_pid), "the head's daemonized child survived"


def test_sidecar_death_restarts_the_whole_shard(one_node: UserManager, tmp_path: Path) -> None:
    shard = Shard(one_node, tmp_path, delay=3)
    shard.start()
    head_pid, daemon_pid = shard.pids()
    engine_pid = shard.main_pid(ENGINE)

    os.kill(head_pid, signal.SIGKILL)

    # The engine loses its head and exits too; either way the whole shard goes down.
    shard.wait_down()
    shard.assert_nothing_left(daemon_pid)

    shard.wait_up()
    assert shard.main_pid(ENGINE) != engine_pid and shard.pids()[0] != head_pid
    assert shard.timestamp(HEAD, "ActiveEnter") < shard.timestamp(ENGINE, "ActiveEnter")


def test_engine_death_restarts_the_whole_shard(one_node: UserManager, tmp_path: Path) -> None:
    shard = Shard(one_node, tmp_path, delay=3)
    shard.start()
    head_pid, daemon_pid = shard.pids()

    one_node.kill_main(ENGINE)

    shard.wait_down()  # BindsTo= took the sidecar down
    shard.assert_nothing_left(daemon_pid)
    assert one_node.show(ENGINE, "Result")["Result"] == "signal"

    shard.wait_up()
    assert shard.pids()[0] != head_pid
    assert shard.timestamp(HEAD, "ActiveEnter") < shard.timestamp(ENGINE, "ActiveEnter")


def test_restart_budget_ends_a_crash_loop(one_node: UserManager, tmp_path: Path) -> None:
    shard = Shard(one_node, tmp_path, delay=1, burst=3, interval=300)
    shard.start()
    kills = 0

    def restart_pending() -> bool:
        # The restart unit sleeping, or any job still queued (its start waits After= the
        # members' stops): a member failed now may still come back.
        sleeping = any(one_node.show(u, "ActiveState")["ActiveState"] in ("active", "activating")
                       for u in (RESTART, RESTART.replace("-restart.", "-relaunch.")))
        return sleeping or bool(one_node.systemctl("list-jobs", "--no-legend").stdout.strip())

    give_up = time.monotonic() + 180  # a bound on the loop, not a figure under test
    while True:
        time.sleep(0.05)
        state = {u: one_node.show(u, "ActiveState", "Result") for u in (HEAD, ENGINE)}
        # The loop ends when a member is failed and nothing will start it again. A stop that
        # lands before a start step can catch SIGTERM (fork to exec, interpreter start) fails
        # the member by signal, which systemd cannot tell from a crash: it is restarted as
        # after any other failure, so it ends nothing.
        if any(s["ActiveState"] == "failed" for s in state.values()) and not restart_pending():
            state = {u: one_node.show(u, "ActiveState", "Result") for u in (HEAD, ENGINE)}
            if any(s["ActiveState"] == "failed" for s in state.values()):
                break
        assert time.monotonic() < give_up, (
            f"the crash loop neither ended nor went on: {state}, "
            f"{one_node.show(RESTART, 'ActiveState', 'NRestarts')}, "
            f"jobs: {one_node.systemctl('list-jobs', '--no-legend').stdout}")
        assert kills < 10, f"no end to the restarts after {kills} kills: {state}"
        if state[ENGINE]["ActiveState"] == "active":
            pid = one_node.kill_main(ENGINE)
            kills += 1

            def engine_replaced(killed: int = pid) -> bool:
                return shard.main_pid(ENGINE) != killed

            wait_until(engine_replaced, 10, "the engine to die")
        wait_until(lambda: any(one_node.show(u, "ActiveState")["ActiveState"] in
                               ("active", "failed") for u in (ENGINE, HEAD)) and
                   one_node.show(ENGINE, "ActiveState")["ActiveState"] != "activating",
                   30, "the shard to come back or give up")
    # burst=3 allows three starts of each unit: the first and two restarts, so at most
    # three deaths. A death can cost two starts: the engine's stop, propagated back from
    # its sidecar, counts as clean, so its OnSuccess= restart unit starts the target
    # after the delay too, and with deaths as quick as these that can land between the
    # next death and its own restart (docs/engines.md). Never more than burst starts.
    assert 2 <= kills <= 3, kills
    failed = {u: s for u, s in state.items() if s["ActiveState"] == "failed"}
    assert [s["Result"] for s in failed.values()] == ["start-limit-hit"], state
    status = one_node.systemctl("status", *failed, check=False).stdout
    assert "start-limit-hit" in status
    # It stays down: nothing restarts it any more, for several restart delays.
    before = {u: one_node.show(u, "NRestarts", "ActiveState") for u in (HEAD, ENGINE)}
    try:
        wait_until(lambda: any(one_node.state_of(u)[0] in ("active", "activating")
                               for u in (HEAD, ENGINE)), 5, "a restart that must not come")
        raise AssertionError("the shard restarted after its budget ran out")
    except AssertionError as exc:
        if "must not come" not in str(exc):
            raise
    assert {u: one_node.show(u, "NRestarts", "ActiveState") for u in (HEAD, ENGINE)} == before


def test_stop_leaves_every_unit_inactive_and_nothing_running(
        one_node: UserManager, tmp_path: Path) -> None:
    shard = Shard(one_node, tmp_path)
    shard.start()
    _, daemon_pid = shard.pids()

    one_node.systemctl("stop", TARGET)

    assert one_node.state_of(TARGET)[0] == "inactive"
    for unit in (HEAD, ENGINE):
        info = one_node.show(unit, "ActiveState", "Result")
        assert info == {"ActiveState": "inactive", "Result": "success"}, (unit, info)
    # reverse start order: the engine went first, then the sidecar it depends on
    assert shard.timestamp(ENGINE, "InactiveEnter") <= shard.timestamp(HEAD, "InactiveEnter")
    shard.assert_nothing_left(daemon_pid)
    assert port_is_free(shard.head) and port_is_free(shard.http)

    shard.start()  # the same ports, straight away
    assert http_ok(shard.http)


def test_stale_port_holder_fails_the_sidecar_naming_the_port(
        one_node: UserManager, tmp_path: Path) -> None:
    shard = Shard(one_node, tmp_path, delay=2, burst=10, interval=600)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import socket, time\n"
        f"s = socket.create_server(('127.0.0.1', {shard.head}))\n"
        "print('holding', flush=True)\n"
        "time.sleep(120)\n")], stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"holding\n"
        one_node.systemctl("start", "--no-block", TARGET)
        head = one_node.wait_state(HEAD, "activating", 20, sub="auto-restart")
        assert head["Result"] == "exit-code"
        assert (f"gave up after 3 s waiting for 0.0.0.0:{shard.head} to be free "
                "(0.0.0.0:" in head["StatusText"])
        assert not shard.pid_file.exists(), "a second head started"
        assert one_node.state_of(ENGINE)[0] != "active"
        with socket.create_connection(("127.0.0.1", shard.head), timeout=2):
            pass  # the port still belongs to the holder alone
    finally:
        holder.kill()
        holder.wait(timeout=10)
    shard.wait_up(timeout=60)  # retried under the restart policy once the port is free


def test_members_dying_together_still_bring_the_shard_back(
        one_node: UserManager, tmp_path: Path) -> None:
    """Killed at once, each member's stop cancels the other's restart (BindsTo=); the
    restart unit, started by OnFailure=, brings the shard back all the same."""
    shard = Shard(one_node, tmp_path, delay=2, burst=10, interval=600)
    shard.start()
    for _ in range(3):
        head_pid, daemon_pid = shard.pids()
        engine_pid = shard.main_pid(ENGINE)
        assert head_pid > 1 and engine_pid > 1  # a 0 would signal our own process group
        os.kill(head_pid, signal.SIGKILL)
        os.kill(engine_pid, signal.SIGKILL)
        shard.wait_down()
        shard.assert_nothing_left(daemon_pid)
        shard.pid_file.unlink()
        shard.wait_up(timeout=30)
        assert shard.timestamp(HEAD, "ActiveEnter") < shard.timestamp(ENGINE, "ActiveEnter")


def test_an_engine_that_exits_cleanly_on_its_own_still_brings_the_shard_back(
        one_node: UserManager, tmp_path: Path) -> None:
    """vLLM exits 0 when its engine died: a clean exit, so Restart= should bring it
    back. But its engine core outlives it for a moment; while systemd stops that, the
    unit is deactivating, BindsTo= stops the Ray head, and the head's stop queues a stop
    of the engine, which cancels the pending restart: both end inactive, nothing failed
    (measured with the real vLLM on Ray). OnSuccess= brings the shard back."""
    shard = Shard(one_node, tmp_path, delay=1, burst=10, interval=600,
                  engine_child_lingers=1)
    shard.start()
    for _ in range(2):
        old_head, daemon_pid = shard.pids()
        engine_pid = shard.main_pid(ENGINE)
        shard.pid_file.unlink()
        os.kill(engine_pid, signal.SIGTERM)  # dies by SIGTERM: a clean exit
        wait_until(shard.pid_file.exists, 40, "a new head")
        assert shard.pids()[0] != old_head
        shard.wait_up(timeout=30)
        assert shard.main_pid(ENGINE) != engine_pid
        assert not pid_alive(daemon_pid), "the old head's daemonized child survived"


@pytest.mark.parametrize("how", ["engine killed", "engine exits cleanly",
                                 "engine with an ExecStop= exits cleanly"])
def test_a_sidecar_stop_longer_than_the_restart_delay_still_brings_the_shard_back(
        one_node: UserManager, tmp_path: Path, how: str) -> None:
    """The engine dies; BindsTo= stops the head, which takes 5 s to exit, past the 1 s
    restart delay. Whatever starts the shard again (the engine's Restart=, or the
    restart unit's OnSuccess= with JobMode=fail) meets the head's stop still running:
    the shard must come back all the same, not stay down with its target active.
    A vLLM engine has an ExecStop= (llmgw-stop-group), and then a clean exit fires no
    Restart= at all: only the restart unit brings the shard back, and it must wait for
    the head's stop to end (docs/design.md §3; found on a booted node with Ray)."""
    shard = Shard.__new__(Shard)
    shard.manager, shard.http, shard.head = one_node, free_port(), free_port()
    shard.pid_file = tmp_path / "head.pids"
    shard.spec = one_node_shard(tmp_path / "spec.yaml", name="shard", http=shard.http,
                                head=shard.head, pid_file=shard.pid_file, delay=1,
                                burst=10, interval=600, head_slow_stop=5)
    one_node.render(shard.spec, "node")
    if "ExecStop" in how:  # the vLLM units' shape, through a drop-in as an admin would
        dropin = one_node.unit_dir / f"{ENGINE}.d"
        dropin.mkdir()
        (dropin / "stop.conf").write_text("[Service]\nExecStop=/bin/true\n")
        one_node.systemctl("daemon-reload")
    shard.start()
    for _ in range(2):
        old_head, daemon_pid = shard.pids()
        engine_pid = shard.main_pid(ENGINE)
        shard.pid_file.unlink()
        os.kill(engine_pid, signal.SIGKILL if how == "engine killed" else signal.SIGTERM)
        wait_until(lambda: one_node.state_of(HEAD)[0] == "deactivating", 10,
                   "the head's slow stop")
        wait_until(shard.pid_file.exists, 60, "a new head after the slow stop")
        assert shard.pids()[0] != old_head
        shard.wait_up(timeout=30)
        assert shard.main_pid(ENGINE) != engine_pid
        assert not pid_alive(daemon_pid), "the old head's daemonized child survived"


def test_a_stop_never_brings_the_shard_back(one_node: UserManager, tmp_path: Path) -> None:
    """An engine that exits non-zero on SIGTERM ends failed when stopped; its
    OnFailure= must not then start the replica again."""
    shard = Shard.__new__(Shard)
    shard.manager, shard.http, shard.head = one_node, free_port(), free_port()
    shard.pid_file = tmp_path / "head.pids"
    shard.spec = one_node_shard(tmp_path / "spec.yaml", name="shard", http=shard.http,
                                head=shard.head, pid_file=shard.pid_file, delay=1,
                                engine_exit_on_term=3)
    one_node.render(shard.spec, "node")
    shard.start()

    one_node.systemctl("stop", TARGET)  # returns once every member has stopped

    assert one_node.show(ENGINE, "ActiveState", "Result") == {
        "ActiveState": "failed", "Result": "exit-code"}
    try:  # several restart delays: nothing may start
        wait_until(lambda: any(one_node.state_of(u)[0] in ("active", "activating")
                               for u in (TARGET, HEAD, ENGINE)), 4, "a start that must not come")
        raise AssertionError("the stopped replica came back")
    except AssertionError as exc:
        if "must not come" not in str(exc):
            raise
    assert port_is_free(shard.head) and port_is_free(shard.http)


def test_an_enabled_replica_comes_back_when_its_manager_starts(
        one_node: UserManager, tmp_path: Path) -> None:
    """`systemctl enable` of the target is what brings a replica back after a reboot:
    here the node's manager is stopped and started again over the same configuration."""
    shard = Shard(one_node, tmp_path)
    enabled = one_node.systemctl("enable", TARGET)
    assert "default.target.wants/llmgw-shard.target" in enabled.stderr + enabled.stdout
    one_node.stop()  # the whole node goes down, shard and manager (checked: nothing left)
    assert port_is_free(shard.head) and port_is_free(shard.http)

    one_node.start()  # boot: nobody starts the shard by hand

    shard.wait_up(timeout=60)


def test_a_user_manager_loads_no_credentials(one_node: UserManager, tmp_path: Path) -> None:
    """The fact the planner relies on when it names the Ray token file itself under a
    user manager (units/plan.py, docs/design.md §6): systemd 252's user manager sets
    $CREDENTIALS_DIRECTORY for LoadCredential= but leaves the directory empty. If a
    later systemd loads them, this fails, and the user units can use credentials too."""
    secret, out = tmp_path / "secret", tmp_path / "seen"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    (one_node.unit_dir / "llmgw-credprobe.service").write_text(
        "[Service]\nType=oneshot\n"
        f"LoadCredential=token:{secret}\n"
        f"ExecStart=/usr/bin/env --chdir=/ /usr/bin/find -H ${{CREDENTIALS_DIRECTORY}} "
        f"-fprint {out}\n")
    one_node.systemctl("daemon-reload")
    one_node.systemctl("start", "llmgw-credprobe.service")
    seen = out.read_text().split()
    assert seen and seen[0].endswith("/credentials/llmgw-credprobe.service"), seen
    assert seen[1:] == [], f"the user manager loaded a credential: {seen}"


def test_a_stop_while_the_restart_unit_sleeps_leaves_nothing_failed(
        one_node: UserManager, tmp_path: Path) -> None:
    """The engine dies, the restart unit sleeps its delay, and the operator stops the
    target meanwhile: every unit ends inactive, the restart unit too (it used to end
    failed, Result=signal, which every "failed units" alert fires on), and nothing starts
    again."""
    shard = Shard(one_node, tmp_path, delay=8, burst=10, interval=900)
    shard.start()
    one_node.kill_main(ENGINE)
    one_node.wait_state(RESTART, "activating", 20)
    one_node.systemctl("stop", TARGET)
    for unit in (RESTART, ENGINE, HEAD, TARGET):
        assert one_node.state_of(unit)[0] == "inactive", (unit, one_node.state_of(unit))
    assert one_node.show(RESTART, "Result")["Result"] == "success"
    try:
        wait_until(lambda: any(one_node.state_of(u)[0] in ("active", "activating")
                               for u in (TARGET, HEAD, ENGINE, RESTART)), 10,
                   "a start that must not come")
        raise AssertionError("the stopped replica came back")
    except AssertionError as exc:
        if "must not come" not in str(exc):
            raise
