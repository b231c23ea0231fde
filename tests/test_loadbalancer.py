"""A real HAProxy (Debian 12's 2.6), configured from docs/loadbalancer.md as written, in front
of stand-ins: engines that answer /v1/completions, and the supervisor's own HTTP server
(h11, its TLS context) whose /v1/replicas/NAME/ready says 200 or 503 as the test says.

What the doc promises: one 503 takes a replica out of rotation and two 200s put it back; a
replica taken out, stopped and started again under load costs no request; a connection
that never reached a server is retried elsewhere, and a request that did is never sent
twice; the TLS check presents a client certificate made with docs/tls.md's recipe and
believes only the cluster CA's certificate for that node. Everything listens on 127.0.0.1
(or in a test's own network namespaces); every process is stopped by PID."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from certs import run_recipe
from loadbalancer import HAProxy, Sampler, Server, TlsCheck, Traffic
from specs import free_port
from systemd_harness import make_network, remove_network, wait_until

from llmgw_systemd.gather.tls import TlsFiles, server_context
from llmgw_systemd.supervisor.http.server import HttpServer, Request, Response

pytestmark = pytest.mark.integration

# the doc's check timing (test_doc_check_timing holds it to this): seconds between checks,
# milliseconds between checks once one has gone the other way, checks to go out and back
INTER, FASTINTER_MS, FALL, RISE = 1, 250, 2, 2
OUT = INTER + FASTINTER_MS / 1000 * (FALL - 1)  # seconds from the first 503 to out
BACK = INTER + FASTINTER_MS / 1000 * (RISE - 1)  # seconds from the first 200 to back
CHECK_TIMEOUT = 3  # `timeout check`: seconds a check waits for the answer once connected
SETTLE = 5  # seconds of slack on top of a bound, for a loaded machine: never an assertion


class _Quiet(ThreadingHTTPServer):
    """A threaded HTTP server on 127.0.0.1 (port 0: any free one), serving from a thread
    until close(). HAProxy resets connections it is done with: no error here."""

    daemon_threads = True

    def __init__(self, handler: type[BaseHTTPRequestHandler], port: int = 0) -> None:
        super().__init__(("127.0.0.1", port), handler)
        self.lock = threading.Lock()
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass

    def close(self) -> None:
        """Stop accepting; requests in flight finish on their own threads."""
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=10)


class _EngineHandler(BaseHTTPRequestHandler):
    server: Engine

    def do_POST(self) -> None:
        engine = self.server
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        with engine.lock:
            engine.received += 1
            engine.inflight += 1
        try:
            if engine.rude:  # read the request, then close without a word
                self.close_connection = True
                return
            time.sleep(engine.delay)
            data = json.dumps({"object": "text_completion", "model": engine.name,
                               "choices": [{"index": 0, "text": " x" * body["max_tokens"]}],
                               "usage": {"completion_tokens": body["max_tokens"]}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        finally:
            with engine.lock:
                engine.inflight -= 1

    def log_message(self, *_: Any) -> None:
        pass


class Engine(_Quiet):
    """A serving rank's OpenAI API: POST /v1/completions answered after `delay` s (rude:
    read and hung up on), one request per connection."""

    def __init__(self, name: str, delay: float = 0.2, port: int = 0, rude: bool = False
                 ) -> None:
        self.name, self.delay, self.rude = name, delay, rude
        self.received = self.inflight = 0
        super().__init__(_EngineHandler, port)


class Supervisor:
    """A node's supervisor as a load balancer sees it: the supervisor's own HTTP server (and
    under TLS its own server context: a client certificate from its CA required) with a
    stand-in handler: /v1/replicas/NAME/ready is 200 while ready[NAME], 503 otherwise.
    Keeps every answer (time, name, status) and the client certificates it was asked
    with."""

    def __init__(self, ready: dict[str, bool], tls: TlsFiles | None = None) -> None:
        self.ready = ready
        self.stall_next = 0.0  # seconds the next answer waits before it is given
        self.answers: list[tuple[float, str, int]] = []
        self.clients: list[dict[str, Any]] = []
        self.log: list[str] = []
        self.lock = threading.Lock()
        self.http = HttpServer("127.0.0.1", 0, self._handle, log=self.log.append,
                               ssl_context=server_context(tls) if tls else None)
        self.http.start()

    @property
    def port(self) -> int:
        return self.http.address[1]

    @property
    def refused(self) -> int:
        """TLS handshakes that failed."""
        return self.http.stats["tls_failures"]

    def close(self) -> None:
        self.http.stop()

    async def _handle(self, request: Request) -> Response:
        parts = request.path.split("/")
        if len(parts) != 5 or parts[:3] != ["", "v1", "replicas"] or parts[4] != "ready" \
                or parts[3] not in self.ready:
            return Response(404, b"no such replica\n", "text/plain")
        name = parts[3]
        with self.lock:
            stall, self.stall_next = self.stall_next, 0.0
        if stall:
            await asyncio.sleep(stall)
        code = 200 if self.ready[name] else 503
        with self.lock:  # counted before HAProxy can have read it
            self.answers.append((time.monotonic(), name, code))
            if request.peer_cert is not None:
                self.clients.append(request.peer_cert)
        return Response(code, b"ready\n" if code == 200 else b"draining: out of rotation\n",
                        "text/plain")

    def count(self, name: str, code: int, since: float) -> int:
        with self.lock:
            return sum(1 for at, n, c in self.answers if n == name and c == code and at >= since)


@contextlib.contextmanager
def running(*servers: Engine | Supervisor) -> Iterator[None]:
    try:
        yield
    finally:
        for server in servers:
            server.close()


def server(name: str, engine: Engine, supervisor: Supervisor, node: str = "") -> Server:
    return Server(name, "127.0.0.1", engine.port, "127.0.0.1", supervisor.port, node)


def test_doc_check_timing(tmp_path: Path) -> None:
    """The doc's server line is the timing these tests reason with."""
    lb = HAProxy(tmp_path, [Server("rep", "127.0.0.1", 1, "127.0.0.1", 2)])
    assert f"inter {INTER}s fastinter {FASTINTER_MS}ms fall {FALL} rise {RISE}" in lb.text
    assert f"timeout check {CHECK_TIMEOUT}s" in lb.text
    for line in ("option httpchk", "http-check expect status 200", "retries 3",
                 "option redispatch", "retry-on conn-failure"):
        assert line in lb.text


def test_one_check_that_times_out_leaves_a_healthy_replica_in_rotation(tmp_path: Path
                                                                      ) -> None:
    """One slow answer (here past `timeout check`; in CI a TLS handshake past `inter`) is
    one failed check: HAProxy checks again a `fastinter` later, gets 200, and the replica
    never leaves rotation. With `fall 1` it would have."""
    engine, supervisor = Engine("rep-a"), Supervisor({"rep-a": True})
    with running(engine, supervisor), \
            HAProxy(tmp_path, [server("rep-a", engine, supervisor)]) as lb, \
            Sampler(lb, interval=0.1) as sampler:
        assert lb.servers_up() == {"rep-a"}
        supervisor.stall_next = CHECK_TIMEOUT + 1
        wait_until(lambda: int(lb.stats()["rep-a"]["chkfail"] or 0) >= 1,
                   INTER + CHECK_TIMEOUT + 1 + SETTLE, "HAProxy to count the slow check failed")
        stalled = time.monotonic()
        wait_until(lambda: supervisor.count("rep-a", 200, stalled) >= 2, BACK + SETTLE,
                   "two more checks answered")
        assert lb.stats()["rep-a"]["check_status"].removeprefix("* ") == "L7OK"
    assert [up for _, up in sampler.transitions("rep-a")] == [True], \
        sampler.transitions("rep-a")


def test_two_503s_take_it_out_and_two_200s_bring_it_back(tmp_path: Path) -> None:
    engine, supervisor = Engine("rep-a"), Supervisor({"rep-a": True})
    with running(engine, supervisor), \
            HAProxy(tmp_path, [server("rep-a", engine, supervisor)]) as lb, \
            Sampler(lb) as sampler:
        assert lb.servers_up() == {"rep-a"}
        wait_until(lambda: sampler.samples, SETTLE, "a first sample")

        flipped = time.monotonic()
        supervisor.ready["rep-a"] = False
        lb.wait_until_down("rep-a", timeout=OUT + SETTLE)
        # HAProxy can only have gone by an answer already given: `fall` of them
        assert supervisor.count("rep-a", 503, flipped) >= FALL
        row = lb.stats()["rep-a"]
        assert (row["check_status"].removeprefix("* "), row["check_code"]) == ("L7STS", "503")
        wait_until(lambda: any(at > flipped and "rep-a" not in (up or ())
                               for at, up in sampler.samples),
                   SETTLE, "the sampler to see rep-a out")

        back = time.monotonic()
        supervisor.ready["rep-a"] = True
        lb.wait_until_up("rep-a", timeout=BACK + SETTLE)
        # up only once `rise` 200s had been answered since the flip back
        assert supervisor.count("rep-a", 200, back) >= RISE
        wait_until(lambda: any(at > back and "rep-a" in (up or ())
                               for at, up in sampler.samples),
                   SETTLE, "the sampler to see rep-a back")

    states = [up for _, up in sampler.transitions("rep-a")]
    assert states == [True, False, True], sampler.transitions("rep-a")


def test_replica_taken_out_then_stopped_and_restarted_under_load_loses_nothing(
        tmp_path: Path) -> None:
    """As a planned restart of one of two replicas goes: its supervisor says 503
    (draining), HAProxy takes it out, the requests it has finish, its engine stops, starts
    again, the supervisor says 200, HAProxy puts it back; 4 clients throughout."""
    engines = {name: Engine(name) for name in ("rep-a", "rep-b")}
    first_b = engines["rep-b"]
    supervisors = {name: Supervisor({name: True}) for name in engines}
    servers = [server(name, engines[name], supervisors[name]) for name in engines]
    try:
        with running(*supervisors.values()), HAProxy(tmp_path, servers) as lb, \
                Sampler(lb) as sampler:
            assert lb.servers_up() == {"rep-a", "rep-b"}
            with Traffic(lb.url, clients=4, seconds=12, timeout=30) as traffic:
                wait_until(lambda: all(e.received >= 3 for e in engines.values()), SETTLE,
                           "both replicas to serve")
                supervisors["rep-b"].ready["rep-b"] = False  # draining
                lb.wait_until_down("rep-b", timeout=OUT + SETTLE)
                out = time.monotonic()
                time.sleep(0.5)  # what drain.delay is for: a request HAProxy sent just before
                wait_until(lambda: first_b.inflight == 0, 30, "rep-b's requests to finish")
                first_b.close()  # the engine stops
                time.sleep(2)  # the other replica carries the load meanwhile
                restarted = time.monotonic()
                engines["rep-b"] = Engine("rep-b", port=first_b.port)  # started again
                supervisors["rep-b"].ready["rep-b"] = True
                lb.wait_until_up("rep-b", timeout=BACK + SETTLE)
                back = time.monotonic()
    finally:
        for engine in (first_b, *engines.values()):
            engine.close()

    done = traffic.requests
    assert len(done) > 20, f"only {len(done)} requests"
    assert not traffic.failed, traffic.failed[:5]
    assert sampler.fewest_up() >= 1, sampler.samples
    assert [up for _, up in sampler.transitions("rep-b")] == [True, False, True]
    # nothing new reached rep-b from when HAProxy said it was out: its old engine got only
    # requests started before, and nothing was answered by it while it was stopped
    assert first_b.received == sum(1 for r in done if r.server == "rep-b" and r.started < out)
    assert not [r for r in done if r.server == "rep-b" and out < r.started < restarted]
    assert traffic.served_by(since=back).get("rep-b", 0) > 0, traffic.served_by(back)
    assert engines["rep-b"].received > 0


def test_only_requests_that_never_reached_a_server_are_retried(tmp_path: Path) -> None:
    """A replica whose check says ready but whose port refuses connections costs no
    request (retries, then another server); one that hangs up after reading the request
    costs that request (502), and it is never sent twice."""
    ok, rude = Engine("ok"), Engine("rude", rude=True)
    supervisor = Supervisor({"ok": True, "refusing": True, "rude": True})
    servers = [server("ok", ok, supervisor), server("rude", rude, supervisor),
               Server("refusing", "127.0.0.1", free_port(), "127.0.0.1", supervisor.port)]
    with running(ok, rude, supervisor), HAProxy(tmp_path, servers) as lb:
        assert lb.servers_up() == {"ok", "refusing", "rude"}
        with Traffic(lb.url, clients=4, seconds=5, timeout=30) as traffic:
            pass
        stats = lb.stats()

    failed = traffic.failed
    assert {r.status for r in failed} == {502}, failed[:5]
    assert len(failed) == rude.received, (len(failed), rude.received)
    assert int(stats["refusing"]["wretr"]) + int(stats["refusing"]["wredis"]) > 0, stats
    assert int(stats["rude"]["wretr"]) == int(stats["rude"]["wredis"]) == 0
    assert ok.received == len(traffic.requests) - len(failed)
    assert set(traffic.served_by()) == {"ok"}


def _tls_material(tmp_path: Path) -> dict[str, Path]:
    """With docs/tls.md's recipe: the cluster CA and nodes gpu-a1, gpu-a2 and HAProxy's
    haproxy-1 (its client.pem as docs/loadbalancer.md joins it), and another CA's gpu-a1."""
    cluster, other = tmp_path / "llmgw-tls", tmp_path / "other-tls"
    for out, name in ((cluster, "gpu-a1"), (cluster, "gpu-a2"), (cluster, "haproxy-1"),
                      (other, "gpu-a1")):
        run_recipe(tmp_path, out, name, "127.0.0.1")
    client = tmp_path / "client.pem"
    client.write_bytes((cluster / "haproxy-1" / "node.crt").read_bytes()
                       + (cluster / "haproxy-1" / "node.key").read_bytes())
    client.chmod(0o600)
    return {"cluster": cluster, "other": other, "client": client}


def test_tls_check_with_a_client_certificate(tmp_path: Path) -> None:
    files = _tls_material(tmp_path)
    cluster, other = files["cluster"], files["other"]

    def node(where: Path, name: str, trusts: Path) -> TlsFiles:
        return TlsFiles(cert=str(where / name / "node.crt"), key=str(where / name / "node.key"),
                        ca=str(trusts / "ca.crt"))

    engine = Engine("any")
    supervisors = {
        "good": Supervisor({"good": True}, node(cluster, "gpu-a1", cluster)),
        # gpu-a1's name, but another CA signed it
        "other-ca": Supervisor({"other-ca": True}, node(other, "gpu-a1", cluster)),
        # the cluster CA signed it, but for another node
        "wrong-node": Supervisor({"wrong-node": True}, node(cluster, "gpu-a2", cluster)),
        # the right certificate, but it trusts another CA, so not HAProxy's certificate
        "distrusts": Supervisor({"distrusts": True}, node(cluster, "gpu-a1", other)),
    }
    servers = [server(name, engine, sup, node="gpu-a1") for name, sup in supervisors.items()]
    tls = TlsCheck(client_pem=files["client"], ca_crt=cluster / "ca.crt")
    with running(engine, *supervisors.values()), HAProxy(tmp_path / "lb", servers, tls=tls) as lb:
        assert "check-ssl crt" in lb.text and "verifyhost gpu-a1" in lb.text
        wait_until(lambda: supervisors["good"].count("good", 200, 0) >= RISE, SETTLE,
                   "two checks of good")
        assert lb.servers_up() == {"good"}, lb.server_states()
        statuses = {name: lb.check_status(name) for name in supervisors}
        with Traffic(lb.url, clients=2, seconds=1) as traffic:
            pass

    assert statuses["good"] == "L7OK", statuses
    for name in ("other-ca", "wrong-node"):  # HAProxy refused the server's certificate
        assert statuses[name] == "L6RSP", statuses
        assert not supervisors[name].answers
    # the supervisor refused HAProxy's certificate: no check ever got an answer
    assert supervisors["distrusts"].refused > 0 and not supervisors["distrusts"].answers
    assert statuses["distrusts"] != "L7OK", statuses
    subjects = {dict(x[0] for x in c["subject"])["commonName"]
                for c in supervisors["good"].clients}
    assert subjects == {"haproxy-1"}
    assert traffic.requests and not traffic.failed and set(traffic.served_by()) == {"good"}


# Runs in a node's network namespace: an engine on ADDR:8000 and a supervisor on ADDR:9470
# whose replica "rep" is ready while FLAG exists; prints "listening" once both are.
_NODE = """\
import json, os, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
addr, flag = sys.argv[1], sys.argv[2]
class Engine(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        data = json.dumps({"choices": [{"text": "x"}],
                           "usage": {"completion_tokens": body["max_tokens"]}}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data)))
        self.end_headers(); self.wfile.write(data)
    def log_message(self, *a): pass
class Check(BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path == "/v1/replicas/rep/ready" and os.path.exists(flag)
        self.send_response(200 if ok else 503); self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *a): pass
servers = [ThreadingHTTPServer((addr, 8000), Engine), ThreadingHTTPServer((addr, 9470), Check)]
for s in servers:
    s.daemon_threads = True
    s.handle_error = lambda *a: None
    threading.Thread(target=s.serve_forever, daemon=True).start()
print("listening", flush=True)
sys.stdin.read()
"""


def test_in_network_namespaces(tmp_path: Path) -> None:
    """HAProxy and the load in one node's namespace, the replica in another's."""
    tag = f"{os.getpid() % 10000}lb"
    flag = tmp_path / "ready"
    flag.touch()
    node: subprocess.Popen[str] | None = None
    try:
        front, back = make_network(tag, 2)
        node = subprocess.Popen(["ip", "netns", "exec", back.name, "/usr/bin/python3", "-c",
                                 _NODE, back.address, str(flag)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert node.stdout is not None and node.stdout.readline().strip() == "listening"
        servers = [Server("rep", back.address, 8000, back.address, 9470)]
        with HAProxy(tmp_path / "lb", servers, netns=front, port=8080) as lb:
            assert lb.servers_up() == {"rep"}
            with Traffic(lb.url, clients=2, seconds=1, netns=front) as traffic:
                pass
            flag.unlink()
            lb.wait_until_down("rep", timeout=OUT + SETTLE)
        assert traffic.requests and not traffic.failed
        assert set(traffic.served_by()) == {"rep"}
    finally:
        if node is not None:
            node.send_signal(signal.SIGTERM)
            try:
                node.wait(timeout=10)
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait(timeout=10)
        remove_network(tag)
