"""Spec -> the units of one node, as data (pure).

Per replica R whose nodes include this node (docs/design.md §3):

    llmgw-R.target               Wants= + Before= every member; `systemctl enable` hooks
                                 it to boot; stop waits for every member to stop
      llmgw-R-<sidecar>.service  PartOf= target, BindsTo= engine, After= earlier sidecars
      llmgw-R-engine.service     PartOf= target, BindsTo= + After= every sidecar
      llmgw-R-restart.service    oneshot: sleep the restart delay, then start relaunch
      llmgw-R-relaunch.service   oneshot, After= every member: start the target once no
                                 member is stopping

BindsTo= both ways makes the death of any member stop the whole shard. Restart=always
on every member brings it back: the member that died restarts after RestartSec and pulls
the others in through BindsTo= (sidecars first, by After=); a stop that systemd itself
propagates never triggers Restart=, and StartLimitBurst= in [Unit] bounds the loop.
When members die together, each one's stop cancels the other's pending restart and one
ends failed: its OnFailure= starts the restart unit, which waits the same delay and then
starts the relaunch unit, which starts the target again once no member has a stop job
left (docs/engines.md, "The restart unit's two steps"). Measured under a real systemd
by tests/integration.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, fields, is_dataclass, replace

from llmgw_systemd.errors import NoShard
from llmgw_systemd.spec.common_keys import (
    DEVICE_SETS,
    GPUS_VAR,
    IFNAME_VARS,
    NO_DEVICES,
    ROOT_USERS,
    SERVICE_ACCOUNT,
)
from llmgw_systemd.spec.endpoint import SUPERVISOR_LOCAL, Endpoint, local_address
from llmgw_systemd.spec.engines.base import KillMode, Step
from llmgw_systemd.spec.model import Replica, Spec
from llmgw_systemd.spec.names import DIGEST_VAR, RESTART_UNITS
from llmgw_systemd.spec.policies import STOP_MARGIN, RestartPolicy

UNIT_PREFIX = "llmgw-"
UNIT_DIR_PREFIX = "llmgw"  # StateDirectory=llmgw/R: /var/lib/llmgw/R, /var/cache/llmgw/R
SLEEP = "/usr/bin/sleep"  # coreutils, at this path on Debian and RHEL alike
TRUE = "/usr/bin/true"  # the same
# A start command may run as long as its own wait plus this margin before systemd
# kills it: TimeoutStartSec= is re-armed for each ExecStartPre=, so each wait carries
# its own deadline and systemd's timeout is only a backstop.
START_TIMEOUT_MARGIN = 30
UNSERVED_GRACE = 5  # seconds of SIGTERM for a serving rank that does not answer /health
# Seconds of SIGTERM in a failure's stop (the supervisor's group restart, a member's death)
# for an engine whose SIGKILL would end its unit failed (SGLang, a command): vLLM's counts
# as clean, so vLLM gets SIGKILL at once
FAILURE_GRACE = 2
SUPERVISOR_UNIT = "llmgw-supervisor.service"  # packaging/systemd
DIGEST_HEX = 16  # 64 bits: versions of one replica never collide in practice


@dataclass(frozen=True)
class Manager:
    """Which systemd instance the units are for, and where our helper lives."""

    user: bool  # a per-user manager (systemctl --user) instead of the system manager
    wait_for_port: str  # absolute path of llmgw-wait-for-port

    @property
    def stop_group(self) -> str:
        """llmgw-stop-group, installed beside llmgw-wait-for-port."""
        return f"{self.wait_for_port.rsplit('/', 1)[0]}/llmgw-stop-group"


@dataclass(frozen=True)
class ServiceUnit:
    """One member service of a shard, as data for templates/service.j2."""

    name: str
    description: str
    part_of: str
    binds_to: tuple[str, ...]
    after: tuple[str, ...]
    wants: tuple[str, ...]
    exec_start_pre: tuple[tuple[str, ...], ...]
    exec_start: tuple[str, ...]
    environment: tuple[tuple[str, str], ...]
    # (variable, credential name, file): LoadCredential= the file, the variable names it
    credential_env: tuple[tuple[str, str, str], ...]
    environment_file: str | None
    user: str | None  # None: the manager's own (a user manager)
    group: str | None
    supplementary_groups: tuple[str, ...]
    restart: RestartPolicy
    timeout_start_sec: int | None
    timeout_stop_sec: int
    kill_mode: KillMode
    success_exit_status: tuple[int | str, ...]
    exec_stop: tuple[str, ...] | None
    notify_status: bool  # a start step reports STATUS= to systemd
    # Least privilege (docs/hardening.md): the sandbox, with where the units may write
    sandbox: bool
    state_directory: str | None  # StateDirectory=, CacheDirectory= (relative to /var/...)
    cache_directory: str | None
    read_write_paths: tuple[str, ...]
    device_allow: tuple[str, ...]  # DeviceAllow= entries, with DevicePolicy=closed
    joins_namespace_of: str | None  # the shard's first member: one /tmp for all of them
    on_failure: str  # the shard's restart unit
    is_engine: bool  # the last member, whose exit is the shard's
    syslog_identifier: str  # one per rank: journalctl -t llmgw-R-rankK finds the rank


@dataclass(frozen=True)
class TargetUnit:
    """The replica's target on this node, as data for templates/target.j2."""

    name: str
    description: str
    wants: tuple[str, ...]
    wanted_by: str
    after: tuple[str, ...] = ()


@dataclass(frozen=True)
class RestartUnit:
    """The restart unit (sleeps the delay after a member ended, then starts its
    on_success: the relaunch unit) and the relaunch unit (starts the target once no
    member has a job: ordering is checked when its start job runs, after the delay)."""

    name: str
    description: str
    target: str
    members: tuple[str, ...]  # ordered after: it waits for a member's stop to finish
    argv: tuple[str, ...]
    on_success: str
    relaunch: bool  # which of the two
    start_limit: tuple[int, int]  # StartLimitBurst=, StartLimitIntervalSec=
    sandbox: bool  # it only sleeps or does nothing: locked down completely (system manager)


@dataclass(frozen=True)
class ShardPlan:
    """One replica's shard on this node: the target and its member services."""

    replica: str
    rank: int
    ranks: int
    node: str
    source: str
    serves_http: bool
    enable: bool  # the spec's enable: started at boot
    target: TargetUnit
    services: tuple[ServiceUnit, ...]
    restart: RestartUnit
    relaunch: RestartUnit
    notes: tuple[str, ...] = ()  # for the operator: what this plan does that may surprise
    spec_digest: str = ""  # the replica's version, the same on every node (spec_digest)



def target_name(replica: str) -> str:
    return f"{UNIT_PREFIX}{replica}.target"


def service_name(replica: str, step: str) -> str:
    return f"{UNIT_PREFIX}{replica}-{step}.service"


def restart_unit_name(replica: str) -> str:
    return f"{UNIT_PREFIX}{replica}-{RESTART_UNITS[0]}.service"


def relaunch_unit_name(replica: str) -> str:
    return f"{UNIT_PREFIX}{replica}-{RESTART_UNITS[1]}.service"


def plan_node(spec: Spec, node: str, manager: Manager, *, allow_empty: bool = False
              ) -> tuple[ShardPlan, ...]:
    plans = []
    for replica in spec.replicas:
        rank = replica.rank_of(node)
        if rank is not None:
            plans.append(plan_shard(replica, rank, manager))
    if not plans and not allow_empty:
        raise NoShard(node, spec.node_names())
    return tuple(plans)


def plan_shard(replica: Replica, rank: int, manager: Manager) -> ShardPlan:
    """One rank's shard, every member service stamped with the replica's digest."""
    plan = _plan_rank(replica, rank, manager)
    digest = spec_digest(replica, manager)
    services = tuple(replace(s, environment=(*s.environment, (DIGEST_VAR, digest)))
                     for s in plan.services)
    return replace(plan, services=services, spec_digest=digest)


def spec_digest(replica: Replica, manager: Manager) -> str:
    """The version of a replica's units, the same on every node: a digest of every
    rank's plan (so it changes exactly when some rank's units would), leaving out what
    does not reach a unit's behaviour (the spec file's path, enable:, notes) and where
    this machine keeps our helpers. A rank whose units carry another digest runs another
    version of the replica (docs/generator.md, "Rolling a change")."""
    canonical = Manager(user=manager.user, wait_for_port="/usr/bin/llmgw-wait-for-port")
    ranks = [replace(_plan_rank(replica, rank, canonical), source="", enable=False, notes=())
             for rank in range(len(replica.nodes))]
    text = json.dumps(ranks, sort_keys=True, separators=(",", ":"), default=_as_json)
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_HEX]


def _as_json(value: object) -> object:
    """What json.dumps writes for a plan's parts: a dataclass as the dict of its fields,
    the text as asdict() gives it (so a digest stays what it was), without asdict's deep
    copy (a third of a 64-node render's time: bench/render.py)."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in fields(value)}
    return str(value)


def ready_within(replica: Replica) -> int:
    """How long `llmgw-render --apply` waits for a restarted replica to be routable again:
    its drain and stop, its rendezvous (which bounds the start of every rank), the
    group restart's first delay (the other nodes' ranks follow), and the stability a
    rank must show before it counts as ready."""
    return (replica.stop_timeout + replica.rendezvous_timeout + START_TIMEOUT_MARGIN
            + replica.group_restart.delay + replica.health.stability)


def digest_in(environment: Iterable[str]) -> str:
    """The spec digest among a unit's Environment= assignments ("NAME=value", as systemd
    reports them), or "" when it carries none (a unit rendered before digests)."""
    prefix = f"{DIGEST_VAR}="
    found = [e[len(prefix):] for e in environment if isinstance(e, str) and e.startswith(prefix)]
    return found[-1] if found and is_digest(found[-1]) else ""


def is_digest(text: str) -> bool:
    return len(text) == DIGEST_HEX and all(c in "0123456789abcdef" for c in text)


def _plan_rank(replica: Replica, rank: int, manager: Manager) -> ShardPlan:
    steps = replica.engine.steps(replica.name, replica.nodes, rank)
    target = target_name(replica.name)
    restarter = restart_unit_name(replica.name)
    relauncher = relaunch_unit_name(replica.name)
    # Each start of the restart steps follows a member's end, and each member starts at
    # most burst times an interval: twice that for every member is a bound no real run
    # reaches. It ends the one loop a spent budget leaves: a member refused for its own
    # limit fails again, and its OnFailure= starts the restart again, every delay.
    limit = (2 * replica.restart.burst * len(steps), replica.restart.interval)
    names = [service_name(replica.name, step.name) for step in steps]
    engine = names[-1]
    sidecars = tuple(names[:-1])
    n = len(replica.nodes)
    node = replica.nodes[rank]
    http = replica.http
    serves = http is not None and rank in http.ranks
    place = f"rank {rank} of {n} on {node.name}"
    shared_env = _shared_env(replica) + (() if manager.user else cache_env(replica.name))
    own_env = node_env(replica, rank)
    sandbox = replica.hardening and not manager.user
    directory = None if manager.user else f"{UNIT_DIR_PREFIX}/{replica.name}"
    system_deps = () if manager.user else ("network-online.target",)
    services = []
    for i, (name, step) in enumerate(zip(names, steps)):
        is_engine = name == engine
        pre = _start_pre(step, replica, manager, joins=rank > 0 and is_engine)
        waits = [replica.rendezvous_timeout] if step.wait_for else []
        if step.frees:
            waits.append(replica.port_release_timeout)
        services.append(ServiceUnit(
            name=name,
            description=f"llmgw {replica.name} {place}: {step.role}",
            part_of=target,
            binds_to=sidecars if is_engine else (engine,),
            after=(*system_deps, *(sidecars if is_engine else names[:i])),
            wants=system_deps,
            exec_start_pre=pre,
            exec_start=step.argv,
            # later wins in systemd: the replica's env, then this node's own
            environment=_merged(*shared_env, *step.env, *replica.env, *own_env, *(
                (var, path) for var, _, path in step.credential_env if manager.user)),
            # A user manager loads no credentials (measured: docs/design.md §6): there the
            # variable names the file itself, which the user can read.
            credential_env=() if manager.user else step.credential_env,
            environment_file=replica.environment_file,
            user=None if manager.user else replica.user,
            group=None if manager.user else replica.group,
            supplementary_groups=() if manager.user else replica.supplementary_groups,
            restart=replica.restart,
            timeout_start_sec=max(waits) + START_TIMEOUT_MARGIN if waits else None,
            timeout_stop_sec=replica.stop_timeout,
            kill_mode=step.kill_mode,
            success_exit_status=(*step.clean_exit_statuses, *step.clean_exit_signals),
            exec_stop=_exec_stop(manager, step, replica, is_engine=is_engine,
                                 serves=is_engine and serves),
            notify_status=bool(pre),
            sandbox=sandbox,
            state_directory=directory,
            cache_directory=directory,
            read_write_paths=replica.read_write_paths if sandbox else (),
            device_allow=device_allow(replica.devices) if sandbox else (),
            # Ray's driver (the server) reaches its raylet over sockets under the head's
            # temp dir in /tmp: every member sees the first member's private /tmp
            joins_namespace_of=names[0] if sandbox and i > 0 else None,
            on_failure=restarter,
            is_engine=is_engine,
            syslog_identifier=f"{UNIT_PREFIX}{replica.name}-rank{rank}",
        ))
    role = "leader" if rank == 0 else "worker"
    serving = f", serves HTTP on port {http.port}" if serves and http is not None else ""
    return ShardPlan(
        replica=replica.name, rank=rank, ranks=n, node=node.name, source=replica.source,
        serves_http=serves, enable=replica.enable,
        target=TargetUnit(
            name=target,
            description=f"llmgw replica {replica.name}: {place} ({role}{serving})",
            wants=tuple(names),
            wanted_by="default.target" if manager.user else "multi-user.target",
            after=() if manager.user else (SUPERVISOR_UNIT,),
        ),
        services=tuple(services),
        restart=RestartUnit(
            name=restarter,
            description=f"llmgw {replica.name} {place}: restart after members died together",
            target=target, members=tuple(names),
            argv=(SLEEP, str(replica.restart.delay)),
            on_success=relauncher, relaunch=False, start_limit=limit,
            sandbox=not manager.user,
        ),
        relaunch=RestartUnit(
            name=relauncher,
            description=f"llmgw {replica.name} {place}: start the members again once none "
                        "is stopping",
            target=target, members=tuple(names), argv=(TRUE,), on_success=target,
            relaunch=True, start_limit=limit, sandbox=not manager.user,
        ),
        notes=_notes(replica, manager),
    )


def _notes(replica: Replica, manager: Manager) -> tuple[str, ...]:
    if manager.user:
        return ()
    notes = []
    if replica.user in ROOT_USERS:
        notes.append(f"replica {replica.name} runs as root (user: {replica.user}): a "
                     "compromised engine would own the node; the default is the service "
                     f"account {SERVICE_ACCOUNT}")
    if not replica.hardening:
        notes.append(f"replica {replica.name} runs without its sandbox (hardening: off)")
    return tuple(notes)


def cache_env(replica: str) -> tuple[tuple[str, str], ...]:
    """Where the engines keep what they write: the replica's state directory as HOME,
    its cache directory for every cache the engines know of (Hugging Face, vLLM, Triton,
    torch's compiler), so that nothing needs to write elsewhere (docs/hardening.md). The
    spec's env may point one elsewhere (with read_write_paths)."""
    state = f"/var/lib/{UNIT_DIR_PREFIX}/{replica}"
    cache = f"/var/cache/{UNIT_DIR_PREFIX}/{replica}"
    return (("HOME", state), ("XDG_CACHE_HOME", cache), ("HF_HOME", f"{cache}/huggingface"),
            ("VLLM_CACHE_ROOT", f"{cache}/vllm"), ("TRITON_CACHE_DIR", f"{cache}/triton"),
            ("TORCHINDUCTOR_CACHE_DIR", f"{cache}/torchinductor"))


def device_allow(devices: tuple[str, ...]) -> tuple[str, ...]:
    """DeviceAllow= entries for the spec's devices: the sets' groups and nodes, paths."""
    out: list[str] = []
    for device in devices:
        if device == NO_DEVICES:
            continue
        out.extend(f"{entry} rw" for entry in DEVICE_SETS.get(device, (device,)))
    return tuple(out)


def _exec_stop(manager: Manager, step: Step, replica: Replica, *, is_engine: bool,
               serves: bool) -> tuple[str, ...] | None:
    """llmgw-stop-group for every engine (its drain step first: a planned stop takes
    the replica out of rotation before any signal, docs/supervisor.md "Drain") and for
    every step that must be SIGKILLed inside its stop (vLLM, a Ray worker)."""
    if not step.stop_with_grace and not is_engine:
        return None
    grace = stop_grace(replica.stop_timeout)
    # KillMode=mixed means "the main process first": llmgw-stop-group keeps that order;
    # so does a main process that drains and stops its own children
    main_first = ("--main-first",) if step.kill_mode == "mixed" or step.main_drains else ()
    # the serving rank drains only what it serves: one that does not answer its health
    # check at the stop (still starting, blocked at its rendezvous) stops quickly
    health = health_url(replica) if serves else None
    quick = (() if health is None or grace <= UNSERVED_GRACE
             else ("--health", health, "--unserved-grace", str(UNSERVED_GRACE)))
    drain = (("--drain", replica.name, "--supervisor", str(SUPERVISOR_LOCAL),
              "--drain-delay", str(replica.drain.delay),
              "--drain-timeout", str(replica.drain.timeout),
              "--target", target_name(replica.name), *(("--user",) if manager.user else ()),
              *(("--serving",) if serves else ()))
             if is_engine else ())
    failure = (() if "SIGKILL" in step.clean_exit_signals
               else ("--failure-grace", str(FAILURE_GRACE)))
    return (manager.stop_group, "--grace", str(grace), *failure, *main_first, *quick,
            *drain)


def health_url(replica: Replica) -> str | None:
    """The serving rank's health check as its own node reaches it."""
    http = replica.http
    if http is None:
        return None
    host = local_address(http.host)
    return f"http://{f'[{host}]' if ':' in host else host}:{http.port}{replica.health.path}"


def stop_grace(stop_timeout: int) -> int:
    """Seconds llmgw-stop-group gives SIGTERM before SIGKILL: inside TimeoutStopSec=, so
    its SIGKILL, not systemd's timeout, ends a process that ignores SIGTERM."""
    return max(1, stop_timeout - STOP_MARGIN)


def node_env(replica: Replica, rank: int) -> tuple[tuple[str, str], ...]:
    """Variables every unit of this rank gets from its node's entry: the interface for
    gloo and NCCL, then the node's own env (which wins over the replica's)."""
    node = replica.nodes[rank]
    env: tuple[tuple[str, str], ...] = ()
    if node.interface is not None:
        env += tuple((var, node.interface) for var in IFNAME_VARS)
    return env + node.env


def _merged(*pairs: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    """One assignment per name, the last one winning (in its first one's place)."""
    return tuple(dict(pairs).items())


def _shared_env(replica: Replica) -> tuple[tuple[str, str], ...]:
    # Python buffers stdout without a terminal; unbuffered output reaches the journal
    # as it happens.
    env: tuple[tuple[str, str], ...] = (("PYTHONUNBUFFERED", "1"),)
    if replica.gpus:
        env += ((GPUS_VAR, ",".join(replica.gpus)),)
    return env


def _start_pre(step: Step, replica: Replica, manager: Manager, *, joins: bool
               ) -> tuple[tuple[str, ...], ...]:
    """The waits before a step starts: its ports free, then its rendezvous up. The engine
    of a rank > 0 also waits while rank 0 is about to restart onto the version this
    rank starts on (health/versions.py, leader_behind), as its node's supervisor sees
    it: it would join a rank 0 that is about to go."""
    pre: list[tuple[str, ...]] = []
    if step.frees:
        pre.append(_wait_cmd(manager, replica.port_release_timeout, step.frees, free=True))
    if step.wait_for:
        same = (("--same-version", replica.name, "--supervisor", str(SUPERVISOR_LOCAL))
                if joins else ())
        pre.append(_wait_cmd(manager, replica.rendezvous_timeout, step.wait_for, free=False,
                             extra=same))
    return tuple(pre)


def _wait_cmd(manager: Manager, timeout: int, endpoints: tuple[Endpoint, ...], *, free: bool,
              extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    return (manager.wait_for_port, *(("--free",) if free else ()), "--timeout", str(timeout),
            *extra, *(str(e) for e in endpoints))
