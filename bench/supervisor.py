"""Benchmark llmgw-supervisor against a real systemd user manager (the test harness).

Prints, in one run:
- detection latency: SIGKILL of a unit's main process -> the supervisor's API
  (GET /v1/replicas/NAME, polled every 0.5 ms) showing the replica no longer ready
  (median and max over --trials), beside the raw D-Bus signal latency (SIGKILL -> first
  PropertiesChanged for that unit, received by this process on the same bus) measured
  on the same kills;
- idle CPU of the supervisor over --idle seconds while it watches --units units;
- its memory (RSS).
Goals (issue 4): API latency median <= 2x the raw signal latency; idle CPU <= 0.5 % of
one core; RSS <= 60 MB.

Needs root (it starts a private systemd user manager). Run:
    .venv/bin/python bench/supervisor.py [--trials 50] [--idle 60] [--units 100]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "integration")]

from systemd_harness import UserManager, wait_until  # noqa: E402

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spec_text(replicas: int) -> str:
    lines = ["replicas:"]
    for i in range(replicas):
        lines += [
            f"  - name: bench-{i:03d}",
            "    engine: command",
            "    serving_rank: null",
            "    restart: {delay: 1, burst: 1000, interval: 100000}",
            "    health: {stability: 0}",
            "    nodes: [{name: node, address: 127.0.0.1}]",
            "    ranks: [{commands: [{argv: [/usr/bin/sleep, infinity]}]}]",
        ]
    return "\n".join(lines) + "\n"


def api(port: int, path: str) -> object:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
        return json.loads(resp.read())


def replica_state(port: int, replica: str) -> str:
    data = api(port, f"/v1/replicas/{replica}")
    assert isinstance(data, dict)
    return str(data["state"])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--idle", type=float, default=60.0)
    parser.add_argument("--units", type=int, default=100)
    options = parser.parse_args()
    replicas = -(-options.units // 3)  # target + engine + restart unit each

    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmp:
        manager = UserManager(f"llmgw-bench-{os.getpid()}", Path(tmp) / "node")
        manager.start()
        supervisor: subprocess.Popen[bytes] | None = None
        try:
            spec = Path(tmp) / "spec.yaml"
            spec.write_text(spec_text(replicas))
            manager.render(spec, "node")
            targets = [f"llmgw-bench-{i:03d}.target" for i in range(replicas)]
            manager.systemctl("start", *targets)
            port = free_port()
            supervisor = subprocess.Popen(
                [str(BIN / "llmgw-supervisor"), "--user", "--node", "node", "--listen",
                 f"127.0.0.1:{port}", str(spec)], env=manager.env,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_until(lambda: _all_ready(port, replicas), 120, "all shards ready")

            os.environ.update({k: manager.env[k] for k in ("XDG_RUNTIME_DIR",
                                                          "DBUS_SESSION_BUS_ADDRESS")})
            from llmgw_systemd.systemd_dbus import SystemdBus

            bus = SystemdBus(user=True)
            unit = "llmgw-bench-000-engine.service"
            escaped = unit.replace("-", "_2d").replace(".", "_2e")
            seen: dict[str, float] = {}
            armed = threading.Event()

            def on_signal(path: str) -> None:
                if armed.is_set() and path.endswith(escaped) and "sig" not in seen:
                    seen["sig"] = time.perf_counter()

            bus.watch([unit], on_signal)
            raw, via_api = [], []
            for _ in range(options.trials):
                wait_until(lambda: replica_state(port, "bench-000") == "ready", 30, "ready")
                pid = int(manager.show(unit, "MainPID")["MainPID"])
                assert pid > 1
                seen.clear()
                armed.set()
                started = time.perf_counter()
                os.kill(pid, signal.SIGKILL)
                while replica_state(port, "bench-000") == "ready":
                    time.sleep(0.0005)
                via_api.append(time.perf_counter() - started)
                wait_until(lambda: "sig" in seen, 10, "the raw signal")
                raw.append(seen["sig"] - started)
                armed.clear()
            bus.close()

            wait_until(lambda: _all_ready(port, replicas), 120, "all shards ready again")
            time.sleep(2)
            units = len(manager.llmgw_units())
            before = cpu_seconds(supervisor.pid)
            time.sleep(options.idle)
            idle_cpu = (cpu_seconds(supervisor.pid) - before) / options.idle * 100
            rss = rss_mb(supervisor.pid)
        finally:
            if supervisor is not None:
                supervisor.send_signal(signal.SIGTERM)
                supervisor.wait(timeout=15)
            manager.stop()

    med_raw, med_api = statistics.median(raw), statistics.median(via_api)
    print(f"trials: {len(raw)} SIGKILLs of {unit}'s main process")
    print(f"{'':24} {'median ms':>10} {'max ms':>8}")
    print(f"{'raw D-Bus signal':24} {med_raw * 1000:>10.1f} {max(raw) * 1000:>8.1f}")
    print(f"{'supervisor API':24} {med_api * 1000:>10.1f} {max(via_api) * 1000:>8.1f}")
    print(f"API / raw (median): {med_api / med_raw:.2f} (goal <= 2)")
    print(f"idle CPU over {options.idle:.0f} s watching {units} units: {idle_cpu:.2f} % of one "
          "core (goal <= 0.5 %)")
    print(f"RSS: {rss:.1f} MB (goal <= 60 MB)")


def _all_ready(port: int, replicas: int) -> bool:
    try:
        shards = api(port, "/v1/shards")
    except OSError:
        return False
    assert isinstance(shards, list)
    return len(shards) == replicas and all(s["state"] == "ready" for s in shards)


if __name__ == "__main__":
    main()
