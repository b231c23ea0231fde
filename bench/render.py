"""Benchmark llmgw-render as a whole process, beside the floor of its unavoidable imports.

Prints, for 1, 10, 100 and 1000 vLLM/Ray replicas led by one node (3 units each), the
median wall time of `llmgw-render` writing into an empty directory and of a re-render
with nothing changed, next to `python -c "import yaml, jinja2, click"` measured in the
same run with the same interpreter. Goals (issue 2): one replica <= 1.25 x the floor;
marginal cost per rendered unit <= 100 us; a re-render writes nothing.

Output goes to a tmpfs by default, as a systemd generator's does (/run): on these VMs
creating a file on the ext4 root costs 50-700 us by itself and varies tenfold from run
to run, which would measure the disk, not llmgw-render. --dir points elsewhere; the
cost of bare file creation there is printed beside the results either way.

    .venv/bin/python bench/render.py [--runs N] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
RENDER = str(BIN / "llmgw-render")
SIZES = (1, 10, 100, 1000)


def spec_text(replicas: int) -> str:
    lines = ["replicas:"]
    for i in range(replicas):
        lines += [
            f"  - name: model-{i:04d}",
            "    engine: vllm",
            f"    model: /srv/models/model-{i:04d}",
            f"    port: {10000 + i}",
            f"    rendezvous_port: {20000 + i}",
            "    tensor_parallel_size: 8",
            "    pipeline_parallel_size: 2",
            "    nodes:",
            "      - {name: bench-a, address: 10.0.0.11}",
            "      - {name: bench-b, address: 10.0.0.12}",
            "    env: {VLLM_LOGGING_LEVEL: INFO}",
            "    args: [--max-model-len, '32768']",
        ]
    return "\n".join(lines) + "\n"


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    return time.perf_counter() - start


def file_create_cost(directory: Path, count: int) -> float:
    """Seconds per file to create, write 1 KB and rename, in Python: the I/O floor."""
    directory.mkdir()
    start = time.perf_counter()
    for i in range(count):
        fd = os.open(directory / f".f{i}.tmp", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        os.write(fd, b"x" * 1024)
        os.close(fd)
        os.replace(directory / f".f{i}.tmp", directory / f"f{i}")
    return (time.perf_counter() - start) / count


def snapshot(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="runs per measurement")
    parser.add_argument("--dir", default="/dev/shm", help="where to write (default: a tmpfs)")
    options = parser.parse_args()
    runs = options.runs
    floor_cmd = [sys.executable, "-c", "import yaml, jinja2, click"]
    for _ in range(3):  # warm the page cache
        timed(floor_cmd)
    with tempfile.TemporaryDirectory(dir=options.dir) as tmp:
        work = Path(tmp)
        results = []
        floor_samples: list[float] = []
        for size in SIZES:
            spec = work / f"spec-{size}.yaml"
            spec.write_text(spec_text(size), encoding="utf-8")
            n = max(3, runs // (1 + size // 200))
            fresh, again = [], []
            units = 0
            for run in range(n):
                floor_samples.append(timed(floor_cmd))  # interleaved: same machine state
                out = work / f"out-{size}-{run}"
                fresh.append(timed([RENDER, "--node", "bench-a", "--output", str(out),
                                    str(spec)]))
                units = len(os.listdir(out))
                before = snapshot(out)
                again.append(timed([RENDER, "--node", "bench-a", "--output", str(out),
                                    str(spec)]))
                if snapshot(out) != before:
                    sys.exit(f"re-render of {size} replicas changed files")
            results.append((size, units, statistics.median(fresh), statistics.median(again)))
        floor = statistics.median(floor_samples)
        create = file_create_cost(work / "bare", 3000)

    print(f"python: {sys.executable}; output under {options.dir}; bare file create+write+"
          f"rename there: {create * 1e6:.0f} us per file")
    print(f"floor  python -c 'import yaml, jinja2, click': {floor * 1000:7.1f} ms "
          f"(median of {len(floor_samples)})")
    print(f"{'replicas':>8} {'units':>6} {'render ms':>10} {'x floor':>8} "
          f"{'re-render ms':>13} {'x floor':>8}")
    for size, units, fresh_t, again_t in results:
        print(f"{size:>8} {units:>6} {fresh_t * 1000:>10.1f} {fresh_t / floor:>8.2f} "
              f"{again_t * 1000:>13.1f} {again_t / floor:>8.2f}")
    (_, u1, t1, r1), (_, un, tn, rn) = results[0], results[-1]
    per_unit = (tn - t1) / (un - u1)
    per_unit_again = (rn - r1) / (un - u1)
    print(f"one replica: {t1 / floor:.2f} x floor (goal <= 1.25)")
    print(f"marginal per unit, fresh: {per_unit * 1e6:.0f} us; re-render: "
          f"{per_unit_again * 1e6:.0f} us (goal <= 100 us; Quadlet ~120 us)")
    print("re-render with nothing changed wrote nothing: yes (mtimes checked every run)")


if __name__ == "__main__":
    main()
