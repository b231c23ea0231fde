"""Certificates for tests: a cluster CA and node certificates like docs/tls.md makes.

Only tests import this (the product never needs the cryptography package). EC P-256 keys,
SHA-256 signatures; private keys are written with mode 0600. cluster() lays each node's
files out as a credentials directory (DIR/NODE/node.crt, node.key, ca.crt), so a test can
point $CREDENTIALS_DIRECTORY at it.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw_systemd.gather.tls import CREDENTIAL_NAMES, TlsFiles

__all__ = ["cluster", "make_ca", "make_node_cert"]

CERT, KEY, CA = CREDENTIAL_NAMES


def make_ca(directory: Path, name: str = "llmgw test CA") -> tuple[Path, Path]:
    """A self-signed CA, valid for ten years from a day ago: (DIR/ca.crt, DIR/ca.key)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    cert = (x509.CertificateBuilder()
            .subject_name(subject).issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(_key_usage(ca=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    return _write_cert(directory / "ca.crt", cert), _write_key(directory / "ca.key", key)


def make_node_cert(directory: Path, ca: tuple[Path, Path], node: str, address: str, *,
                   days: int = 30, expired: bool = False, client: bool = True,
                   server: bool = True) -> tuple[Path, Path]:
    """A node's certificate signed by ca (its (crt, key) paths): CN and DNS SAN the node's
    name, an IP SAN its address (a DNS SAN if the address is a host name), extendedKeyUsage
    clientAuth and/or serverAuth (neither: only codeSigning, a certificate for something
    else). Valid from a day ago for `days`; expired: from ten days ago to yesterday.
    Writes (DIR/node.crt, DIR/node.key)."""
    ca_cert = x509.load_pem_x509_certificate(ca[0].read_bytes())
    ca_key = serialization.load_pem_private_key(ca[1].read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError(f"{ca[1]}: expected an EC private key")
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    start, end = ((now - datetime.timedelta(days=10), now - datetime.timedelta(days=1))
                  if expired else (now - datetime.timedelta(days=1),
                                   now + datetime.timedelta(days=days)))
    usages = ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else []) + (
        [ExtendedKeyUsageOID.SERVER_AUTH] if server else [])
    ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(_san(node, address)), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages or [ExtendedKeyUsageOID.CODE_SIGNING]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(ca=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    return _write_cert(directory / CERT, cert), _write_key(directory / KEY, key)


def cluster(directory: Path, nodes: Sequence[tuple[str, str]]) -> dict[str, TlsFiles]:
    """One CA (DIR/ca.crt, DIR/ca.key) and, per (name, address), a credentials directory
    DIR/NAME holding node.crt, node.key and a copy of ca.crt. TlsFiles by node name."""
    ca = make_ca(directory)
    files: dict[str, TlsFiles] = {}
    for name, address in nodes:
        node_dir = directory / name
        crt, key = make_node_cert(node_dir, ca, name, address)
        ca_copy = Path(shutil.copyfile(ca[0], node_dir / CA))
        files[name] = TlsFiles(cert=str(crt), key=str(key), ca=str(ca_copy))
    return files


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _san(node: str, address: str) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.DNSName(node)]
    try:
        names.append(x509.IPAddress(ipaddress.ip_address(address)))
    except ValueError:
        if address != node:
            names.append(x509.DNSName(address))
    return names


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=True, content_commitment=False,
                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                         key_cert_sign=ca, crl_sign=ca, encipher_only=False,
                         decipher_only=False)


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> Path:
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)  # an existing file keeps its mode through O_CREAT
        f.write(data)
    return path


# -- the openssl recipe in docs/tls.md, run as an operator would -------------------------

DOC = Path(__file__).resolve().parents[2] / "docs" / "tls.md"
RECIPE_MARKER = "<!-- recipe: tls -->"


def recipe() -> str:
    text = DOC.read_text()
    assert text.count(RECIPE_MARKER) == 1, f"{DOC}: want exactly one {RECIPE_MARKER}"
    block = re.match(r"\s*```sh\n(.*?)^```", text.split(RECIPE_MARKER, 1)[1], re.S | re.M)
    assert block, f"{DOC}: no ```sh block right after {RECIPE_MARKER}"
    return block.group(1)


def run_recipe(workdir: Path, out: Path, name: str, address: str,
               interpreter: str = "bash") -> None:
    script = workdir / "recipe.sh"
    script.write_text(recipe())
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(workdir),
           "NODE_NAME": name, "NODE_ADDR": address, "DIR": str(out)}
    proc = subprocess.run([interpreter, str(script)], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=30, check=False, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"recipe for {name} failed:\n{proc.stdout}{proc.stderr}"
