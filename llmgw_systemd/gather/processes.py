"""Whether the main processes systemd last named still run: the kernel's word on this
node's shard while systemd itself does not answer (judge.held_read).

A process that died while its manager was too busy to reap it is a zombie: it is gone
as far as serving goes, so a zombie counts as gone, as does a PID no longer there.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from llmgw_systemd.health.unit_state import UnitState

PROC = Path("/proc")


def _runs(pid: int, proc: Path) -> bool:
    try:
        stat = (proc / str(pid) / "stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return False
    # "PID (COMM) STATE ...": COMM may hold spaces and parentheses; the state follows
    # the last ")"
    state = stat.rpartition(")")[2].split()[:1]
    return bool(state) and state[0] not in ("Z", "X")


def gone(units: Iterable[UnitState], proc: Path = PROC) -> tuple[str, ...]:
    """The units whose main process, as last read, no longer runs (or is a zombie)."""
    return tuple(u.name for u in units if u.main_pid > 0 and not _runs(u.main_pid, proc))
