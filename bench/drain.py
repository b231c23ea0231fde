"""Benchmark the drain on planned restarts, with the real vLLM (CPU build) from
scripts/setup-engines behind a real HAProxy (docs/loadbalancer.md), four clients of
16-token completions throughout. Two vLLM replicas, one at a time: `one` (one node) and
`tp` (mp, tensor parallel over two network namespaces, each with its own systemd user
manager and supervisor), beside a stand-in replica that takes the load meanwhile: the
harness of tests/engines/test_engine_drain.py.

The same run twice, first with the drain off (`drain: {delay: 0, timeout: 0}`: vLLM's
--shutdown-timeout 0 aborts what it has in flight, and nothing waits for the load
balancer: the behaviour before the drain), then on (the default's shape, delay 3 s,
timeout 10 s):

- `systemctl restart llmgw-one.target` under the load;
- `systemctl restart llmgw-tp.target` on tp's worker node (rank 1) under the load;
- a crash: SIGKILL of every process of `one`'s engine, as when it dies.

For each restart: requests and failed requests, seconds HAProxy had the replica out of
rotation, seconds from the restart to `systemctl restart` returning and to being back in
rotation; for the crash: seconds from the kill to the next engine process (the drain must
not slow a failure's restart).

Needs root and the engine cache (bash scripts/setup-engines). Run:
    .venv/bin/python bench/drain.py [--rounds 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / d) for d in ("", "support", "integration", "engines")]

import test_engine_drain as scenario  # noqa: E402
from realengine import VLLM_VERSION, assert_engines  # noqa: E402
from systemd_harness import Nodes, two_node_network  # noqa: E402

MODES = {"off": (0, 0), "on": (scenario.DELAY, scenario.TIMEOUT)}


def restart_figures(restart: scenario.Disruption) -> dict[str, float]:
    out = (restart.came_back or restart.back) - restart.out if restart.out else 0.0
    return {"requests": len(restart.requests), "failed": len(restart.failed),
            "out_s": out, "returned_s": restart.returned - restart.asked,
            "back_s": restart.back - restart.asked}


def one_mode(nodes: Nodes, tmp: Path, mode: str, rounds: int) -> dict[str, list[dict[str, float]]]:
    delay, timeout = MODES[mode]
    figures: dict[str, list[dict[str, float]]] = {"one": [], "worker": [], "crash": []}
    (tmp / mode).mkdir()
    with scenario.running(nodes, tmp / mode, delay, timeout) as cluster:
        for _ in range(rounds):
            cluster.serving("one")
            figures["one"].append(restart_figures(
                scenario.planned_restart(cluster, "node-a", "one")))
            cluster.serving("one")
            figures["crash"].append({"restart_s": scenario.crash(cluster, "node-a", "one")})
            cluster.serving("tp")
            figures["worker"].append(restart_figures(
                scenario.planned_restart(cluster, "node-b", "tp")))
    return figures


def show(label: str, rows: list[dict[str, float]]) -> str:
    keys = rows[0].keys()
    parts = []
    for key in keys:
        values = [r[key] for r in rows]
        value = statistics.median(values)
        parts.append(f"{key} {value:.0f}" if key in ("requests", "failed")
                     else f"{key} {value:.1f}")
    return f"  {label:<24} " + ", ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1, help="restarts of each kind per mode")
    args = parser.parse_args()
    assert os.geteuid() == 0, "needs root (network namespaces, user managers)"
    assert_engines()
    print(f"vLLM {VLLM_VERSION} (CPU), {os.cpu_count()} CPUs, {scenario.CLIENTS} clients, "
          f"{args.rounds} round(s); drain on = delay {scenario.DELAY} s, timeout "
          f"{scenario.TIMEOUT} s")
    tag = f"{os.getpid() % 10000}d"
    results = {}
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-drain-") as tmp_dir:
        tmp = Path(tmp_dir)
        with two_node_network("llmgw-bench", tag, tmp) as nodes:
            for mode in MODES:
                started = time.monotonic()
                results[mode] = one_mode(nodes, tmp, mode, args.rounds)
                print(f"(drain {mode}: {time.monotonic() - started:.0f} s)", flush=True)
    for kind, title in (("one", "restart of a one-node replica"),
                        ("worker", "restart of tp's worker node"),
                        ("crash", "SIGKILL of one's engine")):
        print(title)
        for mode in MODES:
            print(show(f"drain {mode} (baseline)" if mode == "off" else f"drain {mode}",
                       results[mode][kind]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
