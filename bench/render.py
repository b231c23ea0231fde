"""Benchmark llmgw-render and the generator as whole processes, beside baseline revisions.

Prints, in one run, the median wall time of each of these whole processes, for the
working tree (the console scripts installed in this interpreter's bin directory, as
scripts/setup installs them) and for each baseline revision (default db16837, the
previous landing, and 724de46), next to the floor `python -c "import yaml, jinja2,
click"`; all interleaved, round by round, so every figure sees the same machine state:

- `llmgw-render --version`;
- `llmgw-render --dry-run --node gpu-a1 --output DIR examples/replicas.yaml`;
- `llmgw-render --dry-run` of one vLLM mp replica over 64 nodes, for its last node;
- `llmgw-systemd-generator` as bench/generator.py runs it (a user generator on the
  example spec, into a tmpfs): slow (its cache removed first) and fast (nothing changed).

A baseline is `git archive`d into a temporary directory, built with `pip wheel
--no-deps` and installed into a venv made by `/usr/bin/python3 -m venv
--system-site-packages` (jinja2, yaml, click and h11 come from Debian's python3-*
packages), with the generator's launcher made from that revision's
packaging/generator-launcher.in the way scripts/setup makes it. The venvs are kept under
--cache (keyed by commit and Python version), so a re-run starts at once. Goal (issue
35): the render path no slower than db16837's.

Then, as before (skip with --no-sizes): for 1, 10, 100 and 1000 vLLM/Ray replicas led by
one node (3 units each), the working tree's median wall time of `llmgw-render` writing
into an empty directory and of a re-render with nothing changed, next to the floor.
Goals (issue 2): one replica <= 1.25 x the floor; marginal cost per rendered unit <=
100 us; a re-render writes nothing.

Output goes to a tmpfs by default, as a systemd generator's does (/run): on these VMs
creating a file on the ext4 root costs 50-700 us by itself and varies tenfold from run
to run, which would measure the disk, not llmgw-render. --dir points elsewhere; the
cost of bare file creation there is printed beside the results either way.

    .venv/bin/python bench/render.py [--runs N] [--dir DIR] [--baseline REV ...]
                                     [--cache DIR] [--no-sizes]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
RENDER = str(BIN / "llmgw-render")
EXAMPLE = ROOT / "examples" / "replicas.yaml"
SIZES = (1, 10, 100, 1000)
BASELINES = ("db16837", "724de46")
BASE_PYTHON = "/usr/bin/python3"
WIDE_NODES = 64
WIDE_NODE = f"gpu-{WIDE_NODES - 1:03d}"  # a worker rank, as 63 of the 64 nodes are
# scripts/setup's: the launcher's package directories, the package's own first
SITEDIRS = """import llmgw_systemd, os, sys
own = os.path.dirname(os.path.dirname(llmgw_systemd.__file__))
print(repr([own] + [p for p in sys.path if p.endswith(("-packages")) and p != own]))"""
PIP_ENV = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
MEASURES = (
    ("version", "render --version"),
    ("example", "render --dry-run example, gpu-a1"),
    ("wide", f"render --dry-run {WIDE_NODES}-node mp, {WIDE_NODE}"),
    ("slow", "generator, cache removed"),
    ("fast", "generator, nothing changed"),
)


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


def wide_spec_text() -> str:
    """One vLLM replica over WIDE_NODES nodes with its own multiprocessing executor."""
    lines = ["replicas:", "  - name: wide-mp", "    engine: vllm", "    launch_mode: mp",
             "    model: /srv/models/wide", "    port: 8000", "    tensor_parallel_size: 8",
             f"    pipeline_parallel_size: {WIDE_NODES}", "    nodes:"]
    lines += [f"      - {{name: gpu-{i:03d}, address: 10.0.{i // 200}.{i % 200 + 1}, "
              "interface: ens1f0}" for i in range(WIDE_NODES)]
    lines += ["    gpus: [0, 1, 2, 3, 4, 5, 6, 7]", "    env: {VLLM_LOGGING_LEVEL: INFO}",
              "    args: [--max-model-len, '32768']",
              "    health: {generation: {interval: 30, timeout: 10}}"]
    return "\n".join(lines) + "\n"


def timed(cmd: list[str], env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                   env=env)
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


# -- baselines ---------------------------------------------------------------------------

def stale_files() -> list[str]:
    """Working-tree files the installed package (this interpreter's) does not match."""
    # -I: not the working tree's own llmgw_systemd/ from the current directory
    installed = Path(subprocess.run(
        [sys.executable, "-I", "-c", "import importlib.util as u; "
         "print(u.find_spec('llmgw_systemd').origin)"],
        check=True, capture_output=True, text=True).stdout.strip()).parent
    pairs = [(p, installed / p.relative_to(ROOT / "llmgw_systemd"))
             for p in (ROOT / "llmgw_systemd").rglob("*.py")]
    pairs += [(p, installed / "units" / "templates" / p.relative_to(ROOT / "templates"))
              for p in (ROOT / "templates").rglob("*") if p.is_file()]
    return [str(mine.relative_to(ROOT)) for mine, theirs in pairs
            if not theirs.is_file() or theirs.read_bytes() != mine.read_bytes()]


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def site_packages(venv: Path) -> str:
    """A venv's own site-packages (where its llmgw_systemd is)."""
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if len(found) != 1:
        sys.exit(f"{venv}: expected one lib/python3*/site-packages, found {found}")
    return str(found[0])


def install_launcher(template: Path, venv: Path) -> None:
    """The generator's -IS launcher over the console script, as scripts/setup makes it."""
    python = venv / "bin" / "python3"
    sitedirs = subprocess.run([str(python), "-I", "-c", SITEDIRS], check=True,
                              capture_output=True, text=True).stdout.strip()
    text = template.read_text().replace("@PYTHON@", str(python)).replace("@SITEDIRS@",
                                                                         sitedirs)
    script = venv / "bin" / "llmgw-systemd-generator"
    tmp = script.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.chmod(0o755)
    tmp.replace(script)


def baseline_bin(rev: str, cache: Path) -> Path:
    """The bin directory of a venv with revision REV installed, built once and cached."""
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    version = subprocess.run([BASE_PYTHON, "-c", "import sys; print(*sys.version_info[:2], "
                              "sep='.')"], check=True, capture_output=True,
                             text=True).stdout.strip()
    venv = cache / f"{sha}-py{version}"
    ready = venv / "llmgw-bench-ready"
    if ready.exists():
        return venv / "bin"
    print(f"building {rev} ({sha[:12]}) into {venv} ...", file=sys.stderr, flush=True)
    shutil.rmtree(venv, ignore_errors=True)  # a build cut short
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"llmgw-bench-{sha[:12]}-") as tmp:
        src, dist = Path(tmp) / "src", Path(tmp) / "dist"
        src.mkdir()
        git("archive", f"--output={tmp}/src.tar", sha)
        subprocess.run(["tar", "-x", "-f", f"{tmp}/src.tar", "-C", str(src)], check=True)
        subprocess.run([BASE_PYTHON, "-m", "venv", "--system-site-packages", str(venv)],
                       check=True)
        pip = str(venv / "bin" / "pip")
        # the build needs hatchling and jinja2, which Debian's python3-* packages provide
        subprocess.run([pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(dist), str(src)], check=True, env=PIP_ENV)
        (wheel,) = dist.glob("llmgw_systemd-*.whl")
        subprocess.run([pip, "install", "-q", "--no-deps", str(wheel)], check=True,
                       env=PIP_ENV)
        template = src / "packaging" / "generator-launcher.in"
        if template.exists():
            install_launcher(template, venv)
    ready.write_text(f"{rev} {sha}\n")
    return venv / "bin"


# -- the comparison ----------------------------------------------------------------------

class Flavour:
    """One installation (the working tree's, or a baseline revision's) and its work area."""

    def __init__(self, label: str, bin_dir: Path, work: Path, rev: str | None) -> None:
        self.label, self.bin, self.rev = label, bin_dir, rev
        self.example = EXAMPLE
        self.notes: list[str] = []
        self.samples: dict[str, list[float]] = {key: [] for key, _ in MEASURES}
        specs = work / "config" / "llmgw" / "replicas.d"
        specs.mkdir(parents=True)
        self.specs = specs
        (specs.parent / "node").write_text("gpu-a1\n")
        runtime = work / "runtime"
        runtime.mkdir(mode=0o700)
        self.env = {**os.environ, "SYSTEMD_SCOPE": "user", "XDG_CONFIG_HOME": str(work / "config"),
                    "XDG_RUNTIME_DIR": str(runtime)}
        self.cache = runtime / "llmgw-systemd" / "generator.cache"
        self.render_env = dict(os.environ)
        if rev is not None:
            self.render_env["PYTHONPATH"] = site_packages(bin_dir.parent)
        self.out = work / "out"
        self.empty = work / "empty"  # --dry-run's --output: must stay empty
        self.empty.mkdir()
        self.own_example = work / "replicas.yaml"
        self.generator = bin_dir / "llmgw-systemd-generator"
        if not self.generator.read_text().splitlines()[0].endswith(" -IS"):
            sys.exit(f"{self.generator} is not the -IS launcher; run scripts/setup")

    def render(self, *args: str) -> list[str]:
        # Every installation's llmgw-render under this one interpreter, its own package
        # first on the path: the interpreter's start (its site, the .pth files of the
        # machine, which may import packages whose versions differ between venvs) is then
        # the same for all, and only our code differs.
        return [sys.executable, str(self.bin / "llmgw-render"), *args]

    def dry_run(self, spec: Path, node: str) -> list[str]:
        return self.render("--dry-run", "--node", node, "--output", str(self.empty), str(spec))

    def generate(self) -> list[str]:
        shutil.rmtree(self.out, ignore_errors=True)
        self.out.mkdir()
        return [str(self.generator), str(self.out), f"{self.out}.early", f"{self.out}.late"]

    def prepare(self, wide: Path) -> None:
        """Choose the example this installation accepts; check that every command runs."""
        if self.rev and subprocess.run(self.dry_run(EXAMPLE, "gpu-a1"), check=False,
                                       env=self.render_env, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL).returncode != 0:
            # the working tree's example has a key this revision does not know
            self.own_example.write_text(git("show", f"{self.rev}:examples/replicas.yaml")
                                        + "\n")
            self.example = self.own_example
            self.notes.append(f"{self.label} rejects the working tree's examples/replicas.yaml;"
                              " its own was measured (example and generator rows)")
        where = subprocess.run([sys.executable, "-c",
                                "import llmgw_systemd; print(llmgw_systemd.__file__)"],
                               capture_output=True, text=True, check=True, env=self.render_env,
                               cwd=self.empty).stdout.strip()
        if not where.startswith(f"{self.bin.parent}/"):
            sys.exit(f"{self.label}: its llmgw-render would run {where}, not its own")
        shutil.copy(self.example, self.specs / "replicas.yaml")
        for cmd, env in ((self.render("--version"), self.render_env),
                         (self.dry_run(self.example, "gpu-a1"), self.render_env),
                         (self.dry_run(wide, WIDE_NODE), self.render_env),
                         (self.generate(), self.env)):
            result = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
            if result.returncode != 0:
                sys.exit(f"{self.label}: {' '.join(cmd)} failed ({result.returncode}):\n"
                         f"{result.stderr}")

    def dry_run_job(self, key: str, spec: Path, node: str) -> Callable[[], None]:
        def job() -> None:
            self.samples[key].append(timed(self.dry_run(spec, node), self.render_env))
            if any(self.empty.iterdir()):
                sys.exit(f"{self.label}: --dry-run wrote into {self.empty}")
        return job

    def jobs(self, wide: Path) -> list[Callable[[], None]]:
        def version() -> None:
            self.samples["version"].append(timed(self.render("--version"), self.render_env))

        def generator() -> None:
            self.cache.unlink(missing_ok=True)  # as after a spec changed
            self.samples["slow"].append(timed(self.generate(), self.env))
            slow_units = {p.name: p.read_bytes() for p in self.out.iterdir() if p.is_file()}
            if not self.cache.exists():
                sys.exit(f"{self.label}: the generator left no cache at {self.cache}")
            self.samples["fast"].append(timed(self.generate(), self.env))
            if {p.name: p.read_bytes() for p in self.out.iterdir() if p.is_file()} != slow_units:
                sys.exit(f"{self.label}: the fast path and the slow path wrote different units")

        return [version, self.dry_run_job("example", self.example, "gpu-a1"),
                self.dry_run_job("wide", wide, WIDE_NODE), generator]


def compare(options: argparse.Namespace, floor_cmd: list[str]) -> None:
    cache = Path(options.cache)
    bins = [("working tree", BIN)] + [(rev, baseline_bin(rev, cache))
                                      for rev in options.baseline]
    with tempfile.TemporaryDirectory(dir=options.dir) as tmp:
        work = Path(tmp)
        wide = work / f"wide-{WIDE_NODES}.yaml"
        wide.write_text(wide_spec_text(), encoding="utf-8")
        flavours = [Flavour(label, path, work / f"f{i}", None if i == 0 else label)
                    for i, (label, path) in enumerate(bins)]
        for flavour in flavours:
            flavour.prepare(wide)
        floor_samples: list[float] = []

        def floor() -> None:
            floor_samples.append(timed(floor_cmd))

        jobs = [floor] + [job for flavour in flavours for job in flavour.jobs(wide)]
        for _ in range(2):  # warm the page cache, the bytecode and the generators' caches
            for job in jobs:
                job()
        floor_samples.clear()
        for flavour in flavours:
            for values in flavour.samples.values():
                values.clear()
        for run in range(options.runs):
            # interleaved, and rotated so that no figure always follows the same one
            shift = run % len(jobs)
            for job in jobs[shift:] + jobs[:shift]:
                job()
    floor_t = statistics.median(floor_samples)
    median = [{k: statistics.median(v) for k, v in f.samples.items()} for f in flavours]
    labels = [f.label for f in flavours]
    first = labels[1] if len(labels) > 1 else None
    width = max(len(text) for _, text in MEASURES)
    print(f"whole-process wall time, ms: median of {options.runs} interleaved runs; "
          f"working tree: {BIN}'s console scripts; baselines: {cache}; floor: python -c "
          "'import yaml, jinja2, click'")
    header = f"{'what':<{width}} " + " ".join(f"{label:>12}" for label in labels)
    header += f" {'floor':>8}"
    if first:
        header += f" {'wt / ' + first:>14}"
    print(header)
    for key, text in MEASURES:
        row = f"{text:<{width}} " + " ".join(f"{m[key] * 1000:>12.1f}" for m in median)
        row += f" {floor_t * 1000:>8.1f}"
        if first:
            row += f" {median[0][key] / median[1][key]:>14.2f}"
        print(row)
    for flavour in flavours:
        for note in flavour.notes:
            print(f"note: {note}")
    stale = stale_files()
    if stale:
        print(f"note: the installed llmgw_systemd differs from the working tree in "
              f"{len(stale)} files ({', '.join(stale[:3])}{', ...' if len(stale) > 3 else ''});"
              " the working tree column measures what is installed (scripts/setup updates it)")
    if first:
        worst = max(median[0][k] / median[1][k] for k in ("version", "example", "wide"))
        print(f"render path: working tree at worst {worst:.2f} x {first} "
              f"(goal <= 1.00, issue 35)")


def sizes(options: argparse.Namespace, floor_cmd: list[str]) -> None:
    runs = options.runs
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="runs per measurement")
    parser.add_argument("--dir", default="/dev/shm", help="where to write (default: a tmpfs)")
    parser.add_argument("--baseline", action="append", metavar="REV",
                        help=f"a revision to compare with, repeatable; the first is the one "
                             f"ratios are to (default: {' '.join(BASELINES)})")
    default_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    parser.add_argument("--cache", default=str(default_cache / "llmgw-systemd-bench"),
                        help="where the baselines' venvs are kept (default: %(default)s)")
    parser.add_argument("--no-sizes", action="store_true",
                        help="skip the working tree's 1/10/100/1000-replica figures")
    options = parser.parse_args()
    options.baseline = options.baseline or list(BASELINES)
    floor_cmd = [sys.executable, "-c", "import yaml, jinja2, click"]
    for _ in range(3):  # warm the page cache
        timed(floor_cmd)
    compare(options, floor_cmd)
    if not options.no_sizes:
        print()
        sizes(options, floor_cmd)


if __name__ == "__main__":
    main()
