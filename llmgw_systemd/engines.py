"""What each engine runs on each rank: the shard's command sequence (pure).

Every step but the last is a sidecar that lives as long as the shard; the last is the
engine, whose exit is the shard's exit (DESIGN.md section 1 and 7).
"""

from __future__ import annotations

from dataclasses import dataclass

from .endpoint import Endpoint
from .errors import unreachable
from .spec import Replica, flag_value

# ray start --block exits 1 when systemd stops it with SIGTERM (docs/engines.md);
# counting 1 as clean keeps a plain `systemctl stop` from leaving the unit failed.
RAY_CLEAN_EXIT = (1,)
# `ray start --block` drains its node through the GCS when it gets SIGTERM; signalled
# together with its children (KillMode=control-group) a head waits 30 s for its own GCS
# that is already gone; alone (mixed) it stops in 2 s, and systemd SIGKILLs what is
# left (measured: docs/engines.md).
RAY_KILL_MODE = "mixed"
# A worker stopped while it still joins its head ignores SIGTERM (seen: a stop 8 s into
# start-up on a loaded machine), and would end failed with Result=timeout, which starts
# the restart unit. So a worker's `ray start` stops through llmgw-stop-group --main-first:
# SIGTERM to it alone, SIGKILL to the group inside the stop if it is still there; SIGKILL
# of the main process then counts as clean. The head keeps plain KillMode=mixed: its stop
# races the leader's restart delay, and the helper adds its own start-up to that stop.
RAY_CLEAN_SIGNALS = ("SIGKILL",)
# On SIGTERM `ray start` first drains its node for up to 30 s (meant for Ray Serve's
# proxies); a worker whose head is gone waits all of it, past the stop timeout. A vLLM
# replica gains nothing from the drain: off, unless the spec's env sets it.
RAY_NO_DRAIN = ("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
# The real vllm serve 0.32 exits 0 on SIGTERM once ready, but 1 when stopped while it
# still starts (waiting for Ray's placement group or for its mp peers), in every mode
# (docs/engines.md). Either is a clean stop. It also exits 0 after its engine died:
# Restart=always, not on-failure, is what brings it back.
VLLM_CLEAN_EXIT = (1,)
# A vLLM rank blocked in its rendezvous ignores SIGTERM (an mp rank 0 waiting for its
# peers). The units stop vLLM through llmgw-stop-group, which SIGKILLs what is left after
# a grace period inside the stop; so SIGKILL of the main process counts as clean too.
VLLM_CLEAN_SIGNALS = ("SIGKILL",)
# The Ray token reaches the processes as a file named by RAY_AUTH_TOKEN_PATH; under the
# system manager the file comes in through LoadCredential= under this name.
RAY_TOKEN_CREDENTIAL = "ray-token"  # noqa: S105 - a credential name, not a secret
# Ray puts AF_UNIX sockets under <temp-dir>/session_<date>_<pid>/sockets/<name>,
# and sun_path holds 107 bytes: the temp dir must stay short.
RAY_TEMP_DIR_MAX = 40


@dataclass(frozen=True)
class Step:
    """One command of a shard's sequence, with what must hold before it starts."""

    name: str  # unit name suffix: "ray-head", "engine"
    role: str  # for people: "Ray head", "vLLM server (Ray leader)"
    argv: tuple[str, ...]
    wait_for: tuple[Endpoint, ...] = ()  # must accept TCP connections before the start
    frees: tuple[Endpoint, ...] = ()  # must be bindable (nobody listening) before the start
    env: tuple[tuple[str, str], ...] = ()
    clean_exit_statuses: tuple[int, ...] = ()
    # (variable, credential name, source file): the variable names the file, loaded as a
    # credential where the manager can (never the secret itself in the unit)
    credential_env: tuple[tuple[str, str, str], ...] = ()
    kill_mode: str = "control-group"  # "mixed" for `ray start` (RAY_KILL_MODE)
    clean_exit_signals: tuple[str, ...] = ()
    stop_with_grace: bool = False  # ExecStop=llmgw-stop-group: SIGTERM, grace, SIGKILL


def ray_temp_dir(replica_name: str, rank: int) -> str:
    """A Ray session root per replica and rank: two Ray nodes sharing one (two replicas
    on a node, or two ranks on one test machine) break each other (DESIGN.md 3)."""
    plain = f"/tmp/ray-{replica_name}-{rank}"  # noqa: S108 - Ray's own default root is /tmp/ray
    if len(plain) <= RAY_TEMP_DIR_MAX:
        return plain
    import hashlib  # only for long names

    digest = hashlib.sha256(replica_name.encode()).hexdigest()[:8]
    keep = RAY_TEMP_DIR_MAX - len(f"/tmp/ray--{digest}-{rank}")  # noqa: S108
    return f"/tmp/ray-{replica_name[:keep]}-{digest}-{rank}"  # noqa: S108


def _wildcard(address: str) -> str:
    return "::" if ":" in address else "0.0.0.0"  # noqa: S104 - a bind test, not a listener


def shard_steps(replica: Replica, rank: int) -> tuple[Step, ...]:
    engine = replica.engine
    if engine == "command":
        return _command_steps(replica, rank)
    if engine == "sglang":
        return (_sglang_step(replica, rank),)
    if engine == "vllm":
        return ((_vllm_mp_step(replica, rank),) if replica.launch_mode == "mp"
                else _vllm_ray_steps(replica, rank))
    unreachable(engine)


def served_model_name(replica: Replica) -> str:
    """The name completions must ask for: the first --served-model-name, else the model."""
    return flag_value(replica.args, "--served-model-name") or replica.model or ""


def _bin(replica: Replica, name: str) -> str:
    return f"{replica.virtualenv.rstrip('/')}/bin/{name}"


def _http_args(replica: Replica) -> tuple[str, ...]:
    return ("--host", replica.host, "--port", str(replica.port))


def _parallel_args(replica: Replica) -> tuple[str, ...]:
    return ("--tensor-parallel-size", str(replica.tensor_parallel_size),
            "--pipeline-parallel-size", str(replica.pipeline_parallel_size))


def _distributed_args(replica: Replica) -> tuple[str, ...]:
    if replica.distributed_timeout is None:
        return ()
    return ("--distributed-timeout-seconds", str(replica.distributed_timeout))


def node_env(replica: Replica, rank: int) -> tuple[tuple[str, str], ...]:
    """Variables every unit of this rank gets from its node's entry: the interface for
    gloo and NCCL, then the node's own env (which wins over the replica's)."""
    node = replica.nodes[rank]
    env: tuple[tuple[str, str], ...] = ()
    if node.interface is not None:
        env += (("GLOO_SOCKET_IFNAME", node.interface), ("NCCL_SOCKET_IFNAME", node.interface))
    return env + node.env


def _ray_auth(replica: Replica) -> tuple[tuple[tuple[str, str], ...],
                                        tuple[tuple[str, str, str], ...]]:
    """Ray's auth settings for every process that talks to the cluster: stated always,
    because a Ray head turns token auth on by itself once ~/.ray/auth_token exists, and
    then workers without the token fail to join (docs/engines.md)."""
    mode = (("RAY_AUTH_MODE", replica.ray_auth),)
    if replica.ray_auth == "token" and replica.ray_token_file is not None:
        return mode, (("RAY_AUTH_TOKEN_PATH", RAY_TOKEN_CREDENTIAL, replica.ray_token_file),)
    return mode, ()


def _rendezvous(replica: Replica) -> Endpoint:
    assert replica.rendezvous_port is not None  # noqa: S101 - validated for every engine
    return Endpoint(replica.nodes[0].address, replica.rendezvous_port)


def _vllm_ray_steps(replica: Replica, rank: int) -> tuple[Step, ...]:
    address = replica.nodes[rank].address
    head = _rendezvous(replica)
    auth, token = _ray_auth(replica)
    ray_env = (("VLLM_HOST_IP", address), *auth)
    gpus = () if replica.ray_num_gpus is None else (f"--num-gpus={replica.ray_num_gpus}",)
    ray_common = (f"--node-ip-address={address}", f"--temp-dir={ray_temp_dir(replica.name, rank)}",
                  "--disable-usage-stats", *gpus, *replica.ray_args, "--block")
    if rank > 0:
        return (Step(
            name="engine", role=f"Ray worker joining {head}",
            argv=(_bin(replica, "ray"), "start", f"--address={head}", *ray_common),
            wait_for=(head,), env=(*ray_env, RAY_NO_DRAIN), clean_exit_statuses=RAY_CLEAN_EXIT,
            credential_env=token, kill_mode=RAY_KILL_MODE, clean_exit_signals=RAY_CLEAN_SIGNALS,
            stop_with_grace=True,
        ),)
    ray_head = Step(
        name="ray-head", role=f"Ray head on port {head.port}",
        argv=(_bin(replica, "ray"), "start", "--head", f"--port={head.port}",
              *ray_common[:-1], *replica.ray_head_args, "--block"),
        frees=(Endpoint(_wildcard(address), head.port),), env=(*ray_env, RAY_NO_DRAIN),
        clean_exit_statuses=RAY_CLEAN_EXIT, credential_env=token, kill_mode=RAY_KILL_MODE,
    )
    server = Step(
        name="engine", role="vLLM server on the Ray cluster",
        argv=(_bin(replica, "vllm"), "serve", replica.model or "", *_http_args(replica),
              *_parallel_args(replica), "--distributed-executor-backend", "ray",
              *_distributed_args(replica), *replica.args),
        wait_for=(head,), env=(*ray_env, ("RAY_ADDRESS", str(head))),
        clean_exit_statuses=VLLM_CLEAN_EXIT, credential_env=token,
        clean_exit_signals=VLLM_CLEAN_SIGNALS, stop_with_grace=True,
    )
    return (ray_head, server)


def _vllm_mp_step(replica: Replica, rank: int) -> Step:
    address = replica.nodes[rank].address
    argv: tuple[str, ...] = (_bin(replica, "vllm"), "serve", replica.model or "")
    n = len(replica.nodes)
    if rank == 0:
        argv += _http_args(replica)
    argv += (*_parallel_args(replica), "--distributed-executor-backend", "mp",
             *_distributed_args(replica))
    wait_for: tuple[Endpoint, ...] = ()
    frees: tuple[Endpoint, ...] = ()
    role = "vLLM server"
    if n > 1:
        master = _rendezvous(replica)
        argv += ("--nnodes", str(n), "--node-rank", str(rank), "--master-addr", master.host,
                 "--master-port", str(master.port))
        if rank > 0:
            # No wait for the master port: vLLM's rank >= 1 retries it by itself, so its
            # slow start-up (imports, model config) overlaps rank 0's instead of following
            # it (13 s of a 68 s start here: bench/engines.py, docs/engines.md).
            argv += ("--headless",)
            role = f"vLLM headless rank {rank}"
        else:
            frees = (Endpoint(_wildcard(address), master.port),)
    return Step(name="engine", role=role, argv=argv + replica.args, wait_for=wait_for,
                frees=frees, env=(("VLLM_HOST_IP", address),),
                clean_exit_statuses=VLLM_CLEAN_EXIT, clean_exit_signals=VLLM_CLEAN_SIGNALS,
                stop_with_grace=True)


def _sglang_step(replica: Replica, rank: int) -> Step:
    address = replica.nodes[rank].address
    argv: tuple[str, ...] = (_bin(replica, "python"), "-m", "sglang.launch_server",
                             "--model-path", replica.model or "", *_http_args(replica),
                             "--tp-size", str(replica.tensor_parallel_size))
    if replica.pipeline_parallel_size > 1:
        argv += ("--pp-size", str(replica.pipeline_parallel_size))
    n = len(replica.nodes)
    wait_for: tuple[Endpoint, ...] = ()
    frees: tuple[Endpoint, ...] = ()
    role = "SGLang server"
    if n > 1:
        init = _rendezvous(replica)
        argv += ("--nnodes", str(n), "--node-rank", str(rank), "--dist-init-addr", str(init))
        if rank > 0:
            wait_for = (init,)
            role = f"SGLang rank {rank}"
        else:
            frees = (Endpoint(_wildcard(address), init.port),)
    return Step(name="engine", role=role, argv=argv + replica.args, wait_for=wait_for,
                frees=frees)


def _command_steps(replica: Replica, rank: int) -> tuple[Step, ...]:
    wildcard = _wildcard(replica.nodes[rank].address)
    commands = replica.ranks[rank]
    return tuple(
        Step(name="engine" if i == len(commands) - 1 else cmd.name, role=f"command {cmd.name}",
             argv=cmd.argv, wait_for=cmd.wait_for,
             frees=tuple(Endpoint(wildcard, port) for port in cmd.binds))
        for i, cmd in enumerate(commands)
    )
