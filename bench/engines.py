"""Benchmark the units against the bare commands, with the real vLLM (CPU build) and Ray
from scripts/setup-engines, under real systemd user managers (the test harness).

For each replica (one node on mp; two nodes on Ray; two nodes on mp, each node in its
own network namespace), in one run:
- time to first completion started through the units (`systemctl start` of each node's
  target, worker first) beside the same command lines (taken from the rendered units,
  with their environment) started by hand in the right order; the overhead is the
  difference (goal: <= 1 s beyond the configured delays, and the units here wait for
  nothing the bare commands do not);
- recovery after a fault (Ray: SIGKILL of the worker's raylet; mp: SIGKILL of every
  process of rank 1): fault -> first completion again through the units, beside the
  engine's own start time (the bare time to first completion) and the restart delay.

Needs root and the engine cache (bash scripts/setup-engines). Run:
    .venv/bin/python bench/engines.py [--only single,ray,mp]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / d) for d in ("", "support", "integration", "engines")]

from realengine import (  # noqa: E402
    ENGINE_ARGS,
    MODEL,
    VENV,
    VLLM_VERSION,
    assert_engines,
    cmdline,
    complete,
    env_yaml,
    manager_pids,
)
from specs import free_port  # noqa: E402
from systemd_harness import (  # noqa: E402
    UserManager,
    cgroup_pids,
    cgroup_roots,
    make_network,
    remove_network,
)
from unitfile import read_env, read_exec, read_unit  # noqa: E402

DELAY = 2  # restart.delay of every replica here


def spec(mode: str, nodes: int, http: int, rendezvous: int) -> str:
    ray = mode == "ray"
    extra = {"LLMGW_TEST_RAY_ON_CPU": "1"} if ray else {}
    node_list = ("[{name: node-a, address: 127.0.0.1}]" if nodes == 1 else
                 "[{name: node-a, address: 192.0.2.1, interface: eth0}, "
                 "{name: node-b, address: 192.0.2.2, interface: eth0}]")
    return f"""\
replicas:
  - name: tiny
    engine: vllm
    launch_mode: {mode}
    model: {MODEL}
    virtualenv: {VENV}
    tensor_parallel_size: {nodes}
    port: {http}
    rendezvous_port: {rendezvous}
    env: {env_yaml(extra)}
    args: {ENGINE_ARGS}
{"    ray_num_gpus: 1" if ray else ""}
    restart: {{delay: {DELAY}, burst: 20, interval: 900}}
    nodes: {node_list}
"""


def first_completion(manager: UserManager, base: str, since: float, limit: float = 600
                     ) -> float:
    deadline = since + limit
    while time.monotonic() < deadline:
        if complete(manager, base, timeout=10) == 200:
            return time.monotonic() - since
        time.sleep(0.2)
    raise SystemExit(f"no completion within {limit} s")


class Bare:
    """The rendered command lines started by hand, in a cgroup of their own (Ray's
    daemons double-fork out of any process group), stopped by PID."""

    def __init__(self, tag: str) -> None:
        self.relative = f"llmgw-bench-bare-{tag}"
        self.groups = [root / self.relative for root in cgroup_roots()]
        for group in self.groups:
            group.mkdir(exist_ok=True)

    def start(self, manager: UserManager, unit: str, log: Path) -> None:
        entries = read_unit((manager.unit_dir / unit).read_text())
        argv = read_exec(entries["Service.ExecStart"][0])
        env = dict(read_env(v) for v in entries.get("Service.Environment", []))
        env["PATH"] = "/usr/bin:/bin"
        if manager.netns is not None:
            argv = ["ip", "netns", "exec", manager.netns.name, *argv]
        procs = [str(g / "cgroup.procs") for g in self.groups]

        def enter() -> None:
            for path in procs:
                Path(path).write_text(str(os.getpid()))

        subprocess.Popen(argv, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, preexec_fn=enter)  # noqa: PLW1509

    def stop(self) -> None:
        for _ in range(100):
            pids = cgroup_pids(self.relative)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        for group in self.groups:
            group.rmdir()


def run_case(name: str, mode: str, nodes: int, work: Path,
             fault: Callable[[list[UserManager]], None], bare_first: bool
             ) -> dict[str, float]:
    tag = f"{os.getpid() % 10000}{len(name)}"
    managers: list[UserManager] = []
    network = make_network(tag, 2) if nodes == 2 else []
    try:
        for i in range(nodes):
            m = UserManager(f"llmgw-bench-{tag}-{i}", work / name / f"node-{i}",
                            netns=network[i] if network else None)
            m.start()
            managers.append(m)
        http, rendezvous = free_port(), free_port()
        spec_file = work / name / "spec.yaml"
        spec_file.write_text(spec(mode, nodes, http, rendezvous))
        for i, m in enumerate(managers):
            m.render(spec_file, f"node-{'ab'[i]}")
        leader = managers[0]
        base = f"http://{'127.0.0.1' if nodes == 1 else '192.0.2.1'}:{http}"
        bare_ttfc = run_bare(tag, name, managers, base, rendezvous, work) if bare_first else 0.0
        started = time.monotonic()
        for m in reversed(managers):  # worker first: it waits for the leader
            m.systemctl("start", "llmgw-tiny.target")
        units_ttfc = first_completion(leader, base, started)
        fault_at = time.monotonic()
        fault(managers)
        deadline = fault_at + 60
        while complete(leader, base, timeout=5) == 200:  # until the fault shows
            if time.monotonic() > deadline:
                raise SystemExit("the fault never showed in completions")
            time.sleep(0.2)
        recovery = first_completion(leader, base, fault_at)
        for m in managers:
            m.systemctl("stop", "llmgw-tiny.target")
        if not bare_first:
            bare_ttfc = run_bare(tag, name, managers, base, rendezvous, work)
        return {"units": units_ttfc, "bare": bare_ttfc, "recovery": recovery}
    finally:
        for m in managers:
            m.stop()
        if network:
            remove_network(tag)


def run_bare(tag: str, name: str, managers: list[UserManager], base: str, rendezvous: int,
             work: Path) -> float:
    """The rendered command lines by hand: the Ray head first, waited for as the units
    wait for it, then every rank's engine, workers first."""
    leader = managers[0]
    bare = Bare(tag)
    try:
        started = time.monotonic()
        sidecars = [f for f in os.listdir(leader.unit_dir) if f.endswith("ray-head.service")]
        for unit in sidecars:
            bare.start(leader, unit, work / name / "bare.log")
            wait_port(leader, "127.0.0.1" if len(managers) == 1 else "192.0.2.1", rendezvous)
        for m in reversed(managers):
            bare.start(m, "llmgw-tiny-engine.service", work / name / "bare.log")
        return first_completion(leader, base, started)
    finally:
        bare.stop()


def wait_port(manager: UserManager, host: str, port: int) -> None:
    code = f"import socket; socket.create_connection(('{host}', {port}), timeout=1)"
    argv = ["/usr/bin/python3", "-c", code]
    if manager.netns is not None:
        argv = ["ip", "netns", "exec", manager.netns.name, *argv]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if subprocess.run(argv, capture_output=True, check=False, timeout=10).returncode == 0:
            return
        time.sleep(0.1)
    raise SystemExit(f"{host}:{port} never opened")


def kill_raylet(managers: list[UserManager]) -> None:
    worker = managers[1]
    for pid in manager_pids(worker):
        if cmdline(pid).split(" ")[0].endswith("/raylet"):
            os.kill(pid, signal.SIGKILL)
            return
    raise SystemExit("no raylet on the worker")


def kill_rank1(managers: list[UserManager]) -> None:
    managers[1].systemctl("kill", "--signal=SIGKILL", "llmgw-tiny-engine.service")


def kill_engine(managers: list[UserManager]) -> None:
    managers[0].systemctl("kill", "--signal=SIGKILL", "llmgw-tiny-engine.service")


CASES = {
    "single": ("mp", 1, kill_engine, "SIGKILL of the engine"),
    "ray": ("ray", 2, kill_raylet, "SIGKILL of the worker's raylet"),
    "mp": ("mp", 2, kill_rank1, "SIGKILL of all of rank 1"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="single,ray,mp")
    parser.add_argument("--bare-first", action="store_true",
                        help="start the bare commands before the units (order bias check)")
    args = parser.parse_args()
    assert_engines()
    if os.geteuid() != 0:
        raise SystemExit("needs root (private systemd managers, network namespaces)")
    print(f"vLLM {VLLM_VERSION} (CPU build), {os.cpu_count()} cores; restart delay {DELAY} s; "
          f"{'bare' if args.bare_first else 'units'} first")
    results = {}
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-engines-") as tmp:
        for name in args.only.split(","):
            mode, nodes, fault, what = CASES[name]
            r = run_case(name, mode, nodes, Path(tmp), fault, args.bare_first)
            results[name] = r
            print(f"{name:7} ({mode}, {nodes} node{'s' * (nodes > 1)}): first completion "
                  f"units {r['units']:.1f} s, bare {r['bare']:.1f} s, overhead "
                  f"{r['units'] - r['bare']:+.1f} s; after {what}: serving again in "
                  f"{r['recovery']:.1f} s (engine start {r['bare']:.1f} s + restart delay "
                  f"{DELAY} s = {r['bare'] + DELAY:.1f} s)", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
