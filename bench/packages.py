"""Package figures: build time and size of the deb and the rpm (packaging/build), and
the time of their checks (pytest -m packaging), beside a baseline from the same run:
building the plain wheel with the same interpreter.

    .venv/bin/python bench/packages.py
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLEAN = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


def timed(argv: list[str], env: dict[str, str] | None = None) -> float:
    started = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return time.perf_counter() - started


def main() -> None:
    version = re.search(r'__version__ = "([^"]+)"',
                        (ROOT / "llmgw_systemd" / "__init__.py").read_text())
    assert version
    with tempfile.TemporaryDirectory() as tmp:
        wheel_time = timed(["/usr/bin/python3", "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "--no-index", "-w", tmp, "."], CLEAN)
        wheel = next(Path(tmp).glob("*.whl"))
        wheel_size = wheel.stat().st_size
    build_time = timed(["bash", "packaging/build"], CLEAN)
    deb = ROOT / "dist" / f"llmgw-systemd_{version[1]}_all.deb"
    rpm = ROOT / "dist" / f"llmgw-systemd-{version[1]}-1.noarch.rpm"
    check_time = timed([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-m", "packaging", "tests/packaging"])
    print(f"{'':34} {'seconds':>8} {'size KB':>8}")
    print(f"{'baseline: the wheel alone':34} {wheel_time:>8.1f} {wheel_size / 1024:>8.1f}")
    print(f"{'packaging/build (deb + rpm)':34} {build_time:>8.1f}")
    print(f"{'  ' + deb.name:34} {'':>8} {deb.stat().st_size / 1024:>8.1f}")
    print(f"{'  ' + rpm.name:34} {'':>8} {rpm.stat().st_size / 1024:>8.1f}")
    print(f"{'checks: pytest -m packaging':34} {check_time:>8.1f}   (builds again, "
          "lints, installs)")


if __name__ == "__main__":
    main()
