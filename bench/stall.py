"""Benchmark liveness on bad days, with the real vLLM (CPU build) and Ray from
scripts/setup-engines, tensor parallel over two network namespaces, each with its own
systemd user manager and supervisor (the test harness). In one run of one replica:

- the engine's start time: `systemctl start` of both targets to the first completion;
- saturation (six clients of 200-token completions, --max-num-seqs 2, for 3 x
  stall_after), read by supervisors with stall detection on, beside the same load read
  with it off (health.stall_after: 0, the behaviour before liveness): samples not ready,
  ready -> not ready flaps, group restarts, completions that failed;
- a freeze (SIGSTOP of every process of the worker node's engine unit: mp rank 1, or a
  Ray worker node): time to the stall restart (the supervisor's
  llmgw_stall_restarts_total moves) and to serving again (a completion, and the leader's
  supervisor says ready), beside stall_after and the engine's start time.

The supervisors are swapped (a spec differing only in health.stall_after) while the
engines keep running: stall detection lives in the supervisor, not in the units.

Needs root and the engine cache (bash scripts/setup-engines). Run:
    .venv/bin/python bench/stall.py [--mode mp|ray] [--stall-after 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / d) for d in ("", "support", "integration", "engines")]

import test_engine_stall as scenario  # noqa: E402
from realengine import VLLM_VERSION, Load, assert_engines, complete  # noqa: E402
from specs import free_port  # noqa: E402
from supervisors import SupervisorProcess  # noqa: E402
from systemd_harness import UserManager, make_network, remove_network, wait_until  # noqa: E402

TARGET, ENGINE = scenario.TARGET, scenario.ENGINE


def supervisors(managers: list[UserManager], spec: Path, port: int) -> list[SupervisorProcess]:
    return [SupervisorProcess(m, f"node-{'ab'[i]}", spec, listen=f"192.0.2.{i + 1}:{port}",
                              state_dir=m.state / f"sup-{spec.stem}")
            for i, m in enumerate(managers)]


def saturation(leader: UserManager, base: str, sups: list[SupervisorProcess],
               seconds: float) -> dict[str, float]:
    restarts = [float(s.replica("tiny")["group_restarts"]) for s in sups]
    samplers = [scenario.said_by(s) for s in sups]
    with samplers[0], samplers[1], Load(leader, base, clients=6, seconds=seconds,
                                        tokens=200) as load:
        pass
    states = [s for sampler in samplers for _, s in sampler.seen]
    flaps = sum(1 for sampler in samplers
                for (_, a), (_, b) in zip(sampler.seen, sampler.seen[1:])
                if a.startswith("ready") and not b.startswith("ready"))
    took = [r["took"] for r in load.results if r["status"] == 200]
    return {"samples": len(states),
            "not_ready": sum(1 for s in states if not s.startswith("ready")),
            "busy": sum(1 for s in states if "busy" in s), "flaps": flaps,
            "restarts": sum(float(s.replica("tiny")["group_restarts"]) - r
                            for s, r in zip(sups, restarts)),
            "completions": len(load.results),
            "failed": sum(1 for r in load.results if r["status"] != 200),
            "median_s": statistics.median(took) if took else 0.0}


def freeze(leader: UserManager, worker: UserManager, base: str,
           sups: list[SupervisorProcess]) -> dict[str, float]:
    metric = 'llmgw_stall_restarts_total{replica="tiny"}'
    before = sups[0].metric(metric)
    frozen = time.monotonic()
    worker.systemctl("kill", "--signal=SIGSTOP", ENGINE)
    restarted = wait_until(lambda: time.monotonic() if sups[0].metric(metric) > before
                           else None, 600, "the stall restart", interval=0.5)
    wait_until(lambda: complete(leader, base, timeout=5) == 200
               and sups[0].replica("tiny")["state"] == "ready", 600, "serving again",
               interval=0.5)
    return {"restart_s": restarted - frozen, "serving_s": time.monotonic() - frozen}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("mp", "ray"), default="mp")
    parser.add_argument("--stall-after", type=int, default=scenario.STALL_AFTER)
    args = parser.parse_args()
    assert_engines()
    if os.geteuid() != 0:
        raise SystemExit("needs root (private systemd managers, network namespaces)")
    scenario.STALL_AFTER = args.stall_after
    tag = f"{os.getpid() % 10000}9"
    managers: list[UserManager] = []
    sups: list[SupervisorProcess] = []
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-stall-") as tmp:
        work = Path(tmp)
        network = make_network(tag, 2)
        try:
            for i in range(2):
                m = UserManager(f"llmgw-bench-{tag}-{i}", work / f"node-{i}",
                                netns=network[i])
                m.start()
                managers.append(m)
            leader, worker = managers
            http, rendezvous = free_port(), free_port()
            on = work / "on.yaml"
            on.write_text(scenario.spec_text(http, rendezvous, args.mode))
            off = work / "off.yaml"  # the same replica, stall detection off
            off.write_text(on.read_text().replace(f"stall_after: {args.stall_after}",
                                                  "stall_after: 0"))
            for i, m in enumerate(managers):
                m.render(on, f"node-{'ab'[i]}")
            base = f"http://192.0.2.1:{http}"
            started = time.monotonic()
            worker.systemctl("start", TARGET)
            leader.systemctl("start", TARGET)
            wait_until(lambda: complete(leader, base) == 200, 600, "a first completion",
                       interval=0.5)
            engine_start = time.monotonic() - started
            port = free_port()
            results: dict[str, object] = {"engine_start_s": engine_start}
            for name, spec in (("off", off), ("on", on)):
                sups = supervisors(managers, spec, port)
                for sup in sups:
                    sup.wait_state("tiny", "ready", 120)
                results[f"saturation_{name}"] = saturation(leader, base, sups,
                                                           3 * args.stall_after)
                if name == "on":
                    results["freeze"] = freeze(leader, worker, base, sups)
                for sup in sups:
                    sup.stop()
                sups = []
            for m in managers:
                m.systemctl("stop", TARGET)
        finally:
            for sup in sups:
                sup.stop()
            for m in managers:
                m.stop()
            remove_network(tag)
    print(f"vLLM {VLLM_VERSION} (CPU build), {os.cpu_count()} cores, {args.mode}, TP=2 "
          f"over two namespaces; stall_after {args.stall_after} s; engine start "
          f"{engine_start:.1f} s")
    for name in ("off", "on"):
        r = results[f"saturation_{name}"]
        assert isinstance(r, dict)
        print(f"saturation, stall detection {name:3}: not ready in {r['not_ready']} of "
              f"{r['samples']} samples, {r['flaps']} flaps, busy {r['busy']}, "
              f"{r['restarts']:.0f} group restarts; {r['completions']} completions, "
              f"{r['failed']} failed, median {r['median_s']:.1f} s")
    f = results["freeze"]
    assert isinstance(f, dict)
    print(f"freeze of the worker node's engine: stall restart after {f['restart_s']:.1f} s "
          f"(stall_after {args.stall_after} s), serving again after {f['serving_s']:.1f} s "
          f"(stall_after + engine start = {args.stall_after + engine_start:.1f} s)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
