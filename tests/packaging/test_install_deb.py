"""The .deb installed for real with apt into a clean Debian 12 root (debootstrap,
cached under /var/cache/llmgw-test): it pulls its dependencies, renders the bundled
example, its units pass systemd-analyze verify, and removing it leaves the admin's
specs and rendered units in place."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_packages import DEB, VERSION, packages  # noqa: F401 - builds the packages

pytestmark = pytest.mark.packaging

CACHE = Path("/var/cache/llmgw-test")
BASE = CACHE / "bookworm"
MIRROR = "http://deb.debian.org/debian"
ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
       "DEBIAN_FRONTEND": "noninteractive"}


def sh(*argv: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False,
                          env=ENV)


def ok(*argv: str, timeout: float = 900) -> str:
    proc = sh(*argv, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(argv)}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def base_root() -> Path:
    """A minimal Debian 12, made once per machine (about 30 s) and reused."""
    if not (BASE / "etc" / "debian_version").exists():
        partial = CACHE / "bookworm.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.parent.mkdir(parents=True, exist_ok=True)
        ok("debootstrap", "--variant=minbase", "bookworm", str(partial), MIRROR)
        partial.rename(BASE)
    return BASE


@pytest.fixture
def root(base_root: Path, tmp_path: Path) -> Iterator[Path]:
    """A throw-away copy of the base (an overlay), with /proc and /dev, and apt's
    downloads and lists kept in the cache between runs."""
    merged, upper, work = tmp_path / "root", tmp_path / "upper", tmp_path / "work"
    for d in (merged, upper, work):
        d.mkdir()
    mounts: list[Path] = []
    try:
        ok("mount", "-t", "overlay", "overlay", "-o",
           f"lowerdir={base_root},upperdir={upper},workdir={work}", str(merged))
        mounts.append(merged)
        for sub, kind in (("proc", ["-t", "proc", "proc"]), ("dev", ["--bind", "/dev"])):
            ok("mount", *kind, str(merged / sub))
            mounts.append(merged / sub)
        for keep in ("var/cache/apt/archives", "var/lib/apt/lists"):
            cached = CACHE / "apt" / keep.replace("/", "-")
            (cached / "partial").mkdir(parents=True, exist_ok=True)
            ok("mount", "--bind", str(cached), str(merged / keep))
            mounts.append(merged / keep)
        shutil.copy("/etc/resolv.conf", merged / "etc" / "resolv.conf")
        yield merged
    finally:
        for mount in reversed(mounts):
            sh("umount", str(mount))
        leftover = [m for m in mounts if str(m) in Path("/proc/mounts").read_text()]
        assert not leftover, f"still mounted: {leftover}"


def chroot(root: Path, *argv: str, timeout: float = 900) -> str:
    return ok("chroot", str(root), *argv, timeout=timeout)


def test_install_render_verify_remove(root: Path) -> None:
    shutil.copy(DEB, root / "tmp" / DEB.name)
    chroot(root, "apt-get", "update", "-qq")
    chroot(root, "apt-get", "install", "-y", "-qq", "--no-install-recommends",
           f"/tmp/{DEB.name}")

    assert chroot(root, "llmgw-render", "--version").strip() == f"llmgw-render {VERSION}"
    example = "/usr/share/doc/llmgw-systemd/examples/replicas.yaml"
    chroot(root, "cp", example, "/etc/llmgw/replicas.d/replicas.yaml")
    out = chroot(root, "llmgw-render", "--node", "gpu-a1", "/etc/llmgw/replicas.d")
    assert "created /etc/systemd/system/llmgw-llama-70b-engine.service" in out
    rendered = sorted(p.name for p in (root / "etc/systemd/system").glob("llmgw-*"))
    assert len(rendered) == 7, rendered
    # systemd-analyze verify inside the root: empty executables stand in for the
    # engines' installations, which the example spec points at
    for exe in ("/opt/llmgw/vllm/bin/vllm", "/opt/llmgw/vllm/bin/ray",
                "/opt/llmgw/sglang/bin/python"):
        chroot(root, "install", "-D", "-m", "0755", "/dev/null", exe)
    units = [f"/etc/systemd/system/{n}" for n in rendered]
    verify = sh("chroot", str(root), "systemd-analyze", "verify", "--man=no",
                "/lib/systemd/system/llmgw-supervisor.service", *units)
    assert verify.returncode == 0 and verify.stderr.strip() == "", verify.stderr

    chroot(root, "apt-get", "remove", "-y", "-qq", "llmgw-systemd")
    assert not (root / "usr/bin/llmgw-render").exists()
    assert (root / "etc/llmgw/replicas.d/replicas.yaml").exists()  # the admin's spec
    assert sorted(p.name for p in (root / "etc/systemd/system").glob("llmgw-*")) == rendered
