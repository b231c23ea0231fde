"""Benchmark a spec change rolled through the fleet node by node, with the real vLLM (CPU
build) from scripts/setup-engines behind a real HAProxy (docs/loadbalancer.md), four
clients of 16-token completions throughout: the harness of
tests/engines/test_engine_drain.py. Two replicas in rotation: `tp` (vLLM mp, tensor
parallel over node-a, rank 0, and node-b, rank 1) and `standby` (a stand-in on node-b).

The change is one variable in every engine's environment, applied with `llmgw-render
--apply` on node-a, then on node-b (docs/generator.md, "The fleet roll is a plain loop").
The same roll twice, in one run:

- baseline: `--apply --no-wait`, the behaviour before rolling: every changed replica of a
  node restarts at once, and the apply returns without waiting;
- rolled: plain `--apply`: node-a stages `tp`, node-b restarts it once as a group and
  waits until it is routable again (and the gateways had the drain delay to notice),
  then restarts `standby`.

For each: requests and failed requests; the fewest of the two replicas in HAProxy's
rotation in any sample (a quarter of a second apart); engine starts per engine; seconds
from the first apply until both serve in rotation again, against the sum of the seconds
each replica spent out of rotation (a roll that takes one replica out at a time takes at
least that sum).

Needs root and the engine cache (bash scripts/setup-engines). Run:
    .venv/bin/python bench/rollout.py
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / d) for d in ("", "support", "integration", "engines")]

import test_engine_drain as scenario  # noqa: E402
from realengine import VLLM_VERSION, assert_engines  # noqa: E402
from systemd_harness import two_node_network  # noqa: E402

MODES = {"baseline (--no-wait)": ("baseline", ("--no-wait",)), "rolled": ("rolled", ())}


def figures(roll: scenario.Roll) -> str:
    out = {r: roll.out_of_rotation(r) for r in scenario.ROLLED}
    return (f"{len(roll.requests)} requests, {len(roll.failed)} failed; fewest in rotation "
            f"{roll.fewest_in_rotation()} of {len(scenario.ROLLED)}; engine starts "
            f"{roll.restarts()}; roll {roll.took:.1f} s, out of rotation "
            + ", ".join(f"{r} {s:.1f} s" for r, s in out.items())
            + f" (sum {sum(out.values()):.1f} s); applies took "
            + ", ".join(f"{n} {s:.1f} s" for n, s in roll.applies.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args()
    assert os.geteuid() == 0, "needs root (network namespaces, user managers)"
    assert_engines()
    print(f"vLLM {VLLM_VERSION} (CPU), {os.cpu_count()} CPUs, {scenario.CLIENTS} clients; "
          f"drain delay {scenario.DELAY} s, timeout {scenario.TIMEOUT} s")
    tag = f"{os.getpid() % 10000}r"
    results = {}
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-rollout-") as tmp_dir:
        tmp = Path(tmp_dir)
        with two_node_network("llmgw-bench", tag, tmp) as nodes, \
                scenario.running(nodes, tmp) as cluster:
            for mode, (value, extra) in MODES.items():
                results[mode] = scenario.roll(cluster, value, *extra)
                print(f"({mode}: {figures(results[mode])})", flush=True)
    print("a change rolled over node-a, then node-b (tp over both, standby on node-b)")
    for mode, roll in results.items():
        print(f"  {mode:<22} {figures(roll)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
