"""Debian 12 roots for the packaging and booted tiers: a minimal bookworm made once per
machine with debootstrap (from this machine's own mirror) and cached, roots derived from
it (a node image with systemd), and throw-away overlays of either."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from aptsources import APT, debian_mirror

CACHE = Path("/var/cache/llmgw-test")
BASE = CACHE / "bookworm"
ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
       "DEBIAN_FRONTEND": "noninteractive"}


def sh(*argv: str, timeout: float = 900, env: dict[str, str] | None = None
       ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False,
                          env=env or ENV)


def ok(*argv: str, timeout: float = 900) -> str:
    proc = sh(*argv, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(argv)}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def base_root() -> Path:
    """A minimal Debian 12, made once per machine (about 30 s) and reused."""
    if not (BASE / "etc" / "debian_version").exists():
        partial = CACHE / "bookworm.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.parent.mkdir(parents=True, exist_ok=True)
        ok("debootstrap", "--variant=minbase", "bookworm", str(partial), debian_mirror())
        partial.rename(BASE)
    return BASE


@contextlib.contextmanager
def chroot_mounts(root: Path, apt_cache: str = "apt") -> Iterator[None]:
    """/proc, /dev and apt's downloads and lists (kept in the cache between runs, under
    CACHE/apt_cache: a root with other apt sources keeps its own, so that neither's
    apt-get update rewrites the other's lists nor waits on its locks) inside root, for
    apt-get in a chroot; all unmounted afterwards, checked."""
    mounts: list[Path] = []
    try:
        for sub, kind in (("proc", ["-t", "proc", "proc"]), ("dev", ["--bind", "/dev"])):
            ok("mount", *kind, str(root / sub))
            mounts.append(root / sub)
        for keep in ("var/cache/apt/archives", "var/lib/apt/lists"):
            cached = CACHE / apt_cache / keep.replace("/", "-")
            (cached / "partial").mkdir(parents=True, exist_ok=True)
            ok("mount", "--bind", str(cached), str(root / keep))
            mounts.append(root / keep)
        shutil.copy("/etc/resolv.conf", root / "etc" / "resolv.conf")
        yield
    finally:
        for mount in reversed(mounts):
            sh("umount", str(mount))
        left = [m for m in mounts if f" {m} " in Path("/proc/mounts").read_text()]
        assert not left, f"still mounted: {left}"


def host_apt_sources(root: Path, apt: Path = APT) -> None:
    """This machine's apt sources in place of root's (debootstrap's one line for the base
    suite): its sources.list and sources.list.d/*.list, *.sources, copied as they are at
    run time (no mirror is written in the repo), and the keyrings they name (Signed-By)
    that root lacks."""
    target = root / "etc" / "apt"
    (target / "sources.list").unlink(missing_ok=True)
    for old in (target / "sources.list.d").glob("*"):
        old.unlink()
    sources = [p for p in [apt / "sources.list", *sorted((apt / "sources.list.d").glob("*"))]
               if p.is_file() and (p.name == "sources.list" or p.suffix in (".list", ".sources"))]
    assert sources, f"no apt sources in {apt}"
    for path in sources:
        shutil.copy(path, target / path.relative_to(apt))
        for key in re.findall(r"(?im)signed-by\s*[:=]\s*(/[^\s\]]+)",
                              path.read_text(encoding="utf-8")):
            inside = root / key.lstrip("/")
            if Path(key).is_file() and not inside.exists():
                inside.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(key, inside)


def derived_root(name: str, packages: Sequence[str], setup: Sequence[Sequence[str]] = ()
                 ) -> Path:
    """The base root plus these Debian packages (and setup commands run in it), made once
    per machine and per list, under the cache."""
    stamp = "\n".join([*packages, *(" ".join(c) for c in setup)]) + "\n"
    root = CACHE / name
    if (root / ".llmgw-complete").exists() and \
            (root / ".llmgw-complete").read_text(encoding="utf-8") == stamp:
        return root
    base = base_root()
    partial = CACHE / f"{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    ok("cp", "-a", str(base), str(partial))
    with chroot_mounts(partial):
        ok("chroot", str(partial), "apt-get", "update", "-qq")
        ok("chroot", str(partial), "apt-get", "install", "-y", "-qq",
           "--no-install-recommends", *packages, timeout=1800)
        for command in setup:
            ok("chroot", str(partial), *command)
    (partial / ".llmgw-complete").write_text(stamp, encoding="utf-8")
    partial.rename(root)
    return root


@contextlib.contextmanager
def overlay(lower: Path, scratch: Path) -> Iterator[tuple[Path, Path]]:
    """A writable throw-away view of lower: (the merged root, its upper layer)."""
    merged, upper, work = scratch / "root", scratch / "upper", scratch / "work"
    for d in (merged, upper, work):
        d.mkdir(parents=True)
    ok("mount", "-t", "overlay", "overlay", "-o",
       f"lowerdir={lower},upperdir={upper},workdir={work}", str(merged))
    try:
        yield merged, upper
    finally:
        sh("umount", str(merged))
        assert f" {merged} " not in Path("/proc/mounts").read_text(), f"{merged} mounted"
