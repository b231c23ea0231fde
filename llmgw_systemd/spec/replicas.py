"""Parsed spec documents -> the validated Spec (pure).

Every check raises one SpecError naming file, line, key path and what was expected.
Files and replicas are checked in document order, so the first bad replica a user sees
is the first in the file. Within a replica: its name, its engine, which keys it may
have, its nodes, then its engine's own keys (read by the engine's entry in spec/engines/),
then the rest of the keys every engine has (spec/common_keys.py). Every key is read
through its row (spec/keys.py); the checks here are the ones that span keys.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llmgw_systemd.errors import SpecError
from llmgw_systemd.spec import common_keys as keys
from llmgw_systemd.spec.conflicts import Placed, conflicts, name_conflicts
from llmgw_systemd.spec.document import Document, KeyPath
from llmgw_systemd.spec.engines.base import EngineEntry
from llmgw_systemd.spec.engines.table import ENGINES
from llmgw_systemd.spec.model import Replica, Spec
from llmgw_systemd.spec.policies import STOP_MARGIN
from llmgw_systemd.spec.reader import DocumentReader

# (every key some engine allows, the common ones first; engine -> the keys it allows)
KeyTable = tuple[tuple[str, ...], dict[str, frozenset[str]]]
REQUIRED_KEYS = tuple(k.name for k in keys.COMMON_KEYS if k.required)


def replica_keys() -> KeyTable:
    """The keys, from the engine table as it is now (so the table is the only place an
    engine's keys are listed); worked out once per document, not per replica."""
    own = {name: frozenset(keys.COMMON_KEY_NAMES + e.key_names) for name, e in ENGINES.items()}
    every = tuple(dict.fromkeys(
        keys.COMMON_KEY_NAMES + tuple(n for e in ENGINES.values() for n in e.key_names)))
    return every, own


def build_spec(documents: Sequence[Document]) -> Spec:
    """Every replica of every document, or the first error (in document order)."""
    placed = _read_documents(documents)
    found = conflicts(placed)
    if found:
        raise found[0].later
    return Spec(tuple(p.replica for p in placed))


def collect_spec(documents: Sequence[Document | SpecError]) -> tuple[Spec, tuple[SpecError, ...]]:
    """Each file on its own, for readers that must not stop for one bad file (the
    generator, the supervisor): a file with an error loses its replicas and reports its
    first error; two files that conflict both lose theirs, with an error at each naming
    both places. The other files' replicas are kept. A file that could not be read or
    parsed comes in as its SpecError."""
    errors: dict[str, list[SpecError]] = {}
    good: list[list[Placed]] = []
    for doc in documents:
        if isinstance(doc, SpecError):
            errors.setdefault(doc.file, []).append(doc)
            continue
        try:
            placed = _read_documents([doc])
            found = conflicts(placed)
            if found:
                raise found[0].later
        except SpecError as exc:
            errors.setdefault(doc.file, []).append(exc)
            continue
        good.append(placed)
    for conflict in conflicts([p for placed in good for p in placed]):
        for error in (conflict.later, conflict.earlier):
            errors.setdefault(error.file, []).append(error)
    replicas = tuple(p.replica for placed in good for p in placed
                     if p.doc.file not in errors)
    ordered = tuple(e for doc in documents for e in errors.pop(doc.file, []))
    return Spec(replicas), ordered


def keep_last_good(spec: Spec, errors: Sequence[SpecError], previous: Spec | None) -> Spec:
    """collect_spec's result for a reader that already runs (the supervisor): a file that
    turned bad keeps the replicas it had in the previous spec, so an edit with a typo
    never makes a running replica vanish; a file that is gone takes its replicas along."""
    if previous is None or not errors:
        return spec
    bad = {e.file for e in errors}
    names = {r.name for r in spec.replicas}
    kept = tuple(r for r in previous.replicas if r.source in bad and r.name not in names)
    return Spec(spec.replicas + kept)


def _read_documents(documents: Sequence[Document]) -> list[Placed]:
    placed: list[Placed] = []
    names: set[str] = set()
    for doc in documents:
        reader = DocumentReader(doc)
        top = reader.mapping(doc.data, (), ("replicas",), ("replicas",))
        items = reader.sequence(top["replicas"], ("replicas",), "replicas")
        table = replica_keys()
        for index, item in enumerate(items):
            path: KeyPath = ("replicas", index)
            entry = Placed(_replica(reader, item, path, table), doc, path)
            placed.append(entry)
            if entry.replica.name in names:  # reported here, before later files' errors
                raise name_conflicts(placed)[0].later
            names.add(entry.replica.name)
    return placed


def _replica(reader: DocumentReader, raw: Any, path: KeyPath, table: KeyTable) -> Replica:
    every, allowed_by_engine = table
    data = reader.mapping(raw, path, every, REQUIRED_KEYS)
    name = keys.NAME.read(reader, data, path)
    entry = ENGINES[keys.ENGINE.read(reader, data, path)]
    _refuse_other_engines_keys(reader, data, path, entry, allowed_by_engine[entry.name])
    nodes = keys.NODES.read(reader, data, path)
    engine = entry.read(reader, data, path, nodes)
    # every other common key by its row, into the Replica field of the same name: a new
    # common key is its row in COMMON_KEYS and its field in Replica
    common: dict[str, Any] = {"name": name, "nodes": nodes, "engine": engine}
    for key in keys.COMMON_KEYS:
        if key.name not in common:
            common[key.name] = key.read(reader, data, path)

    stop_timeout, drain = common["stop_timeout"], common["drain"]
    least = engine.least_stop_timeout()
    if stop_timeout is None:  # the whole planned stop, computed (DrainPolicy.stop_budget)
        stop_timeout = common["stop_timeout"] = max(drain.stop_budget,
                                                     least[0] if least else 0)
    if least is not None and stop_timeout < least[0]:
        where = (*path, "stop_timeout") if "stop_timeout" in data else path
        raise reader.fail(where, f"stop_timeout ({stop_timeout} s) must be at least "
                          f"{least[1]}; set stop_timeout")
    if stop_timeout < drain.least_stop_timeout:
        where = (*path, "stop_timeout") if "stop_timeout" in data else (*path, "drain")
        raise reader.fail(where, f"stop_timeout ({stop_timeout} s) must be at least "
                          f"drain.delay + drain.timeout + {STOP_MARGIN} s "
                          f"({drain.delay} + {drain.timeout} + {STOP_MARGIN} = "
                          f"{drain.least_stop_timeout} s), or systemd kills the engine "
                          "while it drains; raise stop_timeout or shorten drain")
    gpus = common["gpus"]
    # What the units set themselves, and from which key: the spec's env may not set it.
    # A node's own env may set CUDA_VISIBLE_DEVICES (that node's GPUs differ).
    by_engine = engine.reserved_env()
    by_interface = dict.fromkeys(keys.IFNAME_VARS, "the nodes' interface")
    for rank, node in enumerate(nodes):
        own = {**by_engine, **(by_interface if node.interface is not None else {})}
        for key_name, _ in node.env:
            _refuse_reserved(reader, (*path, "nodes", rank, "env", key_name), key_name, own)
    reserved = {**by_engine, **(by_interface if any(n.interface for n in nodes) else {}),
                **({keys.GPUS_VAR: "gpus"} if gpus else {})}
    for key_name, _ in common["env"]:
        _refuse_reserved(reader, (*path, "env", key_name), key_name, reserved)
    return Replica(**common, source=reader.doc.file)


def _refuse_other_engines_keys(reader: DocumentReader, data: Mapping[str, Any], path: KeyPath,
                               entry: EngineEntry, allowed: frozenset[str]) -> None:
    """A key of another engine's table, named with the engines it belongs to."""
    for key in data:
        if key in allowed:
            continue
        users = " and ".join(e.name for e in ENGINES.values() if key in e.key_names)
        raise reader.fail((*path, key), f"'{key}' is not used by engine '{entry.name}' (it "
                          f"applies to engine {users})", at_key=True)


def _refuse_reserved(reader: DocumentReader, path: KeyPath, key: str,
                     reserved: Mapping[str, str]) -> None:
    if key in reserved:
        raise reader.fail(path, f"'{key}' is set by llmgw-render from {reserved[key]}",
                          at_key=True)
