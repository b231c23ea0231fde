"""llmgw-stop-group, the ExecStop= of vLLM units: which cgroup it finds from
/proc/self/cgroup (table), and, in a real cgroup of its own, that a process ignoring
SIGTERM is SIGKILLed after the grace while one that obeys is simply gone."""

from __future__ import annotations

import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from llmgw_systemd.helpers import stop_group as stopgroup


@pytest.mark.parametrize(("text", "made", "found"), [
    ("0::/system.slice/x.service\n", ["system.slice/x.service"],
     ["system.slice/x.service"]),  # cgroup v2 only
    ("12:cpu,cpuacct:/\n1:name=systemd:/user/u.service\n0::/user/u.service\n",
     ["unified/user/u.service", "systemd/user/u.service"],
     ["unified/user/u.service", "systemd/user/u.service"]),  # hybrid, as on these machines
    ("1:name=systemd:/a.service\n", ["systemd/a.service"], ["systemd/a.service"]),
    ("0::/gone.service\n", [], []),  # nothing mounted there: nothing to signal
])
def test_own_cgroups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str,
                     made: list[str], found: list[str]) -> None:
    monkeypatch.setattr(stopgroup, "CGROUP_FS", tmp_path)
    for rel in made:
        (tmp_path / rel).mkdir(parents=True)
        (tmp_path / rel / "cgroup.procs").write_text("")
    got = stopgroup.own_cgroups(text)
    assert sorted(str(g.relative_to(tmp_path)) for g in got) == sorted(found)


@pytest.mark.parametrize(("unserved", "serving", "kill_at"), [
    (5, True, 125),  # it answers: it keeps its drain, until the grace's end
    (5, False, 105),  # it does not: nothing to drain, 5 s from now
    (None, None, 125),  # no --health: the grace's end
    (30, False, 125),  # never later than the grace's end
])
def test_kill_deadline(unserved: float | None, serving: bool | None, kill_at: float) -> None:
    assert stopgroup.kill_deadline(125, 100, unserved, serving) == kill_at


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status)
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


@pytest.mark.parametrize(("server", "answers"), [
    ("200", True), ("503", False), ("silent", False), ("closed", False)])
def test_answers_health_only_with_200_in_time(server: str, answers: bool) -> None:
    """A real socket each: a server answering 200 or 503, one that accepts and never
    answers (as vLLM's socket does while the engine still starts), a closed port."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        if server == "silent":
            listener.listen()
        if server in ("200", "503"):
            listener.close()
            handler = type("H", (_Health,), {"status": int(server)})
            httpd = http.server.HTTPServer(("127.0.0.1", port), handler)
            thread = threading.Thread(target=httpd.serve_forever, daemon=True)
            thread.start()
            try:
                got = stopgroup.answers_health(f"http://127.0.0.1:{port}/health", 2.0)
            finally:
                httpd.shutdown()
                httpd.server_close()
        else:
            got = stopgroup.answers_health(f"http://127.0.0.1:{port}/health", 0.5)
    assert got is answers


@pytest.mark.parametrize("argv", [
    ["--grace", "25", "--health", "http://127.0.0.1:1/health"],  # without its grace
    ["--grace", "25", "--unserved-grace", "5"],  # without its URL
    ["--grace", "25", "--health", "127.0.0.1:1", "--unserved-grace", "5"],
    ["--grace", "25", "--health", "http://127.0.0.1:1/", "--unserved-grace", "-1"],
])
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        stopgroup.main(argv)
    assert exit_.value.code == 2


def _cgroup(name: str) -> list[Path]:
    roots = [r for r in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup/systemd"),
                         Path("/sys/fs/cgroup")) if (r / "cgroup.procs").is_file()][:2]
    assert roots, "no cgroup hierarchy to test in"
    groups = [r / name for r in roots]
    for g in groups:
        g.mkdir()
    return groups


def _spawn_in(groups: list[Path], code: str, *args: str, env: dict[str, str] | None = None
              ) -> subprocess.Popen[str]:
    procs = [str(g / "cgroup.procs") for g in groups]

    def enter() -> None:
        for path in procs:
            Path(path).write_text(str(os.getpid()))

    return subprocess.Popen([sys.executable, "-c", code, *args],
                            preexec_fn=enter,  # noqa: PLW1509
                            stdout=subprocess.PIPE, text=True, env=env)


def _cleanup(groups: list[Path], *procs: subprocess.Popen[str]) -> None:
    for pid in stopgroup.members(groups):
        os.kill(pid, signal.SIGKILL)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while stopgroup.members(groups) and time.monotonic() < deadline:
        time.sleep(0.05)
    for g in groups:
        g.rmdir()


IGNORES_TERM = ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "print('up', flush=True)\ntime.sleep(600)")


@pytest.mark.parametrize(("ignores_term", "frozen", "killed"), [
    (True, False, True), (False, False, False),
    (False, True, False),  # SIGSTOPped (a frozen rank): SIGCONT lets it act on SIGTERM
])
def test_stop_group_kills_after_the_grace_only_what_ignores_sigterm(
        ignores_term: bool, frozen: bool, killed: bool) -> None:
    groups = _cgroup(f"llmgw-test-stopgroup-{os.getpid()}-{int(ignores_term)}{int(frozen)}")
    code = ("import signal, time\n"
            + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignores_term else "")
            + "print('up', flush=True)\ntime.sleep(600)")
    procs = [str(g / "cgroup.procs") for g in groups]

    def enter() -> None:
        for path in procs:
            Path(path).write_text(str(os.getpid()))

    child = subprocess.Popen([sys.executable, "-c", code], preexec_fn=enter,  # noqa: PLW1509
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "up\n"
        if frozen:
            os.kill(child.pid, signal.SIGSTOP)
        assert stopgroup.stop_group(groups, grace=1.0)
        # SIGTERM ends the obedient one; SIGKILL, after the grace, the other
        assert child.wait(timeout=10) == (-signal.SIGKILL if killed else -signal.SIGTERM)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for g in groups:
            g.rmdir()


@pytest.mark.parametrize("main_ignores_term", [False, True])
def test_main_first_signals_the_main_process_alone_then_kills_the_group(
        main_ignores_term: bool, tmp_path: Path) -> None:
    """--main-first (Ray units, KillMode=mixed; a serving rank whose main process drains):
    SIGTERM reaches only the main process; once it is gone, or outlived the grace, the
    rest of the group gets SIGKILL, its child that never heard a SIGTERM included."""
    groups = _cgroup(f"llmgw-test-stopgroup-main-{os.getpid()}-{int(main_ignores_term)}")
    heard = tmp_path / "child-heard-sigterm"
    code = ("import signal, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import signal, sys, time; "
            "signal.signal(signal.SIGTERM, lambda *_: open(sys.argv[1], \"w\").close()); "
            f"print(1, flush=True); time.sleep(600)', {str(heard)!r}], "
            "stdout=subprocess.PIPE, text=True)\n"
            "child.stdout.readline()\n"
            + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if main_ignores_term else "")
            + "print(child.pid, flush=True)\ntime.sleep(600)")
    main = _spawn_in(groups, code)
    try:
        assert main.stdout is not None
        child_pid = int(main.stdout.readline())
        assert stopgroup.stop_main_first(groups, main.pid, grace=1.0)
        assert main.wait(timeout=10) == (-signal.SIGKILL if main_ignores_term
                                         else -signal.SIGTERM)
        assert child_pid not in stopgroup.members(groups)  # the child went too
        assert not heard.exists()  # by SIGKILL: SIGTERM was the main process's alone
    finally:
        _cleanup(groups, main)


def test_members_never_include_pid_0(tmp_path: Path) -> None:
    """A cgroup.procs of a hierarchy shared with a parent PID namespace lists what this
    namespace cannot see as 0; kill(0) would signal the helper's own process group."""
    group = tmp_path / "g"
    group.mkdir()
    (group / "cgroup.procs").write_text(f"0\n0\n{os.getpid()}\n4242\n")
    assert stopgroup.members([group]) == {4242}


def test_what_outlives_the_main_process_is_killed_at_once() -> None:
    """vLLM's workers ignored SIGTERM once their main process was gone, for the whole
    grace (issue 42): with the main process known, its exit ends the wait, and what is
    left gets SIGKILL then, long before a 600 s grace."""
    groups = _cgroup(f"llmgw-test-stopgroup-after-main-{os.getpid()}")
    code = ("import subprocess, sys, time\n"
            f"child = subprocess.Popen([sys.executable, '-c', {IGNORES_TERM!r}], "
            "stdout=subprocess.PIPE, text=True)\n"
            "child.stdout.readline()\nprint(child.pid, flush=True)\ntime.sleep(600)")
    main = _spawn_in(groups, code)
    try:
        assert main.stdout is not None
        child = int(main.stdout.readline())
        done: list[bool] = []
        stopper = threading.Thread(target=lambda: done.append(
            stopgroup.stop_group(groups, grace=600, main_pid=main.pid)), daemon=True)
        stopper.start()
        assert main.wait(timeout=30) == -signal.SIGTERM  # the main process obeys
        stopper.join(timeout=30)  # far inside the grace: the child went by SIGKILL
        assert done == [True], "the group was not emptied within 30 s of a 600 s grace"
        assert child not in stopgroup.members(groups)
    finally:
        _cleanup(groups, main)


@pytest.mark.parametrize("mainpid", ["", "dead"])
def test_a_failures_stop_kills_at_once(mainpid: str) -> None:
    """The helper as systemd runs it, in the unit's cgroup, when the main process already
    died (systemd then sets no MAINPID; a stale one counts the same): nothing is left to
    save, so what is left gets SIGKILL at once, not after the 600 s grace."""
    groups = _cgroup(f"llmgw-test-stopgroup-failure-{os.getpid()}-{mainpid or 'unset'}")
    leftover = _spawn_in(groups, IGNORES_TERM)
    assert leftover.stdout is not None and leftover.stdout.readline() == "up\n"
    env = {k: v for k, v in os.environ.items() if k != "MAINPID"}
    if mainpid == "dead":
        gone = subprocess.Popen([sys.executable, "-c", ""])
        gone.wait()
        env["MAINPID"] = str(gone.pid)
    helper = _spawn_in(groups, "from llmgw_systemd.helpers.stop_group import main; main()",
                       "--grace", "600", env=env)
    try:
        out, _ = helper.communicate(timeout=30)
        assert helper.returncode == 0, out
        assert "SIGKILL to what is left at once" in out, out
        assert leftover.wait(timeout=10) == -signal.SIGKILL
    finally:
        _cleanup(groups, leftover, helper)
