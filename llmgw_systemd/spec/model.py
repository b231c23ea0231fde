"""The validated spec as data (pure): nodes, replicas, the whole spec."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmgw_systemd.spec.policies import (
    DrainPolicy,
    GroupRestartPolicy,
    HealthCheck,
    RestartPolicy,
)

if TYPE_CHECKING:
    from llmgw_systemd.spec.engines.base import EngineSettings, Http


@dataclass(frozen=True)
class Node:
    """One rank's machine: the name --node matches, the address peers dial."""

    name: str
    address: str
    interface: str | None = None  # the NIC for gloo/NCCL traffic on this node
    env: tuple[tuple[str, str], ...] = ()  # this node's own variables (they win)


@dataclass(frozen=True)
class Replica:
    """One replica of a model across its nodes, validated: the keys every engine has
    (spec/common_keys.py), and its engine's own settings (spec/engines/)."""

    name: str
    nodes: tuple[Node, ...]
    engine: EngineSettings
    rendezvous_timeout: int
    port_release_timeout: int
    gpus: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    environment_file: str | None
    stop_timeout: int
    user: str
    group: str | None
    supplementary_groups: tuple[str, ...]
    read_write_paths: tuple[str, ...]
    devices: tuple[str, ...]
    hardening: bool
    restart: RestartPolicy
    health: HealthCheck
    group_restart: GroupRestartPolicy
    source: str
    # Start at boot: the generator links the target into multi-user.target (or
    # default.target); llmgw-render --apply enables and starts it.
    enable: bool = False
    # a planned stop: out of rotation, then drained (health/drain.py)
    drain: DrainPolicy = field(default_factory=DrainPolicy)

    @property
    def http(self) -> Http | None:
        """The rank that serves HTTP, if one does."""
        return self.engine.http

    def rank_of(self, node_name: str) -> int | None:
        for rank, node in enumerate(self.nodes):
            if node.name == node_name:
                return rank
        return None


@dataclass(frozen=True)
class Spec:
    """Every replica of every spec file given."""

    replicas: tuple[Replica, ...]

    def node_names(self) -> list[str]:
        return sorted({n.name for r in self.replicas for n in r.nodes})
