"""What each engine runs on each rank: the shard's command sequence (pure).

Every step but the last is a sidecar that lives as long as the shard; the last is the
engine, whose exit is the shard's exit (DESIGN.md section 1 and 7).
"""

from __future__ import annotations

from dataclasses import dataclass

from .endpoint import Endpoint
from .spec import Replica

# ray start --block exits 1 when systemd stops it with SIGTERM (DESIGN.md section 3);
# counting 1 as clean keeps a plain `systemctl stop` from leaving the unit failed.
RAY_CLEAN_EXIT = (1,)
# vllm serve turns SIGTERM into KeyboardInterrupt; in a process that has joined Ray
# (whose own handlers are installed) that ends in exit status 1, measured with a
# stand-in running the same code path under ray 2.60. Unconfirmed on real vLLM.
VLLM_ON_RAY_CLEAN_EXIT = (1,)
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
    if replica.engine == "command":
        return _command_steps(replica, rank)
    if replica.engine == "sglang":
        return (_sglang_step(replica, rank),)
    if replica.launch_mode == "mp":
        return (_vllm_mp_step(replica, rank),)
    return _vllm_ray_steps(replica, rank)


def _bin(replica: Replica, name: str) -> str:
    return f"{replica.virtualenv.rstrip('/')}/bin/{name}"


def _http_args(replica: Replica) -> tuple[str, ...]:
    return ("--host", replica.host, "--port", str(replica.port))


def _parallel_args(replica: Replica) -> tuple[str, ...]:
    return ("--tensor-parallel-size", str(replica.tensor_parallel_size),
            "--pipeline-parallel-size", str(replica.pipeline_parallel_size))


def _rendezvous(replica: Replica) -> Endpoint:
    assert replica.rendezvous_port is not None  # noqa: S101 - validated for every engine
    return Endpoint(replica.nodes[0].address, replica.rendezvous_port)


def _vllm_ray_steps(replica: Replica, rank: int) -> tuple[Step, ...]:
    address = replica.nodes[rank].address
    head = _rendezvous(replica)
    host_ip = ("VLLM_HOST_IP", address)
    ray_common = (f"--node-ip-address={address}", f"--temp-dir={ray_temp_dir(replica.name, rank)}",
                  "--disable-usage-stats", *replica.ray_args, "--block")
    if rank > 0:
        return (Step(
            name="engine", role=f"Ray worker joining {head}",
            argv=(_bin(replica, "ray"), "start", f"--address={head}", *ray_common),
            wait_for=(head,), env=(host_ip,), clean_exit_statuses=RAY_CLEAN_EXIT,
        ),)
    ray_head = Step(
        name="ray-head", role=f"Ray head on port {head.port}",
        argv=(_bin(replica, "ray"), "start", "--head", f"--port={head.port}",
              *ray_common[:-1], *replica.ray_head_args, "--block"),
        frees=(Endpoint(_wildcard(address), head.port),), env=(host_ip,),
        clean_exit_statuses=RAY_CLEAN_EXIT,
    )
    server = Step(
        name="engine", role="vLLM server on the Ray cluster",
        argv=(_bin(replica, "vllm"), "serve", replica.model or "", *_http_args(replica),
              *_parallel_args(replica), "--distributed-executor-backend", "ray",
              *replica.args),
        wait_for=(head,), env=(host_ip, ("RAY_ADDRESS", str(head))),
        clean_exit_statuses=VLLM_ON_RAY_CLEAN_EXIT,
    )
    return (ray_head, server)


def _vllm_mp_step(replica: Replica, rank: int) -> Step:
    address = replica.nodes[rank].address
    argv: tuple[str, ...] = (_bin(replica, "vllm"), "serve", replica.model or "")
    n = len(replica.nodes)
    if rank == 0:
        argv += _http_args(replica)
    argv += (*_parallel_args(replica), "--distributed-executor-backend", "mp")
    wait_for: tuple[Endpoint, ...] = ()
    frees: tuple[Endpoint, ...] = ()
    role = "vLLM server"
    if n > 1:
        master = _rendezvous(replica)
        argv += ("--nnodes", str(n), "--node-rank", str(rank), "--master-addr", master.host,
                 "--master-port", str(master.port))
        if rank > 0:
            argv += ("--headless",)
            wait_for = (master,)
            role = f"vLLM headless rank {rank}"
        else:
            frees = (Endpoint(_wildcard(address), master.port),)
    return Step(name="engine", role=role, argv=argv + replica.args, wait_for=wait_for,
                frees=frees, env=(("VLLM_HOST_IP", address),))


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
