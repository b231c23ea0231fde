"""Benchmark llmgw-systemd-generator as systemd runs it, beside its floors, in one run.

A typical node: the bundled example spec (two replicas with a shard on gpu-a1, seven
units), run as a user generator into a tmpfs (where systemd's generator directories
are). Measured, interleaved so every figure sees the same machine state:

- bare:   the launcher's interpreter doing nothing, `python3 -I -S -c pass`;
- fast:   the generator when nothing changed since its last run (its cache matches);
- floor:  `python3 -I -c "import yaml, jinja2"`, a program that needs what rendering
          needs, started the ordinary way (site and its .pth files included);
- floor without site: the same imports from the launcher's own directories, `-I -S`;
- slow:   the generator with its cache removed before each run (a spec changed).

Goals (issue 10): fast <= 2 x bare; slow <= 1.25 x floor. The launcher is the one
scripts/setup installed (the same template the packages install).

    .venv/bin/python bench/generator.py [--runs N] [--dir DIR]
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
GENERATOR = BIN / "llmgw-systemd-generator"
EXAMPLE = Path(__file__).parents[1] / "examples" / "replicas.yaml"


def timed(cmd: list[str], env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                   env=env)
    return time.perf_counter() - start


def launcher() -> tuple[str, list[str]]:
    """The launcher's interpreter and the package directories it names."""
    lines = GENERATOR.read_text().splitlines()
    if not lines[0].endswith(" -IS"):
        sys.exit(f"{GENERATOR} is not the -IS launcher; run scripts/setup")
    python = lines[0][2:].split()[0]
    dirs = next(ast.literal_eval(line.split("=", 1)[1].strip()) for line in lines
                if line.startswith("sys.path[:0] ="))
    return python, dirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="runs per measurement")
    parser.add_argument("--dir", default="/dev/shm", help="where to work (default: a tmpfs)")
    options = parser.parse_args()
    python, dirs = launcher()
    with tempfile.TemporaryDirectory(dir=options.dir) as tmp:
        work = Path(tmp)
        specs = work / "config" / "llmgw" / "replicas.d"
        specs.mkdir(parents=True)
        shutil.copy(EXAMPLE, specs / "replicas.yaml")
        (specs.parent / "node").write_text("gpu-a1\n")
        runtime = work / "runtime"
        runtime.mkdir(mode=0o700)
        env = {**os.environ, "SYSTEMD_SCOPE": "user", "XDG_CONFIG_HOME": str(work / "config"),
               "XDG_RUNTIME_DIR": str(runtime)}
        cache = runtime / "llmgw-systemd" / "generator.cache"
        out = work / "out"

        def generate() -> list[str]:
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            return [str(GENERATOR), str(out), f"{out}.early", f"{out}.late"]

        commands = {
            "bare": [python, "-I", "-S", "-c", "pass"],
            "floor": [python, "-I", "-c", "import yaml, jinja2"],
            "floor without site": [python, "-I", "-S", "-c",
                                   f"import sys; sys.path[:0] = {dirs!r}; import yaml, jinja2"],
        }
        samples: dict[str, list[float]] = {k: [] for k in (*commands, "fast", "slow")}
        for _ in range(3):  # warm the page cache and the bytecode
            for cmd in commands.values():
                timed(cmd)
            timed(generate(), env)
        units = sorted(p.name for p in out.iterdir())
        for _ in range(options.runs):
            for name, cmd in commands.items():
                samples[name].append(timed(cmd))
            samples["fast"].append(timed(generate(), env))
            fast_units = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
            cache.unlink()
            samples["slow"].append(timed(generate(), env))
            if {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} != fast_units:
                sys.exit("the fast path and the slow path wrote different units")
    median = {k: statistics.median(v) for k, v in samples.items()}
    print(f"python: {python}; {len(units)} entries generated ({', '.join(units[:3])}, ...); "
          f"{options.runs} runs each, interleaved; medians")
    for name in ("bare", "fast", "floor", "floor without site", "slow"):
        print(f"  {name:20s} {median[name] * 1000:7.1f} ms")
    fast_x = median["fast"] / median["bare"]
    slow_x = median["slow"] / median["floor"]
    print(f"nothing changed: {fast_x:.2f} x bare (goal <= 2)")
    print(f"changed: {slow_x:.2f} x floor (goal <= 1.25); "
          f"{median['slow'] / median['floor without site']:.2f} x the floor without site")


if __name__ == "__main__":
    main()
