"""Group restart policy, table-driven: backoff doubles, the budget ends the storm."""

from __future__ import annotations

import pytest

from llmgw_systemd.health.group_restart import GIVE_UP, NOW, WAIT, GroupRestartPolicy, decide

POLICY = GroupRestartPolicy(delay=5, max_delay=60, budget=3, window=600)

CASES = [
    # (what, earlier restarts, failing since, now, action, at, reason contains)
    ("first failure waits the first delay", (), 100.0, 101.0, WAIT, 105.0, "1 of 3 in 4 s"),
    ("first failure after the delay", (), 100.0, 105.0, NOW, 105.0, "1 of 3"),
    ("second waits twice as long after the first", (100.0,), 101.0, 105.0, WAIT, 111.0,
     "2 of 3"),
    ("third waits four times", (100.0, 110.0), 111.0, 120.0, WAIT, 131.0, "3 of 3"),
    ("budget spent", (100.0, 110.0, 130.0), 131.0, 200.0, GIVE_UP, 0.0,
     "budget spent: 3 restarts in the last 600 s"),
    ("old restarts leave the window", (100.0, 110.0, 130.0), 800.0, 805.0, NOW, 805.0,
     "1 of 3"),
    ("delay is capped", (0.0, 1.0, 2.0, 3.0, 4.0), 5.0, 6.0, GIVE_UP, 0.0, "budget"),
]


@pytest.mark.parametrize("past, since, now, action, at, reason", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_decide(past: tuple[float, ...], since: float, now: float, action: str, at: float,
                reason: str) -> None:
    decision = decide(POLICY, past, since, now)
    assert (decision.action, decision.at) == (action, at)
    assert reason in decision.reason


def test_delay_never_exceeds_the_cap() -> None:
    policy = GroupRestartPolicy(delay=5, max_delay=60, budget=100, window=10**6)
    past = tuple(float(t) for t in range(10))
    decision = decide(policy, past, 10.0, 10.0)
    assert decision.action == WAIT and decision.at == 10.0 + 60  # failing since 10, cap 60
