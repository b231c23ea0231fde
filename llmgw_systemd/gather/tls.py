"""TLS between peer supervisors: which files, the two SSL contexts, who the peer is.

Every node's supervisor is both a server (peers fetch its shard reports) and a client (it
fetches theirs), so each node holds one certificate, usable for both (extendedKeyUsage
serverAuth and clientAuth), signed by one cluster CA that every node trusts and nothing
else. The server requires a client certificate; the client dials the peer's address and
checks that the server's certificate names that address. See docs/tls.md.

The files come from explicit paths in the supervisor's configuration or, under the
shipped unit, from systemd's credentials (LoadCredential=) in $CREDENTIALS_DIRECTORY.
Nothing is read until a context is built; every error names the file and what is wrong.
Certificate lifetimes are left to OpenSSL, which checks them during each handshake.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn, Union

from llmgw_systemd.errors import TlsError

# Under $CREDENTIALS_DIRECTORY: one LoadCredential= per file (LoadCredential=node.crt:PATH)
# delivers these names; the shipped unit's LoadCredential=tls:/etc/llmgw/tls, which loads
# every file of the folder, delivers them prefixed with "tls_" (tls_node.crt, ...).
CREDENTIAL_NAMES = ("node.crt", "node.key", "ca.crt")
CREDENTIAL_FOLDER_ID = "tls"
_LAYOUTS = (CREDENTIAL_NAMES, tuple(f"{CREDENTIAL_FOLDER_ID}_{n}" for n in CREDENTIAL_NAMES))
_ROLES = ("cert", "key", "ca")

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]


@dataclass(frozen=True)
class TlsFiles:
    """Paths of this node's TLS material."""

    cert: str  # PEM, this node's certificate (may be followed by intermediates)
    key: str   # PEM private key of that certificate, unencrypted
    ca: str    # PEM, the cluster CA that signs every node's certificate


def find_tls_files(cert: str | None, key: str | None, ca: str | None, *,
                   credentials_dir: str | None) -> TlsFiles | None:
    """The TLS files to use, or None for plain HTTP.

    Explicit paths win, all three or none (None and "" both mean not given). Otherwise,
    when credentials_dir (the caller passes os.environ.get("CREDENTIALS_DIRECTORY"))
    holds all of CREDENTIAL_NAMES, those; else all of them prefixed "tls_" (the shipped
    unit's folder credential), those. A credentials directory holding some of a set but
    not all is an error too, never a silent fall-back to plain HTTP. Nothing is opened
    here beyond looking the names up.
    """
    given = dict(zip(_ROLES, (cert, key, ca)))
    if any(given.values()):
        missing = [role for role, path in given.items() if not path]
        if missing:
            present = ", ".join(role for role, path in given.items() if path)
            raise TlsError(f"incomplete TLS configuration: {present} given but "
                           f"{_and(missing)} missing (give all three of cert, key, ca, "
                           "or none)")
        return TlsFiles(cert=str(cert), key=str(key), ca=str(ca))
    if not credentials_dir:
        return None
    partial: list[str] = []
    for names in _LAYOUTS:
        paths = [os.path.join(credentials_dir, name) for name in names]
        found = [os.path.exists(path) for path in paths]
        if all(found):
            return TlsFiles(*paths)
        if any(found):
            partial = partial or [name for name, there in zip(names, found) if not there]
    if partial:
        raise TlsError(f"{credentials_dir}: incomplete TLS credentials: {_and(partial)} "
                       f"missing (need {_and(list(CREDENTIAL_NAMES))} together, or none)")
    return None


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """Serves with this node's certificate; only clients with a CA-signed certificate
    (extendedKeyUsage clientAuth, or none) complete the handshake."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _configure(ctx, files)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(files: TlsFiles) -> ssl.SSLContext:
    """Presents this node's certificate; accepts only a server whose certificate the
    cluster CA signed and names the host dialed (pass server_hostname=<the address>)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    _configure(ctx, files)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.check_hostname = True
    return ctx


def identities(peer_cert: dict[str, Any]) -> frozenset[str]:
    """The names a verified peer certificate (SSLSocket.getpeercert()) carries in its
    subjectAltName: DNS names lower-cased without a trailing dot, IP addresses in
    ipaddress's canonical form. The subject's common name never counts. For logs and
    reports; decide with names_node, which keeps DNS names and addresses apart."""
    dns, ips = _san(peer_cert)
    return frozenset(dns) | frozenset(str(ip) for ip in ips)


def names_node(peer_cert: dict[str, Any], name: str, address: str) -> bool:
    """Whether the certificate's subjectAltName names this node: a DNS entry equal to its
    name, or its address (an IP address matches IP entries only, a host name DNS entries
    only). Entries are compared literally: a wildcard names no node."""
    dns, ips = _san(peer_cert)
    if _dns_name(name) in dns:
        return True
    ip = _ip(address)
    return ip in ips if ip is not None else _dns_name(address) in dns


# -- internals --------------------------------------------------------------------------


def _configure(ctx: ssl.SSLContext, files: TlsFiles) -> None:
    """What both sides share: TLS 1.2 or later, this node's chain, only the cluster CA."""
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    for path in (files.cert, files.key, files.ca):
        _readable(path)
    _check_certificates(files.cert, "certificate")
    try:
        ctx.load_cert_chain(files.cert, files.key, password=_encrypted(files.key))
    except ssl.SSLError as e:
        if e.reason == "KEY_VALUES_MISMATCH":
            raise TlsError(f"{files.key}: private key does not match the certificate in "
                           f"{files.cert}") from e
        _fail(files.key, "not a usable PEM private key", e)
    except OSError as e:
        _fail(files.key, "cannot load the private key", e)
    try:
        ctx.load_verify_locations(cafile=files.ca)
    except (ssl.SSLError, OSError) as e:
        _fail(files.ca, "not a usable PEM CA certificate", e)
    if not ctx.cert_store_stats().get("x509_ca"):
        raise TlsError(f"{files.ca}: holds no CA certificate (none has basicConstraints "
                       "CA:TRUE); it must be the cluster CA, not a node's certificate")


def _readable(path: str) -> None:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise TlsError(f"{path}: cannot read: {e.strerror or e}") from e


def _check_certificates(path: str, what: str) -> None:
    """The file parses as PEM certificates (a scratch store, to blame the right file:
    load_cert_chain's errors do not say whether the certificate or the key failed)."""
    scratch = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        scratch.load_verify_locations(cafile=path)
    except (ssl.SSLError, OSError) as e:
        _fail(path, f"not a usable PEM {what}", e)


def _encrypted(path: str) -> Callable[[], bytes]:
    """A password callback that refuses: a daemon has nobody to type a passphrase, and
    without a callback OpenSSL would prompt on the terminal."""
    def refuse() -> NoReturn:
        raise TlsError(f"{path}: private key is encrypted; the supervisor needs it "
                       "unencrypted (protect it by file mode 0600 instead)")
    return refuse


def _fail(path: str, what: str, error: Exception) -> NoReturn:
    raise TlsError(f"{path}: {what} ({_detail(error)})") from error


def _detail(error: Exception) -> str:
    """OpenSSL's reason in words ("no certificate or crl found"), without _ssl.c lines."""
    if isinstance(error, ssl.SSLError):
        return error.reason.replace("_", " ").lower() if error.reason else "malformed PEM data"
    if isinstance(error, OSError):
        return error.strerror or str(error)
    return str(error)


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _entries(peer_cert: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for entry in peer_cert.get("subjectAltName", ()):
        if isinstance(entry, tuple) and len(entry) == 2:
            kind, value = entry
            if isinstance(kind, str) and isinstance(value, str):
                yield kind, value


def _san(peer_cert: dict[str, Any]) -> tuple[set[str], set[IPAddress]]:
    dns: set[str] = set()
    ips: set[IPAddress] = set()
    for kind, value in _entries(peer_cert):
        if kind == "DNS" and _dns_name(value):
            dns.add(_dns_name(value))
        elif kind == "IP Address":
            ip = _ip(value)
            if ip is not None:
                ips.add(ip)
    return dns, ips


def _dns_name(text: str) -> str:
    return text.strip().rstrip(".").lower()


def _ip(text: str) -> IPAddress | None:
    """ipaddress form, without an IPv6 zone (a certificate never carries one)."""
    try:
        return ipaddress.ip_address(text.strip().split("%", 1)[0])
    except ValueError:
        return None
