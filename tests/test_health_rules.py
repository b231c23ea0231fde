"""Health rules, table-driven: each row is a situation and the verdict it must get."""

from __future__ import annotations

import pytest

from llmgw_systemd.health.rules import (
    DEGRADED,
    FAILED,
    READY,
    STARTING,
    STOPPED,
    UNKNOWN,
    Probe,
    RankReport,
    State,
    replica_health,
    shard_health,
)
from llmgw_systemd.health.unit_state import UnitState

S = 1_000_000  # microseconds
NOW = 1000 * S
WINDOW = 30 * S
TARGET_UP = UnitState("llmgw-r.target", "loaded", "active", "active")
TARGET_DOWN = UnitState("llmgw-r.target", "loaded", "inactive", "dead")


def unit(name: str, active: str = "active", sub: str = "running", *, result: str = "success",
         up_since: int = NOW - 100 * S, restarts: int = 0, status: str = "",
         load: str = "loaded", job: str = "") -> UnitState:
    return UnitState(f"llmgw-r-{name}.service", load, active, sub, result, restarts, 0,
                     status, up_since if active == "active" else 0, 0, job_type=job)


HEAD, ENGINE = unit("ray-head"), unit("engine")
OK = Probe(True, "HTTP 200 in 5 ms")
REFUSED = Probe(False, "connection refused")

SHARD_CASES = [
    # (what, target, members, serving, probe, was_ready, state, reason contains)
    ("all up, probe answers", TARGET_UP, [HEAD, ENGINE], True, OK, False, READY,
     "health endpoint answered: HTTP 200"),
    ("all up, no probe yet", TARGET_UP, [HEAD, ENGINE], True, None, False, STARTING,
     "waiting for the first health probe"),
    ("all up, loading: probe refused", TARGET_UP, [HEAD, ENGINE], True, REFUSED, False,
     STARTING, "not answering yet: connection refused"),
    ("was ready, probe now refused", TARGET_UP, [HEAD, ENGINE], True, REFUSED, True,
     DEGRADED, "stopped answering: connection refused"),
    ("worker up past the window", TARGET_UP, [ENGINE], False, None, False, READY,
     "all units up for 100 s"),
    ("worker up inside the window", TARGET_UP, [unit("engine", up_since=NOW - 10 * S)],
     False, None, False, STARTING, "up for 10 s of the 30 s stability window"),
    ("a worker's /health is never consulted", TARGET_UP, [ENGINE], False, REFUSED, True,
     READY, "all units up"),
    ("waiting for the rendezvous", TARGET_UP,
     [unit("engine", "activating", "start-pre", status="Waiting for 10.0.0.1:6379 to "
           "accept connections (3 s of 300 s)")], False, None, False, STARTING,
     "Waiting for 10.0.0.1:6379"),
    ("starting without a status", TARGET_UP, [HEAD, unit("engine", "activating", "start")],
     True, None, False, STARTING, "llmgw-r-engine.service is starting (start)"),
    # a death is a failure from its first moment: the other nodes restart on it at once
    ("a member restarting after its death", TARGET_UP,
     [unit("ray-head", "activating", "auto-restart", result="signal", restarts=1), ENGINE],
     True, OK, True, FAILED, "llmgw-r-ray-head.service died (signal); restarting "
     "(restart 2)"),
    ("a member's main process killed: its stop cleans up, with no job on it", TARGET_UP,
     [HEAD, unit("engine", "deactivating", "stop", result="signal")], True, OK, True,
     FAILED, "llmgw-r-engine.service died (signal); stopping what is left"),
    ("a member that exited 0 by itself (vLLM after its engine died) died too", TARGET_UP,
     [HEAD, unit("engine", "deactivating", "stop-sigterm")], True, OK, True, FAILED,
     "llmgw-r-engine.service died (exited); stopping what is left"),
    ("a member failed", TARGET_UP, [unit("ray-head", "failed", "failed", result="exit-code",
                                          status="gave up after 30 s"), ENGINE],
     True, OK, True, FAILED, "llmgw-r-ray-head.service failed (exit-code): gave up after"),
    ("budget used up", TARGET_UP, [unit("ray-head", "failed", "failed",
                                        result="start-limit-hit"), unit("engine", "inactive",
                                                                         "dead")],
     True, None, False, FAILED, "restart budget used up"),
    ("stopped", TARGET_DOWN, [unit("ray-head", "inactive", "dead"),
                              unit("engine", "inactive", "dead")], True, None, False,
     STOPPED, "stopped"),
    ("members down, target up", TARGET_UP, [unit("ray-head", "inactive", "dead"),
                                            unit("engine", "inactive", "dead")],
     True, None, False, DEGRADED, "every unit is down while the target is active"),
    ("one member down", TARGET_UP, [HEAD, unit("engine", "inactive", "dead")], True, OK,
     False, DEGRADED, "llmgw-r-engine.service down"),
    # asked to stop: a job on it (planned, the group restart's, one through BindsTo=)
    ("stopping", TARGET_UP, [HEAD, unit("engine", "deactivating", "stop-sigterm",
                                        job="stop")], True, OK, True, DEGRADED, "is stopping"),
    # the supervisor's first look, from signals: the job is not known yet (JOB_UNKNOWN),
    # so a planned stop is not taken for a death
    ("deactivating on a first look, its job not read yet", TARGET_UP,
     [HEAD, unit("engine", "deactivating", "stop", job="?")], True, OK, True, DEGRADED,
     "is stopping"),
    ("stopping in a restart, after a death's result", TARGET_UP,
     [HEAD, unit("engine", "deactivating", "stop", result="signal", job="restart")], True,
     OK, True, DEGRADED, "is stopping"),
    ("not rendered", TARGET_UP, [unit("engine", "inactive", "dead", load="not-found")],
     True, None, False, FAILED, "is not-found: render the spec"),
]


@pytest.mark.parametrize(
    "target, members, serving, probe, was_ready, state, reason",
    [c[1:] for c in SHARD_CASES], ids=[c[0] for c in SHARD_CASES])
def test_shard_health(target: UnitState, members: list[UnitState], serving: bool,
                      probe: Probe | None, was_ready: bool, state: str, reason: str) -> None:
    health = shard_health(target, members, serving=serving, probe=probe, now_usec=NOW,
                          stability_usec=WINDOW, was_ready=was_ready)
    assert health.state == state
    assert reason in health.reason


def r(rank: int, state: State, reason: str = "") -> RankReport:
    return RankReport(rank, f"n{rank}", state, reason or state)


REPLICA_CASES = [
    ("every rank ready", [r(0, READY), r(1, READY)], READY, "all 2 ranks ready"),
    ("leader answers but a worker is dead", [r(0, READY), r(1, FAILED, "engine failed")],
     FAILED, "rank 1 on n1: engine failed"),
    ("a peer unreachable", [r(0, READY), r(1, UNKNOWN, "peer unreachable")], DEGRADED,
     "rank 1 on n1: peer unreachable"),
    ("a rank never reported", [r(0, READY)], DEGRADED, "rank 1 on ?: no report"),
    ("a worker restarting", [r(0, READY), r(1, DEGRADED, "restarting")], DEGRADED,
     "restarting"),
    ("one rank stopped", [r(0, READY), r(1, STOPPED)], DEGRADED, "rank 1 on n1: stopped"),
    ("all stopped", [r(0, STOPPED), r(1, STOPPED)], STOPPED, "stopped"),
    ("still starting", [r(0, STARTING, "loading"), r(1, READY)], STARTING,
     "rank 0 on n0: loading"),
    ("failed beats unknown", [r(0, UNKNOWN), r(1, FAILED)], FAILED, "rank 1"),
]


@pytest.mark.parametrize("ranks, state, reason", [c[1:] for c in REPLICA_CASES],
                         ids=[c[0] for c in REPLICA_CASES])
def test_replica_health(ranks: list[RankReport], state: str, reason: str) -> None:
    health = replica_health(ranks, 2)
    assert health.state == state
    assert reason in health.reason
    assert health.state != READY or all(x.state == READY for x in ranks)


def test_the_states_tuple_is_the_whole_vocabulary() -> None:
    """STATES drives the metrics' labels and the wire check: every State, once each."""
    from typing import get_args

    from llmgw_systemd.health.rules import STATES

    assert get_args(State) == STATES
