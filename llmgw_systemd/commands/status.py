"""`llmgw-systemd status`: this node's shards straight from systemd (no supervisor
needed), through the readers the daemon uses (gather/); with --cluster, every rank of
their replicas, asked of their nodes' supervisors all at once (gather/cluster.py) and
tabled by health/cluster_view.py."""

from __future__ import annotations

import json
import os
import ssl
import time
from collections.abc import Callable, Sequence
from datetime import datetime

from llmgw_systemd.apply.systemctl import running_digest
from llmgw_systemd.commands.common import (
    DEFAULT_SPECS,
    DEFAULT_TLS_DIR,
    default_state_dir,
    say,
    this_node,
)
from llmgw_systemd.errors import LlmgwError, TlsError, UsageError
from llmgw_systemd.gather.cluster import ask_peers
from llmgw_systemd.gather.shard_reader import (
    LocalShard,
    ShardStatus,
    local_shards,
    probe_shard,
    read_status,
)
from llmgw_systemd.gather.systemd_bus import SystemdBus
from llmgw_systemd.gather.tls import client_context, find_tls_files
from llmgw_systemd.health.cluster_view import all_ready, cluster_rows, staged_lines
from llmgw_systemd.health.rules import READY
from llmgw_systemd.health.versions import RankVersion
from llmgw_systemd.spec.files import read_documents
from llmgw_systemd.spec.model import Replica
from llmgw_systemd.spec.names import DIGEST_SHOWN
from llmgw_systemd.spec.replicas import build_spec
from llmgw_systemd.supervisor import drain_requests

WATCH_INTERVAL = 1.0  # seconds between looks of --watch
CLEAR = "\x1b[H\x1b[2J"  # cursor home, erase the screen (ECMA-48)


def status(name: str | None, *, specs: tuple[str, ...], node: str | None,
           user_manager: bool, as_json: bool, cluster: bool, peer_port: int,
           peer_timeout: float, tls_cert: str | None, tls_key: str | None,
           tls_ca: str | None, watch: bool = False, interval: float = WATCH_INTERVAL) -> int:
    """Print the table (or JSON); the exit status: 0 when every shard (or rank) shown is
    ready, 3 when one is not. With `watch`, the table again in place whenever it
    changes, every `interval` seconds, until Ctrl-C (then 0)."""
    spec = build_spec(read_documents(specs or DEFAULT_SPECS))
    node_name = this_node(node)
    shards = [s for s in local_shards(spec, node_name)
              if name is None or s.replica.name == name]
    if name is not None and not shards:
        raise UsageError("NAME", f"replica '{name}' has no shard on node '{node_name}'")
    if watch and as_json:
        raise UsageError("--watch", "draws a table for a terminal; leave out --json")
    tls = _cluster_tls(tls_cert, tls_key, tls_ca) if cluster else None
    bus = SystemdBus(user=user_manager)
    try:
        def frame() -> tuple[list[str], int]:
            return _frame(bus, shards, node_name, user_manager, as_json, cluster=cluster,
                          peer_port=peer_port, timeout=peer_timeout, tls=tls)

        if not watch:
            lines, code = frame()
            for line in lines:
                say(line)
            return code
        return _watch(frame, interval)
    finally:
        bus.close()


def _watch(frame: Callable[[], tuple[list[str], int]], interval: float) -> int:
    """Redraw on change: the screen cleared and the frame written at once, so a person
    watching sees no flicker and no scrolling; a clock line says it is alive."""
    shown: list[str] | None = None
    try:
        while True:
            try:
                lines, _ = frame()
            except LlmgwError as exc:  # systemd restarting, say: shown, and looked at again
                lines = [f"error: {exc}"]
            if lines != shown:
                shown = lines
                stamp = datetime.now().strftime("%H:%M:%S")
                say(CLEAR + "\n".join([*lines, "", f"changed at {stamp}; every "
                                        f"{interval:g} s, Ctrl-C ends"]), end="\n")
            time.sleep(interval)
    except KeyboardInterrupt:
        say()
        return 0


def _frame(bus: SystemdBus, shards: list[LocalShard], node_name: str, user_manager: bool,
           as_json: bool, *, cluster: bool, peer_port: int, timeout: float,
           tls: ssl.SSLContext | None) -> tuple[list[str], int]:
    """One look: the lines to print and the exit status they make."""
    probes = {s.replica.name: probe_shard(s) for s in shards}
    # CLOCK_MONOTONIC, as systemd's timestamps (after the probes: they take time)
    statuses = read_status(bus, shards, probes, int(time.monotonic() * 1e6))
    versions = {s.replica: _local_version(s, shard.plan.services[-1].name)
                for s, shard in zip(statuses, shards)}
    if cluster:
        return _cluster([s.replica for s in shards], node_name, statuses, versions,
                        as_json, peer_port=peer_port, timeout=timeout, tls=tls)
    code = 0 if all(s.health.state == READY for s in statuses) else 3
    serves = {shard.replica.name: shard.replica.http.port_of(shard.plan.rank)
              if shard.replica.http is not None else None for shard in shards}
    if as_json:
        return [json.dumps([{
            "replica": s.replica, "rank": s.rank, "ranks": s.ranks, "node": s.node,
            "http": serves[s.replica], "state": s.health.state, "reason": s.health.reason,
            "spec": {"loaded": versions[s.replica].loaded,
                     "running": versions[s.replica].running},
            "units": {u.name: {"active": u.active_state, "sub": u.sub_state,
                               "result": u.result, "restarts": u.n_restarts}
                      for u in s.units}} for s in statuses], indent=2)], code
    lines = _table([("REPLICA", "RANK", "NODE", "HTTP", "STATE", "REASON")] + [
        (s.replica, f"{s.rank}/{s.ranks}", s.node, _port(serves[s.replica]), s.health.state,
         s.health.reason) for s in statuses])
    lines += _drain_notes([s.replica for s in statuses], user_manager)
    lines += [f"replica {replica}: staged on this node: its engine runs "
              f"{v.running[:DIGEST_SHOWN]}, its units carry {v.loaded[:DIGEST_SHOWN]}; it "
              "restarts once when the last of its nodes applies (--cluster: how many)"
              for replica, v in versions.items() if v.staged]
    return lines, code


def _port(port: int | None) -> str:
    """The HTTP column: the port a serving rank serves on, `-` for a rank that serves none
    (every rank of a data-parallel replica in hybrid mode serves)."""
    return "-" if port is None else f":{port}"


def _local_version(status: ShardStatus, engine: str) -> RankVersion:
    """This node's rank's spec versions: what its engine unit carries, and what the
    engine process started with (its own environment)."""
    unit = next((u for u in status.units if u.name == engine), None)
    if unit is None:
        return RankVersion(status.rank, status.node)
    return RankVersion(status.rank, status.node, unit.spec_digest,
                       running_digest(unit.main_pid))


def _drain_notes(replicas: list[str], user_manager: bool) -> list[str]:
    """Who took which replica out of rotation on this node, and since when."""
    requests, _ = drain_requests.load(default_state_dir(user_manager))
    return [f"drained on this node: {r.replica or 'every replica'} by {r.by} since {r.since}"
            + (f" ({r.reason})" if r.reason else "")
            + f"; llmgw-systemd resume {r.replica or '--node'} puts it back"
            for r in requests if r.replica is None or r.replica in replicas]


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    """Columns padded to their widest cell; the last one (a reason) left as it is."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1]
            for row in rows]


def _cluster_tls(cert: str | None, key: str | None, ca: str | None
                 ) -> ssl.SSLContext | None:
    try:
        files = find_tls_files(cert, key, ca, credentials_dir=DEFAULT_TLS_DIR
                               if os.path.isdir(DEFAULT_TLS_DIR) else None)
        return client_context(files) if files is not None else None
    except (TlsError, OSError) as exc:
        raise UsageError("--tls-cert/--tls-key/--tls-ca", str(exc)) from None


def _cluster(replicas: list[Replica], node: str, statuses: list[ShardStatus],
             versions: dict[str, RankVersion], as_json: bool, *, peer_port: int,
             timeout: float, tls: ssl.SSLContext | None) -> tuple[list[str], int]:
    """Ask every other node's supervisor once, all at once (gather/cluster.py), then one
    table."""
    address = {n.name: n.address for r in replicas for n in r.nodes if n.name != node}
    views = ask_peers(address, peer_port, timeout, tls)
    local = {s.replica: (s.health.state, s.health.reason) for s in statuses}
    where = {peer: f"{addr}:{peer_port}" for peer, addr in address.items()}
    rows = cluster_rows(replicas, node, local, views, where)
    code = 0 if all_ready(rows) else 3
    if as_json:
        return [json.dumps([{"replica": r.replica, "rank": r.rank, "ranks": r.ranks,
                             "node": r.node, "http": r.http, "state": r.state,
                             "reason": r.reason, "source": r.source} for r in rows],
                           indent=2)], code
    lines = _table([("REPLICA", "RANK", "NODE", "HTTP", "STATE", "SOURCE", "REASON")] + [
        (r.replica, f"{r.rank}/{r.ranks}", r.node, _port(r.http), r.state, r.source, r.reason)
        for r in rows])
    return lines + list(staged_lines(replicas, node, versions, views)), code
