"""Benchmark boot-to-serving on a booted node (systemd as PID 1, the deb installed),
beside the engine's start on its own, measured in the same run on the same node.

A node container (tests/booted/nodes.py) with the package and an `enable: true` one-node
vLLM replica (mp) is booted; per round:
- through the units: from the container's boot starting to the first `/health` 200, and
  when the engine's ExecStart= began (systemd's timestamp);
- on its own: the same node booted with the replica's spec moved away, then the engine's
  very command line and environment (read from its rendered unit) started inside as a
  bare transient unit (systemd-run: none of our units, no generator, no waits), from its
  start to the first `/health` 200.
What the units and the generator add = (boot to the engine's start) + (engine start to
serving under the units - the engine on its own). Goal: at most 2 s.

Needs root and the engine cache (bash scripts/setup-engines). Run:
    .venv/bin/python bench/booted.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / d) for d in ("", "support", "integration", "booted")]

from nodes import ENGINE_VENV, MODEL, Node, booted_nodes  # noqa: E402
from realengine import assert_engines  # noqa: E402
from systemd_harness import wait_until  # noqa: E402

SPEC = f"""replicas:
  - name: solo
    engine: vllm
    launch_mode: mp
    enable: true
    model: {MODEL}
    virtualenv: {ENGINE_VENV}
    port: 8000
    env: {{HF_HUB_OFFLINE: "1", TRANSFORMERS_OFFLINE: "1", VLLM_CPU_KVCACHE_SPACE: "1"}}
    args: [--max-model-len, "256", --enforce-eager, --dtype, float32]
    nodes: [{{name: node-a, address: 198.51.100.1}}]
"""
HEALTH = "http://127.0.0.1:8000/health"
SPEC_PATH = "etc/llmgw/replicas.d/solo.yaml"


def serving(node: Node, timeout: float = 300) -> float:
    return wait_until(lambda: time.monotonic() if node.http(HEALTH, timeout=1)[0] == 200
                      else None, timeout, "/health 200", interval=0.2)


def engine_command(node: Node) -> tuple[list[str], dict[str, str]]:
    """The engine unit's ExecStart= argv and Environment=, as systemd parsed them."""
    show = node.show("llmgw-solo-engine.service", "ExecStart", "Environment")
    argv_text = show["ExecStart"].split("argv[]=", 1)[1].split(" ;", 1)[0]
    env = dict(item.split("=", 1) for item in shlex.split(show["Environment"]))
    return shlex.split(argv_text), env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    assert_engines()
    deb_build = subprocess.run(["bash", "packaging/build", "--deb-only"], cwd=ROOT,
                               capture_output=True, text=True, timeout=600, check=True,
                               env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    deb = Path(deb_build.stdout.strip().split()[-1])
    if not deb.is_absolute():
        deb = ROOT / deb
    units: list[tuple[float, float, float]] = []  # (boot to serving, to start, start to serving)
    alone: list[float] = []
    with booted_nodes("bench", 1, binds=(ENGINE_VENV, MODEL)) as (node,):
        shutil.copy(deb, node.root / "root" / deb.name)
        node.run("apt-get", "install", "-y", "-q", "--no-install-recommends",
                 f"/root/{deb.name}", timeout=600)
        node.write("/etc/llmgw/node", "node-a\n")
        node.write(f"/{SPEC_PATH}", SPEC)
        node.reboot()
        node.wait_booted()
        serving(node)  # once, untimed: a first start fills the page cache and torch's caches
        argv, env = engine_command(node)
        for _ in range(args.rounds):
            booted = node.reboot()
            ready = serving(node)
            started = int(node.show("llmgw-solo-engine.service",
                                    "ExecMainStartTimestampMonotonic")
                          ["ExecMainStartTimestampMonotonic"]) / 1e6
            units.append((ready - booted, started - booted, ready - started))

            spec = node.root / SPEC_PATH
            spec.rename(spec.with_suffix(".off"))  # no replica at this boot
            node.reboot()
            node.wait_booted()
            begun = time.monotonic()
            # a bare transient unit: no llmgw unit, no generator, nothing to wait for;
            # a unit all the same, so that its stop leaves no process behind
            node.run("systemd-run", "--unit=bench-alone", "--collect",
                     *(f"--setenv={k}={v}" for k, v in env.items()), *argv)
            try:
                alone.append(serving(node) - begun)
            finally:
                node.systemctl("stop", "bench-alone.service", check=False)
            spec.with_suffix(".off").rename(spec)

    def med(values: list[float]) -> float:
        return statistics.median(values)

    to_serving, to_start, start_to_serving = (med([u[i] for u in units]) for i in range(3))
    added = to_start + (start_to_serving - med(alone))
    print(f"vLLM (CPU build), one node, mp; {args.rounds} rounds, medians:")
    print(f"  boot to serving, through the units and the generator  {to_serving:6.1f} s")
    print(f"    of which boot to the engine's start                 {to_start:6.1f} s")
    print(f"    of which the engine's start to serving              {start_to_serving:6.1f} s")
    print(f"  the engine on its own, start to serving (baseline)     {med(alone):6.1f} s")
    print(f"  what the units and the generator add                   {added:6.1f} s "
          f"(goal <= 2 s); rounds: {', '.join(f'{u[0]:.1f}' for u in units)} against "
          f"{', '.join(f'{a:.1f}' for a in alone)}")


if __name__ == "__main__":
    main()
