"""gather.processes: the kernel's word on a unit's main process while systemd does not
answer (judge.held_read). Real processes: one running, one a zombie nobody reaped (as
under a manager too busy to reap), one gone."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from llmgw_systemd.gather.processes import gone
from llmgw_systemd.health.unit_state import UnitState


def unit(name: str, pid: int) -> UnitState:
    return UnitState(name, "loaded", "active", "running", main_pid=pid)


def test_running_zombie_and_missing_processes() -> None:
    running = subprocess.Popen(["sleep", "60"])
    zombie = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 10
        while (Path(f"/proc/{zombie.pid}/stat").read_text().rpartition(")")[2].split()[0]
               != "Z"):
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


def test_a_name_with_spaces_and_parentheses_is_read_past(tmp_path: Path) -> None:
    """COMM is whatever the process named itself: the state is after the last ')'."""
    for pid, stat in ((41, "41 (a) Z (b) S 1 41"), (42, "42 (x) y) R 1 42"),
                      (43, "43 (odd) Z 1 43")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(stat)
    units = [unit("one", 41), unit("two", 42), unit("three", 43), unit("none", 44)]
    assert gone(units, tmp_path) == ("three", "none")
