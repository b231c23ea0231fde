"""What a stopping supervisor knew, for the one that starts next (docs/supervisor.md, "A
restarted supervisor starts from what it knew").

A supervisor restarted on a serving node (a package upgrade, `systemctl restart`) used to
start from nothing: `starting: waiting for the first health probe` until its own probes
had answered under load, and every peer `no report yet`, so the replica left rotation
for seconds while its engines served on. At a clean stop it now writes the evidence it
last had: per replica the generation whose serving rank answered, the last health probe
and one-token check, and per peer node the last answer that came through. The next
start reads it once (and removes it), and the judge treats it as any evidence: a probe
counts only for the same engine start (its InvocationID) and for `probe_fresh` seconds
from when it was taken, a peer's answer only within the peer grace, so what changed
while no supervisor ran is never taken for ready.

Times are CLOCK_MONOTONIC seconds, which go on across a restart of the process but not
of the machine: the boot ID recorded with them must match, or the file is ignored.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from llmgw_systemd.health.evidence import PeerEvidence, PeerShard, ProbeEvidence
from llmgw_systemd.health.rules import STATE_BY_NAME
from llmgw_systemd.supervisor.state_file import load_record, save_record

FILE_NAME = "saved-evidence.json"
KEY = "evidence"
BOOT_ID = "/proc/sys/kernel/random/boot_id"
MAX_ITEMS = 10_000  # replicas, peers or shards: a bound against a bad file
SAVED = "saved: "  # how a restored probe's detail begins (status shows it)


@dataclass(frozen=True)
class SavedEvidence:
    """One supervisor's last evidence: probes per replica and kind, the generation each
    replica's serving rank answered in, the last answer of each peer node."""

    boot_id: str
    probes: Mapping[tuple[str, str], ProbeEvidence]  # (replica, kind) -> probe
    served: Mapping[str, str]  # replica -> generation
    peers: Mapping[str, PeerEvidence]  # node -> its last answer (no error)


def boot_id() -> str:
    try:
        with open(BOOT_ID, encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def encode(saved: SavedEvidence) -> dict[str, Any]:
    return {
        "boot_id": saved.boot_id,
        "probes": [{"replica": r, "kind": k, **asdict(p)}
                   for (r, k), p in sorted(saved.probes.items())],
        "served": dict(sorted(saved.served.items())),
        "peers": [{"source": p.source, "received_at": p.received_at,
                   "authenticated": p.authenticated,
                   "shards": [asdict(s) for s in p.shards]}
                  for _, p in sorted(saved.peers.items()) if not p.error],
    }


def _typed(record: object, name: str, kind: type | tuple[type, ...]) -> Any:
    value = record.get(name) if isinstance(record, dict) else None
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in (
            kind if isinstance(kind, tuple) else (kind,))):
        raise ValueError(f"{name}: not a {kind}")
    return value


def _list(record: object, name: str) -> list[Any]:
    value: list[Any] = _typed(record, name, list)
    if len(value) > MAX_ITEMS:
        raise ValueError(f"{name}: more than {MAX_ITEMS} items")
    return value


def _shard(record: object) -> PeerShard:
    state = STATE_BY_NAME.get(_typed(record, "state", str))
    if state is None:
        raise ValueError("state: not a state")
    up_for = record.get("up_for") if isinstance(record, dict) else None
    draining = record.get("draining") if isinstance(record, dict) else None
    if up_for is not None and (isinstance(up_for, bool) or not isinstance(up_for, int)):
        raise ValueError("up_for: not an integer")
    if draining is not None and not isinstance(draining, str):
        raise ValueError("draining: not a string")
    return PeerShard(
        replica=_typed(record, "replica", str), rank=_typed(record, "rank", int),
        node=_typed(record, "node", str), state=state, reason=_typed(record, "reason", str),
        generation=_typed(record, "generation", str), serving=_typed(record, "serving", bool),
        up_for=up_for, draining=draining, drained=_typed(record, "drained", bool),
        loaded_digest=_typed(record, "loaded_digest", str),
        running_digest=_typed(record, "running_digest", str))


def decode(data: object) -> SavedEvidence:
    """The evidence in a file's record; ValueError naming what is wrong."""
    number = (int, float)
    probes = {}
    for item in _list(data, "probes"):
        probe = ProbeEvidence(_typed(item, "ok", bool), _typed(item, "detail", str),
                              _typed(item, "generation", str),
                              float(_typed(item, "taken_at", number)))
        probes[(_typed(item, "replica", str), _typed(item, "kind", str))] = probe
    served_record = _typed(data, "served", dict)
    served = {k: v for k, v in served_record.items()
              if isinstance(k, str) and isinstance(v, str)}
    peers = {}
    for item in _list(data, "peers"):
        source = _typed(item, "source", str)
        peers[source] = PeerEvidence(
            source, float(_typed(item, "received_at", number)),
            _typed(item, "authenticated", bool),
            tuple(_shard(s) for s in _list(item, "shards")))
    return SavedEvidence(_typed(data, "boot_id", str), probes, served, peers)


def save(directory: str, saved: SavedEvidence) -> None:
    save_record(directory, FILE_NAME, KEY, encode(saved))


def take(directory: str, now: float, *, volatile: bool = False
         ) -> tuple[SavedEvidence | None, str]:
    """The evidence a supervisor saved when it stopped in this boot, read once: the file
    is removed, so a later start after a crash never takes it for its own. None and a
    warning ("" when there was nothing) otherwise.

    This boot: the boot IDs match. A sandbox with ProcSubset=pid (the shipped unit) cannot
    read the boot ID at all; then only a `volatile` folder (its RuntimeDirectory=, on a
    tmpfs a reboot empties) proves the file is of this boot."""
    record, warning = load_record(directory, FILE_NAME, KEY, "evidence")
    path = os.path.join(directory, FILE_NAME)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        return None, f"cannot remove {path}, not using it: {exc.strerror or exc}"
    if record is None:
        return None, warning
    try:
        saved = decode(record)
    except ValueError as exc:
        return None, f"{path}: {exc}; starting with no saved evidence"
    if saved.boot_id != boot_id() or not (saved.boot_id or volatile):
        return None, ""  # from before a reboot: its clock means nothing now
    stamps = [p.taken_at for p in saved.probes.values()] + \
        [p.received_at for p in saved.peers.values()]
    if any(t > now for t in stamps):
        return None, f"{path}: times in the future; starting with no saved evidence"
    return saved, ""
