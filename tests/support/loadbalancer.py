"""A real HAProxy in front of test replicas, configured from docs/loadbalancer.md, and load
sent through it.

HAProxy: the ```haproxy block after `<!-- config: haproxy -->` in the doc, as written, with
its `server` line repeated once per Server and the placeholders filled in (the TLS line
after `<!-- config: haproxy-tls -->` in its place when asked), plus what only the test
adds: a `global` section with a stats socket in the work directory and a frontend on
`bind:port` that names the answering server in an X-Served-By header. It runs as
`haproxy -f CONF -db` in the foreground, in a network namespace when given (`ip netns
exec` replaces itself with haproxy, so the PID is haproxy's), never as the system service;
stop() ends it by that PID.

Traffic: `clients` concurrent clients send POST /v1/completions back to back for `seconds`
from a child process (in a namespace when given); each request's start (time.monotonic(),
which every namespace shares), duration, HTTP status (0: no HTTP answer) and X-Served-By
come back. Sampler records servers_up() every 0.5 s meanwhile.

bridge_address() puts a third machine on a two_nodes link, for HAProxy and its clients.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import systemd_harness as harness
from specs import free_port
from systemd_harness import Netns, wait_until

DOC = Path(__file__).resolve().parents[2] / "docs" / "loadbalancer.md"
HAPROXY = "/usr/sbin/haproxy"
SERVED_BY = "X-Served-By"
_UNIX_PATH_MAX = 107  # sun_path holds 108 bytes with the NUL


def doc_block(marker: str, doc: Path = DOC) -> str:
    """The ```haproxy block right after `<!-- config: MARKER -->` in the doc."""
    text = doc.read_text(encoding="utf-8")
    tag = f"<!-- config: {marker} -->"
    assert text.count(tag) == 1, f"{doc}: want exactly one {tag}"
    block = re.match(r"\s*```haproxy\n(.*?)^```", text.split(tag, 1)[1], re.S | re.M)
    assert block, f"{doc}: no ```haproxy block right after {tag}"
    return block.group(1)


@dataclass(frozen=True)
class Server:
    """One replica behind HAProxy: its name (the server's, and the path's), where its
    traffic goes, and where its supervisor answers the check. `node`: the checked node's
    name, which its TLS certificate must carry (the TLS line's verifyhost)."""

    name: str
    addr: str
    port: int
    check_addr: str
    check_port: int
    node: str = ""


@dataclass(frozen=True)
class TlsCheck:
    """The files of the TLS line: HAProxy's client certificate and key in one PEM, and the
    cluster CA that must have signed the supervisors' certificates."""

    client_pem: Path
    ca_crt: Path


def server_lines(servers: Sequence[Server], tls: TlsCheck | None = None,
                 doc: Path = DOC) -> tuple[str, list[str]]:
    """The doc's block with every line that holds {{REPLICA}} (the server line) taken out,
    and those lines filled in, one set per server: (block without them, lines)."""
    block = doc_block("haproxy", doc)
    template = [line for line in block.splitlines() if "{{REPLICA}}" in line]
    assert len(template) == 1, f"{doc}: want one server line with {{{{REPLICA}}}}"
    if tls is not None:
        template = [line for line in doc_block("haproxy-tls", doc).splitlines()
                    if line.strip()]
    lines: list[str] = []
    for server in servers:
        values = {"REPLICA": server.name, "SERVER_ADDR": server.addr,
                  "SERVER_PORT": str(server.port), "CHECK_ADDR": server.check_addr,
                  "CHECK_PORT": str(server.check_port), "CHECK_NODE": server.node}
        if tls is not None:
            assert server.node, f"{server.name}: a TLS check needs the checked node's name"
            values |= {"CLIENT_PEM": str(tls.client_pem), "CA_CRT": str(tls.ca_crt)}
        lines.extend(_fill(line, values) for line in template)
    rest = "\n".join(line for line in block.splitlines() if "{{REPLICA}}" not in line)
    return rest + "\n", lines


def _fill(line: str, values: dict[str, str]) -> str:
    filled = re.sub(r"\{\{([A-Z_]+)\}\}", lambda m: values[m.group(1)], line)
    assert "{{" not in filled, filled
    return filled


class HAProxy:
    """`haproxy -f CONF -db` with the doc's backend for `servers` and a frontend on
    bind:port (port: a free one when not given). Use as a context manager, or call
    start() and stop()."""

    def __init__(self, workdir: Path, servers: Sequence[Server], *, tls: TlsCheck | None = None,
                 netns: Netns | str | None = None, bind: str = "127.0.0.1",
                 port: int | None = None, doc: Path = DOC) -> None:
        assert servers, "HAProxy needs at least one server"
        self.workdir, self.servers, self.bind = workdir, list(servers), bind
        self.port = port or free_port()
        self.netns = netns.name if isinstance(netns, Netns) else netns
        self.conf, self.socket = workdir / "haproxy.cfg", workdir / "stats.sock"
        self.log_path = workdir / "haproxy.log"
        assert len(str(self.socket)) <= _UNIX_PATH_MAX, f"{self.socket}: path too long"
        block, lines = server_lines(self.servers, tls, doc)
        backends = re.findall(r"^backend\s+(\S+)", block, re.M)
        assert len(backends) == 1, f"{doc}: want one backend in the block, got {backends}"
        self.backend = backends[0]
        # the server lines go where the block had its own: at the end, in the backend
        assert block.rstrip().splitlines()[-1].startswith((" ", "\t")), block
        self.text = (f"global\n    stats socket {self.socket} mode 600 level admin\n"
                     f"    stats timeout 10s\n\n{block.rstrip()}\n" + "\n".join(lines)
                     + f"\n\nfrontend llmgw-test\n    bind {bind}:{self.port}\n"
                     f"    http-response set-header {SERVED_BY} %s\n"
                     f"    default_backend {self.backend}\n")
        self.pid = 0
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.bind}:{self.port}"

    def _argv(self, *args: str) -> list[str]:
        argv = [HAPROXY, *args]
        return ["ip", "netns", "exec", self.netns, *argv] if self.netns else argv

    def start(self, timeout: float = 10, checked: bool = True) -> HAProxy:
        """Start it and wait until the stats socket answers and, when `checked`, until every
        server's first check has ended (until then HAProxy counts a server up)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.conf.write_text(self.text, encoding="utf-8")
        check = subprocess.run(self._argv("-c", "-f", str(self.conf)), capture_output=True,
                               text=True, timeout=30, check=False, stdin=subprocess.DEVNULL)
        assert check.returncode == 0, (f"haproxy -c refused {self.conf}:\n{check.stdout}"
                                       f"{check.stderr}\n{self.text}")
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(self._argv("-f", str(self.conf), "-db"),
                                             stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                             cwd=self.workdir, start_new_session=True)
        self.pid = self._process.pid
        try:
            wait_until(self._answers, timeout, f"haproxy (PID {self.pid}) to answer on "
                       f"{self.socket}")
        except AssertionError:
            self.stop()
            raise AssertionError(f"haproxy did not start:\n{self.log()}") from None
        if checked:
            self.wait_checked(timeout)
        return self

    def _answers(self) -> bool:
        assert self._process is not None
        if self._process.poll() is not None:
            raise AssertionError(f"haproxy exited with {self._process.returncode}:\n"
                                 f"{self.log()}")
        try:
            return "Pid:" in self.command("show info", timeout=1)
        except OSError:
            return False

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM by PID, SIGKILL after `timeout` s, and wait for it to be gone."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()

    def __enter__(self) -> HAProxy:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def log(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def command(self, line: str, timeout: float = 2) -> str:
        """One command on the stats socket, its whole answer."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(self.socket))
            sock.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")

    def stats(self) -> dict[str, dict[str, str]]:
        """`show stat` of the backend's servers: each server's row (status, weight,
        check_status, check_code, chkdown, ...) by server name."""
        text = self.command("show stat").lstrip("# ")
        rows = csv.DictReader(text.splitlines())
        return {row["svname"]: row for row in rows
                if row["pxname"] == self.backend and row["svname"] not in ("BACKEND",
                                                                           "FRONTEND")}

    def check_status(self, server: str) -> str:
        """The last check's outcome (L7OK, L7STS, L6RSP, ...; INI before the first one),
        without the `* ` HAProxy puts before it while a check runs."""
        return self.stats()[server]["check_status"].removeprefix("* ")

    def wait_checked(self, timeout: float = 10) -> None:
        """Until every server's first check has ended."""
        wait_until(lambda: all(self.check_status(s.name) not in ("", "INI")
                               for s in self.servers),
                   timeout, "haproxy's first check of every server", interval=0.05)

    def servers_up(self) -> frozenset[str]:
        """The servers in rotation: status UP (not DOWN, DOWN 1/2, MAINT, DRAIN, NOLB) with
        a weight above 0."""
        return frozenset(name for name, row in self.stats().items()
                         if row["status"].split()[0] == "UP" and int(row["weight"] or 0) > 0)

    def server_states(self) -> dict[str, str]:
        """Each server's status as `show stat` gives it (UP, DOWN, DOWN 1/2, ...)."""
        return {name: row["status"] for name, row in self.stats().items()}

    def wait_until_up(self, server: str, timeout: float = 10) -> None:
        wait_until(lambda: server in self.servers_up(), timeout,
                   f"haproxy to put {server} in rotation", interval=0.05)

    def wait_until_down(self, server: str, timeout: float = 10) -> None:
        wait_until(lambda: server not in self.servers_up(), timeout,
                   f"haproxy to take {server} out of rotation", interval=0.05)


# -- load through the frontend -------------------------------------------------------------

# Runs in a child process (in a namespace when given): `clients` threads send completions
# back to back for `seconds`; one JSON line per request, printed when it ended.
_LOAD = """\
import http.client, json, signal, sys, threading, time, urllib.parse
url, clients, seconds, timeout, body, header = (sys.argv[1], int(sys.argv[2]),
    float(sys.argv[3]), float(sys.argv[4]), sys.argv[5].encode(), sys.argv[6])
where = urllib.parse.urlsplit(url)
end = time.monotonic() + seconds
over = threading.Event()
signal.signal(signal.SIGUSR1, lambda *_: over.set())  # finish(): no new requests
lock = threading.Lock()
def client():
    while time.monotonic() < end and not over.is_set():
        started = time.monotonic()
        status, server, tokens, error = 0, "", 0, ""
        conn = http.client.HTTPConnection(where.hostname, where.port, timeout=timeout)
        try:
            conn.request("POST", "/v1/completions", body=body,
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            data = r.read()
            status, server = r.status, r.getheader(header) or ""
            if status == 200:
                tokens = json.loads(data).get("usage", {}).get("completion_tokens", 0)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"[:200]
        finally:
            conn.close()
        line = json.dumps({"started": started, "took": time.monotonic() - started,
                           "status": status, "server": server, "tokens": tokens,
                           "error": error})
        with lock:
            print(line, flush=True)
threads = [threading.Thread(target=client) for _ in range(clients)]
for t in threads: t.start()
for t in threads: t.join()
"""


@dataclass(frozen=True)
class Request:
    """One request of the load: started on time.monotonic(), took seconds, the HTTP
    status (0: no HTTP answer, see error), the server HAProxy sent it to (X-Served-By),
    completion_tokens of a 200."""

    started: float
    took: float
    status: int
    server: str
    tokens: int
    error: str

    @property
    def ended(self) -> float:
        return self.started + self.took


class Traffic:
    """`clients` concurrent clients sending POST /v1/completions to url back to back for
    `seconds` (a request still running then finishes, within `timeout`), from a child
    process, in netns when given. As a context manager: started on entry, waited for on
    exit; `requests` then holds every request. Bounded: killed after seconds + timeout +
    30 s."""

    def __init__(self, url: str, *, clients: int, seconds: float, max_tokens: int = 16,
                 prompt: str = "Once upon a time", model: str | None = None,
                 timeout: float = 60, netns: Netns | str | None = None) -> None:
        body: dict[str, object] = {"prompt": prompt, "max_tokens": max_tokens,
                                   "ignore_eos": True, "temperature": 0}
        if model is not None:
            body["model"] = model
        argv = ["/usr/bin/python3", "-c", _LOAD, url, str(clients), str(seconds),
                str(timeout), json.dumps(body), SERVED_BY]
        name = netns.name if isinstance(netns, Netns) else netns
        self.argv = ["ip", "netns", "exec", name, *argv] if name else argv
        self.limit = seconds + timeout + 30
        self.requests: list[Request] = []
        self.stderr = ""
        self._process: subprocess.Popen[bytes] | None = None
        # files, not pipes: a pipe nobody reads until the end fills (64 KiB, some 540
        # requests) and blocks every client in its print
        self._out: IO[bytes] | None = None
        self._err: IO[bytes] | None = None

    def start(self) -> Traffic:
        self._out = tempfile.TemporaryFile()  # noqa: SIM115 - closed in wait()
        self._err = tempfile.TemporaryFile()  # noqa: SIM115
        self._process = subprocess.Popen(self.argv, stdout=self._out, stderr=self._err,
                                         stdin=subprocess.DEVNULL,
                                         env={"PATH": os.environ["PATH"]})
        return self

    def wait(self) -> list[Request]:
        process, self._process = self._process, None
        assert process is not None and self._out is not None and self._err is not None, \
            "not started"
        try:
            process.wait(timeout=self.limit)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        out, err = self._out, self._err
        out.seek(0)
        err.seek(0)
        lines, self.stderr = out.read().decode().splitlines(), err.read().decode()
        out.close()
        err.close()
        self.requests = [Request(**json.loads(line)) for line in lines if line.strip()]
        assert process.returncode == 0, f"load exited with {process.returncode}: {self.stderr}"
        return self.requests

    def finish(self) -> list[Request]:
        """End the load early: no new requests (those running finish), then wait()."""
        assert self._process is not None, "not started"
        self._process.send_signal(signal.SIGUSR1)
        return self.wait()

    def __enter__(self) -> Traffic:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if self._process is None:
            return
        if exc_type is not None:  # the test failed inside: end the load now, by PID
            self._process.kill()
            self.wait()
            return
        self.wait()

    @property
    def failed(self) -> list[Request]:
        """Every request that did not end in HTTP 200."""
        return [r for r in self.requests if r.status != 200]

    def served_by(self, since: float = 0.0) -> dict[str, int]:
        """How many requests each server answered, of those started after `since`."""
        counts: dict[str, int] = {}
        for r in self.requests:
            if r.started >= since and r.status == 200:
                counts[r.server] = counts.get(r.server, 0) + 1
        return counts


class Sampler(harness.Sampler["frozenset[str] | None"]):
    """Records (time.monotonic(), servers_up()) every `interval` s in a thread, for at most
    `limit` s, from entry to exit. A sample the stats socket did not answer is None."""

    def __init__(self, haproxy: HAProxy, interval: float = 0.5, limit: float = 600) -> None:
        super().__init__(haproxy.servers_up, interval, lambda exc: None, limit)

    @property
    def samples(self) -> list[tuple[float, frozenset[str] | None]]:
        return self.seen

    def fewest_up(self) -> int:
        """The fewest servers in rotation in any sample (an unanswered sample counts 0)."""
        assert self.samples, "no samples"
        return min(len(up or ()) for _, up in self.samples)

    def transitions(self, server: str) -> list[tuple[float, bool]]:
        return transitions(self.samples, server)


Samples = Sequence[tuple[float, "frozenset[str] | None"]]


def transitions(samples: Samples, server: str) -> list[tuple[float, bool]]:
    """(time, in rotation) at the first sample and at each change for `server`. A sample
    the stats socket did not answer says nothing either way (on a loaded machine a read
    can time out): skipped."""
    changes: list[tuple[float, bool]] = []
    for at, up in samples:
        if up is None:
            continue
        now = server in up
        if not changes or changes[-1][1] != now:
            changes.append((at, now))
    return changes


def in_rotation(samples: Iterable[tuple[float, frozenset[str] | None]], server: str,
                start: float, end: float) -> bool:
    """Whether every answered sample between start and end had `server` in rotation (and
    there was one): an unanswered read of the stats socket is no evidence either way."""
    answered = [up for at, up in samples if start <= at <= end and up is not None]
    return bool(answered) and all(server in up for up in answered)


def not_in_rotation(samples: Iterable[tuple[float, frozenset[str] | None]], server: str
                    ) -> list[tuple[float, frozenset[str] | None]]:
    """The samples that did not have `server` in rotation (None: the read was not
    answered), for an assertion's message."""
    return [(round(at, 2), up) for at, up in samples if up is None or server not in up]


def out_window(samples: Samples, server: str) -> tuple[float, float]:
    """When the samples first had `server` out, and first had it back after that: it must
    have gone out once and come back once."""
    changes = transitions(samples, server)
    assert [up for _, up in changes] == [True, False, True], changes
    return changes[1][0], changes[2][0]


def summary(requests: Sequence[Request]) -> str:
    """How many requests, how many failed, and how many each server answered."""
    by: dict[str, int] = {}
    for r in requests:
        by[r.server] = by.get(r.server, 0) + 1
    failed = sum(1 for r in requests if r.status != 200)
    return f"{len(requests)} requests, {failed} failed, by server {by}"


def bridge_address(hub: str, address: str) -> str:
    """Give a bridge's own namespace `hub` (the hub of a test network, which joins the
    nodes and has no link to the root namespace) `address` on its br0: a third machine on
    the link, where HAProxy and the clients run. The address goes with the namespace; a
    second call finds it there. Returns `hub`."""
    shown = subprocess.run(["ip", "-n", hub, "-br", "addr", "show", "br0"],
                           capture_output=True, text=True, timeout=10, check=False).stdout
    if f" {address}/24" in shown:
        return hub
    for args in (("link", "set", "lo", "up"), ("addr", "add", f"{address}/24", "dev", "br0")):
        proc = subprocess.run(["ip", "-n", hub, *args], capture_output=True, text=True,
                              timeout=10, check=False)
        assert proc.returncode == 0, proc.stderr
    return hub
