"""Whether the main processes systemd last named still run: the kernel's word on this
node's shard while systemd itself does not answer (judge.held_read).

Asked with a pidfd, not /proc: the shipped supervisor runs with ProtectProc=invisible,
which hides other users' processes (the engines') from its /proc. pidfd_open needs no
permission, and its descriptor turns readable once the process has exited, a zombie its
busy manager has not reaped included. A kernel that cannot say (no pidfd_open, a
syscall filter) counts as gone: no hold without the kernel's word.
"""

from __future__ import annotations

import os
import select
from collections.abc import Iterable

from llmgw_systemd.health.unit_state import UnitState


def runs(pid: int) -> bool:
    """Whether process `pid` exists and has not exited."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # ESRCH: no such process; anything else: the kernel cannot say
        return False
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return not poller.poll(0)
    finally:
        os.close(fd)


def gone(units: Iterable[UnitState]) -> tuple[str, ...]:
    """The units whose main process, as last read, no longer runs (or is a zombie)."""
    return tuple(u.name for u in units if u.main_pid > 0 and not runs(u.main_pid))
