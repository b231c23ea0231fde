"""llmgw-supervisor processes for the integration tests: started on a node's user
manager (in its network namespace, when it has one), stopped by PID, and read through
their API from that same namespace."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import systemd_harness as harness
from installed import BIN_DIR
from systemd_harness import STANDINS, UserManager, wait_until

from llmgw_systemd.spec.endpoint import SUPERVISOR_LOCAL

SUPERVISOR = str(BIN_DIR / "llmgw-supervisor")
LLMGW_SYSTEMD = str(BIN_DIR / "llmgw-systemd")
HOSTILE_PEER = STANDINS / "hostile_peer.py"

# Runs inside a node's namespace: one GET, printed as status, then the body.
_GET = """\
import sys, urllib.request, urllib.error
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
try:
    r = opener.open(sys.argv[1], timeout=float(sys.argv[2]))
    print(r.status); print(r.read().decode())
except urllib.error.HTTPError as e:
    print(e.code); print(e.read().decode())
except Exception as e:
    print(0); print(repr(str(e)))
"""


class ApiReader:
    """Reads one supervisor's API from inside its node's namespace (or here, on
    loopback), whoever started it."""

    def __init__(self, manager: UserManager, node: str, base: str) -> None:
        self.manager, self.node, self._base = manager, node, base

    @property
    def base(self) -> str:
        return self._base

    def get(self, path: str, timeout: float = 3.0, base: str | None = None
            ) -> tuple[int, Any]:
        """GET from inside the node's namespace (or here, on loopback)."""
        url = (base or self.base) + path
        argv = ["/usr/bin/python3", "-c", _GET, url, str(timeout)]
        if self.manager.netns is not None:
            argv = ["ip", "netns", "exec", self.manager.netns.name, *argv]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 10,
                              check=False, env={"PATH": os.environ["PATH"]})
        status, _, body = proc.stdout.partition("\n")
        try:
            return int(status or 0), json.loads(body or "null")
        except ValueError:
            return int(status or 0), body

    def replica(self, name: str, base: str | None = None) -> dict[str, Any]:
        status, data = self.get(f"/v1/replicas/{name}", base=base)
        assert status == 200 and isinstance(data, dict), (status, data)
        return data

    def wait_state(self, name: str, state: str | tuple[str, ...], timeout: float = 60, *,
                   reason: str = "", restarts: int | None = None, settled: bool = False,
                   base: str | None = None) -> dict[str, Any]:
        """Until the replica is `state` (or one of them) with `reason` in its reason."""
        states = (state,) if isinstance(state, str) else state

        def check() -> dict[str, Any] | None:
            status, data = self.get(f"/v1/replicas/{name}", base=base)
            if status != 200 or not isinstance(data, dict):
                return None
            ok = data["state"] in states and reason in str(data["reason"])
            ok = ok and (restarts is None or data["group_restarts"] == restarts)
            ok = ok and (not settled or data["settled"] is True)
            return data if ok else None

        return wait_until(check, timeout, f"{name} to be {'/'.join(states)} ({reason}) on "
                          f"{self.node}", interval=0.2)

    def metric(self, line_start: str, base: str | None = None) -> float:
        """The sum of every /metrics sample whose line starts with line_start."""
        status, body = self.get("/metrics", base=base)
        assert status == 200, (status, body)
        text = body if isinstance(body, str) else json.dumps(body)
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(line_start))



def stop_and_show(sups: Sequence[SupervisorProcess]) -> None:
    """Stop every supervisor by PID, then print each one's log for the test report."""
    for sup in sups:
        sup.stop()
    for sup in sups:
        print(f"===== {sup.node}: supervisor log")
        print(sup.tail())

# Runs between the test and the supervisor as systemd's exec does: the kept descriptors
# (argv up to "--") become 3, 4, ... with LISTEN_FDS, LISTEN_FDNAMES and this process's
# own PID as LISTEN_PID (nsenter execs in place: the supervisor keeps it).
_EXEC_WITH_FDS = """\
import fcntl, os, sys
split = sys.argv.index("--")
pairs = [a.split("=", 1) for a in sys.argv[1:split]]
high = [fcntl.fcntl(int(fd), fcntl.F_DUPFD, 100) for fd, _ in pairs]
for i, fd in enumerate(high):
    os.dup2(fd, 3 + i)
    os.close(fd)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS=str(len(pairs)),
                  LISTEN_FDNAMES=":".join(name for _, name in pairs))
os.execvp(sys.argv[split + 1], sys.argv[split + 1:])
"""


class FdStore:
    """systemd's side of sd_notify for one supervisor, as far as the tests need it: a
    notify socket that keeps the descriptors sent with FDSTORE=1 (FDNAME=), closes them
    on FDSTOREREMOVE=1, and drains every other message (READY=1, STATUS=...)."""

    def __init__(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.held: list[tuple[int, str]] = []
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._receive, daemon=True)
        self.thread.start()

    def _receive(self) -> None:
        while not self.closed.is_set():
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, 65536, 16)
            except TimeoutError:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines()
                          if "=" in line)
            name = fields.get("FDNAME", "stored")
            with self.lock:
                if fields.get("FDSTORE") == "1":
                    self.held.extend((fd, name) for fd in fds)
                    continue
                if fields.get("FDSTOREREMOVE") == "1":
                    for fd, held_name in [h for h in self.held if h[1] == name]:
                        os.close(fd)
                        self.held.remove((fd, held_name))
            for fd in fds:
                os.close(fd)

    def names(self) -> list[str]:
        with self.lock:
            return [name for _, name in self.held]

    def wrap(self, argv: list[str]) -> tuple[list[str], tuple[int, ...]]:
        """argv run with the kept descriptors passed as systemd passes them."""
        with self.lock:
            held = list(self.held)
        if not held:
            return argv, ()
        return ([sys.executable, "-c", _EXEC_WITH_FDS, *(f"{fd}={name}" for fd, name in held),
                 "--", *argv], tuple(fd for fd, _ in held))

    def release(self) -> None:
        """What a stop does: every kept descriptor closed."""
        with self.lock:
            for fd, _ in self.held:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self.held.clear()

    def close(self) -> None:
        self.closed.set()
        self.thread.join(5)
        self.release()
        self.sock.close()
        self.path.unlink(missing_ok=True)


class SupervisorProcess(ApiReader):
    """One llmgw-supervisor on one node's user manager, started and stopped by PID.

    With `keep_sockets`, its API sockets are kept across restart() as the shipped unit's
    FileDescriptorStoreMax= has systemd keep them (an FdStore as its NOTIFY_SOCKET);
    stop() closes them, as a stop does."""

    def __init__(self, manager: UserManager, node: str, spec: Path, *, listen: str,
                 extra: Sequence[str] = (), env: dict[str, str] | None = None,
                 state_dir: Path | None = None, wait: bool = True,
                 keep_sockets: bool = False) -> None:
        super().__init__(manager, node, f"http://{listen}")
        self.spec, self.listen = spec, listen
        self.extra = list(extra)
        self.env = {**manager.env, **(env or {})}
        self.state_dir = state_dir or manager.state / f"supervisor-state-{node}"
        self.log = manager.state / f"supervisor-{node}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.fd_store = FdStore(manager.state / f"notify-{node}.sock") if keep_sockets else None
        if self.fd_store is not None:
            self.env["NOTIFY_SOCKET"] = str(self.fd_store.path)
        self.start(wait=wait)

    @property
    def base(self) -> str:
        """Where the test reads the API: the plain loopback listener (--local) when the
        main one needs a client certificate."""
        if "--local" in self.extra:
            return f"http://{self.extra[self.extra.index('--local') + 1]}"
        scheme = "https" if "--tls-cert" in self.extra else "http"
        return f"{scheme}://{self.listen}"

    def argv(self) -> list[str]:
        # in a node's namespace, the plain loopback listener the units' drain step asks
        # (docs/supervisor.md, "Drain"), as a node with TLS has it
        local = (["--local", str(SUPERVISOR_LOCAL)] if self.manager.netns is not None
                 and "--local" not in self.extra and not self.listen.startswith("127.")
                 else [])
        argv = [SUPERVISOR, "--user", "--node", self.node, "--listen", self.listen,
                "--state-dir", str(self.state_dir), *local, *self.extra, str(self.spec)]
        if self.manager.netns is not None:
            argv = ["nsenter", f"--net=/run/netns/{self.manager.netns.name}", *argv]
        return argv

    def start(self, *, wait: bool = True) -> None:
        argv, fds = (self.argv(), ()) if self.fd_store is None else \
            self.fd_store.wrap(self.argv())
        self.process = subprocess.Popen(argv, env=self.env, stdout=self.log.open("ab"),
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        pass_fds=fds)
        if wait:
            wait_until(lambda: self.alive() and self.up(), 30,
                       f"the supervisor on {self.node} to answer")

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`llmgw-systemd ARGS` as an operator on this node runs it: in its namespace, on
        its manager, with this supervisor's spec and state directory."""
        argv = [LLMGW_SYSTEMD, *args, "--user", "--state-dir", str(self.state_dir),
                "--spec", str(self.spec), "--node-name", self.node]
        if self.manager.netns is not None:
            argv = ["ip", "netns", "exec", self.manager.netns.name, *argv]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False,
                              env=self.manager.env, stdin=subprocess.DEVNULL)

    def up(self) -> bool:
        if "--tls-cert" in self.extra and "--local" not in self.extra:
            return "API on https://" in self.log.read_text(errors="replace")
        return self.get("/v1/shards")[0] == 200

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def signal(self, sig: int) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def stop(self, *, release: bool = True) -> None:
        """SIGTERM (SIGKILL after 20 s); `release=False` keeps the kept sockets, as a
        restart does."""
        if self.alive():
            assert self.process is not None
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        if release and self.fd_store is not None:
            self.fd_store.close()
            self.fd_store = None
            self.env.pop("NOTIFY_SOCKET", None)

    def restart(self, *, wait: bool = True) -> None:
        """What `systemctl restart` does: stop, then the same command line, with the
        kept sockets passed on when there are any."""
        self.stop(release=False)
        self.start(wait=wait)

    def rss_kb(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


class Sampler(harness.Sampler[str]):
    """Reads a replica's state over and over in the background, so a test can say what
    it was at every moment of a window, not only at the end."""

    def __init__(self, read: Callable[[], str], interval: float = 0.1) -> None:
        super().__init__(read, interval, lambda exc: f"error: {exc}")

    def states(self) -> set[str]:
        return {s for _, s in self.seen}


class HostilePeer:
    """tests/standins/hostile_peer.py in a mode, on an address; stopped by PID."""

    def __init__(self, listen: str, mode: str, *, report: object | None = None,
                 netns: str | None = None, extra: Sequence[str] = ()) -> None:
        argv = ["/usr/bin/python3", str(HOSTILE_PEER), "--listen", listen, "--mode", mode,
                *extra]
        if report is not None:
            argv += ["--report", json.dumps(report)]
        if netns is not None:
            argv = ["ip", "netns", "exec", netns, *argv]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                                        text=True)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line.startswith("listening on"), line

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
