"""Liveness from the engine's own progress (pure; no I/O, no clock).

A probe's latency cannot tell a hung engine from a busy one: under saturation the
one-token generation check waits in the queue behind real work and times out, while a
TP worker stuck in a collective leaves `/health` answering 200 in milliseconds. What
tells them apart is whether the engine still takes steps while work is pending. The
supervisor reads the serving rank's metrics (a step counter, and the requests running
and waiting) every health interval and keeps the readings of the shard's current
generation; `liveness` turns them into one verdict (docs/supervisor.md, "Stalls"):

- idle: nothing pending, so no step is owed (never stalled);
- progressing: work pending and a step within `stall_after`;
- busy: progressing while the generation check fails (it waits behind real work): the
  replica stays ready, and is never restarted;
- stalled: work pending and not one step for `stall_after` seconds, or the metrics
  unreadable and the generation check failing for that long: a group restart;
- unknown: not enough seen yet to say (too short a history, metrics unreadable while
  the generation check passes or has not failed for long).

Times are seconds on one monotonic clock. A step counter that goes down is a new
process (a restart of the engine), which counts as progress.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

Verdict = Literal["idle", "progressing", "busy", "stalled", "unknown", "off"]
IDLE: Final = "idle"
PROGRESSING: Final = "progressing"
BUSY: Final = "busy"
STALLED: Final = "stalled"
UNKNOWN: Final = "unknown"
OFF: Final = "off"


@dataclass(frozen=True)
class ProgressReading:
    """One read of the serving rank's metrics: steps is a counter that moves on every
    engine step, pending the requests running plus waiting; both None when the metrics
    could not be read (then `error` says why)."""

    taken_at: float
    steps: float | None
    pending: float | None
    error: str = ""
    generation: str = ""  # the shard generation it was read for (evidence.py)

    @property
    def readable(self) -> bool:
        return self.steps is not None and self.pending is not None


@dataclass(frozen=True)
class Liveness:
    verdict: Verdict
    reason: str


def _seconds(value: float) -> str:
    return f"{value:.0f} s"


def last_step_at(readings: Sequence[ProgressReading]) -> float | None:
    """When a step was last seen: the first reading after which the counter moved (a
    counter that goes down is a new process, and counts as a step). None when the
    counter never moved in the readings."""
    last: float | None = None
    previous: float | None = None
    for reading in readings:
        if reading.steps is None:
            continue
        if previous is not None and reading.steps != previous:
            last = reading.taken_at
        previous = reading.steps
    return last


def liveness(readings: Sequence[ProgressReading], *, now: float, stall_after: float,
             check_failing_since: float | None) -> Liveness:
    """The verdict on readings of one shard generation, oldest first.

    check_failing_since is when the generation check began to fail without a pass
    since (None: it passes, or is not configured)."""
    if stall_after <= 0:
        return Liveness(OFF, "stall detection is off (health.stall_after: 0)")
    if not readings:
        return Liveness(UNKNOWN, "no metrics read yet")
    latest = readings[-1]
    failing_for = None if check_failing_since is None else now - check_failing_since

    def pending_of(reading: ProgressReading) -> float:
        # The generation check's own request is work too, whether or not the engine's
        # gauges show it: a frozen engine core stops updating them (docs/supervisor.md).
        owed = check_failing_since is not None and reading.taken_at >= check_failing_since
        return max(reading.pending or 0, 1 if owed else 0)

    if latest.steps is None or latest.pending is None:
        if failing_for is not None and failing_for >= stall_after:
            return Liveness(STALLED, f"metrics unreadable ({latest.error}) and the "
                            f"generation check failing for {_seconds(failing_for)}")
        return Liveness(UNKNOWN, f"metrics unreadable: {latest.error}")
    if pending_of(latest) <= 0:
        return Liveness(IDLE, "no request pending")
    pending = f"{pending_of(latest):.0f} request(s) pending"
    # Since when work has been pending without a break: the first reading of the current
    # run (an empty queue owed no step). The first, not the empty one before it: a stall
    # is never counted from before the work may have come.
    began = readings[0].taken_at
    for before, after in zip(reversed(readings[:-1]), reversed(readings)):
        if not before.readable or pending_of(before) <= 0:
            began = after.taken_at
            break
    stepped = last_step_at(readings)
    quiet_from = began if stepped is None else max(began, stepped)
    quiet_for = now - quiet_from
    if quiet_for >= stall_after:
        return Liveness(STALLED, f"{pending} and no engine step for "
                        f"{_seconds(quiet_for)} (stall_after {_seconds(stall_after)})")
    if stepped is None or stepped < began:
        return Liveness(UNKNOWN, f"{pending}, no engine step seen yet in "
                        f"{_seconds(quiet_for)}")
    if failing_for is not None:
        return Liveness(BUSY, f"{pending} and the engine stepping; the one-token check "
                        "waits behind them")
    return Liveness(PROGRESSING, f"{pending} and the engine stepping")


Motion = Literal["stepping", "still", "unknown"]
STEPPING: Final = "stepping"
STILL: Final = "still"


def motion(readings: Sequence[ProgressReading], *, since: float) -> Motion:
    """Whether the engine stepped while a probe that began at `since` waited (readings of
    one generation, oldest first): what tells a saturated engine (its health endpoint
    slow behind real work) from a hung one.

    - stepping: the step counter moved between two readings, the later taken at or after
      `since` (so read after the probe began);
    - still: readings from before `since` to after it, and the counter never moved;
    - unknown: no reading since `since`, or none before it to compare with.

    The first reading taken after `since` compares with the last one before it, so a
    step taken just before the probe began may count: a freeze shows as still from the
    next probe whose window holds two readings taken after it (docs/supervisor.md,
    "Slow is not down")."""
    readable = [r for r in readings if r.readable]
    window = [*[r for r in readable if r.taken_at < since][-1:],
              *[r for r in readable if r.taken_at >= since]]
    if len(window) < 2 or window[-1].taken_at < since:
        return UNKNOWN
    if any(later.steps != earlier.steps for earlier, later in zip(window, window[1:])):
        return STEPPING
    return STILL


def keep(readings: Sequence[ProgressReading], *, now: float,
         stall_after: float) -> tuple[ProgressReading, ...]:
    """What a verdict needs of the history: the readings of the last stall_after
    seconds and the one before them (the counter's value then), so memory stays bounded
    whatever the interval."""
    horizon = now - stall_after
    recent = [r for r in readings if r.taken_at >= horizon]
    older = [r for r in readings if r.taken_at < horizon]
    return (*older[-1:], *recent)
