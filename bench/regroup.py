"""Benchmark a fault's cost (issue 42): SIGKILL of a rank's main process to every rank of
its group starting again, and to `ready`, beside the engine's own cold start measured in
the same run, and beside a baseline revision (724de46 by default) run the same way.

The real vLLM (CPU build), mp backend, in two network namespaces, each with its own
systemd user manager and supervisor (the test harness). In one run of each revision:

- `one`: a one-node replica on node-a: `systemctl start` to the first completion (the
  engine's cold start) and to the supervisor's `ready`; then SIGKILL of its main process
  to its new main process, and to `ready` again;
- `tp`: tensor parallel 2 over node-a (rank 0, serving) and node-b (rank 1, headless):
  the same cold start; SIGKILL of rank 1's main process, then of rank 0's, each to the
  new main process on node-b and on node-a, and to both supervisors saying `ready`.

Only one vLLM replica runs at a time (two are more than two cores carry). The spec has
restart.delay 2 s and group_restart.delay 1 s, the engines tier's; what is ours is
kill -> every rank's new main process (the restart delay included); kill -> ready is
that plus the engine's own start, which the cold start beside it shows.

The baseline runs from a venv with that revision installed (bench/render.py's
baseline_bin, cached under --cache), its units rendered by its own llmgw-render, so its
helpers and supervisor are its own; the harness is today's.

Needs root and the engine cache (bash scripts/setup-engines). Run:
    .venv/bin/python bench/regroup.py [--baseline REV] [--only now|baseline]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"),
                *(str(ROOT / "tests" / d) for d in ("", "support", "integration", "engines"))]

from realengine import (  # noqa: E402
    ENGINE_ARGS,
    MODEL,
    VENV,
    VLLM_VERSION,
    assert_engines,
    complete,
    env_yaml,
)
from specs import free_port  # noqa: E402
from supervisors import SupervisorProcess  # noqa: E402
from systemd_harness import UserManager, make_network, remove_network, wait_until  # noqa: E402

LIMIT = 600  # bound on any one wait
SETTLE = 12  # after `ready`, before a kill: the supervisors' baseline settles
ADDRESSES = ("192.0.2.1", "192.0.2.2")


def spec_text(ports: dict[str, int], rendezvous: int) -> str:
    common = f"""\
    engine: vllm
    launch_mode: mp
    model: {MODEL}
    virtualenv: {VENV}
    env: {env_yaml()}
    args: {ENGINE_ARGS}
    drain: {{delay: 3, timeout: 10}}
    restart: {{delay: 2, burst: 20, interval: 900}}
    health: {{interval: 1, timeout: 2, stability: 2}}
    group_restart: {{delay: 1, max_delay: 8, budget: 10, window: 900}}
"""
    return f"""\
replicas:
  - name: one
{common}    port: {ports["one"]}
    nodes: [{{name: node-a, address: {ADDRESSES[0]}, interface: eth0}}]
  - name: tp
{common}    tensor_parallel_size: 2
    port: {ports["tp"]}
    rendezvous_port: {rendezvous}
    nodes:
      - {{name: node-a, address: {ADDRESSES[0]}, interface: eth0}}
      - {{name: node-b, address: {ADDRESSES[1]}, interface: eth0}}
"""


def engine(replica: str) -> str:
    return f"llmgw-{replica}-engine.service"


def main_pid(manager: UserManager, replica: str) -> int:
    return int(manager.show(engine(replica), "MainPID")["MainPID"])


def ready(sups: list[SupervisorProcess], replica: str) -> bool:
    try:
        return all(s.replica(replica)["state"] == "ready" for s in sups)
    except (OSError, KeyError, ValueError):
        return False


def cold_start(managers: list[UserManager], sups: list[SupervisorProcess], replica: str,
               base: str) -> dict[str, float]:
    """`systemctl start` of the replica's targets (worker first) to its first completion
    and to every supervisor that holds it saying ready."""
    started = time.monotonic()
    for m in reversed(managers):
        m.systemctl("start", f"llmgw-{replica}.target")
    wait_until(lambda: complete(managers[0], base) == 200, LIMIT,
               f"{replica}'s first completion", interval=0.2)
    first = time.monotonic() - started
    wait_until(lambda: ready(sups, replica), LIMIT, f"{replica} ready", interval=0.2)
    return {"start_to_completion_s": first, "start_to_ready_s": time.monotonic() - started}


def kill(managers: list[UserManager], sups: list[SupervisorProcess], replica: str,
         victim: int) -> dict[str, float]:
    """SIGKILL of the main process of rank `victim` alone, to each rank's new main
    process and to every supervisor saying ready again."""
    time.sleep(SETTLE)
    old = [main_pid(m, replica) for m in managers]
    assert all(pid > 1 for pid in old), old
    killed = time.monotonic()
    os.kill(old[victim], signal.SIGKILL)
    again: dict[int, float] = {}

    def restarted() -> bool:
        for rank, m in enumerate(managers):
            if rank not in again and main_pid(m, replica) not in (0, old[rank]):
                again[rank] = time.monotonic() - killed
        return len(again) == len(managers)

    wait_until(restarted, LIMIT, f"every rank of {replica} to have a new main process",
               interval=0.05)
    wait_until(lambda: ready(sups, replica), LIMIT, f"{replica} ready again", interval=0.2)
    out = {f"kill_to_rank{rank}_s": again[rank] for rank in sorted(again)}
    out["kill_to_every_rank_s"] = max(again.values())
    out["kill_to_ready_s"] = time.monotonic() - killed
    return out


def one_run(work: Path) -> dict[str, dict[str, float]]:
    """Every scenario, with this interpreter's installed llmgw-systemd."""
    tag = f"{os.getpid() % 10000}rg"
    network = make_network(tag, 2)
    managers: list[UserManager] = []
    sups: list[SupervisorProcess] = []
    results: dict[str, dict[str, float]] = {}
    try:
        for i in range(2):
            m = UserManager(f"llmgw-bench-{tag}-{i}", work / f"node-{i}", netns=network[i])
            m.start()
            managers.append(m)
        ports = {"one": free_port(), "tp": free_port()}
        api = free_port()
        spec = work / "spec.yaml"
        spec.write_text(spec_text(ports, free_port()))
        for i, m in enumerate(managers):
            m.render(spec, f"node-{'ab'[i]}")
            sups.append(SupervisorProcess(m, f"node-{'ab'[i]}", spec,
                                          listen=f"{ADDRESSES[i]}:{api}",
                                          state_dir=work / f"sup-{i}"))
        one = [managers[0]]
        results["one start"] = cold_start(one, sups[:1], "one", f"http://{ADDRESSES[0]}:"
                                          f"{ports['one']}")
        results["one: kill main"] = kill(one, sups[:1], "one", 0)
        managers[0].systemctl("stop", "llmgw-one.target")
        base = f"http://{ADDRESSES[0]}:{ports['tp']}"
        results["tp start"] = cold_start(managers, sups, "tp", base)
        results["tp: kill rank 1 main"] = kill(managers, sups, "tp", 1)
        results["tp: kill rank 0 main"] = kill(managers, sups, "tp", 0)
        for m in managers:
            m.systemctl("stop", "llmgw-tp.target")
        return results
    finally:
        for sup in sups:
            sup.stop()
        for m in managers:
            m.stop()
        remove_network(tag)


def run_with(python: Path, label: str) -> dict[str, dict[str, float]]:
    """This script's --one-run under `python` (a venv with the code to measure)."""
    print(f"{label}: running with {python} ...", file=sys.stderr, flush=True)
    # from /: never this checkout's own llmgw_systemd, always the venv's
    proc = subprocess.run([str(python), str(Path(__file__).resolve()), "--one-run"],
                          capture_output=True, text=True, check=False, cwd="/")
    if proc.returncode != 0:
        sys.exit(f"{label}: failed ({proc.returncode}):\n{proc.stdout[-3000:]}"
                 f"{proc.stderr[-3000:]}")
    result: dict[str, dict[str, float]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


COLUMNS = (("start_to_completion_s", "start->completion"), ("start_to_ready_s",
           "start->ready"), ("kill_to_rank0_s", "kill->rank 0 new"),
           ("kill_to_rank1_s", "kill->rank 1 new"), ("kill_to_every_rank_s",
                                                     "kill->every rank"),
           ("kill_to_ready_s", "kill->ready"))


def table(runs: dict[str, dict[str, dict[str, float]]]) -> None:
    print(f"vLLM {VLLM_VERSION} (CPU build), {os.cpu_count()} cores, two namespaces, "
          "supervisors on both; restart delay 2 s, group restart delay 1 s; seconds")
    print(f"{'scenario':24} {'code':10} " + " ".join(f"{title:>17}" for _, title in COLUMNS))
    scenarios = next(iter(runs.values())).keys()
    for scenario in scenarios:
        for label, result in runs.items():
            row = result.get(scenario, {})
            cells = " ".join(f"{row[key]:17.1f}" if key in row else f"{'':>17}"
                             for key, _ in COLUMNS)
            print(f"{scenario:24} {label:10} {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="724de46")
    parser.add_argument("--only", choices=("now", "baseline"))
    default_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    parser.add_argument("--cache", default=str(default_cache / "llmgw-systemd-bench"))
    parser.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (private systemd managers, network namespaces)")
    assert_engines()
    if options.one_run:
        with tempfile.TemporaryDirectory(prefix="llmgw-bench-regroup-") as tmp:
            print(json.dumps(one_run(Path(tmp))))
        return
    from render import baseline_bin  # bench/render.py: the cached venvs of a revision

    runs: dict[str, dict[str, dict[str, float]]] = {}
    if options.only in (None, "now"):
        runs["now"] = run_with(Path(sys.executable), "now")
    if options.only in (None, "baseline"):
        python = baseline_bin(options.baseline, Path(options.cache)) / "python3"
        runs[options.baseline] = run_with(python, options.baseline)
    table(runs)
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
