"""A real systemd user manager per test node, optionally in its own network namespace
(docs/design.md §10), and helpers to drive it.

Each manager runs under `unshare -m` with a tmpfs /run, its own cgroup subtree in every
systemd hierarchy, and private XDG dirs; `tests/harness/user-manager` sets it up. Nodes
are network namespaces joined by a veth pair, addressed from TEST-NET-1 (192.0.2.0/24),
which is never routed anywhere. Everything is stopped by PID and checked gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from installed import RENDER

HERE = Path(__file__).resolve().parents[1]  # tests/
USER_MANAGER = HERE / "harness" / "user-manager"
STANDINS = HERE / "standins"
CGROUP_ROOTS = [Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup/unified")]
# The niceness of the workload under test: the units we render, a booted node. scripts/test
# raises it in the lane where the real vLLM keeps both cores busy, so that what watches the
# engines (the supervisors, the test's clients and samplers) keeps its CPU, as on a real
# node where the engine works on GPUs. A supervisor starved as much as its engine took
# seconds to answer and timed out its own probes.
WORKLOAD_NICE = int(os.environ.get("LLMGW_TEST_WORKLOAD_NICE", "0"))
T = TypeVar("T")
S = TypeVar("S", bound="Sampler[Any]")


class Sampler(Generic[T]):
    """Calls read() every `interval` s in a thread, from entry to exit (for at most
    `limit` s, whatever the test does), keeping (time.monotonic(), value) in `seen`; a read
    that raises AssertionError, OSError or ValueError is kept as failed(the exception).
    A value is stamped with the moment its read began: the answer was current at some
    moment of the read, and the time a read takes on a loaded machine (a process spawned
    in a namespace) is not the answerer's."""

    def __init__(self, read: Callable[[], T], interval: float,
                 failed: Callable[[Exception], T], limit: float = 600) -> None:
        self.read, self.interval, self.failed, self.limit = read, interval, failed, limit
        self.seen: list[tuple[float, T]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self: S) -> S:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        deadline = time.monotonic() + self.limit
        while time.monotonic() < deadline:
            began = time.monotonic()
            try:
                value = self.read()
            except (AssertionError, OSError, ValueError) as exc:
                value = self.failed(exc)
            self.seen.append((began, value))
            if self._stop.wait(self.interval):
                return


class HarnessError(AssertionError):
    """The harness could not do what a test needs: a failure, never a skip."""


def wait_until(check: Callable[[], T | None], timeout: float, what: str,
               interval: float = 0.1) -> T:
    """Poll check() until it returns something truthy; bounded by timeout."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def cgroup_roots() -> list[Path]:
    roots = [r for r in CGROUP_ROOTS if (r / "cgroup.procs").exists()]
    if not roots and Path("/sys/fs/cgroup/cgroup.procs").exists():
        roots = [Path("/sys/fs/cgroup")]
    return roots


def cgroup_pids(relative: str) -> set[int]:
    """PIDs in a cgroup and its children, in every hierarchy the manager uses."""
    pids: set[int] = set()
    for root in cgroup_roots():
        base = root / relative.lstrip("/")
        if not base.exists():
            continue
        for procs in base.rglob("cgroup.procs"):
            with contextlib.suppress(OSError):  # the cgroup went away meanwhile
                pids.update(int(p) for p in procs.read_text().split())
    return pids


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def port_is_free(port: int, host: str = "0.0.0.0", netns: str | None = None) -> bool:
    """Whether a listener could bind host:port (in netns, when given)."""
    if netns is None:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                return False
            return True
    code = ("import socket,sys\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET,"
            f"socket.SO_REUSEADDR,1)\ntry: s.bind(({host!r},{port}))\n"
            "except OSError: sys.exit(1)")
    return subprocess.run(["ip", "netns", "exec", netns, "/usr/bin/python3", "-c", code],
                          check=False, timeout=10).returncode == 0


@dataclass
class Netns:
    """A network namespace with loopback up and one veth end, addressed."""

    name: str
    address: str

    def exec(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", self.name, *argv], capture_output=True,
                              text=True, timeout=30, check=False)


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10,
                          check=False)
    if proc.returncode != 0:
        raise HarnessError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def make_network(tag: str, count: int) -> list[Netns]:
    """count namespaces; more than one are joined by a bridge in a hub namespace of their
    own (hub_of), with no link to the root namespace."""
    nodes = [Netns(f"llmgw-{tag}-{i}", f"192.0.2.{i + 1}") for i in range(count)]
    for ns in nodes:
        _ip("netns", "add", ns.name)
        _ip("-n", ns.name, "link", "set", "lo", "up")
    if count == 1:
        return nodes
    hub = f"llmgw-{tag}-hub"
    _ip("netns", "add", hub)
    _ip("-n", hub, "link", "add", "br0", "type", "bridge")
    _ip("-n", hub, "link", "set", "br0", "up")
    for i, ns in enumerate(nodes):
        _ip("link", "add", f"lg{tag}{i}a", "type", "veth", "peer", "name", f"lg{tag}{i}b")
        _ip("link", "set", f"lg{tag}{i}a", "netns", ns.name)
        _ip("link", "set", f"lg{tag}{i}b", "netns", hub)
        _ip("-n", ns.name, "link", "set", f"lg{tag}{i}a", "name", "eth0")
        _ip("-n", ns.name, "addr", "add", f"{ns.address}/24", "dev", "eth0")
        _ip("-n", ns.name, "link", "set", "eth0", "up")
        _ip("-n", hub, "link", "set", f"lg{tag}{i}b", "master", "br0")
        _ip("-n", hub, "link", "set", f"lg{tag}{i}b", "up")
    return nodes


def hub_of(netns: Netns | str) -> str:
    """The bridge's namespace of the network `netns` is on (make_network with count > 1,
    or the booted tier's: llmgw-TAG-K joined in llmgw-TAG-hub)."""
    name = netns.name if isinstance(netns, Netns) else netns
    return f"{name.rpartition('-')[0]}-hub"


def set_link(netns: Netns, connected: bool) -> None:
    """Cut a node off the bridge, or join it again: its end of the link stays up (no
    carrier change, no error for the node's sockets), and what it sends reaches nobody,
    as when a switch port or the fabric between two nodes fails."""
    tag, _, index = netns.name.removeprefix("llmgw-").rpartition("-")
    hub, port = f"llmgw-{tag}-hub", f"lg{tag}{index}b"
    if connected:
        _ip("-n", hub, "link", "set", port, "master", "br0")
    else:
        _ip("-n", hub, "link", "set", port, "nomaster")


def remove_network(tag: str) -> None:
    for name in list_netns():
        if name.startswith(f"llmgw-{tag}-"):
            subprocess.run(["ip", "netns", "del", name], check=False, timeout=10)
    leftover = [n for n in list_netns() if n.startswith(f"llmgw-{tag}-")]
    if leftover:
        raise HarnessError(f"network namespaces left behind: {leftover}")


def list_netns() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                         check=False, timeout=10).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


@dataclass
class UserManager:
    """One systemd --user manager, private to a test node."""

    name: str  # also its cgroup name
    state: Path
    netns: Netns | None = None
    generator: str | None = None  # linked into the manager's /run/systemd/user-generators
    pid: int = 0
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def runtime(self) -> Path:
        return self.state / "runtime"

    @property
    def unit_dir(self) -> Path:
        return self.state / "config" / "systemd" / "user"

    @property
    def generated_dir(self) -> Path:
        """Where the manager's generators write (their normal directory)."""
        return self.runtime / "systemd" / "generator"

    @property
    def specs_dir(self) -> Path:
        """The user generator's spec folder: $XDG_CONFIG_HOME/llmgw/replicas.d."""
        return self.state / "config" / "llmgw" / "replicas.d"

    def log_text(self) -> str:
        """The manager's own output (generators' stderr included)."""
        return (self.state / "manager.log").read_text(errors="replace")

    @property
    def log_dir(self) -> Path:
        return self.state / "logs"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "XDG_RUNTIME_DIR": str(self.runtime),
                "XDG_CONFIG_HOME": str(self.state / "config"),
                "XDG_DATA_HOME": str(self.state / "data"),
                "XDG_STATE_HOME": str(self.state / "xdg-state"),
                "DBUS_SESSION_BUS_ADDRESS": f"unix:path={self.runtime}/bus",
                "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0"}

    def start(self) -> None:
        self.state.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.runtime, ignore_errors=True)  # sockets of an earlier run
        self.log_dir.mkdir(exist_ok=True)
        self._write_log_dropin()
        argv = ["unshare", "-m", "--propagation", "private", str(USER_MANAGER), self.name,
                str(self.state)]
        if self.netns is not None:
            argv = ["nsenter", f"--net=/run/netns/{self.netns.name}", *argv]
        log = (self.state / "manager.log").open("wb")
        env = {k: v for k, v in os.environ.items() if k != "LLMGW_TEST_USER_GENERATOR"}
        if self.generator is not None:
            env["LLMGW_TEST_USER_GENERATOR"] = self.generator
        self._process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self.pid = self._process.pid  # unshare execs the script, which execs systemd
        try:
            wait_until(lambda: self._process is not None and (
                self._process.poll() is not None or self._ready()), 20,
                f"user manager {self.name}")
        except AssertionError:
            self.stop()
            raise HarnessError(f"user manager {self.name} did not come up:\n"
                               f"{(self.state / 'manager.log').read_text(errors='replace')}"
                               ) from None
        if self._process.poll() is not None:
            raise HarnessError(f"user manager {self.name} exited:\n"
                               f"{(self.state / 'manager.log').read_text(errors='replace')}")

    def _ready(self) -> bool:
        if not (self.runtime / "systemd" / "private").exists():
            return False
        proc = self.systemctl("is-system-running", check=False)
        return proc.stdout.strip() in ("running", "degraded", "offline")

    def _write_log_dropin(self) -> None:
        """Each unit's output to a file: these managers have no journal. A prefix drop-in
        ('llmgw-.service.d') reaches every unit we render without touching them."""
        dropin = self.unit_dir / "llmgw-.service.d"
        dropin.mkdir(parents=True, exist_ok=True)
        (dropin / "50-test-logs.conf").write_text(
            f"[Service]\nStandardOutput=append:{self.log_dir}/%n.log\nStandardError=inherit\n"
            + (f"Nice={WORKLOAD_NICE}\n" if WORKLOAD_NICE else ""))

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(["systemctl", "--user", "--no-pager", *args],
                              capture_output=True, text=True, env=self.env, timeout=60,
                              check=False, stdin=subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise AssertionError(f"systemctl --user {' '.join(args)} failed "
                                 f"({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def apply(self, spec: Path, node: str, *extra: str, check: bool = True
              ) -> subprocess.CompletedProcess[str]:
        """llmgw-render --user --apply into this manager's unit folder (its default), in
        this node's network namespace (where its supervisor answers on loopback)."""
        argv = [RENDER, "--user", "--apply", "--node", node, *extra, str(spec)]
        if self.netns is not None:
            argv = ["nsenter", f"--net=/run/netns/{self.netns.name}", *argv]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=420,
                              check=False, stdin=subprocess.DEVNULL, env=self.env)
        if check and proc.returncode != 0:
            raise AssertionError(f"llmgw-render --apply failed ({proc.returncode}): "
                                 f"{proc.stderr}")
        return proc

    def render(self, spec: Path, node: str, *extra: str) -> str:
        proc = subprocess.run([RENDER, "--user", "--node", node, "--output", str(self.unit_dir),
                               *extra, str(spec)], capture_output=True, text=True, timeout=60,
                              check=False, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise AssertionError(f"llmgw-render failed: {proc.stderr}")
        self.systemctl("daemon-reload")
        return proc.stdout

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", unit, *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def state_of(self, unit: str) -> tuple[str, str]:
        info = self.show(unit, "ActiveState", "SubState")
        return info["ActiveState"], info["SubState"]

    def wait_state(self, unit: str, active: str | Iterable[str], timeout: float = 30,
                   sub: str | None = None) -> dict[str, str]:
        wanted = {active} if isinstance(active, str) else set(active)

        def check() -> dict[str, str] | None:
            info = self.show(unit, "ActiveState", "SubState", "Result", "StatusText",
                             "NRestarts", "MainPID")
            ok = info["ActiveState"] in wanted and (sub is None or info["SubState"] == sub)
            return info if ok else None

        return wait_until(check, timeout, f"{unit} to be {'/'.join(wanted)}"
                          f"{'/' + sub if sub else ''} on {self.name}")

    def kill_main(self, unit: str, sig: int = signal.SIGKILL) -> int:
        """Kill the unit's main process once it has one; returns its PID. (os.kill with
        a MainPID of 0 would signal the test's own process group.)"""
        pid = wait_until(lambda: int(self.show(unit, "MainPID")["MainPID"]) or None, 30,
                         f"{unit} to have a main process")
        assert pid > 1
        os.kill(pid, sig)
        return pid

    def unit_pids(self, unit: str) -> set[int]:
        group = self.show(unit, "ControlGroup")["ControlGroup"]
        return cgroup_pids(group) if group else set()

    def llmgw_units(self) -> list[str]:
        out = self.systemctl("list-units", "--all", "--plain", "--no-legend", "llmgw-*").stdout
        return [line.split()[0] for line in out.splitlines() if line.strip()]

    def dump(self) -> str:
        """What a failing test should show: unit status and each unit's output."""
        parts = [f"===== {self.name}: systemctl --user status llmgw-*",
                 self.systemctl("status", "--full", "--lines=0", "llmgw-*",
                                check=False).stdout]
        for log in sorted(self.log_dir.glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-40:]
            parts.append(f"===== {self.name}: {log.name} (last {len(lines)} lines)")
            parts.extend(lines)
        return "\n".join(parts)

    def stop_all_units(self) -> None:
        units = self.llmgw_units()
        targets = [u for u in units if u.endswith(".target")]
        if targets:
            self.systemctl("stop", *targets, check=False)
        if units:
            self.systemctl("stop", *units, check=False)
            self.systemctl("reset-failed", *units, check=False)

    def stop(self) -> None:
        """Stop the manager by PID and check that nothing it ran is left."""
        if self._process is None:
            return
        if self._process.poll() is None:
            with contextlib.suppress(Exception):  # best effort; the kill below is the rule
                self.stop_all_units()
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=10)
        self._process = None
        leftover = cgroup_pids(self.name)
        for pid in leftover:  # should be none; kill so one bad test does not poison others
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if leftover:
            wait_until(lambda: not cgroup_pids(self.name), 10, "leftover processes to die")
        self._remove_cgroups()
        if leftover:
            raise AssertionError(f"processes left behind by manager {self.name}: "
                                 f"{sorted(leftover)}")

    def _remove_cgroups(self) -> None:
        for root in cgroup_roots():
            base = root / self.name
            if not base.exists():
                continue
            for directory, _, _ in os.walk(base, topdown=False):  # children first
                os.rmdir(directory)
            if base.exists():
                raise AssertionError(f"cgroup {base} left behind")


class Nodes:
    """The managers of one test, by node name, with their network when they have one."""

    def __init__(self, managers: dict[str, UserManager]) -> None:
        self.managers = managers

    def __getitem__(self, node: str) -> UserManager:
        return self.managers[node]

    def address(self, node: str) -> str:
        ns = self.managers[node].netns
        return ns.address if ns else "127.0.0.1"


def read_json(path: Path, timeout: float = 20) -> dict[str, object]:
    wait_until(path.exists, timeout, f"{path} to be written")
    data: dict[str, object] = json.loads(path.read_text(encoding="utf-8"))
    return data


@contextlib.contextmanager
def two_node_network(prefix: str, tag: str, base: Path,
                     failed: Callable[[], bool] = lambda: False) -> Iterator[Nodes]:
    """Two managers, each in its own network namespace, joined by a bridge: node-a at
    192.0.2.1 and node-b at 192.0.2.2, named PREFIX-TAG-NODE, their state under base;
    stopped and the network removed afterwards (each manager dumped first if failed())."""
    managers: dict[str, UserManager] = {}
    try:
        network = make_network(tag, 2)
        for name, ns in zip(("node-a", "node-b"), network):
            manager = UserManager(f"{prefix}-{tag}-{name}", base / name, netns=ns)
            managers[name] = manager
            manager.start()
        yield Nodes(managers)
    finally:
        if failed():
            for manager in managers.values():
                print(manager.dump())
        errors = []
        for manager in managers.values():
            try:
                manager.stop()
            except AssertionError as exc:
                errors.append(str(exc))
        remove_network(tag)
        assert not [n for n in list_netns() if n.startswith(f"llmgw-{tag}-")]
        assert not errors, errors
