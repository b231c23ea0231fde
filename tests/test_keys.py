"""The key rows (spec/keys.py): every key's rule is written once, in its row. A default
is what its own parser would read from the spec, each row reads the way its table says,
and the docs show what the rows hold."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest

from llmgw_systemd.errors import SpecError
from llmgw_systemd.spec.common_keys import COMMON_KEYS, NODE_KEYS
from llmgw_systemd.spec.document import Document
from llmgw_systemd.spec.engines.command import COMMAND_KEYS
from llmgw_systemd.spec.engines.table import ENGINES
from llmgw_systemd.spec.keys import REQUIRED, Key, integer, shown_mapping
from llmgw_systemd.spec.model import Replica
from llmgw_systemd.spec.policies import (
    DRAIN_KEYS,
    GENERATION_KEYS,
    GROUP_RESTART_KEYS,
    HEALTH_KEYS,
    RESTART_KEYS,
    DrainPolicy,
    GenerationCheck,
    GroupRestartPolicy,
    HealthCheck,
    RestartPolicy,
    read_drain,
    read_group_restart,
    read_health,
    read_restart,
)
from llmgw_systemd.spec.reader import Reader

TABLES: dict[str, tuple[Key[Any], ...]] = {
    "common": COMMON_KEYS, "node": NODE_KEYS, "command": COMMAND_KEYS,
    "restart": RESTART_KEYS, "group_restart": GROUP_RESTART_KEYS, "health": HEALTH_KEYS,
    "generation": GENERATION_KEYS, "drain": DRAIN_KEYS,
    **{f"engine {name}": entry.keys for name, entry in ENGINES.items()},
}
ROWS = [(table, row) for table, rows in TABLES.items() for row in rows]


class Refused(Exception):
    pass


def _refuse(path: Any, message: str, at_key: bool) -> Exception:
    return Refused(f"{path}: {message}")


READER = Reader(_refuse)


def _as_spec(value: Any) -> Any:
    """A default as a spec would spell it (tuples are YAML lists)."""
    return list(value) if isinstance(value, tuple) else value


# rows whose default is a plain value a spec could spell (not required, none, or a policy)
PLAIN = [(t, r) for t, r in ROWS if not r.required and r.default not in (None, ())
         and not isinstance(r.default, (RestartPolicy, GroupRestartPolicy, HealthCheck,
                                        DrainPolicy))]


@pytest.mark.parametrize(("table", "row"), PLAIN, ids=[f"{t}.{r.name}" for t, r in PLAIN])
def test_a_plain_default_is_what_its_own_parser_reads(table: str, row: Key[Any]) -> None:
    """A default outside its own bounds could never be written in a spec: the row says
    one thing, the parser another."""
    assert row.parse(READER, _as_spec(row.default), ("k",)) == row.default


@pytest.mark.parametrize(("table", "row"), ROWS, ids=[f"{t}.{r.name}" for t, r in ROWS])
def test_every_row_says_what_it_is(table: str, row: Key[Any]) -> None:
    assert row.meaning and row.shown_default()
    assert len({r.name for r in TABLES[table]}) == len(TABLES[table])


@pytest.mark.parametrize(("read", "keys", "default"), [
    (read_restart, RESTART_KEYS, RestartPolicy()),
    (read_group_restart, GROUP_RESTART_KEYS, GroupRestartPolicy()),
    (read_health, HEALTH_KEYS, HealthCheck()),
    (read_drain, DRAIN_KEYS, DrainPolicy()),
])
def test_a_policy_given_empty_is_its_rows_defaults(read: Any, keys: tuple[Key[Any], ...],
                                                    default: Any) -> None:
    assert read(READER, {}, ("p",)) == default
    assert {k.name: getattr(default, k.name) for k in keys} == {k.name: k.default
                                                                for k in keys}


def test_the_shown_defaults_come_from_the_rows() -> None:
    assert shown_mapping(RESTART_KEYS) == "`{delay: 10, burst: 5, interval: 1200}`"
    assert shown_mapping(HEALTH_KEYS) == ("`{path: /health, interval: 5, timeout: 2, "
                                          "timeouts: 3, stability: 30, stall_after: 120}`")
    assert GenerationCheck() == GenerationCheck(*(k.default for k in GENERATION_KEYS))


ROW = Key("k", integer(1, 9, "a digit"), 5, "a test key")
REQUIRED_ROW = Key("k", integer(1, 9, "a digit"), REQUIRED, "a test key", missing="say k")
NULLABLE_ROW = Key("k", integer(1, 9, "a digit"), 5, "a test key", null=None)


@pytest.mark.parametrize(("row", "data", "expected"), [
    (ROW, {}, 5), (ROW, {"k": None}, 5), (ROW, {"k": 7}, 7),
    (ROW, {"k": 10}, "('m', 'k'): expected a digit from 1 to 9; got 10"),
    (ROW, {"k": "7"}, "('m', 'k'): expected a digit (an integer from 1 to 9); got a string "
     "('7')"),
    (REQUIRED_ROW, {}, "('m',): missing required key 'k' (say k)"),
    (REQUIRED_ROW, {"k": None}, "('m', 'k'): expected a digit (an integer from 1 to 9); got "
     "nothing (null)"),
    (NULLABLE_ROW, {}, 5), (NULLABLE_ROW, {"k": None}, None),
])
def test_a_row_reads(row: Key[Any], data: dict[str, Any], expected: Any) -> None:
    if isinstance(expected, str):
        with pytest.raises(Refused) as caught:
            row.read(READER, data, ("m",))
        assert str(caught.value) == expected
    else:
        assert row.read(READER, data, ("m",)) == expected


def test_a_document_reader_names_the_file_and_line() -> None:
    from llmgw_systemd.spec.document import parse
    from llmgw_systemd.spec.reader import DocumentReader

    doc: Document = parse(b"m:\n  k: 10\n", "/etc/llmgw/replicas.d/x.yaml")
    with pytest.raises(SpecError) as caught:
        ROW.read(DocumentReader(doc), doc.data["m"], ("m",))
    assert str(caught.value) == ("/etc/llmgw/replicas.d/x.yaml:2: m.k: expected a digit "
                                 "from 1 to 9; got 10")


def test_every_common_key_row_is_a_replica_field() -> None:
    """A Replica is built from the common key rows by name (spec/replicas.py): a row
    without its field, or a field without its row, is caught here, not by a user."""
    built_elsewhere = {"source"}  # the file the replica came from, not a key
    assert {k.name for k in COMMON_KEYS} == {f.name for f in fields(Replica)} - built_elsewhere
