"""One spec key as one row (pure): its name, how its value is read (the parser, with its
bounds), its default, and what it means. The reader reads a key only through its row,
the README's key tables and the man pages are written from the rows
(scripts/manpages.py), and so a key's rule is written exactly once, as mkosi's settings
table does it (docs/design.md §2).

A parser is a function (reader, value, key path) -> the typed value; the factories here
make the common ones with their bounds: `integer(1, 86400, "a timeout in seconds")`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable, Generic, TypeVar

from llmgw_systemd.spec.document import KeyPath
from llmgw_systemd.spec.reader import Reader

T = TypeVar("T")
C = TypeVar("C", bound=str)
Parse = Callable[[Reader, Any, KeyPath], T]


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()  # a row's default when the key must be given


class Key(Generic[T]):
    """One spec key. `default` is what a spec that leaves the key out (or sets it to
    null) gets, REQUIRED when it must be given; `null` is what an explicit null means,
    when that differs from the default (serving_rank: null, no rank serves). `shown` is
    the default as the docs show it, when it is not simply the value."""

    __slots__ = ("default", "meaning", "missing", "name", "null", "parse", "shown")

    def __init__(self, name: str, parse: Parse[T], default: T, meaning: str, *,
                 shown: str | None = None, missing: str = "", null: Any = REQUIRED) -> None:
        self.name = name
        self.parse = parse
        self.default = default
        self.meaning = meaning
        self.shown = shown
        self.missing = missing  # why a required key is needed, for its error
        self.null = default if null is REQUIRED else null

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def read(self, reader: Reader, data: Mapping[str, Any], path: KeyPath) -> T:
        """The key's value in `data` (the mapping at `path`), checked; or its default."""
        if self.name not in data:
            if self.required:
                raise reader.fail(path, f"missing required key '{self.name}'"
                                  + (f" ({self.missing})" if self.missing else ""))
            return self.default
        value = data[self.name]
        if value is None and not self.required:
            return self.null
        return self.parse(reader, value, (*path, self.name))

    def shown_default(self) -> str:
        """The default as the README and the man pages show it."""
        if self.shown is not None:
            return self.shown
        return show_value(self.default)

    def __repr__(self) -> str:
        return f"Key({self.name!r}, default={self.default!r})"


def show_value(value: Any) -> str:
    """A default as the docs show it: 300, `false`, `/usr/local`, none."""
    if value is REQUIRED:
        return "required"
    if value is None or value == ():
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int):
        return str(value)
    return f"`{value}`"


def names(keys: Sequence[Key[Any]]) -> tuple[str, ...]:
    return tuple(k.name for k in keys)


def shown_mapping(keys: Sequence[Key[Any]]) -> str:
    """A policy's defaults as the docs show them: `{delay: 10, burst: 5}` (keys without a
    default of their own left out)."""
    fields = ", ".join(f"{k.name}: {_plain(k.default)}" for k in keys
                       if k.default is not None and k.default is not REQUIRED)
    return f"`{{{fields}}}`"


def _plain(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def read_all(reader: Reader, keys: Sequence[Key[Any]], value: Any, path: KeyPath
             ) -> dict[str, Any]:
    """A mapping of exactly these keys, each read by its row: {name: value}."""
    data = reader.mapping(value, path, names(keys))
    return {k.name: k.read(reader, data, path) for k in keys}


# -- parsers -------------------------------------------------------------------------------

def integer(lo: int, hi: int, what: str) -> Parse[int]:
    return lambda r, v, p: r.integer(v, p, lo, hi, what)


def seconds(lo: int, hi: int, what: str = "a timeout in seconds") -> Parse[int]:
    return integer(lo, hi, what)


def tcp_port(reader: Reader, value: Any, path: KeyPath) -> int:
    return reader.port(value, path)


def boolean(what: str) -> Parse[bool]:
    return lambda r, v, p: r.boolean(v, p, what)


def choice(choices: Sequence[C]) -> Parse[C]:
    return lambda r, v, p: r.choice(v, p, choices)


def string(what: str) -> Parse[str]:
    return lambda r, v, p: r.string(v, p, what)


def matching(test: Any, what: str) -> Parse[str]:
    return lambda r, v, p: r.matching(v, p, test, what)


def absolute_path(what: str) -> Parse[str]:
    return lambda r, v, p: r.abs_path(v, p, what)


def string_list(what: str) -> Parse[tuple[str, ...]]:
    return lambda r, v, p: r.str_list(v, p, what)


def ip_address(what: str) -> Parse[str]:
    return lambda r, v, p: r.ip_address(v, p, what)
