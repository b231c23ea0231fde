"""TLS between peer supervisors (llmgw_systemd.gather.tls, docs/tls.md).

Real handshakes on the loopback: a one-connection server thread per case, every socket
with a timeout. TLS 1.3 reports a client certificate the server refuses only after the
client's half of the handshake, so "refused" means: the server raised, and the client
never read the server's b"ok".
"""

from __future__ import annotations

import os
import re
import socket
import ssl
import stat
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from certs import DOC, cluster, make_ca, make_node_cert, run_recipe

from llmgw_systemd.errors import LlmgwError, TlsError
from llmgw_systemd.gather.tls import (
    CREDENTIAL_NAMES,
    TlsFiles,
    client_context,
    find_tls_files,
    identities,
    names_node,
    server_context,
)

TIMEOUT = 5.0
A, B = ("gpu-a", "127.0.0.1"), ("gpu-b", "127.0.0.2")  # server A, client B
OK = b"ok"


# -- a handshake on the loopback --------------------------------------------------------


@dataclass
class Handshake:
    seen_by_server: dict[str, Any] | None  # the client's certificate, when accepted
    seen_by_client: dict[str, Any] | None  # the server's certificate, when accepted
    server_error: Exception | None
    client_error: Exception | None
    reply: bytes  # OK when both sides completed the handshake

    @property
    def ok(self) -> bool:
        return self.reply == OK and self.server_error is None and self.client_error is None


def handshake(server: ssl.SSLContext, client: ssl.SSLContext, host: str = "127.0.0.1",
              dial: str | None = None) -> Handshake:
    """One connection from client to a server on host; the client checks `dial` (default
    host) against the server's certificate, as the supervisor does with a peer's address."""
    out = Handshake(None, None, None, None, b"")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as listener:
        listener.bind((host, 0))
        listener.listen(1)
        listener.settimeout(TIMEOUT)
        port = listener.getsockname()[1]

        def serve() -> None:
            try:
                conn, _ = listener.accept()
                conn.settimeout(TIMEOUT)
                with server.wrap_socket(conn, server_side=True) as tls:
                    out.seen_by_server = tls.getpeercert()
                    tls.sendall(OK)
            except (ssl.SSLError, OSError) as e:
                out.server_error = e

        thread = threading.Thread(target=serve, name="tls-test-server", daemon=True)
        thread.start()
        try:
            with socket.create_connection((host, port), timeout=TIMEOUT) as raw, \
                    client.wrap_socket(raw, server_hostname=dial or host) as tls:
                out.seen_by_client = tls.getpeercert()
                while len(out.reply) < len(OK):
                    chunk = tls.recv(len(OK) - len(out.reply))
                    if not chunk:
                        break
                    out.reply += chunk
        except (ssl.SSLError, OSError) as e:
            out.client_error = e
        thread.join(2 * TIMEOUT)
        assert not thread.is_alive(), "the test server did not finish"
    return out


def no_cert_client(ca: str) -> ssl.SSLContext:
    """A client that verifies the server but has no certificate of its own."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cafile=ca)
    return ctx


# -- the certificates every test shares --------------------------------------------------


@dataclass(frozen=True)
class Pki:
    root: Path
    files: dict[str, TlsFiles]  # by variant: "a", "b", "b-expired", ...


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    nodes = cluster(root / "cluster", [A, B])
    ca_crt = nodes[A[0]].ca
    ca = (Path(ca_crt).parent.parent / "ca.crt", Path(ca_crt).parent.parent / "ca.key")
    other_ca = make_ca(root / "other-ca", "some other CA")
    files = {"a": nodes[A[0]], "b": nodes[B[0]]}

    def variant(label: str, node: tuple[str, str], signer: tuple[Path, Path] = ca,
                **kwargs: Any) -> None:
        crt, key = make_node_cert(root / label, signer, *node, **kwargs)
        files[label] = TlsFiles(cert=str(crt), key=str(key), ca=ca_crt)

    variant("a-other-ca", A, other_ca)
    variant("a-expired", A, expired=True)
    variant("a-client-only", A, server=False)
    variant("a-wrong-address", ("gpu-a", "127.0.0.9"))
    variant("b-other-ca", B, other_ca)
    variant("b-expired", B, expired=True)
    variant("b-server-only", B, client=False)
    variant("v6", ("gpu-v6", "::1"))
    return Pki(root, files)


# -- handshakes ----------------------------------------------------------------------------

REFUSED = [
    # (case, server's files, client's files or None for no certificate, who refuses, why)
    ("client cert from another CA", "a", "b-other-ca", "server",
     "unable to get local issuer certificate"),
    ("expired client cert", "a", "b-expired", "server", "certificate has expired"),
    ("client cert without clientAuth", "a", "b-server-only", "server",
     "unsuitable certificate purpose"),
    ("client without a cert", "a", None, "server", "PEER_DID_NOT_RETURN_A_CERTIFICATE"),
    ("server cert from another CA", "a-other-ca", "b", "client",
     "unable to get local issuer certificate"),
    ("expired server cert", "a-expired", "b", "client", "certificate has expired"),
    ("server cert without serverAuth", "a-client-only", "b", "client",
     "unsuitable certificate purpose"),
    ("server cert lacks the address dialed", "a-wrong-address", "b", "client",
     "IP address mismatch"),
]


def test_handshake_between_two_nodes(pki: Pki) -> None:
    got = handshake(server_context(pki.files["a"]), client_context(pki.files["b"]))
    assert got.ok, got
    assert got.seen_by_server is not None and got.seen_by_client is not None
    assert identities(got.seen_by_server) == {"gpu-b", "127.0.0.2"}
    assert identities(got.seen_by_client) == {"gpu-a", "127.0.0.1"}
    assert names_node(got.seen_by_server, *B)
    assert not names_node(got.seen_by_server, *A)


def test_handshake_by_name_checks_the_dns_entry(pki: Pki) -> None:
    got = handshake(server_context(pki.files["a"]), client_context(pki.files["b"]),
                    dial="gpu-a")
    assert got.ok, got
    wrong = handshake(server_context(pki.files["a"]), client_context(pki.files["b"]),
                      dial="gpu-b")
    assert isinstance(wrong.client_error, ssl.SSLCertVerificationError), wrong
    assert "Hostname mismatch" in str(wrong.client_error)


def test_handshake_over_ipv6(pki: Pki) -> None:
    got = handshake(server_context(pki.files["v6"]), client_context(pki.files["b"]),
                    host="::1")
    assert got.ok, got
    assert got.seen_by_client is not None
    assert names_node(got.seen_by_client, "gpu-v6", "0:0:0:0:0:0:0:1")


@pytest.mark.parametrize(("server", "client", "refuser", "why"),
                         [case[1:] for case in REFUSED], ids=[case[0] for case in REFUSED])
def test_handshake_refused(pki: Pki, server: str, client: str | None, refuser: str,
                           why: str) -> None:
    client_ctx = (no_cert_client(pki.files["b"].ca) if client is None
                  else client_context(pki.files[client]))
    got = handshake(server_context(pki.files[server]), client_ctx)
    assert got.reply == b"" and got.seen_by_server is None, got
    error = got.server_error if refuser == "server" else got.client_error
    assert isinstance(error, ssl.SSLError), got
    assert why in str(error), got
    if refuser == "client":
        assert isinstance(error, ssl.SSLCertVerificationError), got


def test_context_settings(pki: Pki) -> None:
    server, client = server_context(pki.files["a"]), client_context(pki.files["a"])
    for ctx in (server, client):
        assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2
        assert ctx.verify_mode == ssl.CERT_REQUIRED
        assert ctx.cert_store_stats()["x509_ca"] == 1  # the cluster CA, no system CAs
    assert client.check_hostname


# -- identities and names_node ------------------------------------------------------------

SAN = {"subject": ((("commonName", "gpu-a1"),),),
       "subjectAltName": (("DNS", "GPU-A1.Cluster."), ("DNS", "gpu-a1"),
                          ("IP Address", "10.0.0.11"), ("IP Address", "2001:DB8:0:0:0:0:0:1\n"),
                          ("DNS", "10.0.0.99"), ("DNS", "*.wild"), ("email", "ops@example"),
                          ("IP Address", "not an address"), ("URI", "https://gpu-a1"))}


def test_identities_normalised() -> None:
    assert identities(SAN) == {"gpu-a1.cluster", "gpu-a1", "10.0.0.11", "2001:db8::1",
                               "10.0.0.99", "*.wild"}


@pytest.mark.parametrize("cert", [{}, {"subject": ((("commonName", "gpu-a1"),),)},
                                  {"subjectAltName": ()}], ids=["empty", "cn only", "no san"])
def test_identities_without_san(cert: dict[str, Any]) -> None:
    assert identities(cert) == frozenset()
    assert not names_node(cert, "gpu-a1", "10.0.0.11")


NAMES_NODE = [
    # (name, address, expected)
    ("gpu-a1", "10.0.0.11", True),
    ("GPU-A1.", "10.9.9.9", True),           # the name alone, compared case-insensitively
    ("gpu-a9", "10.0.0.11", True),           # the address alone
    ("gpu-a9", "2001:db8::1", True),         # the same IPv6 address, another spelling
    ("gpu-a9", "2001:db8::1%eth0", True),    # a zone is no part of an address in a cert
    ("gpu-a9", "gpu-a1.cluster", True),      # a host name address matches DNS entries
    ("gpu-a9", "10.0.0.12", False),
    ("gpu-a9", "10.0.0.99", False),          # an IP address never matches a DNS entry
    ("gpu-a9", "x.wild", False),             # wildcards are literal
    ("10.0.0.11", "10.0.0.12", False),       # nor does a name match an IP entry
    ("", "", False),
]


@pytest.mark.parametrize(("name", "address", "expected"), NAMES_NODE,
                         ids=[f"{n or '-'}@{a or '-'}" for n, a, _ in NAMES_NODE])
def test_names_node(name: str, address: str, expected: bool) -> None:
    assert names_node(SAN, name, address) is expected


# -- find_tls_files ---------------------------------------------------------------------


def credentials(directory: Path, names: tuple[str, ...]) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / name).write_text("x\n")
    return str(directory)


def test_find_explicit_paths_win(tmp_path: Path) -> None:
    creds = credentials(tmp_path / "creds", CREDENTIAL_NAMES)
    assert find_tls_files("c.pem", "k.pem", "ca.pem", credentials_dir=creds) == \
        TlsFiles(cert="c.pem", key="k.pem", ca="ca.pem")


@pytest.mark.parametrize(("given", "missing"), [
    (("c.pem", None, None), "key and ca missing"),
    ((None, "k.pem", ""), "cert and ca missing"),
    (("c.pem", "k.pem", None), "ca missing"),
    ((None, None, "ca.pem"), "cert and key missing"),
], ids=["cert", "key", "cert+key", "ca"])
def test_find_partial_explicit(tmp_path: Path, given: tuple[str | None, str | None, str | None],
                               missing: str) -> None:
    creds = credentials(tmp_path / "creds", CREDENTIAL_NAMES)  # no fall-back to these
    with pytest.raises(TlsError, match=f"incomplete TLS configuration: .* given but {missing}"):
        find_tls_files(*given, credentials_dir=creds)


def test_find_in_credentials_directory(tmp_path: Path) -> None:
    creds = credentials(tmp_path / "creds", (*CREDENTIAL_NAMES, "unrelated"))
    assert find_tls_files(None, None, None, credentials_dir=creds) == TlsFiles(
        *(os.path.join(creds, name) for name in CREDENTIAL_NAMES))


@pytest.mark.parametrize("present", [("node.crt",), ("node.crt", "node.key"), ("ca.crt",)])
def test_find_partial_credentials(tmp_path: Path, present: tuple[str, ...]) -> None:
    creds = credentials(tmp_path / "creds", present)
    missing = [name for name in CREDENTIAL_NAMES if name not in present]
    with pytest.raises(TlsError) as info:
        find_tls_files(None, None, None, credentials_dir=creds)
    assert str(info.value).startswith(f"{creds}: incomplete TLS credentials: ")
    assert all(name in str(info.value) for name in missing)


@pytest.mark.parametrize("creds", [None, "", "empty", "unrelated", "absent"])
def test_find_nothing_means_plain_http(tmp_path: Path, creds: str | None) -> None:
    where = {"empty": credentials(tmp_path / "e", ()),
             "unrelated": credentials(tmp_path / "u", ("db-password",)),
             "absent": str(tmp_path / "nowhere")}.get(creds or "", creds)
    assert find_tls_files(None, None, "", credentials_dir=where) is None


# -- errors name the file ------------------------------------------------------------------

Builder = Callable[[TlsFiles], ssl.SSLContext]
GARBAGE = "-----BEGIN CERTIFICATE-----\nnot base64 at all!\n-----END CERTIFICATE-----\n"


def broken(pki: Pki, tmp: Path, case: str) -> tuple[TlsFiles, str]:
    """TlsFiles with one thing wrong, and the message expected (the file first)."""
    a, b = pki.files["a"], pki.files["b"]
    (tmp / "garbage.pem").write_text(GARBAGE)
    (tmp / "text.pem").write_text("hello\n")
    garbage, text, missing = str(tmp / "garbage.pem"), str(tmp / "text.pem"), str(tmp / "nope")
    if case == "encrypted key":
        subprocess.run(["openssl", "pkey", "-in", a.key, "-aes256", "-passout", "pass:secret",
                        "-out", str(tmp / "enc.key")], check=True, capture_output=True,
                       timeout=30)
    table = {
        "missing cert": (TlsFiles(missing, a.key, a.ca), f"{missing}: cannot read: No such file"),
        "missing key": (TlsFiles(a.cert, missing, a.ca), f"{missing}: cannot read: No such file"),
        "missing ca": (TlsFiles(a.cert, a.key, missing), f"{missing}: cannot read: No such file"),
        "directory as key": (TlsFiles(a.cert, str(tmp), a.ca), f"{tmp}: cannot read: Is a dir"),
        "garbage cert": (TlsFiles(garbage, a.key, a.ca), f"{garbage}: not a usable PEM cert"),
        "text cert": (TlsFiles(text, a.key, a.ca), f"{text}: not a usable PEM certificate"),
        "key as cert": (TlsFiles(a.key, a.key, a.ca), f"{a.key}: not a usable PEM certificate"),
        "garbage key": (TlsFiles(a.cert, garbage, a.ca), f"{garbage}: not a usable PEM private"),
        "cert as key": (TlsFiles(a.cert, a.cert, a.ca), f"{a.cert}: not a usable PEM private"),
        "key of another node": (TlsFiles(a.cert, b.key, a.ca),
                                f"{b.key}: private key does not match the certificate in "
                                f"{a.cert}"),
        "encrypted key": (TlsFiles(a.cert, str(tmp / "enc.key"), a.ca),
                          f"{tmp / 'enc.key'}: private key is encrypted"),
        "garbage ca": (TlsFiles(a.cert, a.key, garbage), f"{garbage}: not a usable PEM CA"),
        "text ca": (TlsFiles(a.cert, a.key, text), f"{text}: not a usable PEM CA certificate"),
        "node cert as ca": (TlsFiles(a.cert, a.key, b.cert), f"{b.cert}: holds no CA cert"),
    }
    return table[case]


BROKEN = ["missing cert", "missing key", "missing ca", "directory as key", "garbage cert",
          "text cert", "key as cert", "garbage key", "cert as key", "key of another node",
          "encrypted key", "garbage ca", "text ca", "node cert as ca"]


@pytest.mark.parametrize("build", [server_context, client_context], ids=["server", "client"])
@pytest.mark.parametrize("case", BROKEN)
def test_errors_name_the_file(pki: Pki, tmp_path: Path, case: str, build: Builder) -> None:
    files, expected = broken(pki, tmp_path, case)
    with pytest.raises(TlsError) as info:
        build(files)
    message = str(info.value)
    assert message.startswith(expected), message
    assert "\n" not in message and "_ssl.c" not in message, message
    assert isinstance(info.value, LlmgwError)


def test_cert_file_may_carry_the_key(pki: Pki, tmp_path: Path) -> None:
    a = pki.files["a"]
    both = tmp_path / "both.pem"
    both.write_text(Path(a.cert).read_text() + Path(a.key).read_text())
    assert handshake(server_context(TlsFiles(str(both), str(both), a.ca)),
                     client_context(pki.files["b"])).ok


def test_helper_writes_keys_owner_only(pki: Pki) -> None:
    for files in pki.files.values():
        assert stat.S_IMODE(os.stat(files.key).st_mode) == 0o600, files.key


# -- the recipe in docs/tls.md ------------------------------------------------------------


def subject_alt_name(cert: Path) -> str:
    proc = subprocess.run(["openssl", "x509", "-in", str(cert), "-noout", "-ext",
                           "subjectAltName"], capture_output=True, text=True, timeout=30,
                          check=True)
    return proc.stdout.splitlines()[-1].strip()


def test_docs_recipe_makes_working_certificates(tmp_path: Path) -> None:
    out = tmp_path / "tls"
    run_recipe(tmp_path, out, *A)
    ca_first = (out / "ca.crt").read_bytes()
    run_recipe(tmp_path, out, *B, interpreter="sh")  # as docs/tls.md says to run it
    run_recipe(tmp_path, out, "gpu-c", "gpu-c.example")
    assert (out / "ca.crt").read_bytes() == ca_first, "the CA must be made only once"

    nodes: dict[str, TlsFiles] = {}
    for name in ("gpu-a", "gpu-b", "gpu-c"):
        found = find_tls_files(None, None, None, credentials_dir=str(out / name))
        assert found is not None, f"{out / name} is not a complete credentials directory"
        nodes[name] = found
        for key in (found.key, out / "ca.key"):
            assert stat.S_IMODE(os.stat(key).st_mode) & 0o077 == 0, f"{key} readable by others"
    assert subject_alt_name(out / "gpu-a" / "node.crt") == "DNS:gpu-a, IP Address:127.0.0.1"
    assert subject_alt_name(out / "gpu-c" / "node.crt") == "DNS:gpu-c, DNS:gpu-c.example"

    for (server, address), client in ((A, "gpu-b"), (B, "gpu-a")):
        got = handshake(server_context(nodes[server]), client_context(nodes[client]),
                        host=address)
        assert got.ok, got
        assert got.seen_by_server is not None and got.seen_by_client is not None
        assert names_node(got.seen_by_client, server, address)
        assert names_node(got.seen_by_server, client, "0.0.0.0")  # by name alone
    outsider = make_node_cert(tmp_path / "outsider", make_ca(tmp_path / "other"), *B)
    got = handshake(server_context(nodes["gpu-a"]), client_context(
        TlsFiles(str(outsider[0]), str(outsider[1]), nodes["gpu-b"].ca)))
    assert isinstance(got.server_error, ssl.SSLCertVerificationError), got


TLS_FOLDER = "/etc/llmgw/tls"
UNIT = Path(__file__).resolve().parent.parent / "packaging/systemd/llmgw-supervisor.service"


def delivered(text: str) -> list[str]:
    """The credential names the LoadCredential= lines in text hand the service, given a
    TLS_FOLDER holding the three files (systemd names a folder's files ID_FILENAME)."""
    names: list[str] = []
    for ident, path in re.findall(r"^LoadCredential=([^:\s]+):(\S+)$", text, re.M):
        if path.rstrip("/") == TLS_FOLDER:
            names += [f"{ident}_{name}" for name in CREDENTIAL_NAMES]
        else:
            assert path == f"{TLS_FOLDER}/{ident}", f"LoadCredential={ident}:{path}"
            names.append(ident)
    return names


@pytest.mark.parametrize("source", [DOC, UNIT], ids=["docs", "shipped unit"])
def test_loadcredential_lines_deliver_what_we_read(tmp_path: Path, source: Path) -> None:
    names = delivered(source.read_text())
    assert names, f"{source}: no LoadCredential= line"
    for start in range(0, len(names), len(CREDENTIAL_NAMES)):  # each way on its own
        creds = credentials(tmp_path / str(start), tuple(names[start:start + 3]))
        found = find_tls_files(None, None, None, credentials_dir=creds)
        assert found is not None, f"{source}: {names[start:start + 3]} not understood"
        assert Path(found.key).name.endswith("node.key")


def test_folder_credentials(tmp_path: Path) -> None:
    creds = credentials(tmp_path, tuple(f"tls_{name}" for name in CREDENTIAL_NAMES))
    assert find_tls_files(None, None, None, credentials_dir=creds) == TlsFiles(
        *(os.path.join(creds, f"tls_{name}") for name in CREDENTIAL_NAMES))
    os.unlink(os.path.join(creds, "tls_ca.crt"))
    with pytest.raises(TlsError, match=r"tls_ca\.crt missing"):
        find_tls_files(None, None, None, credentials_dir=creds)
