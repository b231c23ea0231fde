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
    uses_rendezvous,
    wildcard,
)
from llmgw_systemd.spec.engines.server import Server, read_server, server_keys
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
        return self.server.port_claims(rendezvous=uses_rendezvous(n_nodes))

    def reserved_env(self) -> Mapping[str, str]:
        return {}

    def follows_leader(self, n_nodes: int) -> bool:
        return n_nodes > 1

    def least_stop_timeout(self) -> tuple[int, str] | None:
        return None


KEYS = server_keys("sglang", http_port=HTTP_PORT, rendezvous_port=RENDEZVOUS_PORT,
                   tp_flag="`--tp-size`, which spans all nodes",
                   pp_flag="`--pp-size`, given when above 1", commands="`python`")


def read(reader: Reader, data: Mapping[str, Any], path: KeyPath, nodes: tuple[Node, ...]
         ) -> Sglang:
    return Sglang(read_server(reader, data, path, KEYS, rendezvous_port=RENDEZVOUS_PORT))


ENTRY = EngineEntry(
    name="sglang",
    summary="SGLang (`python -m sglang.launch_server`), one server across the nodes",
    keys=tuple(KEYS),
    read=read,
)
