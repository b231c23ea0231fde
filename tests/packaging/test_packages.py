"""The deb and rpm packages, built by packaging/build from this tree: what they hold,
what they depend on, their maintainer scripts, and lintian/rpmlint."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.packaging

ROOT = Path(__file__).resolve().parents[2]
VERSION = re.search(r'__version__ = "([^"]+)"',
                    (ROOT / "llmgw_systemd" / "__init__.py").read_text())[1]  # type: ignore[index]
DEB = ROOT / "dist" / f"llmgw-systemd_{VERSION}_all.deb"
RPM = ROOT / "dist" / f"llmgw-systemd-{VERSION}-1.noarch.rpm"
CLEAN_PATH = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
ENTRY_POINTS = ("llmgw-render", "llmgw-wait-for-port", "llmgw-stop-group", "llmgw-supervisor",
                "llmgw-systemd")


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False,
                          env=CLEAN_PATH, cwd=ROOT)


@pytest.fixture(scope="module", autouse=True)
def packages() -> Iterator[None]:
    for old in (DEB, RPM):
        old.unlink(missing_ok=True)
    built = run("bash", "packaging/build")
    assert built.returncode == 0, built.stdout + built.stderr
    assert DEB.exists() and RPM.exists()
    yield


def deb_files() -> list[str]:
    listing = run("dpkg-deb", "-c", str(DEB))
    assert listing.returncode == 0, listing.stderr
    return [line.split()[-1].lstrip(".") for line in listing.stdout.splitlines()]


def test_deb_holds_what_it_should_and_nothing_from_the_build() -> None:
    files = deb_files()
    expected = [*(f"/usr/bin/{e}" for e in ENTRY_POINTS),
                "/lib/systemd/system/llmgw-supervisor.service",
                "/etc/llmgw/replicas.d/",
                "/usr/share/doc/llmgw-systemd/examples/replicas.yaml",
                "/usr/lib/python3/dist-packages/llmgw_systemd/cli.py",
                "/usr/lib/python3/dist-packages/llmgw_systemd/templates/service.j2"]
    for path in expected:
        assert path in files, path
    assert any("/llmgw_systemd/compiled_templates/tmpl_" in f for f in files)
    modes = {line.split()[-1].lstrip("."): line.split()[0]
             for line in run("dpkg-deb", "-c", str(DEB)).stdout.splitlines()}
    assert modes["/etc/llmgw/tls/"] == "drwx------"  # the node's TLS key goes there
    for path in files:
        assert not re.search(r"/(tests|bench|build|\.git|\.venv|debian)/|__pycache__|\.pyc$",
                             path), path


def test_deb_depends_on_distribution_packages() -> None:
    depends = run("dpkg-deb", "-f", str(DEB), "Depends").stdout
    for package in ("python3-jinja2", "python3-yaml", "python3-click", "python3-pydbus",
                    "python3-gi", "python3-h11", "python3-prometheus-client", "systemd"):
        assert package in depends, depends


def test_deb_scripts_enable_but_never_start_and_restart_only_the_supervisor(
        tmp_path: Path) -> None:
    assert run("dpkg-deb", "-e", str(DEB), str(tmp_path)).returncode == 0
    postinst = (tmp_path / "postinst").read_text()
    prerm = (tmp_path / "prerm").read_text()
    assert "deb-systemd-helper enable 'llmgw-supervisor.service'" in postinst
    assert "deb-systemd-invoke try-restart llmgw-supervisor.service" in postinst
    assert "deb-systemd-invoke start" not in postinst
    assert 'if [ "$1" = "remove" ]' in prerm and "stop llmgw-supervisor.service" in prerm
    for script in ("postinst", "prerm", "postrm"):
        text = (tmp_path / script).read_text()
        assert "llmgw-" not in text.replace("llmgw-supervisor", "").replace(
            "llmgw-systemd", ""), f"{script} touches something else of ours"


def test_lintian_finds_no_errors() -> None:
    lint = run("lintian", "--no-tag-display-limit", str(DEB))
    errors = [line for line in lint.stdout.splitlines() if line.startswith("E:")]
    assert errors == [], lint.stdout


def test_rpm_files_requirements_and_scripts(tmp_path: Path) -> None:
    files = run("rpm", "-qlp", str(RPM)).stdout.splitlines()
    for path in (*(f"/usr/bin/{e}" for e in ENTRY_POINTS),
                 "/usr/lib/systemd/system/llmgw-supervisor.service", "/etc/llmgw/replicas.d"):
        assert path in files, path
    assert any(f.endswith("/site-packages/llmgw_systemd/templates/service.j2") for f in files)
    listing = run("rpm", "-qlvp", str(RPM)).stdout.splitlines()
    assert any(line.startswith("drwx------") and line.endswith(" /etc/llmgw/tls")
               for line in listing), listing
    requires = run("rpm", "-qpR", str(RPM)).stdout
    for package in ("python3-jinja2", "python3-pyyaml", "python3-click", "python3-pydbus",
                    "python3-gobject", "python3-h11", "python3-prometheus_client", "systemd"):
        assert package in requires, requires
    scripts = run("rpm", "-qp", "--scripts", str(RPM)).stdout
    assert "systemctl --no-reload preset llmgw-supervisor.service" in scripts
    assert "systemctl --no-reload disable --now llmgw-supervisor.service" in scripts
    assert "systemctl try-restart llmgw-supervisor.service" in scripts
    assert "start llmgw-supervisor" not in scripts.replace("try-restart", "")
    # where every file lands, in a scratch root
    root = tmp_path / "root"
    installed = run("rpm", "-i", "--nodeps", "--noscripts", "--root", str(root), "--dbpath",
                    str(root / "var/lib/rpm"), str(RPM))
    assert installed.returncode == 0, installed.stderr
    for path in files:
        assert (root / path.lstrip("/")).exists(), path
    script = (root / "usr/bin/llmgw-render").read_text()
    assert script.startswith("#!/usr/bin/python3\n") and "render_main" in script


def test_rpmlint_finds_no_errors_but_the_filtered_ones() -> None:
    lint = run("rpmlint", "-c", "packaging/rpm/rpmlint.toml", str(RPM))
    assert " 0 errors," in lint.stdout, lint.stdout
