"""llmgw-render --apply under a real systemd user manager: a changed replica restarts and
no other does; a removed one is stopped, every process gone, before its files go."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from entry_guard import NOT_FOR_RENDER, run_entry
from helpers import snapshot
from installed import RENDER
from specs import PYTHON, free_port, write, yaml_list
from supervisors import SUPERVISOR, ApiReader
from systemd_harness import UserManager, cgroup_pids, pid_alive, port_is_free, wait_until

from llmgw_systemd.spec.document import parse
from llmgw_systemd.spec.endpoint import SUPERVISOR_LOCAL
from llmgw_systemd.spec.names import DIGEST_VAR
from llmgw_systemd.spec.replicas import build_spec
from llmgw_systemd.units.plan import SUPERVISOR_UNIT, ready_within

pytestmark = pytest.mark.integration

# A sidecar that forks a child, so "every process gone" covers more than main PIDs.
FORKS = [PYTHON, "-c", "import subprocess, time; subprocess.Popen(['/usr/bin/sleep', "
         "'infinity']); time.sleep(1e9)"]


# Small bounds, so that the wait for a replica that never comes back ends in ~40 s.
TIGHT = """\
    stop_timeout: 6
    rendezvous_timeout: 1
    drain: {delay: 0, timeout: 1}
    health: {stability: 0}
    group_restart: {delay: 1}
"""


def replica(name: str, port: int, *extra: str, argv: list[str] | None = None,
            keys: str = "") -> str:
    serve = argv or [PYTHON, "-m", "http.server", str(port), "--bind", "127.0.0.1", *extra]
    return f"""\
  - name: {name}
    engine: command
    port: {port}
    enable: true
    restart: {{delay: 1, burst: 5, interval: 120}}
{keys}    nodes: [{{name: node, address: 127.0.0.1}}]
    ranks:
      - commands:
          - name: helper
            argv: {yaml_list(FORKS)}
          - argv: {yaml_list(serve)}
"""


def within(spec: Path, name: str) -> int:
    """How long an apply waits for the replica to be routable again (from its spec)."""
    return ready_within(next(r for r in build_spec([parse(spec.read_bytes(), str(spec))])
                             .replicas if r.name == name))


def waits(spec: Path, name: str) -> str:
    """The end of a restart's line: the wait for the replica to be routable again."""
    return f"then waits up to {within(spec, name)} s for it to be routable again"


def digest_of_pid(pid: int) -> str:
    """The spec digest an engine process started with (its own environment)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next((v.split(b"=", 1)[1].decode() for v in environ
                 if v.startswith(f"{DIGEST_VAR}=".encode())), "")


def digest_of_unit(manager: UserManager, name: str) -> str:
    environment = manager.show(f"llmgw-{name}-engine.service", "Environment")["Environment"]
    return next((v.split("=", 1)[1] for v in environment.split()
                 if v.startswith(f"{DIGEST_VAR}=")), "")


def engine_pid(manager: UserManager, name: str) -> int:
    info = manager.wait_state(f"llmgw-{name}-engine.service", "active", 30)
    return int(info["MainPID"])


def pids_of(manager: UserManager, name: str) -> set[int]:
    return {pid for unit in (f"llmgw-{name}-helper.service", f"llmgw-{name}-engine.service")
            for pid in manager.unit_pids(unit)}


def test_apply_restarts_only_what_changed_and_stops_what_left(one_node: UserManager,
                                                              tmp_path: Path) -> None:
    a, b = free_port(), free_port()
    spec = tmp_path / "spec.yaml"
    write(spec, "replicas:\n" + replica("a", a) + replica("b", b))
    first = one_node.apply(spec, "node")
    assert first.stdout.splitlines() == ["replica a: started and enabled (new)",
                                         "replica b: started and enabled (new)"]
    a_pid, b_pid = engine_pid(one_node, "a"), engine_pid(one_node, "b")
    wants = one_node.unit_dir / "default.target.wants"
    assert sorted(p.name for p in wants.iterdir()) == ["llmgw-a.target", "llmgw-b.target"]

    # nothing changed: nothing restarted, and it says so
    again = one_node.apply(spec, "node")
    assert again.stdout.splitlines() == ["replica a: nothing to do", "replica b: nothing to do"]
    assert (engine_pid(one_node, "a"), engine_pid(one_node, "b")) == (a_pid, b_pid)

    # a changed argv restarts that replica only
    write(spec, "replicas:\n" + replica("a", a, "--directory", "/tmp") + replica("b", b))
    changed = one_node.apply(spec, "node")
    # every member carries the replica's spec digest, so every member's file changes
    assert changed.stdout.splitlines() == [
        "replica a: restarted (changed: llmgw-a-engine.service, llmgw-a-helper.service; "
        f"{waits(spec, 'a')})", "replica b: nothing to do"]
    # no supervisor on this node: it says it cannot wait for routable, and waits for the
    # units to be active instead
    assert ("cannot wait for replica a to be routable: no supervisor on this node says "
            "(") in changed.stderr
    assert "replica a: its units here are active after" in changed.stderr
    wait_until(lambda: engine_pid(one_node, "a") != a_pid, 30, "a's engine to restart")
    assert "--directory /tmp" in one_node.show("llmgw-a-engine.service", "ExecStart")[
        "ExecStart"]
    assert not pid_alive(a_pid)
    assert engine_pid(one_node, "b") == b_pid

    # b leaves the spec: --dry-run says what would happen and changes nothing
    write(spec, "replicas:\n" + replica("a", a, "--directory", "/tmp"))
    before = snapshot(one_node.unit_dir)
    dry = one_node.apply(spec, "node", "--dry-run")
    assert dry.stdout.splitlines()[-2:] == ["replica a: nothing to do",
                                            "replica b: would stop (5 unit files removed)"]
    assert snapshot(one_node.unit_dir) == before
    assert engine_pid(one_node, "b") == b_pid

    # then for real: every process of b gone, then its files and its .wants link
    b_pids = pids_of(one_node, "b")
    assert len(b_pids) == 3  # helper, its child, the engine
    b_cgroups = [f"{one_node.name}/app.slice/llmgw-b-{m}.service" for m in ("helper", "engine")]
    assert [len(cgroup_pids(c)) for c in b_cgroups] == [2, 1]
    gone = one_node.apply(spec, "node")
    assert gone.stdout.splitlines() == ["replica a: nothing to do",
                                        "replica b: stopped (5 unit files removed)"]
    assert not [pid for pid in b_pids if pid_alive(pid)]
    assert [cgroup_pids(c) for c in b_cgroups] == [set(), set()]
    assert sorted(p.name for p in one_node.unit_dir.glob("llmgw-b*")) == []
    assert sorted(p.name for p in wants.iterdir()) == ["llmgw-a.target"]
    assert one_node.show("llmgw-b-engine.service", "LoadState")["LoadState"] == "not-found"
    assert engine_pid(one_node, "a") != a_pid  # still the restarted one, still running


def test_a_new_replica_that_is_not_enabled_waits_for_start(one_node: UserManager,
                                                            tmp_path: Path) -> None:
    port = free_port()
    spec = write(tmp_path / "spec.yaml",
                 "replicas:\n" + replica("c", port).replace("enable: true", "enable: false"))
    proc = one_node.apply(spec, "node")
    assert proc.stdout.splitlines() == [
        "replica c: installed (new; not started, as enable is false: pass --start, or "
        "systemctl start llmgw-c.target)"]
    assert one_node.state_of("llmgw-c.target")[0] == "inactive"
    # a changed replica that is not running is updated and left stopped
    write(spec, "replicas:\n" + replica("c", port, "--directory", "/tmp").replace(
        "enable: true", "enable: false"))
    proc = one_node.apply(spec, "node", "--start")
    assert proc.stdout.splitlines() == [
        "replica c: updated (changed: llmgw-c-engine.service, llmgw-c-helper.service; not "
        "running, so left stopped)"]
    assert one_node.state_of("llmgw-c-engine.service")[0] == "inactive"


def test_units_written_without_a_reload_count_as_changed(one_node: UserManager,
                                                         tmp_path: Path) -> None:
    """llmgw-render without --apply wrote new units; systemd still runs the old ones."""
    port = free_port()
    spec = write(tmp_path / "spec.yaml", "replicas:\n" + replica("d", port))
    one_node.apply(spec, "node")
    pid = engine_pid(one_node, "d")
    write(spec, "replicas:\n" + replica("d", port, "--directory", "/tmp"))
    one_node.render(spec, "node")  # writes and reloads: systemd now knows the new file ...
    # ... so nothing is stale any more, but the engine's own environment still carries
    # the old spec digest: the apply restarts it
    ran, carries = digest_of_pid(pid), digest_of_unit(one_node, "d")
    assert ran and carries and ran != carries
    proc = one_node.apply(spec, "node")
    assert proc.stdout.splitlines() == [
        f"replica d: restarted (its engine runs version {ran[:8]}, its units carry "
        f"{carries[:8]}; {waits(spec, 'd')})"]
    wait_until(lambda: engine_pid(one_node, "d") != pid, 30, "d to restart")
    pid = engine_pid(one_node, "d")
    assert digest_of_pid(pid) == carries
    # and now the engine runs what its units carry: nothing to do
    assert one_node.apply(spec, "node").stdout.splitlines() == ["replica d: nothing to do"]

    write(spec, "replicas:\n" + replica("d", port, "--directory", "/var"))
    subprocess.run([RENDER, "--user", "--node", "node", str(spec)], check=True,
                   capture_output=True, env=one_node.env, timeout=60)  # no reload this time
    proc = one_node.apply(spec, "node")
    assert proc.stdout.splitlines() == [
        f"replica d: restarted (its files changed since systemd last read them; "
        f"{waits(spec, 'd')})"]
    wait_until(lambda: engine_pid(one_node, "d") != pid, 30, "d to restart")


def test_a_failing_systemctl_exits_1_and_changes_nothing(one_node: UserManager,
                                                         tmp_path: Path) -> None:
    spec = write(tmp_path / "spec.yaml", "replicas:\n" + replica("e", free_port()))
    before = snapshot(one_node.unit_dir)
    env = {**one_node.env, "XDG_RUNTIME_DIR": str(tmp_path / "nowhere"),
           "DBUS_SESSION_BUS_ADDRESS": f"unix:path={tmp_path}/nowhere/bus"}
    proc = subprocess.run([RENDER, "--user", "--apply", "--node", "node", str(spec)],
                          capture_output=True, text=True, env=env, timeout=60, check=False)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("llmgw-render: error: systemctl --user show "), proc.stderr
    assert len(proc.stderr.splitlines()) == 1
    assert snapshot(one_node.unit_dir) == before


def test_apply_refuses_a_folder_the_manager_does_not_read(one_node: UserManager,
                                                          tmp_path: Path) -> None:
    spec = write(tmp_path / "spec.yaml", "replicas:\n" + replica("f", free_port()))
    out = tmp_path / "elsewhere"
    proc = one_node.apply(spec, "node", "--output", str(out), check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"llmgw-render: error: --output: --apply needs a folder "
                                  f"the user manager reads units from; '{out}' is not one of ")
    assert not out.exists()
    assert os.listdir(one_node.unit_dir) == ["llmgw-.service.d"]


def test_a_replica_not_back_in_time_ends_the_apply_and_a_rerun_finishes(
        one_node: UserManager, tmp_path: Path) -> None:
    a, b = free_port(), free_port()
    spec = tmp_path / "spec.yaml"
    write(spec, "replicas:\n" + replica("a", a, keys=TIGHT) + replica("b", b))
    one_node.apply(spec, "node")
    b_pid = engine_pid(one_node, "b")
    # a's new engine cannot start at all; b changes too, and comes after a
    write(spec, "replicas:\n" + replica("a", a, argv=["/nonexistent/engine"], keys=TIGHT)
          + replica("b", b, "--directory", "/tmp"))
    failed = one_node.apply(spec, "node", check=False)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    error = failed.stderr.splitlines()[-1]
    assert error.startswith(
        f"llmgw-render: error: replica a was not routable again within {within(spec, 'a')} s "
        "of its restart (not active: llmgw-a-helper.service, llmgw-a-engine.service) (done "
        "before it: "), error
    assert error.endswith("; nothing after it was done"), error
    assert failed.stdout == ""  # no line claims what did not finish
    # b was written and reloaded, but not restarted: its engine runs the old version
    assert engine_pid(one_node, "b") == b_pid
    assert digest_of_pid(b_pid) != digest_of_unit(one_node, "b")

    # the fix, applied again: a comes back, and b, whose engine still runs the old
    # version, is restarted now although none of its files changes
    write(spec, "replicas:\n" + replica("a", a, keys=TIGHT)
          + replica("b", b, "--directory", "/tmp"))
    fixed = one_node.apply(spec, "node")
    lines = fixed.stdout.splitlines()
    assert lines[0].startswith("replica a: restarted (changed: llmgw-a-engine.service"), lines
    assert lines[1].startswith("replica b: restarted (its engine runs version "), lines
    b_new = engine_pid(one_node, "b")
    assert b_new != b_pid and digest_of_pid(b_new) == digest_of_unit(one_node, "b")
    assert one_node.apply(spec, "node").stdout.splitlines() == [
        "replica a: nothing to do", "replica b: nothing to do"]


def test_apply_of_a_multi_node_replica_loads_nothing_of_the_supervisor(
        one_node: UserManager, tmp_path: Path) -> None:
    """--apply of a rank of a two-node replica asks this node's supervisor (none here:
    refused) about the other rank; a replica spanning nodes needs one, so the change is
    refused with nothing done; with --no-wait it restarts: all without asyncio, h11,
    D-Bus or the daemon, checked on the running program."""
    spec = tmp_path / "spec.yaml"

    def duo(seconds: str) -> str:
        argv = yaml_list(["/usr/bin/sleep", seconds])
        rank = f"      - commands:\n          - argv: {argv}\n"
        return ("replicas:\n  - name: duo\n    engine: command\n    port: 1\n"
                "    enable: true\n    restart: {delay: 1, burst: 5, interval: 120}\n"
                "    nodes: [{name: node, address: 127.0.0.1},\n"
                "            {name: other, address: 127.0.0.2}]\n"
                "    ranks:\n" + rank + rank)

    write(spec, duo("infinity"))
    for attempt, extra, status in (("new", [], 0), ("changed", [], 1),
                                   ("changed", ["--no-wait"], 0)):
        before = engine_pid(one_node, "duo") if attempt == "changed" else 0
        files = snapshot(one_node.unit_dir)
        proc, refused = run_entry("llmgw_systemd.cli:render_main", "llmgw-render",
                                  ["--user", "--apply", "--node", "node", *extra, str(spec)],
                                  NOT_FOR_RENDER, tmp_path, env=one_node.env, timeout=300)
        assert refused == [], f"--apply ({attempt}) tried to import {refused}: {proc.stderr}"
        assert proc.returncode == status and "Traceback" not in proc.stderr, proc.stderr
        if status == 1:  # it asked the supervisor: refused, so nothing done
            assert "a replica spanning nodes needs it" in proc.stderr, proc.stderr
            assert "Nothing was done" in proc.stderr and "--no-wait" in proc.stderr
            assert engine_pid(one_node, "duo") == before
            assert snapshot(one_node.unit_dir) == files
        elif attempt == "changed":
            assert "replica duo: restarted" in proc.stdout, proc.stdout
            assert engine_pid(one_node, "duo") != before
        engine_pid(one_node, "duo")
        write(spec, duo("1d"))


def test_apply_will_not_restart_blind_when_the_supervisor_is_there(
        one_node: UserManager, tmp_path: Path) -> None:
    """This node's supervisor runs as its unit, but listens on the node's address only
    (no loopback listener): an apply that would restart a replica cannot ask it whether
    the replica is routable again, so it does nothing, exit 1, naming the address it
    tried and what to pass; --no-wait restarts."""
    assert port_is_free(SUPERVISOR_LOCAL.port, SUPERVISOR_LOCAL.host), \
        f"something listens on {SUPERVISOR_LOCAL} already: this test needs it free"
    port = free_port()
    health = "    health: {path: /, interval: 1, timeout: 1, stability: 0}\n"
    spec = write(tmp_path / "spec.yaml", "replicas:\n" + replica("one", port, keys=health))
    one_node.apply(spec, "node")
    listen = f"127.0.0.2:{free_port()}"  # "the node's address"
    one_node.systemctl("reset-failed", SUPERVISOR_UNIT, check=False)
    started = subprocess.run(
        ["systemd-run", "--user", f"--unit={SUPERVISOR_UNIT}", SUPERVISOR, "--user",
         "--node", "node", "--listen", listen, "--state-dir", str(tmp_path / "state"),
         str(spec)], env=one_node.env, capture_output=True, text=True, timeout=60,
        check=False)
    assert started.returncode == 0, started.stderr
    try:
        reader = ApiReader(one_node, "node", f"http://{listen}")
        reader.wait_state("one", "ready", timeout=60)
        before, files = engine_pid(one_node, "one"), snapshot(one_node.unit_dir)
        write(spec, "replicas:\n" + replica("one", port, "--directory", "/", keys=health))
        proc = one_node.apply(spec, "node", check=False)
        assert proc.returncode == 1, (proc.stdout, proc.stderr)
        assert f"the supervisor at {SUPERVISOR_LOCAL}" in proc.stderr, proc.stderr
        assert "its unit is active" in proc.stderr and "Nothing was done" in proc.stderr
        assert f"--local={SUPERVISOR_LOCAL}" in proc.stderr and "--no-wait" in proc.stderr
        assert engine_pid(one_node, "one") == before
        assert snapshot(one_node.unit_dir) == files
        proc = one_node.apply(spec, "node", "--no-wait")
        assert "replica one: restarted" in proc.stdout, proc.stdout
        assert engine_pid(one_node, "one") != before
    finally:
        one_node.systemctl("stop", SUPERVISOR_UNIT, check=False)

