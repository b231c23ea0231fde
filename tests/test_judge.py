"""The supervisor's decisions, table-driven: each row is the evidence one judgement sees
and the verdict it must reach (state, reason, actions, refused reports)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest

from llmgw_systemd.health.evidence import LocalEvidence, PeerEvidence, PeerShard, ProbeEvidence
from llmgw_systemd.health.group_restart import GroupRestartPolicy
from llmgw_systemd.health.judge import (
    DEATH,
    STALL,
    Memory,
    ReplicaPolicy,
    RestartShard,
    judge,
    refused,
)
from llmgw_systemd.health.progress import ProgressReading
from llmgw_systemd.health.rules import DEGRADED, FAILED, READY, STARTING, STOPPED, State
from llmgw_systemd.health.unit_state import JOB_UNKNOWN, UnitState

NOW = 1000.0
GEN, OLD_GEN = "aa" * 16, "bb" * 16
POLICY = ReplicaPolicy(name="rep", nodes=("a", "b"), rank=0, serving=True, stability=30,
                       probe_fresh=3, peer_fresh=5, settle=10,
                       group_restart=GroupRestartPolicy(delay=5, max_delay=60, budget=2,
                                                        window=600))
WORKER = replace(POLICY, rank=1, serving=False)
GENERATING = replace(POLICY, completion_fresh=12)  # the generation check is on
FOLLOWER = replace(WORKER, follows_leader=True)  # rank 1 of vLLM/SGLang: joined rank 0
REJOINING = replace(FOLLOWER, rejoin_after=30)  # stop_timeout + settle
# ... with room in its budget for a third restart
REJOINING_AGAIN = replace(REJOINING, group_restart=replace(REJOINING.group_restart, budget=5))


def units(active: str = "active", sub: str = "running", *, gen: str = GEN,
          up_for: float = 100, result: str = "success", load: str = "loaded"
          ) -> LocalEvidence:
    up = int((NOW - up_for) * 1e6) if active == "active" else 0
    target = UnitState("llmgw-rep.target", load, "inactive" if active == "inactive"
                       else "active", "dead" if active == "inactive" else "active")
    engine = UnitState("llmgw-rep-engine.service", load, active, sub, result,
                       active_enter_usec=up, invocation_id=gen)
    return LocalEvidence(target, (engine,), NOW)


UP = units()
PROBE_OK = ProbeEvidence(True, "HTTP 200 in 3 ms", GEN, NOW - 1)
PROBE_OLD_GEN = ProbeEvidence(True, "HTTP 200 in 3 ms", OLD_GEN, NOW - 1)
PROBE_STALE = ProbeEvidence(True, "HTTP 200 in 3 ms", GEN, NOW - 10)
PROBE_REFUSED = ProbeEvidence(False, "connection refused", GEN, NOW - 1)
PROBE_SLOW = ProbeEvidence(False, "no answer within 2 s", GEN, NOW - 1)
PROBE_500 = ProbeEvidence(False, "HTTP 503", GEN, NOW - 1)
TOLERANT = replace(POLICY, probe_timeouts=3)  # the spec's health.timeouts
COMPLETED = ProbeEvidence(True, "answered in 40 ms", GEN, NOW - 2)
COMPLETION_500 = ProbeEvidence(False, "HTTP 500 in 9 ms", GEN, NOW - 2)
COMPLETION_TIMEOUT = ProbeEvidence(False, "no answer within 10 s", GEN, NOW - 2)
STALLING = replace(GENERATING, stall_after=120)  # progress read from the metrics


def progress(*, steps: int, pending: int, gen: str = GEN, span: float = 130
             ) -> tuple[ProgressReading, ...]:
    """Readings every 10 s over the last `span` seconds: the counter moving by `steps`
    each time (0: frozen), `pending` requests running and waiting."""
    n = int(span // 10) + 1
    return tuple(ProgressReading(NOW - span + 10 * i, 1000 + steps * i, pending,
                                 generation=gen) for i in range(n))


UNREADABLE = tuple(ProgressReading(NOW - 130 + 10 * i, None, None, "connection refused",
                                   GEN) for i in range(14))
SERVED = Memory(served=GEN)


def peer(source: str, *shards: PeerShard, age: float = 1, authenticated: bool = True,
         error: str = "") -> PeerEvidence:
    return PeerEvidence(source, NOW - age, authenticated, tuple(shards), error)


def shard(rank: int, node: str, state: State = READY, gen: str = "cc" * 16,
          replica: str = "rep", up_for: int | None = None) -> PeerShard:
    return PeerShard(replica, rank, node, state, f"{state} as {node} says", gen,
                     up_for=up_for)


B_READY = peer("b", shard(1, "b"))
GRACEFUL = replace(POLICY, peer_grace=20)
HOLDING = replace(POLICY, systemd_grace=30)  # systemd's last read stands 30 s
SETTLED = Memory(baseline=((0, GEN), (1, "cc" * 16)), failing_since=NOW - 5)


def read_ago(seconds: float) -> LocalEvidence:
    return replace(UP, read_at=NOW - seconds)


def restarting(age: float) -> PeerEvidence:
    """b refuses connections now; its last answer came `age` seconds ago."""
    return PeerEvidence("b", NOW - 0.5, False,
                        error="cannot connect to b: Connection refused", refused=True,
                        last=peer("b", shard(1, "b"), age=age))


@dataclass(frozen=True)
class Case:
    what: str
    local: LocalEvidence | None = UP
    probe: ProbeEvidence | None = PROBE_OK
    peers: dict[str, PeerEvidence] = field(default_factory=lambda: {"b": B_READY})
    policy: ReplicaPolicy = POLICY
    memory: Memory = field(default_factory=Memory)
    state: str = READY
    reason: str = ""
    restarts: int = 0  # RestartShard actions expected
    ignored: int = 0
    systemd_error: str = ""
    completion: ProbeEvidence | None = None
    progress: tuple[ProgressReading, ...] = ()
    cause: str = DEATH  # of the RestartShard actions expected
    gone: tuple[str, ...] = ()  # units whose main process is gone (held_read)
    rank_reason: str = ""  # in this node's rank's own reason


CASES = [
    Case("every rank fresh and ready", reason="all 2 ranks ready"),
    Case("probe taken for an earlier start of the engine", probe=PROBE_OLD_GEN,
         state=STARTING, reason="waiting for the first health probe"),
    Case("probe older than interval + timeout", probe=PROBE_STALE, state=STARTING,
         reason="waiting for the first health probe"),
    Case("stale probe after this generation served", probe=PROBE_STALE,
         memory=Memory(served=GEN), state=DEGRADED, reason="no health probe result"),
    Case("probe refused after this generation served", probe=PROBE_REFUSED,
         memory=Memory(served=GEN), state=DEGRADED, reason="stopped answering"),
    Case("served in an earlier generation only: still starting", probe=PROBE_REFUSED,
         memory=Memory(served=OLD_GEN), state=STARTING, reason="not answering yet"),
    Case("systemd unreachable", local=None, systemd_error="Timeout was reached",
         state=DEGRADED, reason="rank 0 on a: systemd unreachable: Timeout was reached"),
    # -- systemd busy is not a dead shard (judge.held_read)
    Case("systemd silent, the last read within the grace: it stands",
         policy=HOLDING, local=read_ago(25), systemd_error="Timeout was reached",
         reason="all 2 ranks ready",
         rank_reason="(as read 25 s ago; systemd not answering: Timeout was reached)"),
    Case("systemd silent, a worker's last read within the grace: it stands",
         policy=replace(HOLDING, rank=1, serving=False), local=read_ago(5), probe=None,
         peers={"a": peer("a", shard(0, "a"))}, systemd_error="Timeout was reached"),
    Case("systemd silent, the last read older than the grace: unknown", policy=HOLDING,
         local=read_ago(31), systemd_error="Timeout was reached", state=DEGRADED,
         reason="rank 0 on a: systemd unreachable: Timeout was reached"),
    Case("systemd silent and the engine's main process gone: unknown at once",
         policy=HOLDING, local=read_ago(1), systemd_error="Timeout was reached",
         gone=("llmgw-rep-engine.service",), state=DEGRADED,
         reason="systemd unreachable: Timeout was reached; main process gone: "
                "llmgw-rep-engine.service"),
    Case("systemd silent with no grace configured: unknown at once", local=read_ago(1),
         systemd_error="Timeout was reached", state=DEGRADED, reason="systemd unreachable"),
    Case("systemd silent, the held read's probe refused: out", policy=HOLDING,
         local=read_ago(3), systemd_error="Timeout was reached", probe=PROBE_REFUSED,
         memory=SERVED, state=DEGRADED, reason="stopped answering"),
    Case("systemd silent: a peer's failure restarts nothing until it answers",
         policy=HOLDING, local=read_ago(3), systemd_error="Timeout was reached",
         memory=SETTLED, peers={"b": peer("b", shard(1, "b", FAILED))}, state=FAILED,
         reason="rank 1 on b"),
    Case("systemd answers again: the same failure restarts the group", policy=HOLDING,
         memory=SETTLED, peers={"b": peer("b", shard(1, "b", FAILED))}, state=FAILED,
         restarts=1),
    Case("peer's answer too old", peers={"b": peer("b", shard(1, "b"), age=6)},
         state=DEGRADED, reason="report from the supervisor on b is 6 s old"),
    Case("peer unreachable", peers={"b": peer("b", error="connection refused")},
         state=DEGRADED, reason="supervisor on b unreachable: connection refused"),
    # -- a peer's supervisor restarting is not a dead rank (judge.held_over)
    Case("refused, its last answer within the grace, ours ready: held over",
         policy=GRACEFUL, peers={"b": restarting(age=15)},
         reason="all 2 ranks ready"),
    Case("refused, its last answer older than the grace: unknown", policy=GRACEFUL,
         peers={"b": restarting(age=21)}, state=DEGRADED,
         reason="supervisor on b unreachable: cannot connect to b: Connection refused"),
    Case("refused, and no answer ever came through: unknown", policy=GRACEFUL,
         peers={"b": replace(restarting(age=1), last=None)}, state=DEGRADED,
         reason="unreachable"),
    Case("silent (a timeout: the node may be gone): unknown at once", policy=GRACEFUL,
         peers={"b": replace(restarting(age=1), refused=False)}, state=DEGRADED,
         reason="unreachable"),
    Case("refused while ours is not ready: unknown, no grace", policy=GRACEFUL,
         probe=None, peers={"b": restarting(age=1)}, state=DEGRADED,
         reason="rank 1 on b: supervisor on b unreachable"),
    Case("refused, with no grace configured: unknown", peers={"b": restarting(age=1)},
         state=DEGRADED, reason="unreachable"),
    Case("held over, its last answer unauthenticated under TLS: unknown",
         policy=replace(GRACEFUL, require_auth=True),
         peers={"b": replace(restarting(age=1), last=peer("b", shard(1, "b"), age=1,
                                                           authenticated=False))},
         state=DEGRADED, reason="not authenticated"),
    Case("held over: its last answer said degraded, and so it stays", policy=GRACEFUL,
         peers={"b": replace(restarting(age=2), last=peer("b", shard(1, "b", DEGRADED),
                                                           age=2))},
         state=DEGRADED, reason="(as reported 2 s ago; its supervisor is not answering"),
    Case("no word from the peer yet", peers={}, state=DEGRADED,
         reason="no report yet from the supervisor on b"),
    Case("a third node speaks for rank 1 while b is unreachable",
         peers={"b": peer("b", error="timed out"), "c": peer("c", shard(1, "b"))},
         state=DEGRADED, reason="b unreachable", ignored=1),
    Case("b's supervisor claims to be another node", peers={"b": peer("b", shard(1, "c"))},
         state=DEGRADED, reason="reports no shard of rep", ignored=1),
    Case("b speaks for rank 0 too (ours): ignored",
         peers={"b": peer("b", shard(1, "b"), shard(0, "b", FAILED))}, ignored=1),
    Case("b reports a rank the spec does not have",
         peers={"b": peer("b", shard(1, "b"), shard(7, "b", FAILED))}, ignored=1),
    Case("reports about other replicas do not count",
         peers={"b": peer("b", shard(1, "b", replica="other"))}, state=DEGRADED,
         reason="reports no shard of rep"),
    Case("TLS required, answer not authenticated",
         policy=replace(POLICY, require_auth=True),
         peers={"b": peer("b", shard(1, "b"), authenticated=False)}, state=DEGRADED,
         reason="not authenticated", ignored=1),
    Case("unauthenticated claim of a failed rank restarts nothing",
         policy=replace(POLICY, require_auth=True),
         peers={"b": peer("b", shard(1, "b", FAILED), authenticated=False)},
         memory=Memory(failing_since=NOW - 100), state=DEGRADED, reason="not authenticated",
         ignored=1),
    Case("worker judged by staying up, its /health never asked", policy=WORKER,
         probe=PROBE_REFUSED, peers={"a": peer("a", shard(0, "a"))}),
    Case("worker inside its stability window", policy=WORKER, probe=None,
         local=units(up_for=10), peers={"a": peer("a", shard(0, "a"))}, state=STARTING,
         reason="up for 10 s of the 30 s"),
    Case("a failed rank: wait the first delay", peers={"b": peer("b", shard(1, "b", FAILED))},
         state=FAILED, reason="rank 1 on b failed: failed as b says; group restart 1 of 2 in 5 s"),
    Case("a failed rank past the delay: restart this node's shard",
         peers={"b": peer("b", shard(1, "b", FAILED))}, memory=Memory(failing_since=NOW - 5),
         state=FAILED, reason="; group restart 1 of 2", restarts=1),
    # a death here: systemd restarts this node's shard itself (Restart=, the restart
    # unit); a restart of the target on top would stop that start again (issue 42)
    Case("our engine died, waiting to start again: failed, and systemd restarts it",
         local=units("activating", "auto-restart", result="signal"), probe=None,
         memory=Memory(failing_since=NOW - 5), state=FAILED,
         reason="llmgw-rep-engine.service died (signal); restarting (restart 1)"),
    Case("our engine's main process killed, its stop cleaning up: failed, no restart asked",
         local=units("deactivating", "stop", result="signal"), probe=None,
         memory=Memory(failing_since=NOW - 5), state=FAILED,
         reason="died (signal); stopping what is left"),
    Case("budget spent: failed, nothing restarts", peers={"b": peer("b", shard(1, "b",
                                                                             FAILED))},
         memory=Memory(restarts=(NOW - 100, NOW - 50), failing_since=NOW - 40),
         state=FAILED, reason="group restart budget spent: 2 restarts"),
    Case("restarts older than the window no longer count",
         peers={"b": peer("b", shard(1, "b", FAILED))},
         memory=Memory(restarts=(NOW - 900, NOW - 800), failing_since=NOW - 10),
         state=FAILED, restarts=1),
    Case("peer restarted since the replica settled",
         peers={"b": peer("b", shard(1, "b", STARTING, gen="dd" * 16))},
         memory=Memory(baseline=((0, GEN), (1, "cc" * 16)), failing_since=NOW - 5),
         state=DEGRADED, reason="rank 1 on b restarted", restarts=1),
    # before the baseline settles, a death is seen from the generations the replica was
    # last ready with (a data-parallel rank 0 never notices a dead remote rank itself)
    Case("peer restarted after the replica's first ready, before it settled",
         peers={"b": peer("b", shard(1, "b", STARTING, gen="dd" * 16))},
         memory=Memory(ready_with=((0, GEN), (1, "cc" * 16)), failing_since=NOW - 5),
         state=DEGRADED, reason="rank 1 on b restarted", restarts=1),
    # ... but not while this node's own group restart settles: reports lag behind it
    Case("peer restarted within settle of our own group restart: not a new death",
         peers={"b": peer("b", shard(1, "b", STARTING, gen="dd" * 16))},
         memory=Memory(ready_with=((0, GEN), (1, "cc" * 16)), restarts=(NOW - 3,)),
         state=STARTING, reason="rank 1 on b: starting as b says"),
    Case("peer restarted while our own restart is under way: not a new death",
         peers={"b": peer("b", shard(1, "b", STARTING, gen="dd" * 16))},
         policy=replace(POLICY, restart_hold=30),
         memory=Memory(ready_with=((0, GEN), (1, "cc" * 16)), restart_pending=(GEN, NOW - 1)),
         state=STARTING, reason="rank 1 on b: starting as b says"),
    Case("our shard restarted by itself: recorded, not restarted again",
         local=units(gen="ee" * 16), probe=None,
         memory=Memory(baseline=((0, GEN), (1, "cc" * 16)), failing_since=NOW - 5),
         state=DEGRADED, reason="rank 0 on a restarted"),
    Case("every rank started afresh: no death", local=units(gen="ee" * 16),
         probe=ProbeEvidence(True, "HTTP 200", "ee" * 16, NOW),
         peers={"b": peer("b", shard(1, "b", gen="ff" * 16))},
         memory=Memory(baseline=((0, GEN), (1, "cc" * 16)))),
    Case("a rank stopped on purpose is no death",
         peers={"b": peer("b", shard(1, "b", STOPPED, gen="dd" * 16))},
         memory=Memory(baseline=((0, GEN), (1, "cc" * 16))), state=DEGRADED,
         reason="rank 1 on b: stopped as b says"),
    Case("all stopped", local=units("inactive", "dead", gen=""), probe=None,
         peers={"b": peer("b", shard(1, "b", STOPPED))}, state=STOPPED),
    Case("our units not rendered", local=units("inactive", "dead", gen="", load="not-found"),
         probe=None, state=FAILED, reason="not-found: render the spec"),
    # the generation check: /health alone stays 200 with a dead mp peer
    Case("generation check on: /health and a recent completion", policy=GENERATING,
         completion=COMPLETED),
    Case("generation check on, no completion yet: still starting", policy=GENERATING,
         state=STARTING, reason="no one-token completion yet"),
    Case("completion failed while /health says 200", policy=GENERATING,
         completion=COMPLETION_500, memory=Memory(served=GEN), state=DEGRADED,
         reason="one-token completion failed: HTTP 500"),
    Case("completion from an earlier start counts for nothing", policy=GENERATING,
         completion=replace(COMPLETED, generation=OLD_GEN), state=STARTING,
         reason="no one-token completion yet"),
    Case("completion older than its interval + timeout", policy=GENERATING,
         completion=replace(COMPLETED, taken_at=NOW - 13), memory=Memory(served=GEN),
         state=DEGRADED, reason="no one-token completion yet"),
    Case("generation check off: completions are not asked for",
         completion=COMPLETION_500),
    # rank 0 stopped: a rank that had joined it is a broken half and restarts
    Case("rank 0 stopped while this rank's engine runs: restart to wait again",
         policy=FOLLOWER, peers={"a": peer("a", shard(0, "a", STOPPED))},
         memory=Memory(failing_since=NOW - 5), state=DEGRADED,
         reason="rank 0 on a stopped; this rank must start again", restarts=1),
    Case("engine started after rank 0 was seen stopped: it already waits", policy=FOLLOWER,
         local=units(up_for=10), peers={"a": peer("a", shard(0, "a", STOPPED))},
         memory=Memory(failing_since=NOW - 5, leader_stopped_since=NOW - 50),
         state=DEGRADED, reason="rank 0 on a: stopped"),
    Case("rank 0 stopped: first the group-restart delay", policy=FOLLOWER,
         peers={"a": peer("a", shard(0, "a", STOPPED))}, state=DEGRADED,
         reason="group restart 1 of 2 in 5 s"),
    Case("rank 0 stopped while this rank waits for it: nothing to do", policy=FOLLOWER,
         local=units("activating", "start-pre"), memory=Memory(failing_since=NOW - 5),
         peers={"a": peer("a", shard(0, "a", STOPPED))}, state=DEGRADED,
         reason="rank 0 on a: stopped"),
    Case("rank 0 unheard of is no stop (a partition is not an order)", policy=FOLLOWER,
         memory=Memory(failing_since=NOW - 5), peers={"a": peer("a", error="refused")},
         state=DEGRADED, reason="unreachable"),
    # rank 0 started again long after this rank did (its end missed): a broken half
    Case("rank 0's engine started 59 s after ours (heard 1 s ago): restart to join it",
         policy=REJOINING, local=units(up_for=100), memory=Memory(failing_since=NOW - 5),
         peers={"a": peer("a", shard(0, "a", STARTING, up_for=40))}, state=DEGRADED,
         reason="rank 0 on a started again 59 s after this rank did", restarts=1),
    Case("within stop_timeout + settle of ours: the same group restart, nothing to do",
         policy=REJOINING, local=units(up_for=100), memory=Memory(failing_since=NOW - 5),
         peers={"a": peer("a", shard(0, "a", STARTING, up_for=85))}, state=STARTING),
    # rank 0's own restart of the same fault waited its backoff first (as long as ours:
    # every node restarts for every fault): a roll's rank 0 came 35 s after rank 1, and
    # rank 1 restarted a second time, failing what it served meanwhile
    Case("rank 0 started 40 s after ours, within its backoff of 20 s: the same restart",
         policy=REJOINING_AGAIN, local=units(up_for=100),
         memory=Memory(restarts=(NOW - 200, NOW - 100)),
         peers={"a": peer("a", shard(0, "a", STARTING, up_for=60))}, state=STARTING),
    Case("rank 0 started 59 s after ours, beyond its backoff of 20 s: restart to join it",
         policy=REJOINING_AGAIN, local=units(up_for=100),
         memory=Memory(restarts=(NOW - 200, NOW - 100), failing_since=NOW - 30),
         peers={"a": peer("a", shard(0, "a", STARTING, up_for=40))}, state=DEGRADED,
         reason="rank 0 on a started again 59 s after this rank did", restarts=1),
    Case("rank 0 older than ours: we joined it, ready", policy=REJOINING,
         local=units(up_for=100), peers={"a": peer("a", shard(0, "a", up_for=300))},
         reason="all 2 ranks ready"),
    Case("a peer that does not say how long (an older version): no rejoin",
         policy=REJOINING, local=units(up_for=100), memory=Memory(failing_since=NOW - 5),
         peers={"a": peer("a", shard(0, "a", STARTING))}, state=STARTING),
    Case("a command replica's ranks follow no leader: left alone",
         policy=replace(WORKER, rejoin_after=30), local=units(up_for=100),
         peers={"a": peer("a", shard(0, "a", STARTING, up_for=40))}, state=STARTING),
    Case("a command replica's rank 0 stopped: its other ranks are left alone",
         policy=WORKER, memory=Memory(failing_since=NOW - 5),
         peers={"a": peer("a", shard(0, "a", STOPPED))}, state=DEGRADED,
         reason="rank 0 on a: stopped"),
    # -- slow is not down: a timed-out probe counts only in a row (health.timeouts)
    Case("one slow probe after this generation served: still ready", policy=TOLERANT,
         probe=PROBE_SLOW, memory=SERVED, reason="all 2 ranks ready"),
    Case("the third slow probe in a row: down", policy=TOLERANT, probe=PROBE_SLOW,
         memory=replace(SERVED, slow_probes=(GEN, NOW - 6, 2)), state=DEGRADED,
         reason="stopped answering: no answer within 2 s"),
    Case("slow probes from an earlier start do not count", policy=TOLERANT,
         probe=PROBE_SLOW, memory=replace(SERVED, slow_probes=(OLD_GEN, NOW - 6, 2)),
         reason="all 2 ranks ready"),
    Case("refused: down at once, however tolerant", policy=TOLERANT, probe=PROBE_REFUSED,
         memory=SERVED, state=DEGRADED, reason="stopped answering: connection refused"),
    Case("a 5xx: down at once", policy=TOLERANT, probe=PROBE_500, memory=SERVED,
         state=DEGRADED, reason="stopped answering: HTTP 503"),
    Case("slow before it ever answered: still starting, not ready", policy=TOLERANT,
         probe=PROBE_SLOW, state=STARTING, reason="not answering yet"),
    Case("slow, and its engine steps with work pending: busy, never counted",
         policy=replace(TOLERANT, stall_after=120), probe=PROBE_SLOW,
         memory=replace(SERVED, slow_probes=(GEN, NOW - 6, 5)),
         progress=progress(steps=40, pending=7), reason="busy: 7 request(s) pending"),
    Case("slow, and no engine step from before it began to after: down at once (hung)",
         policy=replace(TOLERANT, stall_after=120), probe=PROBE_SLOW, memory=SERVED,
         progress=progress(steps=0, pending=2, span=20), state=DEGRADED,
         reason="no answer within 2 s, and no engine step since it began"),
    Case("slow and idle, nothing excuses it: down at once", policy=TOLERANT,
         probe=PROBE_SLOW, memory=SERVED, progress=progress(steps=0, pending=0, span=10),
         state=DEGRADED, reason="no engine step since it began"),
    Case("slow, the metrics unreadable too: tolerated in a row", policy=TOLERANT,
         probe=PROBE_SLOW, memory=SERVED, progress=UNREADABLE,
         reason="all 2 ranks ready"),
    Case("slow, no reading since it began: tolerated in a row", policy=TOLERANT,
         probe=PROBE_SLOW, memory=SERVED, progress=progress(steps=5, pending=2, span=20)[:-1],
         reason="all 2 ranks ready"),
    Case("slow, work pending and no step for stall_after: stalled, not busy",
         policy=replace(TOLERANT, stall_after=120), probe=PROBE_SLOW,
         memory=replace(SERVED, slow_probes=(GEN, NOW - 6, 1)),
         progress=progress(steps=0, pending=3), state=FAILED, reason="stalled"),
    # -- progress: busy is not stalled, a stall restarts the group (health/progress.py)
    Case("saturated: the check times out behind real work, steps run: ready, busy",
         policy=STALLING, memory=SERVED, completion=COMPLETION_TIMEOUT,
         progress=progress(steps=40, pending=7), reason="busy: 7 request(s) pending and "
         "the engine stepping; the one-token check waits behind them"),
    Case("the same without stall detection: the failing check degrades it",
         policy=GENERATING, memory=SERVED, completion=COMPLETION_TIMEOUT,
         progress=progress(steps=40, pending=7), state=DEGRADED,
         reason="a one-token completion failed: no answer within 10 s"),
    Case("idle and the check failing: a real failure, not busy", policy=STALLING,
         memory=SERVED, completion=COMPLETION_500, progress=progress(steps=0, pending=0),
         state=DEGRADED, reason="a one-token completion failed: HTTP 500"),
    Case("work pending, no step for stall_after: stalled, the restart waits its delay",
         policy=STALLING, memory=SERVED, completion=COMPLETION_TIMEOUT,
         progress=progress(steps=0, pending=1), state=FAILED,
         reason="stalled: 1 request(s) pending and no engine step for 130 s"),
    Case("stalled past the delay: this node restarts its shard, cause stall",
         policy=STALLING, memory=replace(SERVED, failing_since=NOW - 10),
         completion=COMPLETION_TIMEOUT, progress=progress(steps=0, pending=1),
         state=FAILED, reason="group restart 1 of 2", restarts=1, cause=STALL),
    Case("stalled while /health still says 200 and no check is on", policy=replace(
        POLICY, stall_after=120), memory=replace(SERVED, failing_since=NOW - 10),
         progress=progress(steps=0, pending=2), state=FAILED, reason="stalled",
         restarts=1, cause=STALL),
    Case("metrics unreadable and the check failing for stall_after: stalled",
         policy=STALLING, memory=replace(SERVED, failing_since=NOW - 10,
                                         check_failing=(GEN, NOW - 125)),
         completion=COMPLETION_TIMEOUT, progress=UNREADABLE, state=FAILED,
         reason="metrics unreadable (connection refused) and the generation check "
         "failing for 125 s", restarts=1, cause=STALL),
    Case("metrics unreadable, the check failing briefly: degraded, no restart",
         policy=STALLING, memory=SERVED, completion=COMPLETION_TIMEOUT,
         progress=UNREADABLE, state=DEGRADED, reason="a one-token completion failed"),
    Case("a stall before the rank ever served is a slow start, not a stall",
         policy=STALLING, completion=COMPLETION_TIMEOUT,
         progress=progress(steps=0, pending=1), state=STARTING),
    Case("readings of an earlier start say nothing", policy=STALLING, memory=SERVED,
         completion=COMPLETION_TIMEOUT, progress=progress(steps=0, pending=1, gen=OLD_GEN),
         state=DEGRADED, reason="a one-token completion failed"),
    Case("a member of ours past its start limit: a group restart would start nothing",
         local=units("failed", "failed", result="start-limit-hit"), probe=None,
         memory=Memory(failing_since=NOW - 30), state=FAILED,
         reason="no group restart: this node's shard hit its start limit"),
    Case("a member killed during an operator's stop of this node's target: no restart",
         local=replace(units("failed", "failed", result="signal"), target=UnitState(
             "llmgw-rep.target", "loaded", "active", "active", job_type="stop")),
         probe=None, memory=Memory(failing_since=NOW - 30), state=FAILED,
         reason="no group restart: this node's target is stopped"),
    Case("the same once the stop is done (target inactive, no job)",
         local=replace(units("failed", "failed", result="signal"), target=UnitState(
             "llmgw-rep.target", "loaded", "inactive", "dead")),
         probe=None, memory=Memory(failing_since=NOW - 30), state=FAILED,
         reason="no group restart: this node's target is stopped"),
    Case("a group restart's own restart job on the target is no operator's stop",
         local=replace(units("failed", "failed", result="signal"), target=UnitState(
             "llmgw-rep.target", "loaded", "active", "active", job_type="restart")),
         probe=None, memory=Memory(failing_since=NOW - 30), state=FAILED, restarts=1),
    # one fault, one restart: while this node's restart is under way (its old generation
    # still stopping, still stalled), nothing more is asked for
    Case("a stall restart under way: the old generation still stalled, no second one",
         policy=replace(STALLING, restart_hold=30),
         memory=replace(SERVED, restarts=(NOW - 5,), restart_pending=(GEN, NOW - 5)),
         completion=COMPLETION_TIMEOUT, progress=progress(steps=0, pending=1),
         state=FAILED, reason="this node's shard is restarting"),
    Case("the restart lost (the old generation there past restart_hold): again",
         policy=replace(STALLING, restart_hold=30),
         memory=replace(SERVED, restarts=(NOW - 40,), restart_pending=(GEN, NOW - 40),
                        failing_since=NOW - 10),
         completion=COMPLETION_TIMEOUT, progress=progress(steps=0, pending=1),
         state=FAILED, reason="group restart 2 of 2", restarts=1, cause=STALL),
    Case("a peer failed while this node's restart is under way: it covers that too",
         policy=replace(POLICY, restart_hold=30),
         memory=Memory(restarts=(NOW - 5,), restart_pending=(GEN, NOW - 5)),
         peers={"b": peer("b", shard(1, "b", FAILED))}, state=FAILED,
         reason="this node's shard is restarting"),
    Case("the shard started again since: the pending restart is done",
         policy=replace(POLICY, restart_hold=30),
         memory=Memory(restarts=(NOW - 60,), restart_pending=(OLD_GEN, NOW - 5),
                       failing_since=NOW - 30),
         peers={"b": peer("b", shard(1, "b", FAILED))}, state=FAILED,
         reason="group restart 2 of 2", restarts=1),
    # SGLang's /health asks for a token itself: while it fails, its request is owed work
    Case("frozen SGLang with idle gauges: its /health times out for stall_after: stalled",
         policy=replace(POLICY, stall_after=120, health_generates=True),
         memory=replace(SERVED, failing_since=NOW - 10, check_failing=(GEN, NOW - 125)),
         probe=ProbeEvidence(False, "no answer within 2 s", GEN, NOW - 1),
         progress=progress(steps=0, pending=0), state=FAILED,
         reason="stalled: 1 request(s) pending and no engine step", restarts=1,
         cause=STALL),
    Case("the same /health failing, but it does not generate: idle, only degraded",
         policy=replace(POLICY, stall_after=120), memory=replace(SERVED, failing_since=NOW - 10),
         probe=ProbeEvidence(False, "no answer within 2 s", GEN, NOW - 1),
         progress=progress(steps=0, pending=0), state=DEGRADED, reason="no answer"),
    Case("a non-serving rank reads no progress", policy=replace(WORKER, stall_after=120),
         peers={"a": peer("a", shard(0, "a"))}, progress=progress(steps=0, pending=1),
         reason="all 2 ranks ready"),
    Case("a peer that is unreachable while ours fails: unknown, still failed",
         local=units("failed", "failed", result="exit-code"), probe=None,
         peers={"b": peer("b", error="refused")}, state=FAILED, reason="rank 0 on a"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.what for c in CASES])
def test_judge(case: Case) -> None:
    verdict = judge(case.policy, case.memory, local=case.local,
                    systemd_error=case.systemd_error, probe=case.probe, peers=case.peers,
                    now=NOW, completion=case.completion, progress=case.progress,
                    gone=case.gone)
    assert verdict.health.state == case.state, verdict.health
    assert case.reason in verdict.health.reason, verdict.health
    assert case.rank_reason in verdict.ranks[case.policy.rank].reason, verdict.ranks
    assert len(verdict.actions) == case.restarts
    assert all(a == RestartShard("rep", a.reason, case.cause) for a in verdict.actions)
    ignored = [line for seen in case.peers.values() for line in refused(case.policy, seen)]
    assert len(ignored) == case.ignored, ignored
    # "ready" only ever with fresh evidence from every rank
    if verdict.health.state == READY:
        assert all(r.state == READY for r in verdict.ranks)
    if verdict.actions:
        assert verdict.memory.restarts[-1] == NOW


def test_slow_probes_count_in_a_row_and_an_answer_resets_them() -> None:
    """The judge sees each probe result several times (every reconcile): a result counts
    once, by when it was taken; an answer in between starts the count again."""
    memory = SERVED
    states = []
    for taken, probe in ((1, PROBE_SLOW), (1, PROBE_SLOW), (2, PROBE_SLOW), (3, PROBE_OK),
                         (4, PROBE_SLOW), (5, PROBE_SLOW), (6, PROBE_SLOW)):
        verdict = judge(TOLERANT, memory, local=UP, systemd_error="",
                        probe=replace(probe, taken_at=NOW - 1 + taken / 10),
                        peers={"b": B_READY}, now=NOW)
        memory = verdict.memory
        states.append((verdict.health.state, verdict.ranks[0].reason))
    assert [s for s, _ in states] == [READY] * 6 + [DEGRADED], states
    assert states[2][1] == ("health endpoint answered: slow: no answer within 2 s "
                            "(2 of 3 allowed in a row)"), states
    assert states[4][1].endswith("(1 of 3 allowed in a row)"), states


def test_readiness_settles_before_a_restart_counts_as_a_death() -> None:
    memory = Memory()
    for t in (0.0, 5.0):
        verdict = judge(POLICY, memory, local=UP, probe=replace(PROBE_OK, taken_at=NOW + t),
                        peers={"b": replace(B_READY, received_at=NOW + t)}, now=NOW + t)
        memory = verdict.memory
        assert verdict.health.state == READY and not verdict.settled
    verdict = judge(POLICY, memory, local=UP, probe=replace(PROBE_OK, taken_at=NOW + 10),
                    peers={"b": replace(B_READY, received_at=NOW + 10)}, now=NOW + 10)
    assert verdict.settled and verdict.memory.baseline == ((0, GEN), (1, "cc" * 16))


def test_a_death_right_after_the_first_ready_restarts_the_group() -> None:
    """Ready for the first time, then rank 1 dies and comes back within `settle` (before
    a baseline): the group restarts all the same. Seen in bench/data_parallel.py: before,
    node-a's data-parallel rank 0 ran on beside the new rank 1 for 340 s."""
    memory = Memory()
    verdict = judge(POLICY, memory, local=UP, probe=PROBE_OK, peers={"b": B_READY}, now=NOW)
    assert verdict.health.state == READY and not verdict.settled
    memory = verdict.memory
    stopping = {"b": replace(peer("b", shard(1, "b", DEGRADED)),
                             received_at=NOW + 2)}
    verdict = judge(POLICY, memory, local=UP, probe=replace(PROBE_OK, taken_at=NOW + 2),
                    peers=stopping, now=NOW + 2)
    assert not verdict.actions
    memory = verdict.memory
    back = {"b": replace(peer("b", shard(1, "b", STARTING, gen="dd" * 16)),
                         received_at=NOW + 4)}
    actions: list[RestartShard] = []
    for t in (4.0, 6.0, 8.0, 10.0):  # the group restart's first delay (5 s), then it
        verdict = judge(POLICY, memory, local=UP, probe=replace(PROBE_OK, taken_at=NOW + t),
                        peers={"b": replace(back["b"], received_at=NOW + t)}, now=NOW + t)
        memory = verdict.memory
        actions += verdict.actions
    assert len(actions) == 1 and "rank 1 on b restarted" in actions[0].reason, actions


def test_a_restart_clears_the_baseline_and_counts_once() -> None:
    memory = Memory(baseline=((0, GEN), (1, "cc" * 16)))

    def dead(t: float) -> dict[str, PeerEvidence]:
        return {"b": replace(peer("b", shard(1, "b", FAILED)), received_at=t)}

    first = judge(POLICY, memory, local=UP, probe=PROBE_OK, peers=dead(NOW), now=NOW)
    assert not first.actions and first.memory.failing_since == NOW
    later = judge(POLICY, first.memory, local=UP, probe=replace(PROBE_OK, taken_at=NOW + 5),
                  peers=dead(NOW + 5), now=NOW + 5)
    assert len(later.actions) == 1 and later.memory.restarts == (NOW + 5,)
    assert later.memory.baseline is None and later.notes
    # the peer still says failed right after: the next restart waits twice as long
    again = judge(POLICY, later.memory, local=UP, probe=replace(PROBE_OK, taken_at=NOW + 6),
                  peers=dead(NOW + 6), now=NOW + 6)
    assert not again.actions and "2 of 2 in" in again.health.reason


def test_one_fault_asks_for_one_restart_while_the_old_generation_stops() -> None:
    """Judged again and again while the stalled generation stops (a serving rank's
    drain, seconds): one RestartShard, then none until the engine starts again."""
    policy = replace(STALLING, restart_hold=30)
    memory = replace(SERVED, failing_since=NOW - 10)
    actions = 0
    for step in range(20):  # 20 s of judgements, the old generation still there
        verdict = judge(policy, memory, local=UP, probe=PROBE_OK, peers={"b": B_READY},
                        now=NOW + step, completion=COMPLETION_TIMEOUT,
                        progress=progress(steps=0, pending=1, span=130 + step))
        actions += len(verdict.actions)
        memory = verdict.memory
    assert actions == 1
    assert memory.restart_pending == (GEN, NOW)


def test_a_death_here_is_left_to_systemd_once() -> None:
    """This node's engine died: the verdict is failed at once (so the other nodes restart
    their shards), but this node asks for no restart of its own target, and, while
    the dead generation is still the one seen, decides nothing again."""
    policy = replace(POLICY, restart_hold=30)
    dead = units("deactivating", "stop", result="signal")
    verdict = judge(policy, Memory(failing_since=NOW - 5), local=dead, probe=None,
                    peers={"b": B_READY}, now=NOW)
    assert verdict.health.state == FAILED and not verdict.actions, verdict
    assert any("systemd restarts this node's shard itself" in n for n in verdict.notes)
    assert verdict.memory.restart_pending == (GEN, NOW)
    later = judge(policy, verdict.memory, local=units("activating", "auto-restart",
                                                      result="signal"),
                  probe=None, peers={"b": B_READY}, now=NOW + 1)
    assert not later.actions and len(later.memory.restarts) == 1, later
    assert "this node's shard is restarting" in later.health.reason


def test_a_first_look_decides_no_restart() -> None:
    """The supervisor's first look comes from signals, which carry no jobs: a rank failed
    past its delay restarts nothing until a read of systemd confirms this node's state."""
    first = replace(UP, target=replace(UP.target, job_type=JOB_UNKNOWN),
                    members=tuple(replace(m, job_type=JOB_UNKNOWN) for m in UP.members))
    failed_b = {"b": peer("b", shard(1, "b", FAILED))}
    looked = judge(POLICY, Memory(failing_since=NOW - 5), local=first, probe=PROBE_OK,
                   peers=failed_b, now=NOW)
    assert looked.health.state == FAILED and not looked.actions, looked
    read = judge(POLICY, Memory(failing_since=NOW - 5), local=UP, probe=PROBE_OK,
                 peers=failed_b, now=NOW)
    assert len(read.actions) == 1, read
