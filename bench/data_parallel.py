"""Benchmark a data-parallel replica against today's tensor-parallel one, with the real
vLLM (CPU build) over two network namespaces, each with its own systemd user manager and
supervisor (the test harness). In one run, for each layout:

- `tp`: vLLM's mp backend, tensor parallel 2 over the two nodes (rank 1 headless);
- `dp`: data parallel 2 over the two nodes, vLLM's internal mode (node-a serves and
  balances over both data-parallel ranks; node-b headless);

it measures
- start: `systemctl start` of both targets (worker first) to the first completion (the
  engine's own start through the units), and to both supervisors saying `ready`;
- a death: SIGKILL of every process of node-b's engine unit, to node-b's new main process,
  to node-a's new main process (the group restart: in `dp` node-a's vLLM never notices the
  dead rank, so only the supervisors restart it), and to both supervisors saying `ready`
  again.

Needs root and the engine cache (bash scripts/setup-engines). Run:
    .venv/bin/python bench/data_parallel.py [--only tp,dp]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / d) for d in ("", "support", "integration", "engines")]

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

TARGET, ENGINE = "llmgw-bench.target", "llmgw-bench-engine.service"
LAYOUTS = {"tp": "tensor_parallel_size: 2", "dp": "data_parallel_size: 2"}
LIMIT = 600  # bound on any one wait


def spec_text(layout: str, http: int, rendezvous: int) -> str:
    return f"""\
replicas:
  - name: bench
    engine: vllm
    launch_mode: mp
    model: {MODEL}
    virtualenv: {VENV}
    {LAYOUTS[layout]}
    port: {http}
    rendezvous_port: {rendezvous}
    env: {env_yaml()}
    args: {ENGINE_ARGS}
    stop_timeout: 20
    drain: {{delay: 3, timeout: 10}}
    restart: {{delay: 2, burst: 20, interval: 900}}
    health: {{interval: 1, timeout: 2, stability: 2, generation: {{interval: 1, timeout: 5}}}}
    group_restart: {{delay: 1, max_delay: 8, budget: 10, window: 900}}
    nodes:
      - {{name: node-a, address: 192.0.2.1, interface: eth0}}
      - {{name: node-b, address: 192.0.2.2, interface: eth0}}
"""


def main_pid(manager: UserManager) -> int:
    return int(manager.show(ENGINE, "MainPID")["MainPID"])


def all_ready(sups: list[SupervisorProcess]) -> bool:
    return all(s.replica("bench")["state"] == "ready" for s in sups)


def run(layout: str, work: Path) -> dict[str, float]:
    tag = f"{os.getpid() % 10000}{len(layout)}{'td'.index(layout[0])}"
    network = make_network(tag, 2)
    managers: list[UserManager] = []
    sups: list[SupervisorProcess] = []
    try:
        for i in range(2):
            m = UserManager(f"llmgw-bench-{tag}-{i}", work / layout / f"node-{i}",
                            netns=network[i])
            m.start()
            managers.append(m)
        leader, worker = managers
        http, rendezvous, api = free_port(), free_port(), free_port()
        spec = work / layout / "spec.yaml"
        spec.write_text(spec_text(layout, http, rendezvous))
        for i, m in enumerate(managers):
            m.render(spec, f"node-{'ab'[i]}")
            sups.append(SupervisorProcess(m, f"node-{'ab'[i]}", spec,
                                          listen=f"192.0.2.{i + 1}:{api}",
                                          state_dir=work / layout / f"sup-{i}"))
        base = f"http://192.0.2.1:{http}"
        started = time.monotonic()
        worker.systemctl("start", TARGET)
        leader.systemctl("start", TARGET)
        wait_until(lambda: complete(leader, base) == 200, LIMIT, "a first completion",
                   interval=0.2)
        first = time.monotonic() - started
        wait_until(lambda: all_ready(sups), LIMIT, "both supervisors ready", interval=0.2)
        ready = time.monotonic() - started
        time.sleep(5)  # settled: a death from here on restarts the group
        old = {id(m): main_pid(m) for m in managers}
        killed = time.monotonic()
        worker.systemctl("kill", "--signal=SIGKILL", ENGINE)
        again: dict[str, float] = {}

        def restarted() -> bool:
            for name, m in zip(("node_b", "node_a"), (worker, leader)):
                if name not in again and main_pid(m) not in (0, old[id(m)]):
                    again[name] = time.monotonic() - killed
            return len(again) == 2
        wait_until(restarted, LIMIT, "every rank's new main process", interval=0.05)
        wait_until(lambda: all_ready(sups), LIMIT, "both supervisors ready again",
                   interval=0.2)
        back = time.monotonic() - killed
        for m in managers:
            m.systemctl("stop", TARGET)
        return {"first_completion_s": first, "ready_s": ready,
                "kill_to_node_b_s": again["node_b"], "kill_to_node_a_s": again["node_a"],
                "kill_to_ready_s": back}
    finally:
        for sup in sups:
            sup.stop()
        for m in managers:
            m.stop()
        remove_network(tag)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="tp,dp")
    args = parser.parse_args()
    assert_engines()
    if os.geteuid() != 0:
        raise SystemExit("needs root (private systemd managers, network namespaces)")
    results = {}
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-dp-") as tmp:
        for layout in args.only.split(","):
            results[layout] = run(layout, Path(tmp))
    print(f"vLLM {VLLM_VERSION} (CPU build), {os.cpu_count()} cores, two namespaces, "
          "supervisors on both; restart delay 2 s, group restart delay 1 s")
    print(f"{'layout':6} {'start->completion':>18} {'start->ready':>13} "
          f"{'kill->node-b':>13} {'kill->node-a':>13} {'kill->ready':>12}")
    for layout, r in results.items():
        print(f"{layout:6} {r['first_completion_s']:17.1f}s {r['ready_s']:12.1f}s "
              f"{r['kill_to_node_b_s']:12.1f}s {r['kill_to_node_a_s']:12.1f}s "
              f"{r['kill_to_ready_s']:11.1f}s")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
