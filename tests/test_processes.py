"""gather.processes: the kernel's word on a unit's main process while systemd does not
answer (judge.held_read). Real processes: one running, one a zombie nobody reaped (as
under a manager too busy to reap), one gone; and the answer from inside the shipped
unit's sandbox, where /proc hides other users' processes (ProtectProc=invisible)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import llmgw_systemd
from llmgw_systemd.gather.processes import gone
from llmgw_systemd.health.unit_state import UnitState


def unit(name: str, pid: int) -> UnitState:
    return UnitState(name, "loaded", "active", "running", main_pid=pid)


def state_of(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def test_running_zombie_and_missing_processes() -> None:
    running = subprocess.Popen(["sleep", "60"])
    zombie = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 10
        while state_of(zombie.pid) != "Z":
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.01)
        finished = subprocess.Popen(["true"])
        finished.wait()  # reaped: its PID is no process now
        units = [unit("running.service", running.pid), unit("zombie.service", zombie.pid),
                 unit("missing.service", finished.pid), unit("never.service", 0)]
        assert gone(units) == ("zombie.service", "missing.service")
    finally:
        running.kill()
        running.wait()
        zombie.wait()


# Run as nobody, in a mount namespace whose /proc hides other users' processes, as
# ProtectProc=invisible does: the root-owned process is invisible in /proc, yet runs.
SANDBOXED = """
import os, sys
sys.path.insert(0, sys.argv[2])
from llmgw_systemd.gather.processes import gone
from llmgw_systemd.health.unit_state import UnitState
pid = int(sys.argv[1])
assert not os.path.exists(f"/proc/{pid}"), "the sandbox shows other users' processes"
print(gone([UnitState("engine.service", "loaded", "active", "running", main_pid=pid)]))
"""


def test_a_process_hidden_from_proc_still_counts_as_running() -> None:
    # nobody reads the package from a copy anyone may read (the checkout may be private),
    # with the system's Python 3.11 (a venv's path may be private too)
    shared = Path(tempfile.mkdtemp(prefix="llmgw-processes-"))
    running = subprocess.Popen(["sleep", "60"])
    try:
        shutil.copytree(Path(llmgw_systemd.__file__).parent, shared / "llmgw_systemd",
                        ignore=shutil.ignore_patterns("__pycache__"))
        for path in (shared, *shared.rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)
        python = ["/usr/bin/python3", "-I", "-S", "-c"]
        proc = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "--fork", "--",
             "/bin/sh", "-ec", 'mount -t proc -o hidepid=invisible proc /proc; exec "$@"',
             "sandbox", "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
             *python, SANDBOXED, str(running.pid), str(shared)],
            capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "()", proc.stdout
        running.kill()
        running.wait()
        proc = subprocess.run(
            [*python, SANDBOXED.replace("assert not", "assert True or"), str(running.pid),
             str(shared)], capture_output=True, text=True, timeout=60, check=False)
        assert proc.stdout.strip() == "('engine.service',)", (proc.stdout, proc.stderr)
    finally:
        running.kill()
        running.wait()
        shutil.rmtree(shared, ignore_errors=True)
