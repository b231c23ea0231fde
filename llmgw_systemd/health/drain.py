"""Drain: a planned stop takes the replica out of rotation before any process goes (pure;
no I/O, no clock).

Every planned disruption of a serving replica (`systemctl stop|restart` of its target on
any node, `llmgw-render --apply`, its removal, a node shutting down) or an operator's
`llmgw-systemd drain` starts a drain (docs/supervisor.md, "Drain"):

1. the node where it happens says so in its shard report (`draining`, with why), and
   every node's supervisor reports the replica `draining`, not routable, at once;
2. nothing is signalled for `delay` seconds, so a gateway checking every 1-2 s has
   taken the replica out of rotation;
3. the serving rank finishes what it has in flight, for at most `timeout` seconds
   (vLLM's --shutdown-timeout, SGLang's and a command's SIGTERM drain); its supervisor
   says `drained` once the engine's own count of requests running and waiting, read
   after the delay, is 0, or once the timeout ran out (cut short);
4. then the ranks stop. A worker rank's planned stop waits for `drained` (bounded):
   its leaving breaks the serving rank's collective in the middle of a request.

Failures never wait: a stop whose main process is gone, a stop that systemd passes on
from a dead member (the replica is no longer routable), and the supervisor's own group
restart all go at once. A stop that finds no supervisor to ask waits `delay` alone.

Two parts use these rules: the supervisor (`origin`, `progress`: what it reports), and
the drain step that every engine unit runs first in its `ExecStop=` (`step`: whether to
wait, from the local supervisor's answer). Times are seconds on CLOCK_MONOTONIC, which
every process of one node shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

# systemd job types that take a target down (a restart stops it first)
STOPPING_JOBS = frozenset({"stop", "restart", "try-restart", "reload-or-restart",
                           "try-reload-or-restart"})

# What this node's shard is going through, as the API says it (`stopping`).
Stopping = Literal["planned", "group-restart"]
PLANNED: Final = "planned"
GROUP_RESTART: Final = "group-restart"

Phase = Literal["draining", "drained"]
DRAINING: Final = "draining"
DRAINED: Final = "drained"

# How long the drain step waits for a supervisor that answers but has not seen the stop
# yet (it reads systemd within milliseconds of a signal; this only bounds a slow one).
NOTICE = 2.0


@dataclass(frozen=True)
class DrainRequest:
    """An operator's `llmgw-systemd drain` on this node: one replica, or every replica
    with a shard here (`replica` None)."""

    replica: str | None
    by: str  # who asked (the user name), for people
    since: str  # when, as the requester wrote it (ISO 8601, UTC), for people
    reason: str = ""


def stopping(job_type: str, own_restart: bool) -> Stopping | None:
    """What this node's target is going through: a planned stop or restart (someone
    else's stop or restart job on it), the supervisor's own group restart, or nothing."""
    if job_type not in STOPPING_JOBS:
        return None
    return GROUP_RESTART if own_restart else PLANNED


def origin(replica: str, node: str, target: str, job_type: str, own_restart: bool,
           requests: tuple[DrainRequest, ...]) -> str | None:
    """Why this node drains the replica (for its shard report), or None: a planned stop
    of its target, or an operator's request."""
    if stopping(job_type, own_restart) == PLANNED:
        verb = "stop" if job_type == "stop" else "restart"
        return f"planned {verb} of {target} on {node}"
    for request in requests:
        if request.replica in (None, replica):
            what = "this node" if request.replica is None else replica
            why = f": {request.reason}" if request.reason else ""
            return f"drain of {what} on {node} asked by {request.by} at {request.since}{why}"
    return None


@dataclass(frozen=True)
class Drain:
    """A drain in progress as one supervisor holds it (kept in the judge's memory)."""

    since: float  # when this supervisor first saw it
    served: bool  # whether the replica was routable then: else nothing is in flight
    causes: tuple[str, ...]  # the origins, as the ranks' reports say them
    # once drained, it stays so for as long as the drain lasts: the engine's count may
    # become unreadable as its ranks stop, and a worker's stop went on already
    finished: DrainProgress | None = None


@dataclass(frozen=True)
class DrainProgress:
    """Where a drain stands: `phase`, why, and what was in flight when it ended."""

    phase: Phase
    reason: str
    cut_short: bool = False  # drained because the timeout ran out, not by finishing
    in_flight: float | None = None  # the serving rank's last count (None: unknown)


def progress(drain: Drain, now: float, delay: float, timeout: float, *,
             serving_here: bool, pending: float | None, pending_at: float | None,
             serving_drained: bool | None) -> DrainProgress:
    """Where the drain stands on this node.

    serving_here: this node runs the serving rank, and `pending` (requests running and
    waiting, None when its metrics cannot be read) is its engine's count read at
    `pending_at`. Elsewhere `serving_drained` is what the serving rank's own node
    reported (None: no rank serves HTTP, or no report)."""
    if drain.finished is not None:
        return drain.finished
    waited = now - drain.since
    # A worker's node follows the serving rank's node when it reports: only that node
    # knows whether requests are in flight, and a worker's own view may have missed
    # the replica in rotation (a late peer report on a loaded node).
    if not drain.served and (serving_here or serving_drained is not False):
        return DrainProgress(DRAINED, "was not in rotation: nothing in flight", in_flight=0)
    if waited < delay:
        return DrainProgress(DRAINING, f"out of rotation for {waited:.0f} s of {delay:g} s "
                             "before the requests in flight are drained", in_flight=pending)
    if serving_here:
        counted = pending_at is not None and pending_at >= drain.since + delay
        if counted and pending is not None and pending <= 0:
            return DrainProgress(DRAINED, "nothing in flight", in_flight=0)
        if waited >= delay + timeout:
            known = pending if counted else None
            return DrainProgress(DRAINED, f"drain timeout ({timeout:g} s) ran out with "
                                 f"{'an unknown number of' if known is None else f'{known:g}'}"
                                 " request(s) in flight", cut_short=True, in_flight=known)
        count = (f"{pending:g} request(s) in flight" if counted and pending is not None
                 else "waiting for the engine's count of requests in flight")
        return DrainProgress(DRAINING, f"{count}; {delay + timeout - waited:.0f} s left",
                             in_flight=pending if counted else None)
    if serving_drained:
        return DrainProgress(DRAINED, "the serving rank has nothing in flight")
    if serving_drained is None and waited >= delay:
        # no rank serves HTTP (or none reports): nothing to count, the delay is all
        return DrainProgress(DRAINED, "no serving rank to drain")
    if waited >= delay + timeout:
        return DrainProgress(DRAINED, f"drain timeout ({timeout:g} s) ran out",
                             cut_short=True)
    return DrainProgress(DRAINING, "waiting for the serving rank to finish what it has in "
                         f"flight; {delay + timeout - waited:.0f} s left")


def with_other_servers(own: DrainProgress, others_drained: bool | None, waited: float,
                       delay: float, timeout: float) -> DrainProgress:
    """Where the drain stands on a serving node among other serving ranks (data parallel
    behind a load balancer: every node serves): drained once its own engine has nothing in
    flight and every other serving rank reports the same of its own, or when the timeout
    runs out. Each rank reports only its own part (`own`), so no rank waits on another's
    wait. others_drained: None when no other rank serves."""
    if own.phase != DRAINED or others_drained is None or others_drained or own.cut_short:
        return own
    if waited >= delay + timeout:
        return DrainProgress(DRAINED, f"drain timeout ({timeout:g} s) ran out waiting for "
                             "the other serving ranks", cut_short=True, in_flight=own.in_flight)
    return DrainProgress(DRAINING, f"{own.reason} here; waiting for the other serving ranks; "
                         f"{delay + timeout - waited:.0f} s left", in_flight=own.in_flight)


# -- the drain step: the first thing every engine unit's ExecStop= does ------------------

@dataclass(frozen=True)
class StopView:
    """What the drain step reads of the local supervisor's answer for its replica."""

    routable: bool
    stopping: Stopping | None  # this node's shard, as the supervisor saw it
    phase: Phase | None  # the drain's, None when none is in progress
    drained_for: float = 0.0  # seconds since the drain began, as of the answer


@dataclass(frozen=True)
class StepDecision:
    go: bool  # signal the engine now (else ask again shortly)
    reason: str
    # a failure's stop: nothing in flight to finish or save, so what is left of the unit
    # is killed at once rather than given SIGTERM's grace (issue 42: vLLM's workers
    # outlived their dead main process by the whole 25 s grace, before Restart= could act)
    failure: bool = False


def step(view: StopView | None, elapsed: float, delay: float, timeout: float, *,
         serving: bool, main_alive: bool, target_job: str | None = None) -> StepDecision:
    """Whether the drain step lets the stop go on now. view: the local supervisor's
    answer (None: no supervisor answered); elapsed: seconds since the step began;
    target_job: the job on the replica's target as systemd itself said it (asked when no
    supervisor answers, or it says not routable without having seen the stop; None: not
    known).

    The serving rank goes once the delay is over: its engine drains on SIGTERM (vLLM's
    --shutdown-timeout). Any other rank goes once the serving rank is drained, or the
    timeout ran out: its leaving would break the serving rank's requests."""
    if not main_alive:
        return StepDecision(True, "the main process is gone (a failure): no drain",
                            failure=True)
    if view is None:
        if target_job is not None and target_job not in STOPPING_JOBS:
            return StepDecision(True, "no stop or restart of the target (a member died, or "
                                "was stopped alone): no drain")
        if elapsed >= delay:
            return StepDecision(True, f"no supervisor answered: out of rotation by the "
                                f"{delay:g} s delay alone")
        return StepDecision(False, "no supervisor answers: waiting out the delay")
    if view.stopping == GROUP_RESTART:
        return StepDecision(True, "the supervisor's group restart (a failure): no drain",
                            failure=True)
    if view.phase is None:
        if view.stopping == PLANNED:  # it saw this stop and holds no drain: failed, stopped
            return StepDecision(True, "not in rotation: nothing to drain")
        if not view.routable:
            # Not routable, and the stop not seen yet: a failure's stop goes at once, but
            # systemd's own planned job on the target waits for the supervisor to see it.
            # Its view may be a blip (a late peer report on a loaded node): a worker that
            # left on it broke rank 0's requests in flight (2 failed in a CI run).
            if target_job in STOPPING_JOBS and elapsed < NOTICE:
                return StepDecision(False, "not routable, and a stop job on the target: "
                                    "waiting for the supervisor to see this stop")
            if target_job == "":  # systemd's word: a member died, this is its stop
                return StepDecision(True, "not routable, no stop or restart of the target "
                                    "(a member died): no drain", failure=True)
            return StepDecision(True, "not in rotation: nothing to drain")
        if elapsed < NOTICE:
            return StepDecision(False, "waiting for the supervisor to see this stop")
        if elapsed >= delay:
            return StepDecision(True, f"the supervisor did not see this stop; out of "
                                f"rotation by the {delay:g} s delay alone")
        return StepDecision(False, "the supervisor did not see this stop: waiting out the "
                            "delay")
    if view.phase == DRAINED:
        return StepDecision(True, "drained")
    waited = max(elapsed, view.drained_for)
    if waited < delay:
        return StepDecision(False, "out of rotation: waiting for the gateways to notice")
    if serving:
        return StepDecision(True, f"out of rotation for {delay:g} s; the engine drains what "
                            "it has in flight on SIGTERM")
    if elapsed >= delay + timeout:
        return StepDecision(True, f"drain timeout ({timeout:g} s) ran out")
    return StepDecision(False, "waiting for the serving rank to drain")


# -- what the metrics count -----------------------------------------------------------

STARTED: Final = "started"
FINISHED: Final = "finished"
CUT_SHORT: Final = "cut-short"


@dataclass(frozen=True)
class DrainEvent:
    """A drain's start or end, from one judgement to the next (for the metrics)."""

    kind: str  # STARTED, FINISHED (nothing in flight) or CUT_SHORT (the timeout ran out)
    seconds: float = 0.0  # at the end: how long it took
    in_flight: float | None = None  # at a cut: what the serving rank still had


def events(before: DrainProgress | None, after: DrainProgress | None, drain: Drain | None,
           now: float) -> tuple[DrainEvent, ...]:
    """What changed between two judgements of one replica's drain. A drain of a replica
    that was not in rotation ends as soon as it starts and counts for nothing."""
    if after is None or drain is None or not drain.served:
        return ()
    out: list[DrainEvent] = []
    if before is None:
        out.append(DrainEvent(STARTED))
    if after.phase == DRAINED and (before is None or before.phase != DRAINED):
        out.append(DrainEvent(CUT_SHORT if after.cut_short else FINISHED, now - drain.since,
                              after.in_flight if after.cut_short else None))
    return tuple(out)
