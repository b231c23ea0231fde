"""llmgw-wait-for-port against real sockets on loopback."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import WAIT_FOR_PORT


def free_port(family: int = socket.AF_INET) -> int:
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind(("::1" if family == socket.AF_INET6 else "127.0.0.1", 0))
        return int(sock.getsockname()[1])


def listener(port: int, host: str = "127.0.0.1") -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen()
    return sock


def wait_tool(*args: str, env: dict[str, str] | None = None,
              timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([WAIT_FOR_PORT, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False, stdin=subprocess.DEVNULL)


def test_listening_address_returns_at_once() -> None:
    port = free_port()
    with listener(port):
        proc = wait_tool("--timeout", "5", f"127.0.0.1:{port}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""


def test_waits_until_the_address_listens() -> None:
    port = free_port()
    opened = threading.Event()
    holder: list[socket.socket] = []

    def open_later() -> None:
        time.sleep(1.0)
        holder.append(listener(port))
        opened.set()

    thread = threading.Thread(target=open_later)
    thread.start()
    try:
        proc = wait_tool("--timeout", "20", "--interval", "0.2", f"127.0.0.1:{port}")
    finally:
        thread.join()
        for sock in holder:
            sock.close()
    assert opened.is_set()
    assert proc.returncode == 0, proc.stderr


def test_timeout_names_the_address_and_the_time() -> None:
    port = free_port()
    proc = wait_tool("--timeout", "1", "--interval", "0.2", f"127.0.0.1:{port}")
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"llmgw-wait-for-port: gave up after 1 s waiting for "
                               f"127.0.0.1:{port} to accept connections")
    assert "Connection refused" in lines[0]


def test_every_address_must_listen() -> None:
    up, down = free_port(), free_port()
    with listener(up):
        proc = wait_tool("--timeout", "1", "--interval", "0.2", f"127.0.0.1:{up}",
                         f"localhost:{down}")
    assert proc.returncode == 1
    assert f"localhost:{down}" in proc.stderr
    assert f"127.0.0.1:{up}" not in proc.stderr


def test_ipv6_address() -> None:
    port = free_port(socket.AF_INET6)
    with listener(port, "::1"):
        proc = wait_tool("--timeout", "5", f"[::1]:{port}")
    assert proc.returncode == 0, proc.stderr


def test_names_are_resolved_on_every_try() -> None:
    """An unresolvable name is a reason to wait, not an error."""
    proc = wait_tool("--timeout", "1", "--interval", "0.3", "no-such-host.invalid:80")
    assert proc.returncode == 1
    assert "cannot resolve no-such-host.invalid" in proc.stderr


def test_free_waits_for_the_holder_to_go() -> None:
    port = free_port()
    sock = listener(port, "127.0.0.1")
    timer = threading.Timer(1.0, sock.close)
    timer.start()
    try:
        proc = wait_tool("--free", "--timeout", "20", "--interval", "0.2", f"0.0.0.0:{port}")
    finally:
        timer.join()
    assert proc.returncode == 0, proc.stderr


def test_free_gives_up_on_a_stale_holder() -> None:
    port = free_port()
    with listener(port, "127.0.0.1"):
        proc = wait_tool("--free", "--timeout", "1", "--interval", "0.2", f"0.0.0.0:{port}")
    assert proc.returncode == 1
    assert f"0.0.0.0:{port} to be free" in proc.stderr
    assert "Address already in use" in proc.stderr


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0)
    yield sock, path
    sock.close()


def received(sock: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except BlockingIOError:
            return out


def test_progress_and_result_reach_systemd(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    port = free_port()
    proc = wait_tool("--timeout", "1", "--interval", "0.3", f"127.0.0.1:{port}",
                     env={"NOTIFY_SOCKET": path, "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 1
    messages = received(sock)
    assert messages[0].startswith(f"STATUS=Waiting for 127.0.0.1:{port} to accept connections")
    assert messages[-1].startswith("STATUS=llmgw-wait-for-port: gave up after 1 s")
    with listener(port):
        proc = wait_tool("--timeout", "5", f"127.0.0.1:{port}",
                         env={"NOTIFY_SOCKET": path, "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0
    assert received(sock) == ["STATUS="]  # the status line is cleared once ready


@pytest.mark.parametrize("args, message", [
    (["10.0.0.1"], "expected HOST:PORT"),
    (["fd00::1:80"], "expected HOST:PORT (IPv6 as [ADDR]:PORT)"),
    (["h:0"], "expected a port from 1 to 65535"),
    (["--timeout", "soon", "h:1"], "expected seconds, got 'soon'"),
    (["--interval", "0", "h:1"], "--interval must be more than 0 seconds"),
    ([], "the following arguments are required"),
    (["--same-version", "rep", "h:1"], "--same-version and --supervisor go together"),
    (["--same-version", "Rep!", "--supervisor", "127.0.0.1:9470", "h:1"],
     "--same-version: expected a replica's name, without --free; got 'Rep!'"),
    (["--same-version", "rep", "--supervisor", "nowhere", "h:1"],
     "--supervisor: expected HOST:PORT; got 'nowhere'"),
])
def test_bad_arguments(args: list[str], message: str) -> None:
    proc = wait_tool(*args)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_starts_without_click_jinja2_or_yaml() -> None:
    code = ("import sys, llmgw_systemd.helpers.wait_for_port; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'click', 'jinja2', 'yaml'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_sigterm_ends_the_wait_cleanly() -> None:
    """systemd stops a unit waiting in ExecStartPre= with SIGTERM; a start step killed
    by a signal would leave the stopped unit failed, so SIGTERM ends it with 0."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nobody listens once closed
    proc = subprocess.Popen([WAIT_FOR_PORT, "--timeout", "60", f"127.0.0.1:{port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        time.sleep(1)  # past the interpreter's start-up, into the wait
        assert proc.poll() is None, "it should still be waiting"
        proc.terminate()
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class ReplicaView:
    """The local supervisor's GET /v1/replicas/NAME on loopback, as far as the version
    gate reads it (ranks[].spec), with the answer swapped by the test."""

    def __init__(self) -> None:
        import http.server
        import json

        view = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = json.dumps(view.answer).encode()
                self.send_response(200 if self.path == "/v1/replicas/rep" else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:
                pass

        self.answer: dict[str, object] = {}
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def ranks(self, leader: tuple[str, str], worker: tuple[str, str]) -> None:
        self.answer = {"ranks": [
            {"rank": k, "node": f"n{k}", "spec": {"loaded": loaded, "running": running}}
            for k, (loaded, running) in enumerate((leader, worker))]}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


OLD, NEW = "1" * 16, "2" * 16


@pytest.fixture
def replica_view() -> Iterator[ReplicaView]:
    view = ReplicaView()
    yield view
    view.close()


def test_a_rank_waits_while_rank_0_is_about_to_restart_onto_its_version(
        replica_view: ReplicaView) -> None:
    port = free_port()
    replica_view.ranks((NEW, OLD), (NEW, NEW))  # rank 0 staged for NEW, not restarted
    env = {"LLMGW_SPEC_DIGEST": NEW, "PATH": "/usr/bin:/bin"}
    released = threading.Event()

    def restart_rank_0() -> None:
        time.sleep(2.0)
        replica_view.ranks((NEW, NEW), (NEW, NEW))
        released.set()

    thread = threading.Thread(target=restart_rank_0)
    with listener(port):
        thread.start()
        proc = wait_tool("--timeout", "30", "--same-version", "rep", "--supervisor",
                         replica_view.address, f"127.0.0.1:{port}", env=env)
        done = released.is_set()
    thread.join()
    assert proc.returncode == 0, proc.stderr
    assert done, "it went before rank 0 ran the new version"
    assert proc.stdout == ("llmgw-wait-for-port: rep: rank 0 on n0 still runs version "
                           "11111111, and its units carry 22222222: waiting for it to start "
                           "on it\n")


@pytest.mark.parametrize(("leader", "digest"), [
    ((NEW, NEW), NEW),  # rank 0 runs this version
    ((OLD, OLD), NEW),  # rank 0's node has not applied: it will not restart by itself
    ((NEW, OLD), ""),  # this unit carries no digest (rendered before versions)
])
def test_a_rank_that_need_not_wait_goes(replica_view: ReplicaView, leader: tuple[str, str],
                                        digest: str) -> None:
    port = free_port()
    replica_view.ranks(leader, (NEW, NEW))
    with listener(port):
        proc = wait_tool("--timeout", "3", "--same-version", "rep", "--supervisor",
                         replica_view.address, f"127.0.0.1:{port}",
                         env={"LLMGW_SPEC_DIGEST": digest, "PATH": "/usr/bin:/bin"})
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


def test_no_supervisor_answering_does_not_hold_the_start() -> None:
    port = free_port()
    with listener(port):
        proc = wait_tool("--timeout", "3", "--same-version", "rep", "--supervisor",
                         f"127.0.0.1:{free_port()}", f"127.0.0.1:{port}",
                         env={"LLMGW_SPEC_DIGEST": NEW, "PATH": "/usr/bin:/bin"})
    assert (proc.returncode, proc.stderr) == (0, "")


def test_a_rank_0_that_never_restarts_runs_out_the_timeout(replica_view: ReplicaView) -> None:
    port = free_port()
    replica_view.ranks((NEW, OLD), (NEW, NEW))
    with listener(port):
        proc = wait_tool("--timeout", "2", "--same-version", "rep", "--supervisor",
                         replica_view.address, f"127.0.0.1:{port}",
                         env={"LLMGW_SPEC_DIGEST": NEW, "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 1
    assert proc.stderr.startswith("llmgw-wait-for-port: gave up after 2 s waiting for rank 0 "
                                  "on n0 still runs version 11111111"), proc.stderr
    assert proc.stderr.rstrip().endswith("(the ports are ready)")
