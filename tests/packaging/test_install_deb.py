"""The .deb installed for real with apt into a clean Debian 12 root (debootstrap,
cached under /var/cache/llmgw-test): it pulls its dependencies, renders the bundled
example, its units pass systemd-analyze verify, and removing it leaves the admin's
specs and rendered units in place. Its generator runs there as systemd runs it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from debianroot import base_root, chroot_mounts, ok, overlay, sh
from test_packages import (  # noqa: F401 - packages builds them
    DEB,
    DEB_GENERATOR_LINKS,
    VERSION,
    packages,
)

pytestmark = pytest.mark.packaging

EXAMPLE = "/usr/share/doc/llmgw-systemd/examples/replicas.yaml"


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    """A throw-away copy (an overlay) of the cached minimal Debian 12, with /proc, /dev
    and apt's downloads and lists kept in the cache between runs."""
    with overlay(base_root(), tmp_path) as (merged, _), chroot_mounts(merged):
        yield merged


def chroot(root: Path, *argv: str, timeout: float = 900) -> str:
    return ok("chroot", str(root), *argv, timeout=timeout)


def install(root: Path) -> None:
    shutil.copy(DEB, root / "tmp" / DEB.name)
    chroot(root, "apt-get", "update", "-qq")
    chroot(root, "apt-get", "install", "-y", "-qq", "--no-install-recommends",
           f"/tmp/{DEB.name}")
    (root / "tmp" / DEB.name).unlink()


def test_install_render_verify_remove(root: Path) -> None:
    install(root)

    assert chroot(root, "llmgw-render", "--version").strip() == f"llmgw-render {VERSION}"
    chroot(root, "cp", EXAMPLE, "/etc/llmgw/replicas.d/replicas.yaml")
    out = chroot(root, "llmgw-render", "--node", "gpu-a1", "/etc/llmgw/replicas.d")
    assert "created /etc/systemd/system/llmgw-llama-70b-engine.service" in out
    rendered = sorted(p.name for p in (root / "etc/systemd/system").glob("llmgw-*"))
    assert len(rendered) == 9, rendered  # 2 replicas: target, restart, relaunch, members
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


# Runs GEN OUT OUT.early OUT.late chrooted into ROOT as systemd runs a system generator:
# SYSTEMD_SCOPE=system, an otherwise empty environment, no terminal. Its stderr is not the
# journal's, so it would log to /dev/kmsg: the file KMSG stands in for it, bound there in
# this private mount namespace only (root/dev is the host's /dev).
#   unshare -m --propagation private sh -c RUN_GENERATOR sh KMSG ROOT GEN OUT
RUN_GENERATOR = """set -eu
kmsg=$1 root=$2 gen=$3 out=$4
mount -n --bind "$kmsg" "$root/dev/kmsg"
exec chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin SYSTEMD_SCOPE=system \\
    "$gen" "$out" "$out.early" "$out.late" </dev/null
"""


def written(upper: Path) -> set[str]:
    """The files (not directories) the overlay's upper layer holds: what the root's
    processes have written since it was made."""
    return {"/" + str(p.relative_to(upper)) for p in upper.rglob("*")
            if p.is_symlink() or not p.is_dir()}


def test_generator_runs_from_its_system_generators_link(root: Path, tmp_path: Path) -> None:
    """The installed generator, run through its link in the system generator directory
    on the example spec and a node file naming gpu-a1: this node's units, with the
    packaged llmgw-wait-for-port (found beside the link's target) in their waits;
    silent; nothing written but its output and its cache. A second run (the cache's fast
    path, as at a daemon-reload) gives the same units."""
    install(root)
    link = next(p for p in DEB_GENERATOR_LINKS if "/system-generators/" in p)
    spec, node = root / "etc/llmgw/replicas.d/replicas.yaml", root / "etc/llmgw/node"
    out, kmsg = root / "tmp/llmgw-generator", root / "tmp/llmgw-kmsg"
    outs = [out, *(out.with_name(f"{out.name}{s}") for s in (".early", ".late"))]
    cache = root / "run/llmgw-systemd"
    upper = tmp_path / "upper"  # the root fixture's overlay layer
    try:
        chroot(root, "cp", EXAMPLE, "/etc/llmgw/replicas.d/replicas.yaml")
        node.write_text("gpu-a1\n", encoding="utf-8")
        kmsg.touch()
        before = written(upper)
        runs, caches = [], []
        for _ in range(2):
            for folder in outs:  # fresh at every run; systemd makes them before it runs
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir(mode=0o755)
            proc = sh("unshare", "-m", "--propagation", "private", "sh", "-c", RUN_GENERATOR,
                      "sh", str(kmsg), str(root), link, "/tmp/llmgw-generator", timeout=120)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert proc.stdout == "" and proc.stderr == "", proc.stdout + proc.stderr
            assert kmsg.read_text(encoding="utf-8") == ""
            units = {p.name: p.read_text(encoding="utf-8") for p in sorted(out.iterdir())
                     if p.is_file()}
            runs.append(units)
            assert [list(folder.iterdir()) for folder in outs[1:]] == [[], []]
            st = (cache / "generator.cache").stat()
            caches.append((st.st_ino, st.st_mtime_ns))
        outside = written(upper) - before
        assert {p for p in outside if not p.startswith(
            ("/tmp/llmgw-generator/", "/tmp/llmgw-generator."))} == {
                "/run/llmgw-systemd/generator.cache"}, sorted(outside)

        units = runs[0]
        assert runs[1] == units and caches[1] == caches[0]  # the second from the cache
        assert len(units) == 9 and "llmgw-llama-70b-engine.service" in units, sorted(units)
        assert all(name.startswith("llmgw-") for name in units), sorted(units)
        waits = [line for text in units.values() for line in text.splitlines()
                 if line.startswith("ExecStartPre=") and "llmgw-wait-for-port" in line]
        assert waits, "the example's units wait for their rendezvous ports"
        for line in waits:
            assert line.startswith("ExecStartPre=/usr/bin/llmgw-wait-for-port "), line
        assert (root / "usr/bin/llmgw-wait-for-port").is_file()
    finally:
        for path in (spec, node, kmsg):
            path.unlink(missing_ok=True)
        for folder in (*outs, cache):
            shutil.rmtree(folder, ignore_errors=True)
    assert not any(os.path.lexists(p) for p in (spec, node, kmsg, *outs, cache))
