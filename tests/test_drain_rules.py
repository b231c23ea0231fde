"""Drain rules (llmgw_systemd.health.drain), table-driven: one row per rule, each with a
comment saying why; then the same rules through `judge`, with real evidence objects.

Times: a drain begun at SINCE, delay 5 s, timeout 20 s unless a row says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import pytest

from llmgw_systemd.health.drain import (
    CUT_SHORT,
    DRAINED,
    DRAINING,
    FINISHED,
    GROUP_RESTART,
    NOTICE,
    PLANNED,
    STARTED,
    Drain,
    DrainEvent,
    DrainProgress,
    DrainRequest,
    Phase,
    Stopping,
    StopView,
    events,
    origin,
    progress,
    step,
    stopping,
)
from llmgw_systemd.health.evidence import LocalEvidence, PeerEvidence, PeerShard, ProbeEvidence
from llmgw_systemd.health.judge import Memory, ReplicaPolicy, judge
from llmgw_systemd.health.progress import ProgressReading
from llmgw_systemd.health.rules import DEGRADED, FAILED, READY, State
from llmgw_systemd.health.unit_state import UnitState

SINCE = 1000.0
DELAY, TIMEOUT = 5.0, 20.0
TARGET = "llmgw-rep.target"

# -- stopping: what this node's target is going through --------------------------------


@pytest.mark.parametrize(("job_type", "own_restart", "expected"), [
    # someone's `systemctl stop` of the target: a planned stop
    pytest.param("stop", False, PLANNED, id="stop is planned"),
    # a restart stops the target first: planned too
    pytest.param("restart", False, PLANNED, id="restart is planned"),
    # try-restart of an active target restarts it all the same
    pytest.param("try-restart", False, PLANNED, id="try-restart is planned"),
    # a target has nothing to reload: reload-or-restart is a restart
    pytest.param("reload-or-restart", False, PLANNED, id="reload-or-restart is planned"),
    pytest.param("try-reload-or-restart", False, PLANNED,
                 id="try-reload-or-restart is planned"),
    # the supervisor's own restart after a failure: never drained
    pytest.param("restart", True, GROUP_RESTART, id="own restart is a group restart"),
    # a start takes nothing down
    pytest.param("start", False, None, id="start is nothing"),
    # no job at all
    pytest.param("", False, None, id="no job is nothing"),
    # verify-active, reload: the target stays up
    pytest.param("verify-active", False, None, id="verify-active is nothing"),
    pytest.param("reload", False, None, id="reload is nothing"),
    # our restart pending says nothing while no stopping job runs
    pytest.param("start", True, None, id="own restart pending but a start job: nothing"),
])
def test_stopping(job_type: str, own_restart: bool, expected: Stopping | None) -> None:
    assert stopping(job_type, own_restart) == expected


# -- origin: why this node drains the replica --------------------------------------------

ASKED = "2025-03-01T09:00:00Z"
FOR_REP = DrainRequest("rep", "alice", ASKED, "maintenance")
FOR_OTHER = DrainRequest("other", "alice", ASKED, "maintenance")
FOR_NODE = DrainRequest(None, "bob", ASKED)
FOR_NODE_WHY = DrainRequest(None, "bob", ASKED, "kernel update")


class Origin(NamedTuple):
    name: str
    job_type: str
    own_restart: bool
    requests: tuple[DrainRequest, ...]
    expected: str | None


ORIGINS = [
    # an operator's stop of the target: says which target and where
    Origin("planned stop", "stop", False, (), f"planned stop of {TARGET} on a"),
    # a restart of it: a restart, not a stop
    Origin("planned restart", "restart", False, (), f"planned restart of {TARGET} on a"),
    # every restarting job is described as a restart
    Origin("planned try-restart", "try-restart", False, (),
           f"planned restart of {TARGET} on a"),
    # our own group restart is a failure's: it never drains
    Origin("own group restart", "restart", True, (), None),
    # ... but an operator's drain still holds while it runs
    Origin("own group restart with a request", "restart", True, (FOR_REP,),
           f"drain of rep on a asked by alice at {ASKED}: maintenance"),
    # nothing planned, nothing asked
    Origin("no job, no request", "", False, (), None),
    # an operator's drain of this very replica, with the reason given
    Origin("request for this replica", "", False, (FOR_REP,),
           f"drain of rep on a asked by alice at {ASKED}: maintenance"),
    # a drain of another replica on this node is none of ours
    Origin("request for another replica is ignored", "", False, (FOR_OTHER,), None),
    # a drain of the whole node covers every replica here; no reason: no colon
    Origin("request for the node, no reason", "", False, (FOR_NODE,),
           f"drain of this node on a asked by bob at {ASKED}"),
    # ... and with a reason, the reason follows
    Origin("request for the node, with reason", "", False, (FOR_NODE_WHY,),
           f"drain of this node on a asked by bob at {ASKED}: kernel update"),
    # another replica's request is skipped, the node's that follows counts
    Origin("request for another replica, then the node", "", False, (FOR_OTHER, FOR_NODE),
           f"drain of this node on a asked by bob at {ASKED}"),
    # a planned stop says so first, whatever was asked
    Origin("planned stop before a request", "stop", False, (FOR_REP,),
           f"planned stop of {TARGET} on a"),
]


@pytest.mark.parametrize("case", ORIGINS, ids=[c.name for c in ORIGINS])
def test_origin(case: Origin) -> None:
    got = origin("rep", "a", TARGET, case.job_type, case.own_restart, case.requests)
    assert got == case.expected


# -- progress: where the drain stands on this node ---------------------------------------

SERVED_DRAIN = Drain(SINCE, True, ("planned stop of llmgw-rep.target on a",))


class Progress(NamedTuple):
    name: str
    waited: float  # now - since
    phase: Phase
    says: str
    served: bool = True
    serving_here: bool = True
    pending: float | None = None
    pending_at: float | None = None  # seconds after SINCE; None: no reading
    serving_drained: bool | None = None
    cut_short: bool = False
    in_flight: float | None = None


PROGRESSES = [
    # the replica was out of rotation when the drain began: nothing can be in flight
    Progress("not served: drained at once", 0, DRAINED, "was not in rotation",
             served=False, in_flight=0),
    # a worker's node that saw the replica out of rotation follows the serving rank's
    # node, which says it is draining: its own view may have missed it in rotation
    Progress("not served here, the serving rank draining: wait for it", 6, DRAINING,
             "waiting for the serving rank", served=False, serving_here=False,
             serving_drained=False),
    Progress("not served here, the serving rank drained: drained", 6, DRAINED,
             "was not in rotation", served=False, serving_here=False,
             serving_drained=True, in_flight=0),
    Progress("not served here, no serving rank reports: drained at once", 0, DRAINED,
             "was not in rotation", served=False, serving_here=False, in_flight=0),
    # the gateways need the delay to take it out of rotation: no count matters yet
    Progress("within the delay: draining", 3, DRAINING, "out of rotation for 3 s of 5 s",
             pending=0, pending_at=2, in_flight=0),
    # a count read before since + delay may miss what gateways still sent: not counted
    Progress("serving: a count from before the delay does not count", 8, DRAINING,
             "waiting for the engine's count", pending=0, pending_at=4),
    # nothing read at all yet after the delay
    Progress("serving: no reading yet", 8, DRAINING, "waiting for the engine's count"),
    # the engine's own count, read after the delay, is 0: done
    Progress("serving: 0 pending after the delay: drained", 7, DRAINED, "nothing in flight",
             pending=0, pending_at=6, in_flight=0),
    # requests still running: draining, with the count and the time left
    Progress("serving: 2 pending: draining with the count", 7, DRAINING,
             "2 request(s) in flight; 18 s left", pending=2, pending_at=6, in_flight=2),
    # metrics unreadable: keep waiting until delay + timeout
    Progress("serving: metrics unreadable before the timeout", 24, DRAINING,
             "waiting for the engine's count of requests in flight; 1 s left",
             pending_at=23),
    # ... then cut short, with nothing known in flight
    Progress("serving: metrics unreadable at the timeout: cut short", 25, DRAINED,
             "ran out with an unknown number of request(s) in flight", pending_at=24,
             cut_short=True),
    # still 3 running when the timeout runs out: cut short, and say 3
    Progress("serving: 3 pending at the timeout: cut short", 25, DRAINED,
             "drain timeout (20 s) ran out with 3 request(s) in flight", pending=3,
             pending_at=24, cut_short=True, in_flight=3),
    # a count from before the delay is not known at the timeout either
    Progress("serving: only an early count at the timeout: unknown", 25, DRAINED,
             "an unknown number", pending=3, pending_at=1, cut_short=True),
    # elsewhere: the serving rank's node says it is drained
    Progress("not serving here: the serving node drained", 6, DRAINED,
             "the serving rank has nothing in flight", serving_here=False,
             serving_drained=True),
    # ... but not before the delay, which is the gateways'
    Progress("not serving here: drained, but within the delay", 4, DRAINING,
             "out of rotation for 4 s", serving_here=False, serving_drained=True),
    # the serving node not drained yet: wait for it
    Progress("not serving here: the serving node still draining", 6, DRAINING,
             "waiting for the serving rank to finish what it has in flight; 19 s left",
             serving_here=False, serving_drained=False),
    # ... at most until delay + timeout
    Progress("not serving here: not drained at the timeout: cut short", 25, DRAINED,
             "drain timeout (20 s) ran out", serving_here=False, serving_drained=False,
             cut_short=True),
    # no rank serves HTTP (a command replica), or none reports: the delay is all
    Progress("no serving rank: drained once the delay passed", 5, DRAINED,
             "no serving rank to drain", serving_here=False),
    Progress("no serving rank: within the delay", 4, DRAINING, "out of rotation",
             serving_here=False),
]


@pytest.mark.parametrize("case", PROGRESSES, ids=[c.name for c in PROGRESSES])
def test_progress(case: Progress) -> None:
    drain = replace(SERVED_DRAIN, served=case.served)
    got = progress(drain, SINCE + case.waited, DELAY, TIMEOUT, serving_here=case.serving_here,
                   pending=case.pending,
                   pending_at=None if case.pending_at is None else SINCE + case.pending_at,
                   serving_drained=case.serving_drained)
    assert (got.phase, got.cut_short, got.in_flight) == \
        (case.phase, case.cut_short, case.in_flight), got
    assert case.says in got.reason, got


# -- step: the ExecStop= drain step ----------------------------------------------------

WATCHING = StopView(routable=True, stopping=None, phase=None)  # sees no stop (yet)
DRAINING_VIEW = StopView(routable=False, stopping=PLANNED, phase=DRAINING)
DRAINED_VIEW = StopView(routable=False, stopping=PLANNED, phase=DRAINED, drained_for=9)


class Step(NamedTuple):
    name: str
    view: StopView | None
    elapsed: float
    go: bool
    says: str
    serving: bool = True
    main_alive: bool = True
    target_job: str | None = None
    failure: bool = False  # a failure's stop: what is left is killed at once


STEPS = [
    # the engine died: the stop is systemd cleaning up a failure
    Step("main process gone: go", DRAINING_VIEW, 0, True, "main process is gone",
         main_alive=False, failure=True),
    # no supervisor to ask: the delay alone takes it out of rotation
    Step("no supervisor: wait within the delay", None, 1, False, "waiting out the delay"),
    Step("no supervisor: go after the delay", None, DELAY, True, "delay alone"),
    # no supervisor, and systemd says the target is not being stopped: a member's failure
    Step("no supervisor, no job on the target: go", None, 0, True, "no drain",
         target_job=""),
    # ... while a stop job on the target is planned: the delay still holds
    Step("no supervisor, a stop job on the target: wait", None, 1, False,
         "waiting out the delay", target_job="stop"),
    # the supervisor's group restart: a failure never waits
    Step("group restart: go at once",
         StopView(routable=True, stopping=GROUP_RESTART, phase=None), 0, True,
         "group restart", failure=True),
    # a planned stop of a replica not in rotation (failed, stopped): no drain held
    Step("no drain, planned: go at once",
         StopView(routable=False, stopping=PLANNED, phase=None), 0, True,
         "nothing to drain"),
    # a stop passed on from a dead member: the replica is no longer routable
    Step("no drain, not routable (a failure): go at once",
         StopView(routable=False, stopping=None, phase=None), 0, True, "nothing to drain"),
    # ... and systemd lists no stop or restart on the target: a member died
    Step("no drain, not routable, no job on the target: a failure, go at once",
         StopView(routable=False, stopping=None, phase=None), 0, True, "a member died",
         serving=False, target_job="", failure=True),
    # no supervisor and no job on the target: a member died, or an operator stopped the
    # engine unit alone; which, nothing here can tell, so SIGTERM's grace stays
    Step("no supervisor, no job on the target: not known to be a failure", None, 0, True,
         "was stopped alone", target_job=""),
    # not routable in a view that has not seen systemd's own stop job yet: perhaps a blip
    # (a late peer report); a worker leaving on it breaks rank 0's requests in flight
    Step("no drain, not routable, a restart job on the target: wait for the supervisor",
         StopView(routable=False, stopping=None, phase=None), NOTICE / 2, False,
         "waiting for the supervisor to see this stop", serving=False,
         target_job="restart"),
    Step("no drain, not routable, a stop job, past NOTICE: go",
         StopView(routable=False, stopping=None, phase=None), NOTICE, True,
         "nothing to drain", serving=False, target_job="stop"),
    # routable and no drain: the supervisor may not have seen the stop yet
    Step("no drain, routable, before NOTICE: wait", WATCHING, NOTICE / 2, False,
         "waiting for the supervisor to see this stop"),
    # past NOTICE it did not see it: the delay alone
    Step("no drain, routable, after NOTICE: wait out the delay", WATCHING, NOTICE, False,
         "did not see this stop: waiting out the delay"),
    Step("no drain, routable, after the delay: go", WATCHING, DELAY, True,
         "did not see this stop; out of rotation by the 5 s delay alone"),
    # the gateways need the delay to notice
    Step("draining within the delay: wait", DRAINING_VIEW, 1, False,
         "waiting for the gateways"),
    # a maintenance drain begun long ago: the gateways noticed long ago
    Step("drained_for counts: a drain begun long ago, no further delay",
         replace(DRAINING_VIEW, drained_for=600), 0, True, "drains what it has in flight"),
    # the serving rank's engine drains on SIGTERM itself
    Step("serving, after the delay: go", DRAINING_VIEW, DELAY, True, "on SIGTERM"),
    # a worker's leaving would break the serving rank's requests in flight
    Step("worker, after the delay, not drained: wait", DRAINING_VIEW, DELAY + 1, False,
         "waiting for the serving rank to drain", serving=False),
    # the serving rank is drained: the worker may go
    Step("worker, drained: go", DRAINED_VIEW, 0, True, "drained", serving=False),
    # bounded: at delay + timeout the worker goes anyway
    Step("worker at delay + timeout: go", DRAINING_VIEW, DELAY + TIMEOUT, True,
         "drain timeout (20 s) ran out", serving=False),
    # a drain begun long ago does not shorten the worker's wait for the serving rank
    Step("worker, a drain begun long ago, not drained: wait",
         replace(DRAINING_VIEW, drained_for=600), 0, False,
         "waiting for the serving rank to drain", serving=False),
]


@pytest.mark.parametrize("case", STEPS, ids=[c.name for c in STEPS])
def test_step(case: Step) -> None:
    got = step(case.view, case.elapsed, DELAY, TIMEOUT, serving=case.serving,
               main_alive=case.main_alive, target_job=case.target_job)
    assert got.go == case.go, got
    assert case.says in got.reason, got
    assert got.failure == case.failure, got


# -- events: what the metrics count ----------------------------------------------------

IN_PROGRESS = DrainProgress(DRAINING, "2 request(s) in flight", in_flight=2)
DONE = DrainProgress(DRAINED, "nothing in flight", in_flight=0)
CUT = DrainProgress(DRAINED, "drain timeout", cut_short=True, in_flight=3)
CUT_UNKNOWN = DrainProgress(DRAINED, "drain timeout", cut_short=True)


class Events(NamedTuple):
    name: str
    before: DrainProgress | None
    after: DrainProgress | None
    expected: tuple[DrainEvent, ...]
    served: bool = True


EVENTS = [
    # the first judgement that sees the drain: it starts
    Events("start", None, IN_PROGRESS, (DrainEvent(STARTED),)),
    # over already in the judgement that saw it start: both, with how long it took
    Events("start and drained at once", None, DONE,
           (DrainEvent(STARTED), DrainEvent(FINISHED, 12.0))),
    # nothing in flight any more: finished, after how long
    Events("draining -> drained: finished", IN_PROGRESS, DONE,
           (DrainEvent(FINISHED, 12.0),)),
    # the timeout ran out: cut short, with what was still in flight
    Events("draining -> cut short: with in_flight", IN_PROGRESS, CUT,
           (DrainEvent(CUT_SHORT, 12.0, 3),)),
    # cut short with the count unknown
    Events("draining -> cut short, unknown count", IN_PROGRESS, CUT_UNKNOWN,
           (DrainEvent(CUT_SHORT, 12.0, None),)),
    # not in rotation when it began: counts for nothing
    Events("not served: nothing", None, DONE, (), served=False),
    # no change between two judgements
    Events("draining, unchanged: nothing", IN_PROGRESS, IN_PROGRESS, ()),
    Events("drained, unchanged: nothing", DONE, DONE, ()),
    # the drain ended (its cause gone): no event of its own
    Events("drain over: nothing", IN_PROGRESS, None, ()),
]


@pytest.mark.parametrize("case", EVENTS, ids=[c.name for c in EVENTS])
def test_events(case: Events) -> None:
    drain = replace(SERVED_DRAIN, served=case.served)
    assert events(case.before, case.after, drain, SINCE + 12) == case.expected


def test_events_without_a_drain_held() -> None:
    # the judge forgot the drain (a failed replica): nothing to count
    assert events(None, IN_PROGRESS, None, SINCE) == ()


# -- through judge ----------------------------------------------------------------------

NOW = 2000.0
GEN, PEER_GEN = "aa" * 16, "cc" * 16
ONE = ReplicaPolicy(name="rep", nodes=("a",), rank=0, serving=True, stability=30,
                    probe_fresh=3, peer_fresh=5, settle=10, drain_delay=DELAY,
                    drain_timeout=TIMEOUT, target=TARGET, serving_ranks=(0,))
TWO = replace(ONE, nodes=("a", "b"))  # rank 0 on a serves HTTP, rank 1 on b
WORKER = replace(TWO, rank=1, serving=False, target=TARGET)  # b's view of the same replica
# data parallel with every node serving (vLLM's hybrid mode): a's view, and a third
# node's, a worker, with ranks 0 and 1 serving
HYBRID = replace(TWO, serving_ranks=(0, 1))
HYBRID_WORKER = replace(HYBRID, nodes=("a", "b", "c"), rank=2, serving=False)
PLANNED_A = f"planned stop of {TARGET} on a"
PLANNED_B = f"planned stop of {TARGET} on b"
RESTART_A = f"planned restart of {TARGET} on a"


def units(job: str = "", active: str = "active", sub: str = "running",
          result: str = "success") -> LocalEvidence:
    target = UnitState(TARGET, "loaded", "active", "active", job_type=job)
    engine = UnitState("llmgw-rep-engine.service", "loaded", active, sub, result,
                       active_enter_usec=int((NOW - 100) * 1e6), invocation_id=GEN)
    return LocalEvidence(target, (engine,), NOW)


def peer(source: str, rank: int, *, draining: str | None = None, drained: bool = False,
         node: str | None = None, serving: bool | None = None, state: State = READY,
         reason: str = "ready as it says") -> dict[str, PeerEvidence]:
    shard = PeerShard("rep", rank, node or source, state, reason, PEER_GEN,
                      serving=rank == 0 if serving is None else serving,
                      draining=draining, drained=drained)
    return {source: PeerEvidence(source, NOW - 1, True, (shard,))}


def reading(pending: float | None, taken_at: float, gen: str = GEN) -> ProgressReading:
    return ProgressReading(taken_at, None if pending is None else 100, pending,
                           "" if pending is not None else "connection refused", gen)


PROBE_OK = ProbeEvidence(True, "HTTP 200 in 3 ms", GEN, NOW - 1)
IN_ROTATION = Memory(served=GEN, routable=True)  # the last judgement: ready, routable


def draining_since(since: float, *causes: str) -> Memory:
    return Memory(served=GEN, drain=Drain(since, True, causes))


@dataclass(frozen=True)
class Judged:
    what: str
    state: State
    routable: bool
    policy: ReplicaPolicy = ONE
    memory: Memory = IN_ROTATION
    local: LocalEvidence | None = field(default_factory=units)
    probe: ProbeEvidence | None = PROBE_OK
    peers: dict[str, PeerEvidence] = field(default_factory=dict)
    progress: tuple[ProgressReading, ...] = ()
    requests: tuple[DrainRequest, ...] = ()
    draining: str | None = None  # our own RankReport.draining (None: none)
    drained: bool = False  # our own RankReport.drained
    stopping: Stopping | None = None
    held: bool | None = None  # memory.drain.served (None: no drain held)
    since: float = NOW  # memory.drain.since, when one is held
    reason: str = ""


JUDGED = [
    # a planned restart of a ready replica's target: out of rotation before anything stops
    Judged("one node, planned restart: draining", "draining", False,
           local=units("restart"), draining=RESTART_A, stopping=PLANNED, held=True,
           reason=f"out of rotation for 0 s of 5 s before the requests in flight are drained "
           f"({RESTART_A})"),
    # the same restart job, but ours (a failure's group restart): no drain
    Judged("one node, our own group restart: no drain", READY, True,
           policy=replace(ONE, restart_hold=30),
           memory=replace(IN_ROTATION, restart_pending=(GEN, NOW - 1)),
           local=units("restart"), stopping=GROUP_RESTART),
    # a planned stop on another node takes the replica out of rotation here too
    Judged("two nodes, the peer drains: this node drains too", "draining", False,
           policy=TWO, peers=peer("b", 1, draining=PLANNED_B), held=True,
           reason=PLANNED_B),
    # the serving node's own count, read after since + delay, is 0: drained
    Judged("serving node, 0 pending read after the delay: drained", "drained", False,
           policy=TWO, memory=draining_since(NOW - 10, PLANNED_A), local=units("stop"),
           peers=peer("b", 1), progress=(reading(0, NOW - 1),), draining=PLANNED_A,
           drained=True, stopping=PLANNED, held=True, since=NOW - 10,
           reason="nothing in flight"),
    # a count taken before since + delay may miss requests still arriving
    Judged("serving node, 0 pending read within the delay: still draining", "draining",
           False, policy=TWO, memory=draining_since(NOW - 10, PLANNED_A),
           local=units("stop"), peers=peer("b", 1), progress=(reading(0, NOW - 8),),
           draining=PLANNED_A, stopping=PLANNED, held=True, since=NOW - 10,
           reason="waiting for the engine's count"),
    # a reading of an earlier start of the engine says nothing about this one
    Judged("serving node, a reading of an earlier start does not count", "draining",
           False, policy=TWO, memory=draining_since(NOW - 10, PLANNED_A),
           local=units("stop"), peers=peer("b", 1),
           progress=(reading(0, NOW - 1, gen="bb" * 16),), draining=PLANNED_A,
           stopping=PLANNED, held=True, since=NOW - 10,
           reason="waiting for the engine's count"),
    # still 4 running at delay + timeout: drained anyway, cut short
    Judged("serving node, 4 pending at the timeout: cut short", "drained", False,
           policy=TWO, memory=draining_since(NOW - 25, PLANNED_A), local=units("stop"),
           peers=peer("b", 1), progress=(reading(4, NOW - 1),), draining=PLANNED_A,
           drained=True, stopping=PLANNED, held=True, since=NOW - 25,
           reason="ran out with 4 request(s) in flight"),
    # the worker's node waits for the serving node's word
    Judged("worker node, the serving node still draining", "draining", False,
           policy=WORKER, memory=draining_since(NOW - 10, PLANNED_B), local=units("stop"),
           probe=None, peers=peer("a", 0), draining=PLANNED_B, stopping=PLANNED, held=True,
           since=NOW - 10, reason="waiting for the serving rank"),
    # ... and is drained once the serving node says it is
    Judged("worker node, the serving node drained", "drained", False, policy=WORKER,
           memory=draining_since(NOW - 10, PLANNED_B), local=units("stop"), probe=None,
           peers=peer("a", 0, drained=True), draining=PLANNED_B, drained=True,
           stopping=PLANNED, held=True, since=NOW - 10,
           reason="the serving rank has nothing in flight"),
    # several serving ranks (hybrid): each reports its own part, and a node goes on once
    # every serving rank is done; none waits on another's wait
    Judged("two serving nodes, done here, the other still busy: draining", "draining", False,
           policy=HYBRID, memory=draining_since(NOW - 10, PLANNED_A), local=units("stop"),
           peers=peer("b", 1, serving=True), progress=(reading(0, NOW - 1),),
           draining=PLANNED_A, drained=True, stopping=PLANNED, held=True, since=NOW - 10,
           reason="nothing in flight here; waiting for the other serving ranks"),
    Judged("two serving nodes, both done: drained", "drained", False, policy=HYBRID,
           memory=draining_since(NOW - 10, PLANNED_A), local=units("stop"),
           peers=peer("b", 1, serving=True, drained=True), progress=(reading(0, NOW - 1),),
           draining=PLANNED_A, drained=True, stopping=PLANNED, held=True, since=NOW - 10,
           reason="nothing in flight"),
    Judged("two serving nodes, the other said drained but this one is busy: draining",
           "draining", False, policy=HYBRID, memory=draining_since(NOW - 10, PLANNED_B),
           local=units(), peers=peer("b", 1, serving=True, drained=True,
                                     draining=PLANNED_B),
           progress=(reading(3, NOW - 1),), held=True, since=NOW - 10,
           reason="3 request(s) in flight"),
    Judged("two serving nodes, the other still busy at the timeout: cut short", "drained",
           False, policy=HYBRID, memory=draining_since(NOW - 25, PLANNED_A),
           local=units("stop"), peers=peer("b", 1, serving=True),
           progress=(reading(0, NOW - 1),), draining=PLANNED_A, drained=True,
           stopping=PLANNED, held=True, since=NOW - 25,
           reason="ran out waiting for the other serving ranks"),
    Judged("worker node, one of two serving ranks drained: draining", "draining", False,
           policy=HYBRID_WORKER, memory=draining_since(NOW - 10, PLANNED_B),
           local=units("stop"), probe=None,
           peers={**peer("a", 0, drained=True, draining=PLANNED_B),
                  **peer("b", 1, serving=True)},
           stopping=PLANNED, held=True, since=NOW - 10, draining=f"{PLANNED_A[:-2]} c",
           reason="waiting for the serving rank"),
    Judged("worker node, both serving ranks drained: drained", "drained", False,
           policy=HYBRID_WORKER, memory=draining_since(NOW - 10, PLANNED_B),
           local=units("stop"), probe=None,
           peers={**peer("a", 0, drained=True, draining=PLANNED_B),
                  **peer("b", 1, serving=True, drained=True)},
           drained=True, stopping=PLANNED, held=True, since=NOW - 10,
           draining=f"{PLANNED_A[:-2]} c", reason="the serving rank has nothing in flight"),
    # every serving endpoint must answer: one that does not takes the replica out of
    # rotation on every node, this one's endpoint included (the ranks step together)
    Judged("two serving nodes, the other's endpoint not answering: out everywhere",
           DEGRADED, False, policy=HYBRID,
           peers=peer("b", 1, serving=True, state=DEGRADED,
                      reason="units up, but HTTP 503 from /health"),
           reason="HTTP 503 from /health"),
    Judged("two serving nodes, both answering: ready", READY, True, policy=HYBRID,
           peers=peer("b", 1, serving=True)),
    # a failed replica is out of rotation already: it stays failed, nothing drains
    Judged("failed replica with a drain cause stays failed", FAILED, False,
           local=units("restart", "failed", "failed", "exit-code"), probe=None,
           draining=RESTART_A, stopping=PLANNED),
    # an operator's drain of this replica: draining with no job at all
    Judged("drain request for this replica: draining", "draining", False,
           requests=(FOR_REP,), draining="drain of rep on a asked by alice", held=True,
           reason="maintenance"),
    # an operator's drain of another replica: this one stays in rotation
    Judged("drain request for another replica: ignored", READY, True,
           requests=(FOR_OTHER,)),
    # a drain that begins while the replica is out of rotation has nothing in flight
    Judged("drain begun while out of rotation: drained at once", "drained", False,
           memory=Memory(served=GEN, routable=False), local=units("restart"),
           draining=RESTART_A,
           drained=True, stopping=PLANNED, held=False, reason="was not in rotation"),
    Judged("drain begun out of rotation for longer than the delay: drained at once",
           "drained", False, memory=Memory(served=GEN, routable=False, routable_at=NOW - 5),
           local=units("restart"), draining=RESTART_A, drained=True, stopping=PLANNED,
           held=False, reason="was not in rotation"),
    # ... but routable a moment ago: a gateway may not have noticed yet, so it waits
    Judged("drain begun just after a moment out of rotation: waits the delay", "draining",
           False, memory=Memory(served=GEN, routable=False, routable_at=NOW - 1),
           local=units("restart"), draining=RESTART_A, stopping=PLANNED, held=True,
           reason="out of rotation for 0 s"),
    # a supervisor that just started (no last judgement) assumes the replica was in
    # rotation: a drain it finds is not cut short to nothing
    Judged("drain found by a supervisor that just started: waits the delay", "draining",
           False, memory=Memory(served=GEN), local=units("restart"), draining=RESTART_A,
           stopping=PLANNED, held=True, reason="out of rotation for 0 s"),
    # the cause gone (the job cancelled, the request withdrawn): back in rotation
    Judged("cause gone: drain forgotten, routable again", READY, True,
           memory=draining_since(NOW - 60, RESTART_A)),
    # a report that does not count (b speaking as c) cannot start a drain
    Judged("a refused peer report does not drain", DEGRADED, False, policy=TWO,
           peers=peer("b", 1, draining=PLANNED_B, node="c"),
           reason="reports no shard of rep"),
]


@pytest.mark.parametrize("case", JUDGED, ids=[c.what for c in JUDGED])
def test_judge_drains(case: Judged) -> None:
    verdict = judge(case.policy, case.memory, local=case.local, probe=case.probe,
                    peers=case.peers, now=NOW, progress=case.progress,
                    requests=case.requests)
    assert verdict.health.state == case.state, verdict.health
    assert case.reason in verdict.health.reason, verdict.health
    assert (verdict.routable, verdict.memory.routable) == (case.routable, case.routable)
    assert verdict.stopping == case.stopping
    mine = next(r for r in verdict.ranks if r.rank == case.policy.rank)
    if case.draining is None:
        assert mine.draining is None, mine
    else:
        assert mine.draining is not None and case.draining in mine.draining, mine
    assert mine.drained == case.drained, mine
    held = verdict.memory.drain
    if case.held is None:
        assert held is None and verdict.drain is None
    else:
        assert held is not None and held.served == case.held, held
        assert held.since == case.since, held
        assert verdict.drain is not None and verdict.drain.phase == case.state


def test_a_planned_restart_through_judgements() -> None:
    """Ready, then a restart job: draining at once, drained once the count read after the
    delay is 0; the events count one drain, finished; the job gone: routable again."""
    memory, before = IN_ROTATION, None
    seen: list[DrainEvent] = []
    plan = [(0.0, "restart", ()), (3.0, "restart", (reading(2, NOW + 2),)),
            (6.0, "restart", (reading(1, NOW + 6),)), (8.0, "restart", (reading(0, NOW + 7),)),
            (9.0, "", ())]
    states = []
    for t, job, readings in plan:
        local = replace(units(job), read_at=NOW + t)
        verdict = judge(ONE, memory, local=local, probe=replace(PROBE_OK, taken_at=NOW + t),
                        peers={}, now=NOW + t, progress=readings)
        # as the daemon counts them (supervisor/daemon.py, _count_drain)
        seen.extend(events(before, verdict.drain, verdict.memory.drain, NOW + t))
        memory, before = verdict.memory, verdict.drain
        states.append((verdict.health.state, verdict.routable))
    assert states == [("draining", False), ("draining", False), ("draining", False),
                      ("drained", False), (READY, True)]
    assert seen == [DrainEvent(STARTED), DrainEvent(FINISHED, 8.0)]
    assert memory.drain is None


def test_drained_stays_drained_while_the_drain_lasts() -> None:
    """The serving rank's count goes unreadable as its ranks stop (the engine is gone):
    a drain that was drained does not fall back to draining (a worker's stop went on
    already on its word)."""
    drain = Drain(0.0, True, ("x",))
    done = progress(drain, 6.0, 5, 20, serving_here=True, pending=0, pending_at=5.5,
                    serving_drained=None)
    assert done.phase == DRAINED
    later = progress(replace(drain, finished=done), 9.0, 5, 20, serving_here=True,
                     pending=None, pending_at=8.5, serving_drained=None)
    assert later == done
