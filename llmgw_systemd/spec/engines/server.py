"""The keys that vLLM and SGLang share: an OpenAI-compatible server of one model, split
over the nodes, started from an installation prefix (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from llmgw_systemd.spec.document import KeyPath
from llmgw_systemd.spec.engines.base import Http, PortClaim, arguments, flag_value
from llmgw_systemd.spec.keys import REQUIRED, Key, absolute_path, integer, ip_address, tcp_port
from llmgw_systemd.spec.reader import Reader

DEFAULT_VIRTUALENV = "/usr/local"
NO_ARGS: tuple[str, ...] = ()
DEFAULT_HOST = "0.0.0.0"  # noqa: S104 - the gateway must reach the serving rank


@dataclass(frozen=True)
class Server:
    """One model served over HTTP by rank 0, its ranks meeting at rank 0's
    rendezvous port."""

    model: str
    host: str
    port: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    rendezvous_port: int
    args: tuple[str, ...]
    virtualenv: str
    data_parallel_size: int = 1
    expert_parallel_size: int = 1  # 1: the experts are not sharded (no expert parallel)

    def bin(self, name: str) -> str:
        return f"{self.virtualenv.rstrip('/')}/bin/{name}"

    def http_args(self) -> tuple[str, ...]:
        return ("--host", self.host, "--port", str(self.port))

    def http(self, ranks: tuple[int, ...] = (0,)) -> Http:
        """The serving ranks (rank 0 unless the engine says more); completions must name
        the served model: the first --served-model-name (both engines take it), else the
        model itself."""
        model = flag_value(self.args, "--served-model-name") or self.model
        return Http(ranks, self.host, self.port, model)

    def port_claims(self, *, rendezvous: bool, serving: tuple[int, ...] = (0,)
                    ) -> tuple[PortClaim, ...]:
        http = tuple(PortClaim(rank, self.port, ("port",), "HTTP") for rank in serving)
        if not rendezvous:
            return http
        return (*http, PortClaim(0, self.rendezvous_port, ("rendezvous_port",), "rendezvous"))


def check_gpus(reader: Reader, data: Mapping[str, Any], path: KeyPath, per_node: int,
               why: str) -> None:
    """The spec's `gpus` (each node's CUDA_VISIBLE_DEVICES), when given, must be as many as
    the engine's workers on each node: fewer cannot start, more sit idle."""
    from llmgw_systemd.spec.common_keys import GPUS  # the common key's own row

    gpus = GPUS.read(reader, data, path)
    if gpus and len(gpus) != per_node:
        raise reader.fail((*path, "gpus"), f"expected {per_node} GPUs per node ({why}); "
                          f"got {len(gpus)}")


def read_model(reader: Reader, value: Any, path: KeyPath) -> str:
    model = reader.string(value, path, "a model path or name")
    if model.startswith("-"):
        raise reader.fail(path, f"expected a model path or name; got '{model}', which "
                          "would be read as an option")
    return model


class ServerKeys(NamedTuple):
    """The shared keys' rows, with one engine's defaults."""

    model: Key[str]
    port: Key[int]
    host: Key[str]
    tensor_parallel_size: Key[int]
    pipeline_parallel_size: Key[int]
    rendezvous_port: Key[int | None]
    args: Key[tuple[str, ...]]
    virtualenv: Key[str]
    data_parallel_size: Key[int]
    expert_parallel_size: Key[int]


def server_keys(engine: str, *, http_port: int, rendezvous_port: int | None,
                rendezvous_shown: str | None = None, tp_flag: str, pp_flag: str,
                dp_flag: str, ep_flag: str, commands: str) -> ServerKeys:
    """The shared keys, with this engine's defaults, for the engine's key table.
    rendezvous_port None: the engine's default depends on more than the engine (vLLM's
    launch mode), and rendezvous_shown says how."""
    return ServerKeys(
        Key("model", read_model, REQUIRED, "model path or name",
            missing=f"engine '{engine}' needs a model path or name"),
        Key("port", tcp_port, http_port, "HTTP port of rank 0, which serves the API"),
        Key("host", ip_address("an IP address to bind HTTP to"), DEFAULT_HOST,
            "address the server binds"),
        Key("tensor_parallel_size", integer(1, 4096, "a tensor parallel size"), 1,
            f"tensor parallel size: {tp_flag}"),
        Key("pipeline_parallel_size", integer(1, 4096, "a pipeline parallel size"), 1,
            f"pipeline parallel size: {pp_flag}"),
        Key("rendezvous_port", tcp_port, rendezvous_port,
            "the port on rank 0 the other ranks meet at", shown=rendezvous_shown),
        Key("args", arguments("engine arguments"), NO_ARGS, "appended to the engine command "
            "(`--api-key` and other secret flags are refused)"),
        Key("virtualenv", absolute_path("the engine's installation (a virtualenv or prefix)"),
            DEFAULT_VIRTUALENV, f"installation prefix whose `bin/` holds {commands}"),
        Key("data_parallel_size", integer(1, 4096, "a data parallel size"), 1,
            f"data parallel size (attention replicated per rank, the ranks stepping in "
            f"lockstep): {dp_flag}"),
        Key("expert_parallel_size", integer(1, 65536, "an expert parallel size"), 1,
            f"GPUs the experts of a mixture-of-experts model are sharded over (1: off): "
            f"{ep_flag}"),
    )


def read_server(reader: Reader, data: Mapping[str, Any], path: KeyPath, keys: ServerKeys, *,
                rendezvous_port: int) -> Server:
    """The shared keys, each through its row; rendezvous_port is the engine's default
    when the row has none."""
    chosen = keys.rendezvous_port.read(reader, data, path)
    return Server(
        model=keys.model.read(reader, data, path),
        port=keys.port.read(reader, data, path),
        rendezvous_port=rendezvous_port if chosen is None else chosen,
        tensor_parallel_size=keys.tensor_parallel_size.read(reader, data, path),
        pipeline_parallel_size=keys.pipeline_parallel_size.read(reader, data, path),
        host=keys.host.read(reader, data, path),
        args=keys.args.read(reader, data, path),
        virtualenv=keys.virtualenv.read(reader, data, path),
        data_parallel_size=keys.data_parallel_size.read(reader, data, path),
        expert_parallel_size=keys.expert_parallel_size.read(reader, data, path),
    )
