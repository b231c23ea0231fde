"""`pip install llmgw-systemd` as a user does it: the wheel built from this tree installed
with no extras into a virtualenv that does not see the system's site packages (the test
machines have python3-h11, python3-gi and the rest installed system-wide, which hid a
render that needed them). llmgw-render works there and renders what the test venv does;
the supervisor's programs say in one line what to install."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from installed import RENDER

pytestmark = pytest.mark.packaging

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "replicas.yaml"


def run(*argv: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=600,
                          check=False, stdin=subprocess.DEVNULL, cwd=cwd,
                          env={k: v for k, v in os.environ.items()
                               if k not in ("PYTHONPATH", "VIRTUAL_ENV")})


@pytest.fixture(scope="module")
def plain_venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    work = tmp_path_factory.mktemp("plain-pip")
    wheel_dir = work / "wheel"
    # the test venv's own build tools (hatchling, jinja2 for the compiled templates)
    built = run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                "-w", wheel_dir, ROOT)
    assert built.returncode == 0, built.stderr
    (wheel,) = wheel_dir.glob("llmgw_systemd-*.whl")
    venv = work / "venv"
    made = run("/usr/bin/python3", "-m", "venv", venv)
    assert made.returncode == 0, made.stderr
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
    installed = run(venv / "bin" / "pip", "install", "-q", "--disable-pip-version-check",
                    wheel)
    assert installed.returncode == 0, installed.stderr
    yield venv


def test_the_plain_venv_has_none_of_the_supervisors_dependencies(plain_venv: Path) -> None:
    """Else the tests below prove nothing."""
    for module in ("h11", "gi", "pydbus", "prometheus_client"):
        probe = run(plain_venv / "bin" / "python", "-c", f"import {module}")
        assert probe.returncode != 0, f"{module} is importable in the plain venv"


def test_llmgw_render_works_after_a_plain_pip_install(plain_venv: Path, tmp_path: Path) -> None:
    version = run(plain_venv / "bin" / "llmgw-render", "--version")
    assert version.returncode == 0 and version.stdout.startswith("llmgw-render "), \
        version.stderr
    ours, theirs = tmp_path / "plain", tmp_path / "test-venv"
    for render, out in ((plain_venv / "bin" / "llmgw-render", ours), (Path(RENDER), theirs)):
        proc = run(render, "--node", "gpu-a1", "--output", out, EXAMPLE)
        assert proc.returncode == 0, proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
    names = sorted(p.name for p in ours.iterdir())
    assert names == sorted(p.name for p in theirs.iterdir()) and names
    for name in names:  # the same but for where each finds its helper programs
        assert (ours / name).read_bytes().replace(bytes(plain_venv / "bin"), b"BIN") == \
            (theirs / name).read_bytes().replace(bytes(Path(RENDER).parent), b"BIN"), name
    dry = run(plain_venv / "bin" / "llmgw-render", "--node", "gpu-a1", "--dry-run", "--output",
              tmp_path / "dry", EXAMPLE)
    assert dry.returncode == 0 and "Traceback" not in dry.stderr, dry.stderr
    assert not (tmp_path / "dry").exists()


@pytest.mark.parametrize("argv", [("llmgw-supervisor",), ("llmgw-systemd", "status")])
def test_the_supervisors_programs_name_what_to_install(plain_venv: Path,
                                                        argv: tuple[str, ...]) -> None:
    proc = run(plain_venv / "bin" / argv[0], *argv[1:])
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "llmgw-systemd[dbus]" in proc.stderr and "python3-gi" in proc.stderr, proc.stderr
