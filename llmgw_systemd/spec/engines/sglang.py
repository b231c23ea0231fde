"""SGLang (pure): every rank runs `python -m sglang.launch_server`, ranks >= 1 after
rank 0's `--dist-init-addr` accepts connections.

SGLang cannot run on this machine (no GPU); its units are checked against a stand-in that
parses the real SGLang's arguments (tests/engines), and no clean exit beyond 0 is
assumed, because none is measured.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmgw_systemd.spec.document import KeyPath
from llmgw_systemd.spec.endpoint import Endpoint
from llmgw_systemd.spec.engines.base import (
    EngineEntry,
    Http,
    PortClaim,
    ProgressSeries,
    Step,
    refuse_owned_flags,
    uses_rendezvous,
    wildcard,
)
from llmgw_systemd.spec.engines.server import Server, check_gpus, read_server, server_keys
from llmgw_systemd.spec.reader import Reader

if TYPE_CHECKING:
    from llmgw_systemd.spec.model import Node

HTTP_PORT = 30000
# SGLang's /metrics (served with --enable-metrics): realtime_tokens_total moves on every
# prefill batch and every decode step; the running and queued requests are gauges, set
# with every logged batch and put right when idle (metrics_collector.py and
# scheduler_components/metrics_reporter.py, 0.5.23).
PROGRESS = ProgressSeries("/metrics", ("sglang:realtime_tokens_total",),
                          ("sglang:num_running_reqs", "sglang:num_queue_reqs"))
# SGLang's /health (and /health_generate) submits a one-token request and answers 200 once
# the scheduler sent anything back, 503 after SGLANG_HEALTH_CHECK_TIMEOUT (20 s): busy
# work answers it, a frozen scheduler never does (http_server.py, 0.5.23)
GENERATING_PATHS = ("/health", "/health_generate")
RENDEZVOUS_PORT = 20000
# With attention data parallel, the ZMQ ports SGLang derives from the dist-init port
# (PortArgs.init_new in server_args.py, 0.5.23; they moved between versions)
ZMQ_DERIVED_PORTS = 6
ZMQ_PORT_DELTA = 233  # from the HTTP port, on one node without --dist-init-addr
# Flags the units set from keys, with SGLang's other spellings (0.5.23)
OWNED_FLAGS = {
    **dict.fromkeys(("--model-path", "--model"), "model"),
    **dict.fromkeys(("--host", "--port"), "host and port"),
    **dict.fromkeys(("--tp-size", "--tensor-parallel-size"), "tensor_parallel_size"),
    **dict.fromkeys(("--pp-size", "--pipeline-parallel-size"), "pipeline_parallel_size"),
    **dict.fromkeys(("--nnodes", "--node-rank", "--dist-init-addr", "--nccl-init-addr"),
                    "nodes and rendezvous_port"),
    **dict.fromkeys(("--attn-dp-size", "--attention-data-parallel-size", "--dp-size",
                     "--data-parallel-size", "--enable-dp-attention"), "data_parallel_size"),
    **dict.fromkeys(("--ep-size", "--expert-parallel-size", "--ep"), "expert_parallel_size"),
}


@dataclass(frozen=True)
class Sglang:
    server: Server

    @property
    def name(self) -> str:
        return "sglang"

    @property
    def http(self) -> Http:
        # SGLang serves /metrics only with --enable-metrics: without, no stall detection
        metrics = "--enable-metrics" in self.server.args
        return self.server.http()._replace(progress=PROGRESS if metrics else None,
                                           generating_paths=GENERATING_PATHS)

    def steps(self, replica: str, nodes: Sequence[Node], rank: int) -> tuple[Step, ...]:
        server = self.server
        argv: tuple[str, ...] = (server.bin("python"), "-m", "sglang.launch_server",
                                 "--model-path", server.model, *server.http_args(),
                                 "--tp-size", str(server.tensor_parallel_size))
        if server.pipeline_parallel_size > 1:
            argv += ("--pp-size", str(server.pipeline_parallel_size))
        if server.data_parallel_size > 1:
            argv += ("--attn-dp-size", str(server.data_parallel_size))
        if server.expert_parallel_size > 1:
            argv += ("--ep-size", str(server.expert_parallel_size))
        n = len(nodes)
        wait_for: tuple[Endpoint, ...] = ()
        frees: tuple[Endpoint, ...] = ()
        role = "SGLang server"
        if uses_rendezvous(n):
            init = Endpoint(nodes[0].address, server.rendezvous_port)
            argv += ("--nnodes", str(n), "--node-rank", str(rank), "--dist-init-addr",
                     str(init))
            if rank > 0:
                wait_for = (init,)
                role = f"SGLang rank {rank}"
            else:
                frees = (Endpoint(wildcard(nodes[rank].address), init.port),)
        return (Step(name="engine", role=role, argv=argv + server.args, wait_for=wait_for,
                     frees=frees, main_drains=rank == 0),)

    def port_claims(self, n_nodes: int) -> tuple[PortClaim, ...]:
        server = self.server
        claims = server.port_claims(rendezvous=uses_rendezvous(n_nodes))
        if server.data_parallel_size == 1:
            return claims
        # Attention data parallel talks ZMQ over TCP: rank 0 binds a run of ports derived
        # from the dist-init port (on one node, from the HTTP port). Claimed, so another
        # replica's port inside the run is an error here, not "address in use" there.
        base = server.rendezvous_port if uses_rendezvous(n_nodes) else \
            server.port + ZMQ_PORT_DELTA
        first = base + 1 if base + ZMQ_DERIVED_PORTS <= 65535 else base - ZMQ_DERIVED_PORTS - 1
        key = "rendezvous_port" if uses_rendezvous(n_nodes) else "port"
        return (*claims, *(PortClaim(0, port, (key,), "rendezvous")
                           for port in range(first, first + ZMQ_DERIVED_PORTS)))

    def reserved_env(self) -> Mapping[str, str]:
        return {}

    def follows_leader(self, n_nodes: int) -> bool:
        return n_nodes > 1

    def least_stop_timeout(self) -> tuple[int, str] | None:
        return None


KEYS = server_keys("sglang", http_port=HTTP_PORT, rendezvous_port=RENDEZVOUS_PORT,
                   tp_flag="`--tp-size`, which spans all nodes",
                   pp_flag="`--pp-size`, given when above 1",
                   dp_flag="`--attn-dp-size` (attention data parallel inside the "
                   "tensor-parallel group: a divisor of tensor_parallel_size), given when "
                   "above 1; rank 0 then also binds the 6 ports after rendezvous_port",
                   ep_flag="`--ep-size`, given when above 1: 1 or tensor_parallel_size",
                   commands="`python`")


def read(reader: Reader, data: Mapping[str, Any], path: KeyPath, nodes: tuple[Node, ...]
         ) -> Sglang:
    server = read_server(reader, data, path, KEYS, rendezvous_port=RENDEZVOUS_PORT)
    refuse_owned_flags(reader, server.args, path, OWNED_FLAGS)
    tp, dp, ep = (server.tensor_parallel_size, server.data_parallel_size,
                  server.expert_parallel_size)
    if tp % dp:
        raise reader.fail((*path, "data_parallel_size"), "SGLang's attention data "
                          "parallel runs inside the tensor-parallel group: expected a "
                          f"divisor of tensor_parallel_size ({tp}); got {dp}")
    if ep not in (1, tp):
        raise reader.fail((*path, "expert_parallel_size"), "SGLang shards the experts over "
                          f"the tensor-parallel group: expected 1 (off) or "
                          f"tensor_parallel_size ({tp}); got {ep}")
    n = len(nodes)
    if dp > 1:
        if (tp * server.pipeline_parallel_size) % n:
            raise reader.fail((*path, "tensor_parallel_size"), "expected the "
                              "tensor-parallel workers to divide evenly over the "
                              f"{n} nodes; got {tp} x {server.pipeline_parallel_size} "
                              "(tensor x pipeline)")
        check_gpus(reader, data, path, tp * server.pipeline_parallel_size // n,
                   f"tensor_parallel_size {tp} x pipeline_parallel_size "
                   f"{server.pipeline_parallel_size} over {n} node(s)")
    return Sglang(server)


ENTRY = EngineEntry(
    name="sglang",
    summary="SGLang (`python -m sglang.launch_server`), one server across the nodes",
    keys=tuple(KEYS),
    read=read,
)
