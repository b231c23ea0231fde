"""Peer supervisors over TLS, on two nodes in their own network namespaces: a replica is
ready only on authenticated reports; a peer with a certificate from another CA, an
expired one, or none at all is refused, and the replica is never ready meanwhile."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from certs import cluster, make_ca, make_node_cert
from specs import free_port, two_node_replica
from supervisors import Sampler, SupervisorProcess
from systemd_harness import Nodes, wait_until

from llmgw_systemd.gather.tls import TlsFiles

pytestmark = pytest.mark.integration

API = 9470
TARGET = "llmgw-rep.target"

# From inside a namespace: a TLS client that trusts the CA but shows no certificate.
NO_CERT_CLIENT = """\
import socket, ssl, sys
ctx = ssl.create_default_context(cafile=sys.argv[3])
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname=sys.argv[1]) as tls:
            tls.sendall(b"GET /v1/shards HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
            print("answered" if tls.recv(100) else "closed")
except (OSError, ssl.SSLError) as exc:
    print("refused:", type(exc).__name__)
"""


def tls_options(files: TlsFiles) -> list[str]:
    return ["--tls-cert", files.cert, "--tls-key", files.key, "--tls-ca", files.ca,
            "--local", f"127.0.0.1:{free_port()}"]


class Pair:
    def __init__(self, nodes: Nodes, tmp: Path) -> None:
        self.nodes, self.tmp = nodes, tmp
        a, b = nodes.address("node-a"), nodes.address("node-b")
        self.spec = two_node_replica(tmp / "spec.yaml", name="rep", leader=a, worker=b,
                                     http=free_port(), head=free_port(),
                                     pid_file=tmp / "head.pids", delay=1, burst=20,
                                     interval=900)
        self.spec.write_text(self.spec.read_text() + """\
    health: {interval: 1, timeout: 1, stability: 2}
    group_restart: {delay: 1, max_delay: 2, budget: 5, window: 600}
""")
        self.files = cluster(tmp / "tls", [("node-a", a), ("node-b", b)])
        self.sups: dict[str, SupervisorProcess] = {}
        for node in ("node-a", "node-b"):
            nodes[node].render(self.spec, node)
        nodes["node-b"].systemctl("start", TARGET)
        nodes["node-a"].systemctl("start", TARGET)

    def supervise(self, node: str, files: TlsFiles) -> SupervisorProcess:
        old = self.sups.pop(node, None)
        if old is not None:
            old.stop()
        sup = SupervisorProcess(self.nodes[node], node, self.spec,
                                listen=f"{self.nodes.address(node)}:{API}",
                                extra=tls_options(files))
        self.sups[node] = sup
        return sup

    def close(self) -> None:
        for node, sup in self.sups.items():
            sup.stop()
            print(f"===== supervisor on {node}\n{sup.tail()}")


@pytest.fixture
def pair(two_nodes: Nodes, tmp_path: Path) -> Iterator[Pair]:
    harness = Pair(two_nodes, tmp_path)
    try:
        yield harness
    finally:
        harness.close()


def bad_files(tmp: Path, good: TlsFiles, kind: str, address: str) -> TlsFiles:
    """node-b's files, spoiled: signed by another CA, or expired."""
    directory = tmp / f"bad-{kind}"
    if kind == "other-ca":
        ca = make_ca(tmp / "other-ca", name="somebody else's CA")
        cert, key = make_node_cert(directory, ca, "node-b", address)
        shutil.copy(ca[0], directory / "ca.crt")  # it trusts its own CA
    else:
        ca = (Path(good.ca), Path(good.ca).parent.parent / "ca.key")
        cert, key = make_node_cert(directory, ca, "node-b", address, expired=True)
        shutil.copy(good.ca, directory / "ca.crt")
    return TlsFiles(str(cert), str(key), str(directory / "ca.crt"))


def refused_by_tls(seen: dict[str, object]) -> bool:
    reason = str(seen["reason"])
    return (seen["state"] == "degraded" and "supervisor on node-b unreachable" in reason
            and ("TLS" in reason or "certificate" in reason))


def test_ready_on_authenticated_reports_only(pair: Pair, tmp_path: Path) -> None:
    a = pair.supervise("node-a", pair.files["node-a"])
    b = pair.supervise("node-b", pair.files["node-b"])
    a.wait_state("rep", "ready", timeout=90)
    b.wait_state("rep", "ready", timeout=30)
    assert "API on https://" in a.tail() and "client certificates required" in a.tail()

    for kind in ("other-ca", "expired"):
        spoiled = bad_files(tmp_path, pair.files["node-b"], kind,
                            pair.nodes.address("node-b"))
        pair.supervise("node-b", spoiled)
        # while node-b's supervisor restarts, node-a may first see "connection refused";
        # what must follow is the TLS refusal of the spoiled certificate
        wait_until(lambda: refused_by_tls(a.replica("rep")), 30,
                   f"node-a to refuse node-b's {kind} certificate")
        with Sampler(lambda: str(a.replica("rep")["state"])) as sampler:
            time.sleep(3)  # an observation window
        assert "ready" not in sampler.states(), sampler.seen
        # and node-b's own fetches of node-a are refused by node-a
        pair.sups["node-b"].wait_state("rep", "degraded", 30,
                                       reason="supervisor on node-a unreachable")

    pair.supervise("node-b", pair.files["node-b"])  # the right files again
    a.wait_state("rep", "ready", timeout=30)


def test_a_client_without_a_certificate_is_refused(pair: Pair) -> None:
    pair.supervise("node-a", pair.files["node-a"])
    ns = pair.nodes["node-b"].netns
    assert ns is not None
    out = ns.exec("/usr/bin/python3", "-c", NO_CERT_CLIENT, pair.nodes.address("node-a"),
                  str(API), pair.files["node-b"].ca)
    assert out.stdout.startswith(("refused", "closed")), (out.stdout, out.stderr)
