"""The keys that vLLM and SGLang share: an OpenAI-compatible server of one model, split
over the nodes, started from an installation prefix (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmgw_systemd.spec.document import KeyPath
from llmgw_systemd.spec.engines.base import (
    Http,
    PortClaim,
    SpecKey,
    flag_value,
    refuse_secret_flags,
)
from llmgw_systemd.spec.reader import Checker, ip_address

DEFAULT_VIRTUALENV = "/usr/local"
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

    def bin(self, name: str) -> str:
        return f"{self.virtualenv.rstrip('/')}/bin/{name}"

    def http_args(self) -> tuple[str, ...]:
        return ("--host", self.host, "--port", str(self.port))

    def http(self) -> Http:
        """Rank 0 serves; completions must name the served model: the first
        --served-model-name (both engines take it), else the model itself."""
        model = flag_value(self.args, "--served-model-name") or self.model
        return Http(0, self.host, self.port, model)

    def port_claims(self, *, rendezvous: bool) -> tuple[PortClaim, ...]:
        http = PortClaim(0, self.port, ("port",), "HTTP")
        if not rendezvous:
            return (http,)
        return (http, PortClaim(0, self.rendezvous_port, ("rendezvous_port",), "rendezvous"))


def server_keys(*, http_port: int, rendezvous_default: str, tp_flag: str, pp_flag: str,
                commands: str) -> tuple[SpecKey, ...]:
    """The shared keys, with this engine's defaults, for the engine's key table."""
    return (
        SpecKey("model", "required", "model path or name"),
        SpecKey("port", str(http_port), "HTTP port of rank 0, which serves the API"),
        SpecKey("host", f"`{DEFAULT_HOST}`", "address the server binds"),
        SpecKey("tensor_parallel_size", "1", f"tensor parallel size: {tp_flag}"),
        SpecKey("pipeline_parallel_size", "1", f"pipeline parallel size: {pp_flag}"),
        SpecKey("rendezvous_port", rendezvous_default,
                "the port on rank 0 the other ranks meet at"),
        SpecKey("args", "none", "appended to the engine command (`--api-key` and other "
                "secret flags are refused)"),
        SpecKey("virtualenv", f"`{DEFAULT_VIRTUALENV}`", "installation prefix whose `bin/` "
                f"holds {commands}"),
    )


def read_server(check: Checker, data: Mapping[str, Any], path: KeyPath, engine: str, *,
                http_port: int, rendezvous_port: int) -> Server:
    if "model" not in data:
        raise check.fail(path, f"missing required key 'model' (engine '{engine}' needs a "
                         "model path or name)")
    model = check.string(data["model"], (*path, "model"), "a model path or name")
    if model.startswith("-"):
        raise check.fail((*path, "model"), f"expected a model path or name; got '{model}', "
                         "which would be read as an option")
    server = Server(
        model=model,
        port=check.optional(data, "port", path, check.port, http_port),
        rendezvous_port=check.optional(data, "rendezvous_port", path, check.port,
                                       rendezvous_port),
        tensor_parallel_size=check.optional_int(data, "tensor_parallel_size", path, 1, 4096,
                                                "a tensor parallel size", 1),
        pipeline_parallel_size=check.optional_int(data, "pipeline_parallel_size", path, 1,
                                                  4096, "a pipeline parallel size", 1),
        host=check.optional(data, "host", path, lambda v, p: ip_address(
            check, v, p, "an IP address to bind HTTP to"), DEFAULT_HOST),
        args=check.optional(data, "args", path,
                            lambda v, p: check.str_list(v, p, "engine arguments"), ()),
        virtualenv=check.optional(data, "virtualenv", path, lambda v, p: check.abs_path(
            v, p, "the engine's installation (a virtualenv or prefix)"), DEFAULT_VIRTUALENV),
    )
    refuse_secret_flags(check, "args", server.args, path)
    return server
