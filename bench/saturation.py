"""Benchmark slow is not down (docs/supervisor.md, "Slow is not down"): what a load
balancer sees of saturated replicas, under today's rules and a baseline revision's, in
the same run on the same engines.

The harness of tests/engines/test_engine_drain.py: the real vLLM (CPU build) from
scripts/setup-engines, `one` (one node) and `tp` (mp, tensor parallel over two network
namespaces, each with its own systemd user manager), one at a time or together (issue
40's layout; then `tp`'s two processes, sharing two cores with `one`, can go seconds
without a step, which is not busy), beside the stand-in `standby`; eight clients of 64-token
completions through a real HAProxy configured from docs/loadbalancer.md, whose checks
ask today's supervisors. Beside them, each node runs the supervisors of the baseline
revision (--baseline, a git ref; default: the commit before this issue's rules) on
another port, checked by a second real HAProxy with the same configuration that carries
no traffic, so both sets of rules judge the same engines under the same load at the same
moments.

For each health.timeout in --timeouts, over --seconds of load: per set of rules and
replica, how often HAProxy took it out of rotation (flips per hour) and for how long in
all; the requests and how many failed (they go to today's HAProxy only).

`tp`'s processes are pinned to CPU 0 by default (--pin; "" for not), so that they
saturate it. Issue 40's own layout, both replicas unpinned on both cores, is
`--layouts tp+one --pin "" --clients 4`; docs/supervisor.md ("Slow is not down") has
the figures of both.

Needs root and the engine cache (bash scripts/setup-engines). Run:
    .venv/bin/python bench/saturation.py [--seconds 300] [--timeouts 1,2] [--baseline REF]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / d) for d in ("", "support", "integration", "engines")]

import test_engine_drain as scenario  # noqa: E402
from loadbalancer import HAProxy, Sampler, Server, Traffic, summary, transitions  # noqa: E402
from realengine import VLLM_VERSION, assert_engines  # noqa: E402
from scale import baseline_tree  # noqa: E402
from specs import free_port  # noqa: E402
from supervisors import SUPERVISOR, SupervisorProcess, stop_and_show  # noqa: E402
from systemd_harness import two_node_network, wait_until  # noqa: E402

CLIENTS = 2 * scenario.CLIENTS
_MAIN = ("import sys; sys.argv[0] = 'llmgw-supervisor'; "
         "from llmgw_systemd.cli import supervisor_main; supervisor_main()")


class BaselineSupervisor(SupervisorProcess):
    """llmgw-supervisor as it was at the baseline: its package extracted into `code`,
    run with this venv's interpreter (and libraries) from that folder, so that nothing
    of today's package is imported."""

    def __init__(self, code: Path, *args: object, **kwargs: object) -> None:
        self.code = code
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def argv(self) -> list[str]:
        argv = super().argv()
        at = argv.index(SUPERVISOR)
        argv[at:at + 1] = ["env", "-C", str(self.code), f"PYTHONPATH={self.code}",
                           sys.executable, "-c", _MAIN]
        return argv


def out_of_rotation(samples: list[tuple[float, frozenset[str] | None]], server: str
                    ) -> tuple[int, float]:
    """(times taken out, seconds out in all) of `server` over the samples."""
    changes = transitions(samples, server)
    flips, out = 0, 0.0
    ends = [*changes[1:], (samples[-1][0], True)]
    for (at, up), (after, _) in zip(changes, ends):
        if not up:
            out += after - at
    for (_, before), (_, now) in zip(changes, changes[1:]):
        flips += before and not now
    return flips, out


def measure(cluster: scenario.Cluster, old_lb: HAProxy, original: str,
            replicas: list[str], timeout: int, seconds: float, clients: int,
            baseline: str) -> None:
    text = original.replace("interval: 1, timeout: 2, stability",
                            f"interval: 1, timeout: {timeout}, stability")
    assert text.count(f"timeout: {timeout}, stability") == 3, "spec shape"
    cluster.spec.write_text(text)
    time.sleep(8)  # every supervisor reads the spec again (its mtime)
    traffic = Traffic(cluster.lb.url, clients=clients, seconds=seconds, max_tokens=64,
                      timeout=120, netns=cluster.hub)
    with Sampler(cluster.lb, 0.25, seconds + 300) as now, \
            Sampler(old_lb, 0.25, seconds + 300) as before, traffic:
        pass
    hours = seconds / 3600
    print(f"{' + '.join(replicas)} serving, health.timeout {timeout} s, {seconds:.0f} s of "
          f"{clients} clients: {summary(traffic.requests)}")
    start = min((r.started for r in traffic.requests), default=0.0)
    for r in (r for r in traffic.requests if r.status != 200):
        print(f"  failed at +{r.started - start:.1f} s after {r.took:.1f} s: HTTP {r.status} "
              f"from {r.server or 'HAProxy itself'}{': ' + r.error if r.error else ''}")
    for replica in replicas:
        for name, sampler in ((f"baseline {baseline}", before), ("today", now)):
            flips, out = out_of_rotation(list(sampler.samples), replica)
            print(f"  {replica:>4} {name:>18}: {flips / hours:7.1f} flips/hour ({flips} in "
                  f"{seconds:.0f} s), {out:6.1f} s out of rotation, "
                  f"{len(sampler.samples)} samples", flush=True)


def run(seconds: float, timeouts: list[int], layouts: list[list[str]], clients: int,
        baseline: str, pin: str, tmp: Path) -> None:
    code = baseline_tree(baseline, tmp / "baseline")
    tag = f"{os.getpid() % 10000}s"
    (tmp / "cluster").mkdir()
    with two_node_network("llmgw-bench", tag, tmp) as nodes, \
            scenario.running(nodes, tmp / "cluster") as cluster:
        port = free_port()
        old = [BaselineSupervisor(code, nodes[n], n, cluster.spec,
                                  listen=f"{a}:{port}", state_dir=tmp / f"old-{n}",
                                  extra=["--peer-port", str(port),
                                         "--local", f"127.0.0.1:{free_port()}"])
               for n, a in scenario.ADDRESS.items()]
        old_lb: HAProxy | None = None
        try:
            servers = [Server(r, scenario.ADDRESS[n[0]], cluster.ports[r],
                              scenario.ADDRESS[n[0]], port, n[0])
                       for r, n in scenario.NODES.items()]
            old_lb = HAProxy(tmp / "lb-old", servers, netns=cluster.hub,
                             port=8081).start(timeout=30)
            original = cluster.spec.read_text()
            for replicas in layouts:
                cluster.serving(replicas[0])  # and no other vLLM replica
                for other in replicas[1:]:
                    for node in reversed(scenario.NODES[other]):  # rank 0 waits for rank 1
                        nodes[node].systemctl("start", f"llmgw-{other}.target")
                    wait_until(functools.partial(cluster.completes, other), scenario.BACK,
                               f"{other} to complete", interval=1)
                for lb in (cluster.lb, old_lb):
                    for replica in replicas:
                        lb.wait_until_up(replica, timeout=120)
                pinned = bool(pin) and "tp" in replicas
                if pinned:
                    # tp's processes on the cores given, which they saturate: their API
                    # servers' event loops wait behind the engines' threads
                    print(f"tp's {scenario.pin(cluster, pin)} processes pinned to CPUs {pin}")
                try:
                    for timeout in timeouts:
                        measure(cluster, old_lb, original, replicas, timeout, seconds,
                                clients, baseline)
                finally:
                    if pinned:
                        scenario.pin(cluster, f"0-{(os.cpu_count() or 1) - 1}")
        finally:
            if old_lb is not None:
                old_lb.stop()
            stop_and_show(old)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300, help="of load per timeout")
    parser.add_argument("--timeouts", default="1,2", help="health.timeout values, seconds")
    parser.add_argument("--baseline", default="631b056", help="a git ref of this repository")
    parser.add_argument("--layouts", default="tp,one,tp+one",
                        help="what serves, in turn: a replica, or several joined by +")
    parser.add_argument("--clients", type=int, default=CLIENTS)
    parser.add_argument("--pin", default="0",
                        help="CPUs for tp's processes (taskset list); empty: not pinned")
    args = parser.parse_args()
    assert os.geteuid() == 0, "needs root (network namespaces, user managers)"
    assert_engines()
    print(f"vLLM {VLLM_VERSION} (CPU), {os.cpu_count()} CPUs, {args.clients} clients "
          f"through HAProxy, beside the stand-in, health interval 1 s")
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-saturation-") as tmp:
        run(args.seconds, [int(t) for t in args.timeouts.split(",")],
            [layout.split("+") for layout in args.layouts.split(",")], args.clients,
            args.baseline, args.pin, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
