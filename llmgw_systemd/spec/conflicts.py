"""Checks that span replicas (pure): names, node addresses and ports must agree across
every replica of every spec file. Each conflict is an error at both places, each naming
the other, so whichever file an operator opens shows the clash."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from llmgw_systemd.errors import SpecError
from llmgw_systemd.spec.document import Document, KeyPath, format_path
from llmgw_systemd.spec.model import Replica


def _where(doc: Document, path: KeyPath) -> str:
    return f"{doc.file}:{doc.key_line(path)} ({format_path(path)})"


class Conflict(NamedTuple):  # a NamedTuple, as spec/engines/base.py says why
    """Two places in the specs that cannot both hold (a replica name used twice, a node
    with two addresses, a port claimed twice): an error at each, naming the other."""

    later: SpecError
    earlier: SpecError


class Placed(NamedTuple):
    """A replica with the document and key path it was read from."""

    replica: Replica
    doc: Document
    path: KeyPath


def conflicts(placed: Sequence[Placed]) -> list[Conflict]:
    """Every conflict among the replicas, in document order: names, then node addresses,
    then ports (the order build_spec reports them in)."""
    return [*name_conflicts(placed), *_address_conflicts(placed), *_port_conflicts(placed)]


def name_conflicts(placed: Sequence[Placed]) -> list[Conflict]:
    out: list[Conflict] = []
    first: dict[str, Placed] = {}
    for entry in placed:
        name = entry.replica.name
        if name not in first:
            first[name] = entry
            continue
        other = first[name]
        here, there = (*entry.path, "name"), (*other.path, "name")
        out.append(Conflict(
            later=entry.doc.error(here, f"replica name '{name}' is already used at "
                                  f"{_where(other.doc, there)}"),
            earlier=other.doc.error(there, f"replica name '{name}' is also used at "
                                    f"{_where(entry.doc, here)}")))
    return out


def _address_conflicts(placed: Sequence[Placed]) -> list[Conflict]:
    out: list[Conflict] = []
    seen: dict[str, tuple[str, Placed, int]] = {}  # node name -> (address, first use, rank)
    for entry in placed:
        for rank, node in enumerate(entry.replica.nodes):
            if node.name not in seen:
                seen[node.name] = (node.address, entry, rank)
                continue
            address, other, other_rank = seen[node.name]
            if address == node.address:
                continue
            here = (*entry.path, "nodes", rank, "address")
            there = (*other.path, "nodes", other_rank, "address")
            out.append(Conflict(
                later=entry.doc.error(here, f"node '{node.name}' has address '{address}' in "
                                      f"replica '{other.replica.name}' at "
                                      f"{_where(other.doc, there)} but '{node.address}' here"),
                earlier=other.doc.error(there, f"node '{node.name}' has address "
                                        f"'{node.address}' in replica '{entry.replica.name}' "
                                        f"at {_where(entry.doc, here)} but '{address}' here")))
    return out


def port_claims(replica: Replica) -> list[tuple[str, int, KeyPath, str]]:
    """(node name, port, key path in the replica, what) for every port the replica binds."""
    return [(replica.nodes[c.rank].name, c.port, c.path, c.what)
            for c in replica.engine.port_claims(len(replica.nodes))]


def _port_conflicts(placed: Sequence[Placed]) -> list[Conflict]:
    out: list[Conflict] = []
    claimed: dict[tuple[str, int], tuple[Placed, KeyPath, str]] = {}
    for entry in placed:
        for node, port, rel, what in port_claims(entry.replica):
            key = (node, port)
            if key not in claimed:
                claimed[key] = (entry, rel, what)
                continue
            other, other_rel, other_what = claimed[key]
            here, there = (*entry.path, *rel), (*other.path, *other_rel)
            same = other is entry
            out.append(Conflict(
                later=entry.doc.error(here, f"port {port} on node '{node}' is already claimed "
                                      f"by {'this replica' if same else repr_replica(other)} "
                                      f"as its {other_what} port at {_where(other.doc, there)}"
                                      f"{_default_note(entry.doc, here, port)}"),
                earlier=other.doc.error(there, f"port {port} on node '{node}' is also claimed "
                                        f"by {'this replica' if same else repr_replica(entry)} "
                                        f"as its {what} port at {_where(entry.doc, here)}"
                                        f"{_default_note(other.doc, there, port)}")))
    return out


def repr_replica(entry: Placed) -> str:
    return f"replica '{entry.replica.name}'"


def _default_note(doc: Document, path: KeyPath, port: int) -> str:
    return "" if doc.has(path) else f" ({path[-1]} defaults to {port} for this engine; set it)"
