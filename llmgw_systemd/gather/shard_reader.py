"""This node's shards and their health, read from systemd: shared by
`llmgw-systemd status` and the supervisor."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmgw_systemd.gather.probes import http_probe
from llmgw_systemd.gather.systemd_bus import SystemdBus
from llmgw_systemd.health.rules import Health, Probe, shard_health
from llmgw_systemd.health.unit_state import UnitState
from llmgw_systemd.spec.endpoint import local_address
from llmgw_systemd.spec.model import Replica, Spec
from llmgw_systemd.units.plan import Manager, ShardPlan, plan_node

# Unit names do not depend on where the helper lives: any path will do for planning.
_NAMES_ONLY = Manager(user=False, wait_for_port="/usr/bin/llmgw-wait-for-port")


@dataclass(frozen=True)
class LocalShard:
    """One replica's shard on this node: what to read, and how to judge it."""

    replica: Replica
    plan: ShardPlan

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.plan.services)

    @property
    def serving(self) -> bool:
        return self.plan.serves_http


@dataclass(frozen=True)
class ShardStatus:
    """A shard's health at one moment, with the unit states it was judged on."""

    replica: str
    rank: int
    ranks: int
    node: str
    health: Health
    units: tuple[UnitState, ...]


def local_shards(spec: Spec, node: str) -> list[LocalShard]:
    by_name = {r.name: r for r in spec.replicas}
    return [LocalShard(by_name[p.replica], p)
            for p in plan_node(spec, node, _NAMES_ONLY, allow_empty=True)]


def probe_shard(shard: LocalShard) -> Probe | None:
    replica = shard.replica
    http = replica.http
    if not shard.serving or http is None:
        return None
    return http_probe(local_address(http.host), http.port, replica.health.path,
                      replica.health.timeout)


def read_status(bus: SystemdBus, shards: Sequence[LocalShard],
                probes: dict[str, Probe | None], now_usec: int,
                was_ready: frozenset[str] = frozenset(),
                *, refresh: bool = False, properties: bool = True) -> list[ShardStatus]:
    """One bulk snapshot of every unit of every shard, judged by the health rules at
    now_usec (CLOCK_MONOTONIC, as systemd's timestamps: the caller reads the clock)."""
    names = [n for s in shards for n in (s.plan.target.name, *s.members)]
    states = bus.snapshot(names, refresh=refresh, properties=properties)
    out = []
    for shard in shards:
        target = states[shard.plan.target.name]
        members = [states[m] for m in shard.members]
        health = shard_health(
            target, members, serving=shard.serving, probe=probes.get(shard.replica.name),
            now_usec=now_usec, stability_usec=shard.replica.health.stability * 1_000_000,
            was_ready=shard.replica.name in was_ready)
        out.append(ShardStatus(shard.replica.name, shard.plan.rank, shard.plan.ranks,
                               shard.plan.node, health, (target, *members)))
    return out
