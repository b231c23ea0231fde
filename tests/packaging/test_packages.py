"""The deb and rpm packages, built by packaging/build from this tree: what they hold,
what they depend on, their maintainer scripts, and lintian/rpmlint."""

from __future__ import annotations

import ast
import os
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
                "llmgw-systemd", "llmgw-systemd-generator")
# The generator is packaging/generator-launcher.in (Python -IS, the package directories
# named in it), not a console script; it stays beside llmgw-wait-for-port, which it finds
# beside its real path, and the generator directories link to it.
GENERATOR = "/usr/bin/llmgw-systemd-generator"
LAUNCHER_SHEBANG = "#!/usr/bin/python3 -IS"
# Debian 12's own generator directories (pkg-config systemd systemdsystemgeneratordir,
# systemdusergeneratordir: where the systemd package puts its generators); Fedora and
# RHEL spell both under /usr/lib (%{_systemdgeneratordir}, %{_systemdusergeneratordir}).
DEB_GENERATOR_LINKS = ("/lib/systemd/system-generators/llmgw-systemd-generator",
                       "/usr/lib/systemd/user-generators/llmgw-systemd-generator")
# the service accounts and the supervisor's one permission (docs/hardening.md)
LEAST_PRIVILEGE_FILES = ("/usr/lib/sysusers.d/llmgw-systemd.conf",
                         "/usr/share/polkit-1/rules.d/50-llmgw-supervisor.rules")
RPM_GENERATOR_LINKS = ("/usr/lib/systemd/system-generators/llmgw-systemd-generator",
                       "/usr/lib/systemd/user-generators/llmgw-systemd-generator")
# every command's man page and bash completion (scripts/manpages.py)
MAN_PAGES = (*(f"/usr/share/man/man1/{e}.1" for e in ENTRY_POINTS
               if e != "llmgw-systemd-generator"),
             "/usr/share/man/man8/llmgw-systemd-generator.8")
COMPLETIONS = tuple(f"/usr/share/bash-completion/completions/{e}" for e in ENTRY_POINTS)
# what an operator points Prometheus (and later Grafana) at (docs/monitoring.md)
MONITORING = ("/usr/share/llmgw-systemd/prometheus/llmgw-rules.yml",
              "/usr/share/llmgw-systemd/grafana/llmgw-dashboard.json",
              "/usr/lib/systemd/catalog/llmgw-systemd.catalog")


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


def deb_listing() -> dict[str, tuple[str, str | None]]:
    """Path in the .deb -> its mode string and, for a symlink, its target."""
    listing = run("dpkg-deb", "-c", str(DEB))
    assert listing.returncode == 0, listing.stderr
    entries: dict[str, tuple[str, str | None]] = {}
    for line in listing.stdout.splitlines():
        mode, _owner, _size, _date, _time, name = line.split(None, 5)
        name, _, target = name.partition(" -> ")
        entries[name.lstrip(".")] = (mode, target or None)
    return entries


def deb_files() -> list[str]:
    return list(deb_listing())


def link_target(link: str, target: str) -> str:
    """Where a symlink in a package points, as an absolute path inside the package."""
    return os.path.normpath(os.path.join(os.path.dirname(link), target))


def launcher_sitedirs(text: str, python: str, template_name: str = "generator-launcher.in"
                      ) -> list[str]:
    """The package directories a launcher names, after checking that it is its template
    (packaging/generator-launcher.in by default) with python in its shebang and nothing
    else changed."""
    lines = text.splitlines()
    assert lines and lines[0] == f"#!{python} -IS", lines[:1]
    template = (ROOT / "packaging" / template_name).read_text().splitlines()
    assert len(lines) == len(template), lines
    sitedirs: list[str] = []
    for line, want in zip(lines, template):  # the template, its placeholders filled in
        if "@SITEDIRS@" in want:
            before, after = want.split("@SITEDIRS@")
            assert line.startswith(before) and line.endswith(after), line
            sitedirs = ast.literal_eval(line[len(before):len(line) - len(after)])
            assert isinstance(sitedirs, list) and sitedirs, line
        else:
            assert line == want.replace("@PYTHON@", python), line
    return sitedirs


def check_generator(root: Path, links: tuple[str, ...], sitedirs: list[str]) -> None:
    """The generator as a package installs it under root: the launcher in /usr/bin with
    its -IS shebang and the package directories named in it, and the generator
    directories' links to it (checked by name: an absolute link would leave root)."""
    launcher = root / GENERATOR.lstrip("/")
    assert not launcher.is_symlink() and launcher.is_file()
    assert os.access(launcher, os.X_OK)
    text = launcher.read_text(encoding="utf-8")
    assert text.splitlines()[0] == LAUNCHER_SHEBANG
    assert launcher_sitedirs(text, "/usr/bin/python3") == sitedirs
    # llmgw-wait-for-port is a launcher too, exiting 0 on SIGTERM from its first line
    waiter = (root / "usr/bin/llmgw-wait-for-port").read_text(encoding="utf-8")
    assert launcher_sitedirs(waiter, "/usr/bin/python3", "wait-for-port-launcher.in") == \
        sitedirs
    for link in links:
        path = root / link.lstrip("/")
        assert path.is_symlink(), link
        assert link_target(link, os.readlink(path)) == GENERATOR, (link, os.readlink(path))


def test_deb_holds_what_it_should_and_nothing_from_the_build() -> None:
    files = deb_files()
    expected = [*(f"/usr/bin/{e}" for e in ENTRY_POINTS),
                "/lib/systemd/system/llmgw-supervisor.service",
                "/etc/llmgw/replicas.d/",
                "/usr/share/doc/llmgw-systemd/examples/replicas.yaml",
                "/usr/lib/python3/dist-packages/llmgw_systemd/cli.py",
                "/usr/lib/python3/dist-packages/llmgw_systemd/units/templates/service.j2",
                *LEAST_PRIVILEGE_FILES,
                *(f"{p}.gz" for p in MAN_PAGES), *COMPLETIONS, *MONITORING]  # dh_installman gzips
    for path in expected:
        assert path in files, path
    assert any("/llmgw_systemd/units/compiled_templates/tmpl_" in f for f in files)
    listing = deb_listing()
    assert listing["/etc/llmgw/tls/"][0] == "drwx------"  # the node's TLS key goes there
    assert listing[GENERATOR] == ("-rwxr-xr-x", None)
    for link in DEB_GENERATOR_LINKS:
        mode, target = listing[link]
        assert mode.startswith("l") and target is not None, (link, mode)
        assert link_target(link, target) == GENERATOR, (link, target)
    for path in files:
        assert not re.search(r"/(tests|bench|build|\.git|\.venv|debian)/|__pycache__|\.pyc$",
                             path), path


def test_deb_generator_is_the_launcher_and_its_links(tmp_path: Path) -> None:
    """No debhelper (dh_python3's shebang rewrite above all) has turned the launcher back
    into an ordinary script or dropped -IS; Debian's python3-yaml, -jinja2 and
    -markupsafe all live in the one directory it names."""
    extracted = run("dpkg-deb", "-x", str(DEB), str(tmp_path))
    assert extracted.returncode == 0, extracted.stderr
    check_generator(tmp_path, DEB_GENERATOR_LINKS, ["/usr/lib/python3/dist-packages"])


def test_deb_depends_on_distribution_packages() -> None:
    depends = run("dpkg-deb", "-f", str(DEB), "Depends").stdout
    for package in ("python3-jinja2", "python3-yaml", "python3-click", "python3-pydbus",
                    "python3-gi", "python3-h11", "python3-prometheus-client", "systemd",
                    "polkitd"):
        assert package in depends, depends


def test_deb_scripts_enable_but_never_start_and_restart_only_the_supervisor(
        tmp_path: Path) -> None:
    assert run("dpkg-deb", "-e", str(DEB), str(tmp_path)).returncode == 0
    postinst = (tmp_path / "postinst").read_text()
    prerm = (tmp_path / "prerm").read_text()
    assert "deb-systemd-helper enable 'llmgw-supervisor.service'" in postinst
    assert "deb-systemd-invoke try-restart llmgw-supervisor.service" in postinst
    assert "deb-systemd-invoke start" not in postinst
    # the service accounts exist before an upgrade restarts the supervisor as one
    assert "systemd-sysusers" in postinst
    assert postinst.index("systemd-sysusers") < postinst.index("try-restart"), postinst
    assert 'if [ "$1" = "remove" ]' in prerm and "stop llmgw-supervisor.service" in prerm
    for script in ("postinst", "prerm", "postrm"):
        text = (tmp_path / script).read_text()
        assert "llmgw-" not in text.replace("llmgw-supervisor", "").replace(
            "llmgw-systemd", ""), f"{script} touches something else of ours"


def test_lintian_finds_no_errors() -> None:
    lint = run("lintian", "--no-tag-display-limit", str(DEB))
    errors = [line for line in lint.stdout.splitlines() if line.startswith("E:")]
    assert errors == [], lint.stdout
    # and no warnings but /etc/llmgw/tls at 0700, on purpose: every command has its
    # man page (no no-manual-page)
    warnings = [line for line in lint.stdout.splitlines() if line.startswith("W:")
                and not line.endswith(" non-standard-dir-perm 0700 != 0755 [etc/llmgw/tls/]")]
    assert warnings == [], lint.stdout


def test_rpm_files_requirements_and_scripts(tmp_path: Path) -> None:
    files = run("rpm", "-qlp", str(RPM)).stdout.splitlines()
    for path in (*(f"/usr/bin/{e}" for e in ENTRY_POINTS), *RPM_GENERATOR_LINKS,
                 "/usr/lib/systemd/system/llmgw-supervisor.service", "/etc/llmgw/replicas.d",
                 *LEAST_PRIVILEGE_FILES, *COMPLETIONS, *MONITORING):
        assert path in files, path
    for page in MAN_PAGES:  # compressed by rpm's brp-compress where the build host has it
        assert any(f in files for f in (page, f"{page}.gz", f"{page}.xz", f"{page}.zst")), page
    assert any(f.endswith("/site-packages/llmgw_systemd/units/templates/service.j2") for f in files)
    # the pure directory the package's own modules are in, then the arch one (RHEL's and
    # Fedora's python3-pyyaml is arch-specific) of the same Python
    sitelib = next(f for f in files if re.fullmatch(r"/usr/lib/python3\.\d+/site-packages/"
                                                    r"llmgw_systemd", f)).rsplit("/", 1)[0]
    sitedirs = [sitelib, sitelib.replace("/usr/lib/", "/usr/lib64/", 1)]
    listing = run("rpm", "-qlvp", str(RPM)).stdout.splitlines()
    assert any(line.startswith("drwx------") and line.endswith(" /etc/llmgw/tls")
               for line in listing), listing
    requires = run("rpm", "-qpR", str(RPM)).stdout
    for package in ("python3-jinja2", "python3-pyyaml", "python3-click", "python3-pydbus",
                    "python3-gobject", "python3-h11", "python3-prometheus_client", "systemd",
                    "polkit"):
        assert package in requires, requires
    scripts = run("rpm", "-qp", "--scripts", str(RPM)).stdout
    assert "systemctl --no-reload preset llmgw-supervisor.service" in scripts
    assert "systemctl --no-reload disable --now llmgw-supervisor.service" in scripts
    assert "systemctl try-restart llmgw-supervisor.service" in scripts
    assert "start llmgw-supervisor" not in scripts.replace("try-restart", "")
    assert "systemd-sysusers /usr/lib/sysusers.d/llmgw-systemd.conf" in scripts
    # where every file lands, in a scratch root
    root = tmp_path / "root"
    installed = run("rpm", "-i", "--nodeps", "--noscripts", "--root", str(root), "--dbpath",
                    str(root / "var/lib/rpm"), str(RPM))
    assert installed.returncode == 0, installed.stderr
    for path in files:
        assert (root / path.lstrip("/")).exists(), path
    script = (root / "usr/bin/llmgw-render").read_text()
    assert script.startswith("#!/usr/bin/python3\n") and "render_main" in script
    check_generator(root, RPM_GENERATOR_LINKS, sitedirs)


def test_rpmlint_finds_no_errors_but_the_filtered_ones() -> None:
    lint = run("rpmlint", "-c", "packaging/rpm/rpmlint.toml", str(RPM))
    assert " 0 errors," in lint.stdout, lint.stdout
