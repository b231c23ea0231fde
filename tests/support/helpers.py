"""Shared test helpers: the installed entry points, systemd-analyze verify, snapshots."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

from installed import RENDER, WAIT_FOR_PORT
from unitfile import read_unit, split_words

__all__ = ["RENDER", "WAIT_FOR_PORT"]

SYSTEM_UNITS = Path("/usr/lib/systemd/system")


def run_render(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The installed llmgw-render, as a user runs it."""
    return subprocess.run([RENDER, *args], capture_output=True, text=True, cwd=cwd,
                          timeout=60, check=False, stdin=subprocess.DEVNULL)


def exec_paths(unit_text: str) -> set[str]:
    entries = read_unit(unit_text)
    # only the executable: hand-written units (the supervisor's) use $VARS in arguments
    return {split_words(v)[0] for key, values in entries.items()
            if key.startswith("Service.Exec") for v in values}


def verify_units(units: dict[str, str], root: Path, *, user: bool = False) -> None:
    """systemd-analyze verify, offline (docs/design.md §6); any stderr fails.

    System units are checked in a scratch root holding a copy of the host's system
    units and an empty executable at every Exec path, so only our units can be at
    fault. `--user` cannot take --root, so user units are checked in place and their
    executables must exist on this machine. systemd-analyze exits 0 on unknown keys
    and unparsable values (it only warns), hence the stderr check."""
    env = {**os.environ, "SYSTEMD_LOG_LEVEL": "notice"}
    if user:
        unit_dir = root / "user-units"
        runtime = root / "runtime"
        runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
        env["XDG_RUNTIME_DIR"] = str(runtime)
    else:
        if not (root / "usr/lib/systemd/system").exists():
            shutil.copytree(SYSTEM_UNITS, root / "usr/lib/systemd/system", symlinks=True)
        unit_dir = root / "etc/systemd/system"
    unit_dir.mkdir(parents=True, exist_ok=True)
    for name, text in units.items():
        (unit_dir / name).write_text(text, encoding="utf-8")
        if user:
            continue
        for path in exec_paths(text):
            target = root / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()
            target.chmod(0o755)
    names = sorted(units)
    for start in range(0, len(names), 200):  # verify slows down past a few hundred units
        batch = names[start:start + 200]
        cmd = (["systemd-analyze", "--user", "verify", "--man=no",
                *(str(unit_dir / n) for n in batch)] if user else
               ["systemd-analyze", "verify", f"--root={root}", "--man=no", *batch])
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False,
                              env=env)
        assert proc.returncode == 0 and not proc.stderr.strip(), (
            f"systemd-analyze verify failed (exit {proc.returncode}):\n{proc.stderr}")


def rendered_dir(directory: Path) -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(directory.iterdir())
            if p.is_file()}


def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    """Every file's bytes and mtime: to prove nothing changed."""
    return {str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def names(items: Iterable[str]) -> list[str]:
    return sorted(items)
