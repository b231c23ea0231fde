"""vLLM, in its two launch modes (pure): everything about it in one place.

- `ray`: rank 0 runs a Ray head sidecar and `vllm serve --distributed-executor-backend
  ray`; the other ranks run only `ray start --address=HEAD --block`.
- `mp`: every rank runs `vllm serve --nnodes N --node-rank K --master-addr ...`,
  `--headless` on ranks >= 1.

What the real vLLM and Ray do that these units rely on is measured in docs/engines.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from llmgw_systemd.errors import unreachable
from llmgw_systemd.spec.document import KeyPath
from llmgw_systemd.spec.endpoint import Endpoint, is_ip
from llmgw_systemd.spec.engines.base import (
    EngineEntry,
    Http,
    KillMode,
    PortClaim,
    ProgressSeries,
    Step,
    arguments,
    refuse_owned_flags,
    uses_rendezvous,
    wildcard,
)
from llmgw_systemd.spec.engines.server import Server, check_gpus, read_server, server_keys
from llmgw_systemd.spec.keys import Key, absolute_path, choice, integer, seconds
from llmgw_systemd.spec.policies import DRAIN
from llmgw_systemd.spec.reader import Reader

if TYPE_CHECKING:  # types only: a Protocol costs import time on the render path
    from typing import Protocol

    from llmgw_systemd.spec.model import Node

    class Launch(Protocol):
        """What a launch mode decides: the steps of each rank, the variables its units set,
        whether rank 0 binds the rendezvous port even alone. mypy checks that each mode
        answers all of it."""

        @property
        def name(self) -> LaunchMode: ...

        def steps(self, vllm: Vllm, replica: str, nodes: Sequence[Node], rank: int
                  ) -> tuple[Step, ...]: ...

        def reserved_env(self) -> Mapping[str, str]: ...

        @property
        def binds_rendezvous_alone(self) -> bool: ...

LaunchMode = Literal["ray", "mp"]
LAUNCH_MODES: tuple[LaunchMode, ...] = ("ray", "mp")
HTTP_PORT = 8000
# vLLM's own /metrics on the serving rank: the iteration-tokens histogram gets one
# observation per engine step, so its _count is a step counter (docs/supervisor.md).
PROGRESS = ProgressSeries("/metrics", ("vllm:iteration_tokens_total_count",),
                          ("vllm:num_requests_running", "vllm:num_requests_waiting"))
RENDEZVOUS_PORT: dict[LaunchMode, int] = {"ray": 6379, "mp": 29500}
# With data parallel the ranks meet at rank 0's --data-parallel-rpc-port (vLLM's default)
DP_RPC_PORT = 29550
# Who serves HTTP with data parallel (docs/engines.md, "Data parallel"): `internal`, rank
# 0's API server balances over every data-parallel rank and the other nodes run headless;
# `hybrid`, every node serves its own ranks and a load balancer spreads over the nodes.
DataParallelLb = Literal["internal", "hybrid"]
DP_LB_MODES: tuple[DataParallelLb, ...] = ("internal", "hybrid")
RayAuth = Literal["disabled", "token"]
RAY_AUTH_MODES: tuple[RayAuth, ...] = ("disabled", "token")
DEFAULT_RAY_TOKEN_FILE = "/etc/llmgw/ray-token"  # noqa: S105 - a path, not a secret
# vLLM's own drain on SIGTERM (0: abort what is in flight; vllm#36666): set on the
# serving rank from drain.timeout, so the spec's args may not set it.
SHUTDOWN_FLAG = "--shutdown-timeout"

# ray start --block exits 1 when systemd stops it with SIGTERM (docs/engines.md);
# counting 1 as clean keeps a plain `systemctl stop` from leaving the unit failed.
RAY_CLEAN_EXIT = (1,)
# `ray start --block` drains its node through the GCS when it gets SIGTERM; signalled
# together with its children (KillMode=control-group) a head waits 30 s for its own GCS
# that is already gone; alone (mixed) it stops in 2 s, and systemd SIGKILLs what is
# left (measured: docs/engines.md).
RAY_KILL_MODE: KillMode = "mixed"
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
class RayLaunch:
    """launch_mode ray: a Ray cluster of the replica's nodes, its head on rank 0."""

    args: tuple[str, ...] = ()  # on every `ray start`
    head_args: tuple[str, ...] = ()  # on the head's only
    num_gpus: int | None = None  # None: Ray's own detection
    token_file: str | None = None  # ray_auth: token, from this file; None: disabled

    @property
    def name(self) -> LaunchMode:
        return "ray"

    @property
    def auth(self) -> RayAuth:
        return "disabled" if self.token_file is None else "token"

    def steps(self, vllm: Vllm, replica: str, nodes: Sequence[Node], rank: int
              ) -> tuple[Step, ...]:
        return _ray_steps(vllm, self, replica, nodes, rank)

    def reserved_env(self) -> Mapping[str, str]:
        return {"VLLM_HOST_IP": "each node's address",
                "RAY_ADDRESS": "the leader's address and rendezvous_port",
                "RAY_AUTH_MODE": "ray_auth",
                "RAY_AUTH_TOKEN_PATH": "ray_auth and ray_token_file"}

    @property
    def binds_rendezvous_alone(self) -> bool:
        return True  # a Ray head binds its port even on a one-node replica


@dataclass(frozen=True)
class MpLaunch:
    """launch_mode mp: vLLM's own multiprocessing executor across the nodes."""

    @property
    def name(self) -> LaunchMode:
        return "mp"

    def steps(self, vllm: Vllm, replica: str, nodes: Sequence[Node], rank: int
              ) -> tuple[Step, ...]:
        return (_mp_step(vllm, nodes, rank),)

    def reserved_env(self) -> Mapping[str, str]:
        return {"VLLM_HOST_IP": "each node's address"}

    @property
    def binds_rendezvous_alone(self) -> bool:
        return False  # the master port only when there are peers to meet


@dataclass(frozen=True)
class Vllm:
    server: Server
    launch: Launch
    distributed_timeout: int | None  # --distributed-timeout-seconds; None: vLLM's own
    shutdown_timeout: int  # --shutdown-timeout of the serving rank: drain.timeout
    n_nodes: int = 1
    data_parallel_lb: DataParallelLb = "internal"

    @property
    def name(self) -> str:
        return "vllm"

    @property
    def data_parallel(self) -> bool:
        return self.server.data_parallel_size > 1

    @property
    def serving_ranks(self) -> tuple[int, ...]:
        """Rank 0, or with hybrid load balancing every node's rank."""
        if self.data_parallel and self.data_parallel_lb == "hybrid":
            return tuple(range(self.n_nodes))
        return (0,)

    @property
    def http(self) -> Http:
        return self.server.http(self.serving_ranks)._replace(progress=PROGRESS)

    def steps(self, replica: str, nodes: Sequence[Node], rank: int) -> tuple[Step, ...]:
        return self.launch.steps(self, replica, nodes, rank)

    def port_claims(self, n_nodes: int) -> tuple[PortClaim, ...]:
        return self.server.port_claims(
            rendezvous=self.launch.binds_rendezvous_alone or uses_rendezvous(n_nodes),
            serving=self.serving_ranks)

    def reserved_env(self) -> Mapping[str, str]:
        return self.launch.reserved_env()

    def follows_leader(self, n_nodes: int) -> bool:
        return n_nodes > 1

    def least_stop_timeout(self) -> tuple[int, str] | None:
        return None  # its drain is drain.timeout, which the common check covers


SERVER_KEYS = server_keys(
    "vllm", http_port=HTTP_PORT, rendezvous_port=None,
    rendezvous_shown=", ".join(f"{mode} {port}" for mode, port in RENDEZVOUS_PORT.items())
    + f", data parallel {DP_RPC_PORT}",
    tp_flag="`--tensor-parallel-size`, of each data-parallel rank",
    pp_flag="`--pipeline-parallel-size`",
    dp_flag="`--data-parallel-size`, with launch_mode mp, spread evenly over the nodes "
    "(`--data-parallel-size-local`, `--data-parallel-start-rank`; the nodes meet at rank "
    "0's `--data-parallel-rpc-port`, which is rendezvous_port)",
    ep_flag="`--enable-expert-parallel`, which shards the experts over every GPU of the "
    "data- and tensor-parallel ranks: 1 or data_parallel_size x tensor_parallel_size",
    commands="`vllm` and `ray`")
LAUNCH_MODE = Key("launch_mode", choice(LAUNCH_MODES), LAUNCH_MODES[0],
                  "`ray`: rank 0 runs a Ray head sidecar and `vllm serve "
                  "--distributed-executor-backend ray` (with `RAY_ADDRESS`, `VLLM_HOST_IP`); "
                  "the other ranks run only `ray start --address=LEADER:PORT --block`. `mp`: "
                  "every rank runs `vllm serve --nnodes N --node-rank K --master-addr LEADER "
                  "--master-port P`, `--headless` on ranks >= 1.")
DATA_PARALLEL_LB = Key(
    "data_parallel_lb", choice(DP_LB_MODES), DP_LB_MODES[0],
    "(data parallel over nodes) who serves HTTP. `internal`: rank 0's API server, which "
    "balances over every data-parallel rank; the other nodes run `--headless`. `hybrid`: "
    "every node serves its own ranks on `port` (`--data-parallel-hybrid-lb`; vLLM makes "
    "it its external mode when each node has one rank, which it takes for "
    "mixture-of-experts models only) and the load balancer in front spreads over the "
    "nodes (docs/loadbalancer.md)")
DISTRIBUTED_TIMEOUT: Key[int | None] = Key(
    "distributed_timeout", seconds(1, 86400), None, "`--distributed-timeout-seconds`: how "
    "long ranks wait for each other in torch.distributed; with mp a lone rank 1 exits after "
    "about twice this", shown="vLLM's own")
RAY_ARGS: Key[tuple[str, ...]] = Key(
    "ray_args", arguments("'ray start' arguments"), (), "(ray) appended to every `ray start` "
    "(e.g. `--num-cpus=16`, distinct ports when two Ray replicas share a node)")
RAY_HEAD_ARGS: Key[tuple[str, ...]] = Key(
    "ray_head_args", arguments("'ray start --head' arguments"), (), "(ray) appended to the "
    "head's `ray start --head` only (e.g. `--include-dashboard=false`, "
    "`--dashboard-port=8300`, which Ray refuses on workers)")
RAY_NUM_GPUS: Key[int | None] = Key(
    "ray_num_gpus", integer(0, 4096, "the GPUs each Ray node offers"), None,
    "(ray) `--num-gpus=N` on every `ray start`: vLLM places one tensor-parallel worker per "
    "Ray GPU", shown="Ray's own detection")
RAY_AUTH = Key("ray_auth", choice(RAY_AUTH_MODES), RAY_AUTH_MODES[0],
               "(ray) stated on every Ray process (`RAY_AUTH_MODE`), because left unset a Ray "
               "head turns token auth on by itself once `~/.ray/auth_token` exists and then "
               "workers without it fail to join after ~20 s. `token`: every node reads the "
               "same token from `ray_token_file` (the system unit loads it with "
               "`LoadCredential=`, so it can stay root-only and never appears in a unit; "
               "`RAY_AUTH_TOKEN_PATH` names it). Use `token` wherever the Ray port is "
               "reachable from more than the replica's own nodes: Ray without auth runs "
               "whatever anyone who reaches it submits.")
RAY_TOKEN_FILE: Key[str | None] = Key(
    "ray_token_file", absolute_path("the Ray token file"), None,
    "(ray) the token file, the same bytes on every node (e.g. `openssl rand -hex 32 > "
    "/etc/llmgw/ray-token; chmod 600`); a missing file fails the units at start with status "
    "243/CREDENTIALS, naming it in the journal",
    shown=f"`{DEFAULT_RAY_TOKEN_FILE}` with `ray_auth: token`")
KEYS = (LAUNCH_MODE, *SERVER_KEYS, DATA_PARALLEL_LB, DISTRIBUTED_TIMEOUT, RAY_ARGS, RAY_HEAD_ARGS,
        RAY_NUM_GPUS, RAY_AUTH, RAY_TOKEN_FILE)
# Flags the units set from keys, with their short spellings (vLLM 0.32's arg_utils.py)
OWNED_FLAGS = {
    **dict.fromkeys(("--host", "--port"), "host and port"),
    **dict.fromkeys(("--tensor-parallel-size", "-tp"), "tensor_parallel_size"),
    **dict.fromkeys(("--pipeline-parallel-size", "-pp"), "pipeline_parallel_size"),
    **dict.fromkeys(("--distributed-executor-backend",), "launch_mode"),
    **dict.fromkeys(("--nnodes", "-n", "--node-rank", "-r", "--master-addr", "--master-port",
                     "--headless"), "nodes and rendezvous_port"),
    **dict.fromkeys(("--data-parallel-size", "-dp", "--data-parallel-size-local", "-dpl",
                     "--data-parallel-start-rank", "-dpr", "--data-parallel-address", "-dpa",
                     "--data-parallel-rpc-port", "-dpp", "--data-parallel-backend", "-dpb",
                     "--data-parallel-rank", "-dpn"),
                    "data_parallel_size, nodes and rendezvous_port"),
    **dict.fromkeys(("--data-parallel-hybrid-lb", "-dph", "--data-parallel-external-lb",
                     "-dpe"), "data_parallel_lb"),
    **dict.fromkeys(("--enable-expert-parallel", "-ep"), "expert_parallel_size"),
}
# launch_mode ray's own keys: the table's, by their prefix
RAY_KEYS = tuple(k.name for k in KEYS if k.name.startswith("ray_"))


def read(reader: Reader, data: Mapping[str, Any], path: KeyPath, nodes: tuple[Node, ...]
         ) -> Vllm:
    mode = LAUNCH_MODE.read(reader, data, path)
    data_parallel = SERVER_KEYS.data_parallel_size.read(reader, data, path) > 1
    server = read_server(reader, data, path, SERVER_KEYS,
                         rendezvous_port=DP_RPC_PORT if data_parallel else RENDEZVOUS_PORT[mode])
    for rank, node in enumerate(nodes):
        if not is_ip(node.address):
            raise reader.fail((*path, "nodes", rank, "address"), "expected an IP address "
                              f"(vLLM needs VLLM_HOST_IP per node); got '{node.address}'")
    launch: Launch
    if mode == "ray":
        launch = _read_ray(reader, data, path)
    elif mode == "mp":
        for key in RAY_KEYS:
            if key in data:
                raise reader.fail((*path, key), f"'{key}' applies only to launch_mode 'ray'",
                                  at_key=True)
        launch = MpLaunch()
    else:
        unreachable(mode)
    for i, arg in enumerate(server.args):
        if arg.split("=", 1)[0] == SHUTDOWN_FLAG:
            raise reader.fail((*path, "args", i), f"'{SHUTDOWN_FLAG}' is set by llmgw-render "
                              "from drain.timeout (the serving rank's drain on a planned "
                              "stop); set drain: {timeout: N} instead")
    refuse_owned_flags(reader, server.args, path, OWNED_FLAGS)
    lb = DATA_PARALLEL_LB.read(reader, data, path)
    _check_parallel(reader, data, path, server, mode, lb, len(nodes))
    return Vllm(server, launch, DISTRIBUTED_TIMEOUT.read(reader, data, path),
                DRAIN.read(reader, data, path).timeout, len(nodes), lb)


def _check_parallel(reader: Reader, data: Mapping[str, Any], path: KeyPath, server: Server,
                    mode: LaunchMode, lb: DataParallelLb, n_nodes: int) -> None:
    """What vLLM takes of data and expert parallel (its arg_utils.py, 0.32)."""
    dp, tp = server.data_parallel_size, server.tensor_parallel_size
    if dp > 1 and mode != "mp":
        raise reader.fail((*path, "data_parallel_size"), "data parallel needs launch_mode: "
                          "mp (vLLM's own data-parallel processes; its Ray data-parallel "
                          "backend is not supported)")
    if dp > 1 and dp % n_nodes:
        raise reader.fail((*path, "data_parallel_size"), f"expected a multiple of the "
                          f"{n_nodes} nodes (each node runs as many data-parallel ranks); "
                          f"got {dp}")
    if server.expert_parallel_size not in (1, dp * tp):
        raise reader.fail((*path, "expert_parallel_size"), "vLLM shards the experts over "
                          "every GPU of the data- and tensor-parallel ranks: expected 1 (off) "
                          f"or data_parallel_size x tensor_parallel_size = {dp * tp}; got "
                          f"{server.expert_parallel_size}")
    if lb == "hybrid" and (dp == 1 or n_nodes == 1):
        raise reader.fail((*path, "data_parallel_lb"), "hybrid load balancing needs "
                          "data-parallel ranks on more than one node (data_parallel_size "
                          "above 1, two nodes or more)", at_key=True)
    if dp > 1:
        per_node = dp // n_nodes
        check_gpus(reader, data, path, per_node * tp * server.pipeline_parallel_size,
                   f"{per_node} data-parallel rank(s) x tensor_parallel_size {tp} x "
                   f"pipeline_parallel_size {server.pipeline_parallel_size}")


def _read_ray(reader: Reader, data: Mapping[str, Any], path: KeyPath) -> RayLaunch:
    args = RAY_ARGS.read(reader, data, path)
    head_args = RAY_HEAD_ARGS.read(reader, data, path)
    num_gpus = RAY_NUM_GPUS.read(reader, data, path)
    auth = RAY_AUTH.read(reader, data, path)
    token_file = RAY_TOKEN_FILE.read(reader, data, path)
    if token_file is not None and auth != "token":
        raise reader.fail((*path, "ray_token_file"), "a token file needs ray_auth: token",
                          at_key=True)
    if auth == "token" and token_file is None:
        token_file = DEFAULT_RAY_TOKEN_FILE
    return RayLaunch(args, head_args, num_gpus, token_file)


ENTRY = EngineEntry(
    name="vllm",
    summary="vLLM (`vllm serve`), on a Ray cluster of the nodes or with its own "
            "multiprocessing executor",
    keys=KEYS,
    read=read,
)


def ray_temp_dir(replica: str, rank: int) -> str:
    """A Ray session root per replica and rank: two Ray nodes sharing one (two replicas
    on a node, or two ranks on one test machine) break each other (docs/design.md §7)."""
    plain = f"/tmp/ray-{replica}-{rank}"  # noqa: S108 - Ray's own default root is /tmp/ray
    if len(plain) <= RAY_TEMP_DIR_MAX:
        return plain
    import hashlib  # only for long names: the render path stays lean

    digest = hashlib.sha256(replica.encode()).hexdigest()[:8]
    keep = RAY_TEMP_DIR_MAX - len(f"/tmp/ray--{digest}-{rank}")  # noqa: S108
    return f"/tmp/ray-{replica[:keep]}-{digest}-{rank}"  # noqa: S108


def _parallel_args(vllm: Vllm) -> tuple[str, ...]:
    return ("--tensor-parallel-size", str(vllm.server.tensor_parallel_size),
            "--pipeline-parallel-size", str(vllm.server.pipeline_parallel_size))


def _distributed_args(vllm: Vllm) -> tuple[str, ...]:
    if vllm.distributed_timeout is None:
        return ()
    return ("--distributed-timeout-seconds", str(vllm.distributed_timeout))


def _drain_args(vllm: Vllm) -> tuple[str, ...]:
    """The serving rank's own drain on SIGTERM: the requests in flight may finish for up
    to drain.timeout seconds (vLLM's default, 0, aborts them)."""
    return (SHUTDOWN_FLAG, str(vllm.shutdown_timeout))


def _ray_auth(ray: RayLaunch) -> tuple[tuple[tuple[str, str], ...],
                                      tuple[tuple[str, str, str], ...]]:
    """Ray's auth settings for every process that talks to the cluster: stated always,
    because a Ray head turns token auth on by itself once ~/.ray/auth_token exists, and
    then workers without the token fail to join (docs/engines.md)."""
    mode = (("RAY_AUTH_MODE", ray.auth),)
    if ray.token_file is not None:
        return mode, (("RAY_AUTH_TOKEN_PATH", RAY_TOKEN_CREDENTIAL, ray.token_file),)
    return mode, ()


def _ray_steps(vllm: Vllm, ray: RayLaunch, replica: str, nodes: Sequence[Node], rank: int
               ) -> tuple[Step, ...]:
    server = vllm.server
    address = nodes[rank].address
    head = Endpoint(nodes[0].address, server.rendezvous_port)
    auth, token = _ray_auth(ray)
    ray_env = (("VLLM_HOST_IP", address), *auth)
    gpus = () if ray.num_gpus is None else (f"--num-gpus={ray.num_gpus}",)
    ray_common = (f"--node-ip-address={address}", f"--temp-dir={ray_temp_dir(replica, rank)}",
                  "--disable-usage-stats", *gpus, *ray.args)
    if rank > 0:
        return (Step(
            name="engine", role=f"Ray worker joining {head}",
            argv=(server.bin("ray"), "start", f"--address={head}", *ray_common, "--block"),
            wait_for=(head,), env=(*ray_env, RAY_NO_DRAIN), clean_exit_statuses=RAY_CLEAN_EXIT,
            credential_env=token, kill_mode=RAY_KILL_MODE, clean_exit_signals=RAY_CLEAN_SIGNALS,
            stop_with_grace=True,
        ),)
    ray_head = Step(
        name="ray-head", role=f"Ray head on port {head.port}",
        argv=(server.bin("ray"), "start", "--head", f"--port={head.port}", *ray_common,
              *ray.head_args, "--block"),
        frees=(Endpoint(wildcard(address), head.port),), env=(*ray_env, RAY_NO_DRAIN),
        clean_exit_statuses=RAY_CLEAN_EXIT, credential_env=token, kill_mode=RAY_KILL_MODE,
    )
    engine = Step(
        name="engine", role="vLLM server on the Ray cluster",
        argv=(server.bin("vllm"), "serve", server.model, *server.http_args(),
              *_parallel_args(vllm), "--distributed-executor-backend", "ray",
              *_distributed_args(vllm), *_drain_args(vllm), *server.args),
        wait_for=(head,), env=(*ray_env, ("RAY_ADDRESS", str(head))),
        clean_exit_statuses=VLLM_CLEAN_EXIT, credential_env=token,
        clean_exit_signals=VLLM_CLEAN_SIGNALS, stop_with_grace=True, main_drains=True,
    )
    return (ray_head, engine)


def _mp_step(vllm: Vllm, nodes: Sequence[Node], rank: int) -> Step:
    if vllm.data_parallel:
        return _dp_step(vllm, nodes, rank)
    server = vllm.server
    address = nodes[rank].address
    argv: tuple[str, ...] = (server.bin("vllm"), "serve", server.model)
    if rank == 0:
        argv += server.http_args()
    argv += (*_parallel_args(vllm), "--distributed-executor-backend", "mp",
             *_distributed_args(vllm), *(_drain_args(vllm) if rank == 0 else ()))
    frees: tuple[Endpoint, ...] = ()
    role = "vLLM server"
    n = len(nodes)
    if uses_rendezvous(n):
        master = Endpoint(nodes[0].address, server.rendezvous_port)
        argv += ("--nnodes", str(n), "--node-rank", str(rank), "--master-addr", master.host,
                 "--master-port", str(master.port))
        if rank > 0:
            # No wait for the master port: vLLM's rank >= 1 retries it by itself, so its
            # slow start-up (imports, model config) overlaps rank 0's instead of following
            # it (13 s of a 68 s start here: bench/engines.py, docs/engines.md).
            argv += ("--headless",)
            role = f"vLLM headless rank {rank}"
        else:
            frees = (Endpoint(wildcard(address), master.port),)
    return Step(name="engine", role=role, argv=argv + server.args, frees=frees,
                env=(("VLLM_HOST_IP", address),), clean_exit_statuses=VLLM_CLEAN_EXIT,
                clean_exit_signals=VLLM_CLEAN_SIGNALS, stop_with_grace=True,
                main_drains=rank == 0)


def _dp_step(vllm: Vllm, nodes: Sequence[Node], rank: int) -> Step:
    """Data parallel: each node runs its share of the data-parallel ranks (each with its
    own tensor-parallel workers); rank 0 hosts the data-parallel handshake at its RPC
    port, which the others dial and retry by themselves (docs/engines.md). Rank 0 serves
    HTTP, and with hybrid load balancing every node does, for its own ranks."""
    server = vllm.server
    address = nodes[rank].address
    n = len(nodes)
    local = server.data_parallel_size // n
    serves = rank in vllm.serving_ranks
    argv: tuple[str, ...] = (server.bin("vllm"), "serve", server.model,
                             *(server.http_args() if serves else ()), *_parallel_args(vllm),
                             "--distributed-executor-backend", "mp",
                             "--data-parallel-size", str(server.data_parallel_size),
                             "--data-parallel-backend", "mp")
    if server.expert_parallel_size > 1:
        argv += ("--enable-expert-parallel",)
    frees: tuple[Endpoint, ...] = ()
    if uses_rendezvous(n):
        rpc = Endpoint(nodes[0].address, server.rendezvous_port)
        argv += ("--data-parallel-size-local", str(local), "--data-parallel-address",
                 rpc.host, "--data-parallel-rpc-port", str(rpc.port))
        if rank > 0:
            argv += ("--data-parallel-start-rank", str(rank * local))
        else:
            frees = (Endpoint(wildcard(address), rpc.port),)
        if vllm.data_parallel_lb == "hybrid":
            argv += ("--data-parallel-hybrid-lb",)
        elif rank > 0:
            argv += ("--headless",)
    argv += (*_distributed_args(vllm), *(_drain_args(vllm) if serves else ()))
    first = rank * local
    ranks = f"data-parallel rank {first}" if local == 1 else \
        f"data-parallel ranks {first}-{first + local - 1}"
    role = f"vLLM {ranks}" + ("" if serves else ", headless")
    return Step(name="engine", role=role, argv=argv + server.args, frees=frees,
                env=(("VLLM_HOST_IP", address),), clean_exit_statuses=VLLM_CLEAN_EXIT,
                clean_exit_signals=VLLM_CLEAN_SIGNALS, stop_with_grace=True,
                main_drains=serves)
