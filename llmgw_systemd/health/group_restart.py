"""Group restarts (pure): when one rank of a replica fails, every rank restarts together,
with exponential backoff and a budget per time window, so a replica that cannot come up
ends failed instead of being recreated in a storm (kubernetes-sigs/lws#1048: 30
recreations in 90 s). Times are seconds on a monotonic clock, passed in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llmgw_systemd.spec.policies import GroupRestartPolicy

__all__ = ["GIVE_UP", "NOW", "WAIT", "Action", "Decision", "GroupRestartPolicy", "backoff",
           "decide"]

Action = Literal["now", "wait", "give-up"]
NOW: Action = "now"
WAIT: Action = "wait"
GIVE_UP: Action = "give-up"


@dataclass(frozen=True)
class Decision:
    action: Action
    at: float  # when to restart (NOW, WAIT)
    reason: str


def decide(policy: GroupRestartPolicy, past: tuple[float, ...], failed_since: float,
           now: float) -> Decision:
    """Whether to restart a replica that has been failing since failed_since, given the
    times of its earlier group restarts."""
    recent = [t for t in past if now - t < policy.window]
    if len(recent) >= policy.budget:
        return Decision(GIVE_UP, 0.0, f"group restart budget spent: {len(recent)} restarts "
                        f"in the last {policy.window:.0f} s")
    delay = backoff(policy, len(recent))
    at = max(failed_since + delay, (recent[-1] + delay) if recent else 0.0)
    if at <= now:
        return Decision(NOW, now, f"group restart {len(recent) + 1} of {policy.budget}")
    return Decision(WAIT, at, f"group restart {len(recent) + 1} of {policy.budget} in "
                    f"{at - now:.0f} s")


def backoff(policy: GroupRestartPolicy, recent: int) -> float:
    """The wait before a group restart that follows `recent` others within the window."""
    return float(min(policy.max_delay, policy.delay * 2 ** recent))
