"""The README's first command as a new user runs it (issue 35): `bash scripts/demo`, as
root, in a pristine Debian 12 - a throw-away overlay of the packaging tier's cached
minimal bookworm (debootstrap), which has no Python at all, so none of the Debian
packages the test machines carry (python3-h11, python3-prometheus-client, ...) can stand
in for a dependency the wheel forgot, as they do for the test machines' .venv
(--system-site-packages). The checkout is this one's files (tracked, or new and not
ignored: what a commit of the working tree would hold) at this checkout's own path, so
the units name the same paths; apt gets this machine's apt sources and pip its pip
configuration, copied at run time. The demo must exit 0 and leave in ./units exactly
the units this checkout's installed llmgw-render makes, and show them.

About 30-40 s here, apt's downloads cached or not (apt-get 17 s, the venv 3 s, pip 8 s);
on a fresh machine debootstrap adds about 40 s, once for the whole packaging tier."""

from __future__ import annotations

import configparser
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from debianroot import base_root, chroot_mounts, host_apt_sources, ok, overlay, sh

pytestmark = pytest.mark.packaging

ROOT = Path(__file__).resolve().parents[2]
NODE, SPEC = "gpu-a1", "examples/replicas.yaml"
# Nothing of Python before the demo: every module it needs comes from what scripts/setup
# installs (apt) or pip puts in .venv, none from the test machines' extra packages.
ABSENT_BEFORE = ("python3", "python3-minimal", "python3-venv", "python3-pip", "python3-h11",
                 "python3-prometheus-client", "python3-pydbus", "python3-gi",
                 "python3-jinja2", "python3-yaml", "python3-click", "python3-hatchling",
                 "python3-cryptography")
DEMO_TIMEOUT = 1500  # s; a fresh machine's whole CI has 45 minutes
# Where the host's pip certificate bundle goes in the root: not its own path, which the
# root's ca-certificates package (pulled in by python3-pip) rewrites.
CERT_INSIDE = "/etc/llmgw-test-pip-cert.pem"
PROXY_VARS = ("http_proxy", "https_proxy", "no_proxy", "all_proxy",
              "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY")


def installed_packages(root: Path) -> set[str]:
    """The packages dpkg has installed in root, from its status file."""
    names, name = set(), ""
    for line in (root / "var/lib/dpkg/status").read_text(encoding="utf-8").splitlines():
        if line.startswith("Package: "):
            name = line.split(": ", 1)[1]
        elif line.startswith("Status: ") and line.endswith(" installed"):
            names.add(name)
    return names


def checkout_files() -> list[str]:
    """This checkout's files as a commit of its working tree would hold them: tracked (as
    they are now) and new ones not ignored; not .venv, dist or units."""
    out = ok("git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others",
             "--exclude-standard")
    return sorted({f for f in out.split("\0") if f and os.path.lexists(ROOT / f)})


def copy_checkout(root: Path) -> Path:
    """The checkout's files into root at the checkout's own path."""
    inside = root / str(ROOT).lstrip("/")
    inside.mkdir(parents=True)
    listing = "\0".join(checkout_files()) + "\0"
    pack = subprocess.run(["tar", "-C", str(ROOT), "--null", "-T", "-", "-cf", "-"],
                          input=listing.encode(), capture_output=True, check=False)
    assert pack.returncode == 0, pack.stderr.decode()
    unpack = subprocess.run(["tar", "-C", str(inside), "-xf", "-"], input=pack.stdout,
                            capture_output=True, check=False)
    assert unpack.returncode == 0, unpack.stderr.decode()
    return inside


def pip_config_files() -> list[tuple[Path, str]]:
    """(host path, path in the root) of every pip configuration file pip reads here, as
    root: global (/etc/xdg/pip, /etc/pip.conf), the user's (mapped to the root's /root),
    $PIP_CONFIG_FILE."""
    home = Path(os.environ.get("HOME", "/root"))
    xdg_home = Path(os.environ.get("XDG_CONFIG_HOME", home / ".config"))
    found: list[tuple[Path, str]] = []
    for folder in os.environ.get("XDG_CONFIG_DIRS", "/etc/xdg").split(":"):
        found.append((Path(folder) / "pip" / "pip.conf", f"{folder}/pip/pip.conf"))
    found.append((Path("/etc/pip.conf"), "/etc/pip.conf"))
    for path in (home / ".pip" / "pip.conf", xdg_home / "pip" / "pip.conf"):
        with contextlib.suppress(ValueError):
            found.append((path, "/root/" + str(path.relative_to(home))))
    if os.environ.get("PIP_CONFIG_FILE"):
        found.append((Path(os.environ["PIP_CONFIG_FILE"]), os.environ["PIP_CONFIG_FILE"]))
    return [(host, inside) for host, inside in found if host.is_file()]


def local_paths(key: str, value: str) -> list[Path]:
    """The local files and folders a pip setting names (find-links, file:// indexes,
    constraints). A local index's folder comes with its parent, where the files its
    pages link to usually lie (simple/NAME/index.html -> ../../files/...)."""
    paths = []
    for word in value.split():
        path = Path(unquote(urlparse(word).path)) if word.startswith("file:") else Path(word)
        if not (path.is_absolute() and path.exists()):
            continue
        if key in ("index-url", "extra-index-url") and path.is_dir():
            path = path.parent
        paths.append(path)
    return paths


@contextlib.contextmanager
def host_pip_config(root: Path) -> Iterator[dict[str, str]]:
    """This machine's pip configuration in root for the run: its files copied, the
    folders they and the PIP_* variables name bound read-only at their own paths, the
    files copied; yields the PIP_* (and proxy) variables to run with. Unbound afterwards."""
    env = {k: v for k, v in os.environ.items() if k.startswith("PIP_") or k in PROXY_VARS}
    values: list[tuple[str, str]] = [(k[4:].lower().replace("_", "-"), v)
                                     for k, v in env.items() if k.startswith("PIP_")]
    cert = env.get("PIP_CERT")
    for host, inside in pip_config_files():
        target = root / inside.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(host, target)
        parser = configparser.RawConfigParser(strict=False)
        parser.read(host, encoding="utf-8")
        for section in parser.sections():
            values.extend(parser.items(section))
            cert = cert or parser.get(section, "cert", fallback=None)
    if cert:  # the bundle as it is here (it may hold a proxy's CA the root lacks)
        shutil.copy(cert, root / CERT_INSIDE.lstrip("/"))
        env["PIP_CERT"] = CERT_INSIDE
    binds: list[Path] = []
    try:
        for key, value in values:
            if key == "cert":
                continue
            for path in local_paths(key, value):
                target = root / str(path).lstrip("/")
                if path.is_file():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(path, target)
                elif path != Path("/") and target not in binds:
                    target.mkdir(parents=True, exist_ok=True)
                    ok("mount", "--bind", "-o", "ro", str(path), str(target))
                    binds.append(target)
        yield env
    finally:
        for target in reversed(binds):
            sh("umount", str(target))
        left = [b for b in binds if f" {b} " in Path("/proc/mounts").read_text()]
        assert not left, f"still mounted: {left}"


def run_timed(argv: list[str], env: dict[str, str], timeout: float
              ) -> tuple[int, list[tuple[float, str]]]:
    """argv's exit status and its output (stdout and stderr), each line with the seconds
    since the start; its whole process group killed at the timeout."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    timer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
    timer.start()
    lines: list[tuple[float, str]] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic() - start, line.rstrip("\n")))
        status = proc.wait()
    finally:
        timer.cancel()
    lines.append((time.monotonic() - start, f"(exit {status})"))
    return status, lines


def test_demo_on_a_pristine_debian12(tmp_path: Path) -> None:
    assert os.geteuid() == 0, "the pristine-root harness needs root (mounts, chroot)"
    times: dict[str, float] = {}
    start = time.monotonic()
    lower = base_root()
    times["base root"] = time.monotonic() - start
    with overlay(lower, tmp_path / "overlay") as (root, _), \
            chroot_mounts(root, apt_cache="apt-pristine"):
        host_apt_sources(root)
        missing = sorted(set(ABSENT_BEFORE) & installed_packages(root))
        assert not missing, f"not a pristine root: {missing} installed before the demo"
        assert not (root / "usr/bin/python3").exists()
        repo = copy_checkout(root)
        for made in (".venv", "units", "dist"):
            assert not (repo / made).exists(), f"{made} copied into the pristine checkout"
        with host_pip_config(root) as pip_env:
            env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                   "HOME": "/root", "LANG": "C.UTF-8", **pip_env}
            mark = time.monotonic()
            status, lines = run_timed(
                ["chroot", str(root), "bash", "-c",
                 f"cd {shlex.quote(str(ROOT))} && exec bash scripts/demo"], env, DEMO_TIMEOUT)
            times["demo"] = time.monotonic() - mark
        output = "\n".join(line for _, line in lines)
        shown = next((k for k, (_, line) in enumerate(lines) if line.startswith("----- ")),
                     len(lines) - 1)
        timeline = "\n".join(f"{t:7.1f}s  {line}" for t, line in [*lines[:shown], lines[-1]])
        print(f"timings (s): {times}\nthe demo's output up to the units it shows:\n{timeline}")
        assert status == 0, f"bash scripts/demo exited {status} on a pristine Debian 12:\n" \
                            f"{output[-6000:]}"
        units = {p.name: p.read_bytes() for p in sorted((repo / "units").iterdir())}

    expected_dir = tmp_path / "expected"
    rendered = subprocess.run([str(ROOT / ".venv/bin/llmgw-render"), "--node", NODE,
                               "--output", str(expected_dir), SPEC], cwd=ROOT,
                              capture_output=True, text=True, timeout=120, check=False)
    assert rendered.returncode == 0, rendered.stdout + rendered.stderr
    expected = {p.name: p.read_bytes() for p in sorted(expected_dir.iterdir())}
    assert sorted(units) == sorted(expected)
    for name, text in expected.items():
        assert units[name] == text, f"units/{name} differs from the installed llmgw-render's"
        # and the demo showed it
        assert f"----- units/{name}\n{text.decode()}" in output + "\n", name
