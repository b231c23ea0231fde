"""Liveness from the engine's progress (llmgw_systemd.health.progress): one row per case.

Readings are (seconds, steps, pending), or (seconds, None) for metrics that could not be
read; every case uses stall_after 120 unless it says otherwise.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw_systemd.health.progress import (
    STEPPING,
    STILL,
    UNKNOWN,
    ProgressReading,
    Verdict,
    keep,
    last_step_at,
    liveness,
    motion,
)

Row = tuple[float, float, float] | tuple[float, None]


def readings(rows: list[Row]) -> list[ProgressReading]:
    out = []
    for row in rows:
        if row[1] is None:
            out.append(ProgressReading(row[0], None, None, "connection refused"))
        else:
            out.append(ProgressReading(row[0], row[1], row[2]))
    return out


class Case(NamedTuple):
    name: str
    rows: list[Row]
    now: float
    failing_since: float | None
    verdict: Verdict
    says: str
    stall_after: float = 120


CASES = [
    Case("nothing read yet", [], 10, None, "unknown", "no metrics read yet"),
    Case("idle: nothing pending, the counter still", [(0, 5, 0), (100, 5, 0), (200, 5, 0)],
         200, None, "idle", "no request pending"),
    Case("the gauges say idle but the check fails: its own request is pending",
         [(0, 5, 0), (200, 5, 0)], 200, 50, "unknown",
         "1 request(s) pending, no engine step seen yet in 0 s"),
    Case("an engine core frozen while idle: its gauges stay 0, the check's request waits",
         [(0, 5, 0), (60, 5, 0), (120, 5, 0), (200, 5, 0)], 200, 50, "stalled",
         "1 request(s) pending and no engine step for 140 s"),
    Case("work pending, steps moving", [(0, 5, 2), (5, 9, 2), (10, 14, 2)], 10, None,
         "progressing", "2 request(s) pending and the engine stepping"),
    Case("saturated: steps moving, the check failing: busy, not stalled",
         [(0, 5, 6), (100, 900, 7), (200, 1800, 7)], 200, 20, "busy",
         "7 request(s) pending and the engine stepping; the one-token check waits"),
    Case("frozen: pending, the counter still for stall_after",
         [(0, 50, 1), (60, 50, 1), (125, 50, 1)], 125, 10, "stalled",
         "1 request(s) pending and no engine step for 125 s (stall_after 120 s)"),
    Case("frozen after working: counted from the last step",
         [(0, 10, 1), (30, 20, 1), (100, 20, 1), (149, 20, 1)], 149, None, "progressing",
         "engine stepping"),
    Case("frozen after working, long enough",
         [(0, 10, 1), (30, 20, 1), (100, 20, 1), (150, 20, 1)], 150, None, "stalled",
         "no engine step for 120 s"),
    Case("work arrived after an idle spell: counted from when it came",
         [(0, 10, 0), (100, 10, 0), (110, 10, 1), (200, 10, 1)], 200, None, "unknown",
         "1 request(s) pending, no engine step seen yet in 90 s"),
    Case("work arrived after an idle spell and no step for stall_after",
         [(0, 10, 0), (100, 10, 0), (110, 10, 1), (230, 10, 1)], 230, None, "stalled",
         "no engine step for 120 s"),
    Case("a step before the idle spell does not excuse the failing check",
         [(0, 10, 1), (10, 12, 0), (20, 12, 1), (40, 12, 1)], 40, 25, "unknown",
         "no engine step seen yet"),
    Case("a counter that goes down is a new process: progress",
         [(0, 900, 1), (100, 900, 1), (119, 3, 1), (200, 3, 1)], 200, None, "progressing",
         "engine stepping"),
    Case("metrics unreadable, the check passing: no verdict", [(0, 5, 1), (10, None)], 10,
         None, "unknown", "metrics unreadable: connection refused"),
    Case("metrics unreadable, the check failing less than stall_after",
         [(0, None), (100, None)], 100, 0, "unknown", "metrics unreadable"),
    Case("metrics unreadable and the check failing for stall_after: stalled",
         [(0, None), (130, None)], 130, 10, "stalled",
         "metrics unreadable (connection refused) and the generation check failing "
         "for 120 s"),
    Case("an unreadable reading breaks the pending run",
         [(0, 5, 1), (50, None), (60, 5, 1), (170, 5, 1)], 170, None, "unknown",
         "no engine step seen yet in 110 s"),
    Case("off: stall_after 0", [(0, 5, 1), (1000, 5, 1)], 1000, 0, "off",
         "stall detection is off", stall_after=0),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_liveness(case: Case) -> None:
    got = liveness(readings(case.rows), now=case.now, stall_after=case.stall_after,
                   check_failing_since=case.failing_since)
    assert (got.verdict, case.says in got.reason) == (case.verdict, True), got


def test_last_step_at_is_the_reading_after_which_the_counter_moved() -> None:
    assert last_step_at(readings([(0, 1, 1), (5, 1, 1), (10, 2, 1), (15, 2, 1)])) == 10
    assert last_step_at(readings([(0, 1, 1), (5, 1, 1)])) is None
    assert last_step_at(readings([(0, 1, 1), (5, None), (10, 2, 1)])) == 10


steps = st.lists(st.tuples(st.floats(0, 5), st.integers(0, 3), st.integers(0, 3)),
                 min_size=1, max_size=60)


@given(steps, st.floats(1, 300))
def test_keep_bounds_the_history_and_never_changes_the_verdict(
        gaps: list[tuple[float, int, int]], stall_after: float) -> None:
    t, count, history = 0.0, 0, []
    for gap, advance, pending in gaps:
        t += gap
        count += advance
        history.append(ProgressReading(t, count, pending))
    kept = keep(history, now=t, stall_after=stall_after)
    assert len(kept) <= len([r for r in history if r.taken_at >= t - stall_after]) + 1
    whole = liveness(history, now=t, stall_after=stall_after, check_failing_since=None)
    part = liveness(kept, now=t, stall_after=stall_after, check_failing_since=None)
    # pruning forgets only what is older than stall_after: the verdict stays
    assert part.verdict == whole.verdict, (whole, part)


def _read(at: float, steps: float | None) -> ProgressReading:
    return ProgressReading(at, steps, None if steps is None else 1.0)


@pytest.mark.parametrize(("readings", "since", "expected"), [
    # a move between the last reading before the probe and the first after it counts
    ([_read(0, 5), _read(10, 9)], 4, STEPPING),
    ([_read(0, 5), _read(5, 5), _read(10, 7)], 4, STEPPING),
    # from before to after, the counter still: hung (or idle)
    ([_read(0, 5), _read(10, 5)], 4, STILL),
    ([_read(0, 1), _read(2, 5), _read(5, 5), _read(10, 5)], 4, STILL),
    # a move that ended before the probe began says nothing about it
    ([_read(0, 1), _read(2, 5)], 4, UNKNOWN),
    # nothing to compare with: the first reading of a generation, or none after
    ([_read(5, 5)], 4, UNKNOWN),
    ([], 4, UNKNOWN),
    # unreadable metrics are skipped, not taken for a still counter
    ([_read(0, 5), _read(6, None), _read(8, None)], 4, UNKNOWN),
    ([_read(0, 5), _read(6, None), _read(8, 6)], 4, STEPPING),
])
def test_motion_says_whether_the_engine_stepped_while_a_probe_waited(
        readings: list[ProgressReading], since: float, expected: str) -> None:
    assert motion(readings, since=since) == expected
