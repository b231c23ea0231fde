"""The supervisor's decisions (pure): (memory, evidence, policy, now) -> verdict.

One call judges one replica with a shard on this node: the health of this node's rank
from systemd and its probe, the other ranks from their own nodes' supervisors, the
replica's health from all of them, and whether this node's shard must restart with the
group. The daemon gathers the evidence, calls `judge`, keeps the returned memory and
carries out the actions; nothing here reads a clock or a socket.

Rules (docs/supervisor.md):
- Evidence expires. A probe counts only for the shard generation it was taken for and
  for `probe_fresh` seconds; a peer's report for `peer_fresh` seconds, or, while that
  peer refuses connections (its supervisor restarting) and this rank is ready, for
  `peer_grace` seconds (held_over). "Ready" needs fresh evidence for every rank.
- systemd busy is not a dead shard (held_read): while it does not answer, this node's
  last read stands for `systemd_grace` seconds from the read, and only while every main
  process that read named still runs (the kernel's word, gathered by the daemon). On a
  held read nothing is restarted: a death is decided on what systemd says again.
- Slow is not down (_slow_probe): a health probe that timed out on a rank that served
  counts at once only when the engine took no step while it waited; while it stepped,
  the rank is busy; when its metrics cannot tell, `probe_timeouts` in a row count.
- A rank's report counts only when it comes from the node the spec assigns to that rank
  (and, with TLS, only when that node proved who it is). Anything else is ignored and
  counted, never believed.
- A rank that failed, or started again since the replica was last ready, takes every
  rank down with it (Ray placement groups, torch process groups): every node restarts
  its own shard, with backoff and a budget (group_restart.py).
- When the rank that hosts the rendezvous (rank 0) is stopped, a rank whose engine
  started before that is a broken half (a headless vLLM rank outlives its rank 0
  indefinitely): it restarts once, to wait for a new rank 0, under the same backoff and
  budget. An engine started after rank 0 was seen stopped is already waiting.
- With a generation check, the serving rank is ready only while a one-token completion
  for its current start succeeded recently, too: /health alone stays 200 when a peer died.
- Liveness comes from the engine's own progress (progress.py): while the serving rank's
  engine takes steps with work pending it is busy, not failing, and a generation check
  that timed out behind real work does not take it out of rotation; work pending and
  not one step for `stall_after` seconds (or the check failing that long with the
  metrics unreadable) is a stall: the rank is failed, and the group restarts as after a
  death, under the same backoff and budget.
- A planned stop or an operator's drain on any node takes the replica out of rotation
  (`draining`, then `drained` once the serving rank has nothing in flight) before any
  process is signalled (drain.py); a failure never does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from llmgw_systemd.health.drain import (
    DRAINED,
    Drain,
    DrainProgress,
    DrainRequest,
    Stopping,
    origin,
    progress,
    stopping,
    with_other_servers,
)
from llmgw_systemd.health.evidence import LocalEvidence, PeerEvidence, PeerShard, ProbeEvidence
from llmgw_systemd.health.group_restart import (
    GIVE_UP,
    NOW,
    GroupRestartPolicy,
    backoff,
    decide,
)
from llmgw_systemd.health.progress import (
    BUSY,
    STALLED,
    STEPPING,
    STILL,
    Liveness,
    ProgressReading,
    liveness,
    motion,
)
from llmgw_systemd.health.rules import (
    DEGRADED,
    DRAINING,
    FAILED,
    NO_ANSWER,
    READY,
    ROUTABLE_STATES,
    STARTING,
    STOPPED,
    UNKNOWN,
    Health,
    Probe,
    RankReport,
    State,
    replica_health,
    shard_health,
)
from llmgw_systemd.health.unit_state import JOB_UNKNOWN, UnitState
from llmgw_systemd.health.versions import RankVersion, mixed, must_rejoin, staged_line


@dataclass(frozen=True)
class ReplicaPolicy:
    """What the spec and the supervisor's configuration say about judging one replica."""

    name: str
    nodes: tuple[str, ...]  # node name per rank
    rank: int  # this node's rank
    serving: bool  # whether this node's rank serves HTTP (and is probed)
    stability: float  # seconds a non-serving rank must stay up to count as ready
    probe_fresh: float  # a probe result counts this long (interval + 2 x timeout + 1)
    peer_fresh: float  # a peer's answer counts this long
    settle: float  # how long a ready replica holds still before its generations count
    group_restart: GroupRestartPolicy = field(default_factory=GroupRestartPolicy)
    require_auth: bool = False  # TLS configured: unauthenticated reports never count
    # how long a peer's last answer stands while its supervisor refuses connections and
    # this rank is ready (held_over); 0: not at all
    peer_grace: float = 0.0
    # how long this node's last read of its units stands while systemd does not answer
    # (held_read); 0: not at all
    systemd_grace: float = 0.0
    follows_leader: bool = False  # ranks >= 1 joined rank 0's rendezvous (vLLM, SGLang)
    completion_fresh: float | None = None  # a generation check counts this long; None: off
    stall_after: float = 0  # seconds; 0: no stall detection (no metrics to read, or off)
    # the health probe itself asks for a token (SGLang's /health): while it fails, its
    # request is work owed, as the generation check's is
    health_generates: bool = False
    # health probes in a row that may time out before a serving rank that answered counts
    # as down (the spec's health.timeouts; 1: the first); refused, reset, 5xx: at once
    probe_timeouts: int = 1
    # a follower whose leader's engine started more than this many seconds after its own
    # is a half of a group that is gone (None: off): stop_timeout + settle, so that the
    # two ends of one group restart, stopping at their own pace, never count
    rejoin_after: float | None = None
    # after this node restarted its shard, how long its old generation may still be
    # seen (stopping, a serving rank draining) before the restart counts as lost
    restart_hold: float = 0
    drain_delay: float = 5  # the spec's drain (health/drain.py)
    drain_timeout: float = 20
    target: str = ""  # this node's target, as a planned stop of it is described
    serving_ranks: tuple[int, ...] = ()  # the ranks that serve HTTP (none, one, or several)


@dataclass(frozen=True)
class Memory:
    """What one judgement hands to the next (kept by the daemon; `restarts` persisted)."""

    restarts: tuple[float, ...] = ()  # times of this node's group restarts
    failing_since: float | None = None
    baseline: tuple[tuple[int, str], ...] | None = None  # generations a death is seen from
    candidate: tuple[tuple[int, str], ...] | None = None  # generations settling into one
    # the generations the replica was last ready with, kept while it is not: before the
    # baseline settles, a death is seen from these, unless a group restart of this node's
    # is itself settling (_reference)
    ready_with: tuple[tuple[int, str], ...] | None = None
    candidate_since: float | None = None
    served: str | None = None  # generation in which our serving rank answered its probe
    leader_stopped_since: float | None = None  # when rank 0 was first seen stopped
    # (generation, since when) the generation check has failed without a pass between
    check_failing: tuple[str, float] | None = None
    # (this node's generation, when) of the last restart it made of its shard: until
    # that generation is gone, the restart is under way and no other is asked for
    restart_pending: tuple[str, float] | None = None
    drain: Drain | None = None  # a drain in progress (drain.py)
    # what the last judgement said (a drain starting now was served); None before the
    # first: a supervisor restarted in the middle of a drain assumes it was
    routable: bool | None = None
    # when a judgement last said routable: a gateway may still send for drain.delay after
    # (it has not noticed yet), so a drain beginning within that was served all the same
    routable_at: float | None = None
    # (generation, when the last one counted was taken, how many) health probes in a row
    # have timed out: slow_probes()
    slow_probes: tuple[str, float, int] | None = None


DEATH, STALL = "death", "stall"
START_LIMIT = "start-limit-hit"  # systemd's Result= of a unit past StartLimitBurst=


@dataclass(frozen=True)
class RestartShard:
    """Restart this node's shard of the replica (its target)."""

    replica: str
    reason: str
    cause: str = DEATH  # DEATH: a rank died or failed; STALL: ours stalled (metrics)


@dataclass(frozen=True)
class Verdict:
    memory: Memory
    health: Health
    ranks: tuple[RankReport, ...]
    generations: tuple[tuple[int, str], ...]
    actions: tuple[RestartShard, ...] = ()
    notes: tuple[str, ...] = ()  # log lines: what was decided and why
    next_restart: str = ""
    liveness: Liveness | None = None  # this node's serving rank, from its progress
    routable: bool = False  # a gateway should send it new requests
    drain: DrainProgress | None = None  # where a drain in progress stands
    stopping: Stopping | None = None  # this node's target: a planned stop, our restart
    versions: tuple[RankVersion, ...] = ()  # each rank's spec versions (versions.py)

    @property
    def staged(self) -> str:
        """`staged: N of M nodes` while ranks wait for the group restart, else ""."""
        return staged_line(self.versions)

    @property
    def settled(self) -> bool:
        """Ready long enough that a rank's restart from here on counts as a death."""
        return self.memory.baseline is not None


def slow_probes(last: tuple[str, float, int] | None, probe: ProbeEvidence | None,
                generation: str) -> tuple[str, float, int] | None:
    """How many health probes in a row have timed out, this one included: None when this
    one answered or did not time out (refused, reset, 5xx are not slow: they are down)."""
    if probe is None or probe.ok or not probe.detail.startswith(NO_ANSWER):
        return None
    if last is None or last[0] != generation:
        return (generation, probe.taken_at, 1)
    if last[1] == probe.taken_at:
        return last  # the same probe judged again
    return (generation, probe.taken_at, last[2] + 1)


def _slow_probe(policy: ReplicaPolicy, memory: Memory, probe: ProbeEvidence,
                live: Liveness | None, slow: tuple[str, float, int],
                readings: Sequence[ProgressReading],
                ) -> tuple[ProbeEvidence, Liveness | None, Memory]:
    """Slow is not down: a health probe of a rank that served in this start timed out.
    While its engine stepped after the probe began, it waits behind real work: busy,
    never counted (the count starts again). With no step from before the probe began to
    after it, the engine is hung (or idle, and then nothing excuses a slow answer): down
    at once. With the metrics saying neither (unreadable: its API server may be frozen,
    or as saturated as its health endpoint), up to probe_timeouts in a row are tolerated.
    Returns the probe as judged, the liveness and the memory."""
    moved = motion(readings, since=probe.taken_at)
    if moved == STEPPING and (live is None or live.verdict != STALLED):
        pending = readings[-1].pending or 0
        why = (f"{pending:.0f} request(s) pending and the engine stepping; the health "
               "probe waits behind them")
        return (replace(probe, ok=True, detail=f"slow: {probe.detail} (busy: {why})"),
                Liveness(BUSY, why), replace(memory, slow_probes=None))
    if moved == STILL:
        return (replace(probe, detail=f"{probe.detail}, and no engine step since it "
                        "began"), live, memory)
    if slow[2] < policy.probe_timeouts:
        return (replace(probe, ok=True, detail=f"slow: {probe.detail} ({slow[2]} of "
                        f"{policy.probe_timeouts} allowed in a row)"), live, memory)
    return probe, live, memory


def _current(evidence: ProbeEvidence | None, generation: str, fresh: float, now: float
             ) -> ProbeEvidence | None:
    """The evidence if it was taken for this generation within `fresh` seconds, else None."""
    if evidence is None or evidence.generation != generation or now - evidence.taken_at > fresh:
        return None
    return evidence


def combined_probe(policy: ReplicaPolicy, probe: ProbeEvidence | None,
                   completion: ProbeEvidence | None) -> Probe | None:
    """What the serving rank's probes say together: /health first, then (when the
    generation check is on) the one-token completion."""
    if probe is None:
        return None
    if not probe.ok or policy.completion_fresh is None:
        return Probe(probe.ok, probe.detail)
    if completion is None:
        return Probe(False, f"{probe.detail}, but no one-token completion yet")
    if not completion.ok:
        return Probe(False, f"{probe.detail}, but a one-token completion failed: "
                     f"{completion.detail}")
    return Probe(True, f"{probe.detail}; one-token completion {completion.detail}")


def _check_failing(memory: Memory, generation: str, completed: ProbeEvidence | None
                   ) -> tuple[str, float] | None:
    """Since when the generation check fails for this generation (None: it passes, or
    nothing says it fails)."""
    held = memory.check_failing if memory.check_failing is not None and \
        memory.check_failing[0] == generation else None
    if completed is None:
        return held
    if completed.ok:
        return None
    return held if held is not None else (generation, completed.taken_at)


def held_read(policy: ReplicaPolicy, local: LocalEvidence | None, systemd_error: str,
              gone: Sequence[str], now: float) -> tuple[LocalEvidence | None, str]:
    """This node's last read of its units while systemd does not answer (a manager busy
    reloading beside engines restarting missed a call's timeout: a node's whole API then
    said `unknown`, a healthy replica's too): it stands for `systemd_grace` seconds from
    the read, and only while none of the main processes it named is gone (`gone`: the
    units whose MainPID no longer runs, or is a zombie systemd has not reaped). Returns
    the read that counts (None: none does) and what to say of it."""
    if not systemd_error or local is None:
        return local, ""
    age = now - local.read_at
    if age > policy.systemd_grace:
        return None, ""
    if gone:
        return None, f"; main process gone: {', '.join(gone)}"
    return local, f" (as read {age:.0f} s ago; systemd not answering: {systemd_error})"


def local_rank(policy: ReplicaPolicy, memory: Memory, local: LocalEvidence | None,
               systemd_error: str, probe: ProbeEvidence | None,
               now: float, completion: ProbeEvidence | None = None,
               progress: Sequence[ProgressReading] = (),
               requests: tuple[DrainRequest, ...] = (), note: str = "",
               ) -> tuple[RankReport, str, Memory, Liveness | None]:
    """This node's rank: its report, its generation, the updated memory, and (for the
    serving rank, with stall detection on) what its engine's progress says. local: the
    read that counts (held_read), note: what held_read said of it."""
    node = policy.nodes[policy.rank]
    if local is None:
        why = (f"systemd unreachable: {systemd_error}{note}" if systemd_error
               else "no data yet")
        asked = origin(policy.name, node, policy.target, "", False, requests)
        return RankReport(policy.rank, node, UNKNOWN, why, draining=asked), "", memory, None
    generation = local.generation
    # from an earlier start of the shard, or too old to say anything: not evidence
    valid = _current(probe, generation, policy.probe_fresh, now)
    completed = (_current(completion, generation, policy.completion_fresh, now)
                 if policy.completion_fresh is not None else None)
    owed = completed if policy.completion_fresh is not None else \
        valid if policy.health_generates else None
    failing = _check_failing(memory, generation, owed)
    memory = replace(memory, check_failing=failing)
    live = None
    if policy.serving and policy.stall_after > 0 and generation:
        live = liveness([r for r in progress if r.generation == generation], now=now,
                        stall_after=policy.stall_after,
                        check_failing_since=None if failing is None else failing[1])
    was_ready = bool(generation) and memory.served == generation
    slow = slow_probes(memory.slow_probes, valid, generation) if policy.serving else None
    memory = replace(memory, slow_probes=slow)
    if valid is not None and slow is not None and was_ready:
        valid, live, memory = _slow_probe(policy, memory, valid, live, slow, [
            r for r in progress if r.generation == generation])
    busy = live is not None and live.verdict == BUSY
    waited = completed is not None and completed.detail.startswith(NO_ANSWER)
    if busy and live is not None and valid is not None and valid.ok and waited:
        # the one-token check waits behind real work: steps running is the evidence
        combined: Probe | None = Probe(True, f"{valid.detail}; busy: {live.reason}")
    else:
        combined = combined_probe(policy, valid, completed)
    health = shard_health(
        local.target, local.members, serving=policy.serving, probe=combined,
        now_usec=int(now * 1e6), stability_usec=int(policy.stability * 1e6),
        was_ready=was_ready)
    if policy.serving and valid is None and was_ready and health.state == STARTING:
        health = Health(DEGRADED, "no health probe result within the last "
                        f"{policy.probe_fresh:g} s")
    if combined is not None and combined.ok and health.state == READY:
        memory = replace(memory, served=generation)
    if live is not None and live.verdict == STALLED and was_ready and \
            health.state in (READY, DEGRADED):
        # A stall counts once the rank has served in this start: before, the engine is
        # still starting (vLLM has no /metrics until it listens).
        health = Health(FAILED, f"stalled: {live.reason}")
    cause = origin(policy.name, node, policy.target, local.target.job_type,
                   memory.restart_pending is not None, requests)
    return (RankReport(policy.rank, node, health.state, health.reason + note,
                       draining=cause), generation, memory, live)


def counts(policy: ReplicaPolicy, seen: PeerEvidence, shard: PeerShard) -> bool:
    """Whether one shard report in a peer's answer may count for this replica: it names
    a rank that the spec assigns to the very node that answered (and not ours), and with
    TLS the answer proved it came from that node."""
    if shard.replica != policy.name or not 0 <= shard.rank < len(policy.nodes):
        return False
    node = policy.nodes[shard.rank]
    return (shard.rank != policy.rank and node == seen.source == shard.node
            and (seen.authenticated or not policy.require_auth))


def refused(policy: ReplicaPolicy, seen: PeerEvidence) -> tuple[str, ...]:
    """The reports in one peer answer about this replica that do not count, described."""
    return tuple(
        f"{seen.source} reported rank {s.rank} of {policy.name} as node {s.node!r}"
        + ("" if seen.authenticated or not policy.require_auth else ", unauthenticated")
        for s in seen.shards if s.replica == policy.name and not counts(policy, seen, s))


def held_over(policy: ReplicaPolicy, seen: PeerEvidence, now: float, steady: bool
              ) -> PeerEvidence | None:
    """A peer's supervisor restarting is not a dead rank: the last answer that came
    through from a node whose fetch is refused (the node is up, its supervisor is not
    listening), while this node's own rank is ready (its engine still in step with the
    group), for at most peer_grace seconds from that answer. A silent peer (a timeout:
    the node may be gone), an answer older than that, or this rank not ready: None, and
    today's rules (docs/supervisor.md, "A peer's supervisor restarting")."""
    last = seen.last
    if not (seen.error and seen.refused and steady) or last is None:
        return None
    if now - last.received_at > policy.peer_grace:
        return None
    return last


def peer_rank(policy: ReplicaPolicy, rank: int, seen: PeerEvidence | None,
              now: float, steady: bool = False
              ) -> tuple[RankReport, str, float | None, RankVersion]:
    """Another node's rank, from that node's own supervisor only: its report, its
    generation, when its engine started (on this node's clock, to the second), and its
    spec versions. steady: this node's own rank is ready (held_over)."""
    node = policy.nodes[rank]

    def unknown(why: str) -> tuple[RankReport, str, float | None, RankVersion]:
        return RankReport(rank, node, UNKNOWN, why), "", None, RankVersion(rank, node)

    if seen is None:
        return unknown(f"no report yet from the supervisor on {node}")
    held = held_over(policy, seen, now, steady) if seen.error else None
    note = "" if held is None else (f" (as reported {now - held.received_at:.0f} s ago; "
                                    f"its supervisor is not answering: {seen.error})")
    if seen.error and held is None:
        return unknown(f"supervisor on {node} unreachable: {seen.error}")
    seen = held or seen
    if policy.require_auth and not seen.authenticated:
        return unknown(f"report from the supervisor on {node} is not authenticated")
    age = now - seen.received_at
    if age > policy.peer_fresh and held is None:  # a held answer's bound is the grace
        return unknown(f"report from the supervisor on {node} is {age:.0f} s old")
    found = [s for s in seen.shards if s.rank == rank and counts(policy, seen, s)]
    if not found:
        return unknown(f"the supervisor on {node} reports no shard of {policy.name}")
    last = found[-1]
    started = None if last.up_for is None else seen.received_at - last.up_for
    return (RankReport(rank, node, last.state, last.reason + note, draining=last.draining,
                       drained=last.drained), last.generation, started,
            RankVersion(rank, node, last.loaded_digest, last.running_digest))


def judge(policy: ReplicaPolicy, memory: Memory, *, local: LocalEvidence | None,
          systemd_error: str = "", probe: ProbeEvidence | None,
          peers: Mapping[str, PeerEvidence], now: float,
          completion: ProbeEvidence | None = None,
          progress: Sequence[ProgressReading] = (),
          requests: tuple[DrainRequest, ...] = (), gone: Sequence[str] = ()) -> Verdict:
    """One replica's health, and what to do about it. progress: the serving rank's
    metrics readings, oldest first (progress.keep bounds them); requests: the operators'
    drains in effect on this node; gone: while systemd does not answer, the units of
    this node's shard whose main process no longer runs (held_read)."""
    local, note = held_read(policy, local, systemd_error, gone, now)
    mine, generation, memory, live = local_rank(policy, memory, local, systemd_error, probe,
                                                now, completion, progress, requests, note)
    reports = [mine]
    generations = {policy.rank: generation}
    versions = [RankVersion(policy.rank, policy.nodes[policy.rank],
                            local.loaded_digest if local is not None else "",
                            local.running_digest if local is not None else "")]
    leader_started: float | None = None
    for rank, node in enumerate(policy.nodes):
        if rank == policy.rank:
            continue
        report, gen, started, version = peer_rank(policy, rank, peers.get(node), now,
                                                  steady=mine.state == READY)
        reports.append(report)
        versions.append(version)
        if report.state != UNKNOWN:
            generations[rank] = gen
            if rank == 0:
                leader_started = started
    reports.sort(key=lambda r: r.rank)
    versions.sort(key=lambda v: v.rank)
    health = replica_health(reports, len(policy.nodes))
    apart = mixed(versions)
    if apart and health.state not in (FAILED, STOPPED):
        # one group, two versions (a staged rank died and came back on its new units,
        # or the last node restarted first): never in rotation like that
        health = Health(DEGRADED, apart)
    if live is not None and live.verdict == BUSY and health.state == READY:
        # ready, and why a gateway sees slow answers: docs/supervisor.md, "Busy"
        health = Health(READY, f"{health.reason}; busy: {live.reason}")
    gens = tuple(sorted(generations.items()))
    verdict = Verdict(memory, health, tuple(reports), gens, liveness=live,
                      versions=tuple(versions))
    # a member past its start limit starts no more until an operator says so
    # (reset-failed): a group restart here would spend the budget and start nothing
    held = local is not None and any(u.active_state == "failed" and u.result == START_LIMIT
                                     for u in local.members)
    # a restart is decided on what systemd says now (held_read), and on a read of it, not
    # on the first look its signals gave (no jobs in those: a planned stop looks like a death)
    first_look = local is not None and any(u.job_type == JOB_UNKNOWN
                                           for u in (local.target, *local.members))
    if not systemd_error and not first_look:
        verdict = _group_restart(policy, verdict, now,
                                 engine_since=local.engine_since if local else None,
                                 by_itself=local is not None and any(
                                     u.died for u in local.members),
                                 leader_started=leader_started, start_limited=held,
                                 target_stopped=local is not None and stopped_here(local.target),
                                 rejoin=must_rejoin(versions, policy.rank))
    own = stopping(local.target.job_type, verdict.memory.restart_pending is not None) \
        if local is not None else None
    return _drain(policy, replace(verdict, stopping=own), now, progress)


def _drain(policy: ReplicaPolicy, verdict: Verdict, now: float,
           readings: Sequence[ProgressReading]) -> Verdict:
    """A drain on any node takes the replica out of rotation (drain.py): `draining`
    until the serving rank has nothing in flight, then `drained`. A failed replica stays
    failed, and a stopped one stopped: neither is in rotation anyway."""
    memory, health = verdict.memory, verdict.health
    causes = tuple(r.draining for r in verdict.ranks if r.draining is not None)
    if not causes or health.state in (FAILED, STOPPED):
        routable = not causes and health.state in ROUTABLE_STATES
        ranks = tuple(replace(r, drained=False) if r.rank == policy.rank else r
                      for r in verdict.ranks)
        return replace(verdict, ranks=ranks, routable=routable,
                       memory=replace(memory, drain=None, routable=routable,
                                      routable_at=now if routable else memory.routable_at))
    held = memory.drain
    served = memory.routable is not False or (
        memory.routable_at is not None and now - memory.routable_at < policy.drain_delay)
    drain = Drain(now, served, causes) if held is None else replace(held, causes=causes)
    # the other serving ranks' own parts (each reports whether its engine is done)
    others = [r.drained for r in verdict.ranks
              if r.rank != policy.rank and r.rank in policy.serving_ranks]
    others_drained = all(others) if others else None
    generation = dict(verdict.generations).get(policy.rank, "")
    reading = next((r for r in reversed(readings) if r.generation == generation), None)
    own = progress(drain, now, policy.drain_delay, policy.drain_timeout,
                   serving_here=policy.serving,
                   pending=reading.pending if reading is not None else None,
                   pending_at=reading.taken_at if reading is not None else None,
                   serving_drained=others_drained)
    state = own if not policy.serving else with_other_servers(
        own, others_drained, now - drain.since, policy.drain_delay, policy.drain_timeout)
    if state.phase == DRAINED:
        drain = replace(drain, finished=state)
    # what this rank reports: its own part, which the other serving ranks wait for
    ranks = tuple(replace(r, drained=own.phase == DRAINED) if r.rank == policy.rank else r
                  for r in verdict.ranks)
    phase: State = DRAINED if state.phase == DRAINED else DRAINING
    return replace(verdict, ranks=ranks, routable=False, drain=state,
                   health=Health(phase, f"{state.reason} ({'; '.join(causes)})"),
                   memory=replace(memory, drain=drain, routable=False))


def stopped_here(target: UnitState) -> bool:
    """This node's target stopped, or being stopped, by someone (an operator, a node
    shutting down): a group restart here (RestartUnit of the target) would start it again
    against their word. A member that dies in that stop is no death to restart from."""
    return target.job_type == "stop" or (target.is_down and not target.job_type)


def _group_restart(policy: ReplicaPolicy, verdict: Verdict, now: float, *,
                   engine_since: float | None = None,
                   leader_started: float | None = None,
                   start_limited: bool = False, target_stopped: bool = False,
                   rejoin: str = "", by_itself: bool = False) -> Verdict:
    memory, health, reports = verdict.memory, verdict.health, verdict.ranks
    generations = dict(verdict.generations)
    pending = memory.restart_pending
    if pending is not None and (pending[0] != generations.get(policy.rank, "")
                                or now - pending[1] > policy.restart_hold):
        pending = None  # the shard started again (or the restart was lost)
    memory = replace(memory, restart_pending=pending)
    follower = policy.follows_leader and policy.rank > 0
    # rank 0 stopped (its own node says so): an engine here that started before is a
    # broken half that joined the rank 0 that is gone
    leader_stopped = follower and reports[0].state == STOPPED
    stopped_since = (memory.leader_stopped_since if memory.leader_stopped_since is not None
                     else now) if leader_stopped else None
    memory = replace(memory, leader_stopped_since=stopped_since)
    leader_gone = (stopped_since is not None and engine_since is not None
                   and engine_since < stopped_since)
    # rank 0 runs an engine that started well after ours: ours joined the one before it,
    # whose end we may never have seen (a report missed, a restart within a fetch)
    rejoin_gap = (leader_started - engine_since
                  if leader_started is not None and engine_since is not None else None)
    # rank 0's own restart of this fault waited its backoff before it began: as long as
    # ours, since every node restarts for every fault (seen: a roll's rank 0 started 35 s
    # after rank 1, of which 4 s its backoff, and rank 1 restarted a second time)
    waited = backoff(policy.group_restart, sum(
        1 for t in memory.restarts if now - t < policy.group_restart.window))
    leader_new = (follower and policy.rejoin_after is not None and rejoin_gap is not None
                  and rejoin_gap > policy.rejoin_after + waited)
    if health.state == STOPPED:
        return replace(verdict, memory=replace(
            memory, failing_since=None, baseline=None, candidate=None, candidate_since=None,
            ready_with=None))
    # A rank restarted if it runs a generation other than the one the replica was ready
    # with; a stopped or unknown rank is not one (stopped on purpose, or not heard from).
    reference = _reference(policy, memory, now)
    baseline = dict(reference) if reference is not None else None
    running = {r.rank for r in reports if r.state not in (STOPPED, UNKNOWN)}
    restarted = sorted(k for k, gen in (baseline or {}).items()
                       if k in running and generations.get(k, gen) not in ("", gen))
    failed = [r.rank for r in reports if r.state == FAILED]
    if restarted and not failed and len(restarted) == len(policy.nodes):
        restarted = []  # every rank started afresh (or the only one did): nothing stale
    if not restarted and not failed and not leader_gone and not leader_new and not rejoin:
        if health.state == READY:
            memory = replace(memory, failing_since=None, ready_with=verdict.generations)
            if memory.baseline is None:
                memory = _settle(policy, memory, verdict.generations, now)
            else:
                memory = replace(memory, baseline=verdict.generations)
        else:
            memory = replace(memory, candidate=None, candidate_since=None)
        return replace(verdict, memory=memory)
    died = "; ".join([*(f"rank {k} on {policy.nodes[k]} restarted" for k in restarted),
                      *(f"rank {r.rank} on {r.node} failed: {r.reason}" for r in reports
                        if r.state == FAILED),
                      *([f"rank 0 on {policy.nodes[0]} stopped; this rank must start "
                         "again to wait for a new one"] if leader_gone else []),
                      *([f"rank 0 on {policy.nodes[0]} started again {rejoin_gap:.0f} s after "
                         "this rank did; this rank must start again to join it"]
                        if leader_new else []),
                      *([rejoin] if rejoin else [])])
    if start_limited:
        return replace(verdict, memory=replace(memory, failing_since=None),
                       health=Health(FAILED, f"{died}; no group restart: this node's shard "
                                     "hit its start limit (systemctl reset-failed to try "
                                     "again)"))
    if target_stopped:
        return replace(verdict, memory=replace(memory, failing_since=None),
                       health=Health(FAILED if failed else DEGRADED,
                                     f"{died}; no group restart: this node's target is "
                                     "stopped"))
    if pending is not None:
        # This node's restart of its shard is under way: the old generation is still
        # seen while it stops (a stalled one still stalled, a drain still running), and
        # judging it again would spend the budget twice on one fault.
        state_now: State = FAILED if failed else DEGRADED
        return replace(verdict, memory=replace(memory, failing_since=None),
                       health=Health(state_now, f"{died}; this node's shard is restarting"),
                       next_restart="under way")
    since = memory.failing_since if memory.failing_since is not None else now
    memory = replace(memory, failing_since=since)
    decision = decide(policy.group_restart, memory.restarts, since, now)
    if decision.action == GIVE_UP:
        return replace(verdict, memory=memory,
                       health=Health(FAILED, f"{died}; {decision.reason}"))
    state: State = FAILED if failed else DEGRADED
    verdict = replace(verdict, memory=memory, health=Health(state, f"{died}; {decision.reason}"),
                      next_restart=decision.reason)
    if decision.action != NOW:
        return verdict
    # This node's shard restarted by itself since the replica was ready (and is not
    # failed): it is fresh already, and restarting it again would only delay the group.
    fresh = policy.rank in restarted and reports[policy.rank].state != FAILED
    memory = replace(memory, restarts=(*memory.restarts, now), failing_since=None,
                     baseline=None, candidate=None, candidate_since=None, ready_with=None)
    if (by_itself or not fresh) and policy.restart_hold > 0:
        memory = replace(memory, restart_pending=(generations.get(policy.rank, ""), now))
    if by_itself:
        # a member here died: systemd restarts it (Restart=, the restart unit); a restart
        # of the target on top would stop that start again
        note = (f"{policy.name}: a rank died ({died}); systemd restarts this node's shard "
                f"itself ({decision.reason})")
        return replace(verdict, memory=memory, notes=(note,))
    if fresh:
        note = (f"{policy.name}: a rank died; this node's shard already restarted "
                f"({decision.reason})")
        return replace(verdict, memory=memory, notes=(note,))
    stalled = (verdict.liveness is not None and verdict.liveness.verdict == STALLED
               and reports[policy.rank].state == FAILED)
    note = (f"{policy.name}: {'this rank stalled' if stalled else 'a rank died'} ({died}); "
            f"restarting this node's shard: {decision.reason}")
    return replace(verdict, memory=memory, notes=(note,),
                   actions=(RestartShard(policy.name, f"{died}; {decision.reason}",
                                         STALL if stalled else DEATH),))


def _reference(policy: ReplicaPolicy, memory: Memory, now: float
               ) -> tuple[tuple[int, str], ...] | None:
    """The generations a rank's restart is seen from: the settled baseline; before it
    settles, the ones the replica was last ready with, unless this node's own group
    restart is under way or within `settle` (its peers' reports lag, and a rank that lost
    its rendezvous restarts a little later on its own: neither is a new death). Without
    this, a rank that died and came back within `settle` of a fresh replica's first
    `ready` was never seen as a death: a data-parallel rank 0, which never notices a dead
    remote rank, then served beside it until vLLM's own 5-minute handshake timeout
    (bench/data_parallel.py, docs/supervisor.md)."""
    if memory.baseline is not None:
        return memory.baseline
    if memory.restart_pending is not None or (
            memory.restarts and now - memory.restarts[-1] < policy.settle):
        return None
    return memory.ready_with


def _settle(policy: ReplicaPolicy, memory: Memory, generations: tuple[tuple[int, str], ...],
            now: float) -> Memory:
    """Take the generations a replica is ready with as the baseline only once they held
    still for `settle` seconds: right after a group restart, peer reports lag, and a rank
    that lost its rendezvous restarts a little later on its own; neither may count as a
    new death."""
    if memory.candidate != generations:
        return replace(memory, candidate=generations, candidate_since=now)
    if memory.candidate_since is not None and now - memory.candidate_since >= policy.settle:
        return replace(memory, baseline=generations)
    return memory


__all__ = ["DEATH", "DEGRADED", "FAILED", "READY", "STALL", "STARTING", "STOPPED", "UNKNOWN",
           "Memory",
           "ReplicaPolicy", "RestartShard", "Verdict", "judge", "refused"]
