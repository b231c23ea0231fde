"""Typed reads from one parsed spec document (pure): each read fails with one SpecError
naming the file, the line, the key path and what was expected. The spec's common keys
(spec/replicas.py) and every engine module (spec/engines/) read their keys through this."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping, Sequence
from typing import Any, Callable, TypeVar

from llmgw_systemd.errors import SpecError
from llmgw_systemd.spec.document import Document, KeyPath
from llmgw_systemd.spec.endpoint import Endpoint, is_ip, parse_endpoint

T = TypeVar("T")

# Names that become part of unit names: replicas, commands.
NAME_RE = re.compile(r"[a-z0-9][a-z0-9-]*\Z")


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    import difflib  # only on the error path: it costs a few ms to import

    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


class Checker:
    """Typed reads from one document, each failing with file, line and key path."""

    def __init__(self, doc: Document) -> None:
        self.doc = doc

    def fail(self, path: KeyPath, message: str, *, at_key: bool = False) -> SpecError:
        return self.doc.error(path, message, at_key=at_key)

    def mapping(self, value: Any, path: KeyPath, allowed: Sequence[str],
                required: Sequence[str] = ()) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(path, f"expected a mapping with keys {', '.join(allowed)}; "
                            f"got {kind(value)}")
        for key in value:
            if key not in allowed:
                raise self.fail((*path, key), f"unknown key '{key}'"
                                f"{did_you_mean(key, allowed)} (allowed: {', '.join(allowed)})",
                                at_key=True)
        for key in required:
            if key not in value:
                raise self.fail(path, f"missing required key '{key}'")
        return value

    def sequence(self, value: Any, path: KeyPath, what: str, *, min_len: int = 0) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(path, f"expected a list of {what}; got {kind(value)}")
        if len(value) < min_len:
            raise self.fail(path, f"expected at least {min_len} {what}; got {len(value)}")
        return value

    def string(self, value: Any, path: KeyPath, what: str = "a string") -> str:
        if not isinstance(value, str):
            raise self.fail(path, f"expected {what}; got {kind(value)}")
        if not value:
            raise self.fail(path, f"expected {what}; got an empty string")
        return value

    def integer(self, value: Any, path: KeyPath, lo: int, hi: int, what: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(path, f"expected {what} (an integer from {lo} to {hi}); "
                            f"got {kind(value)}")
        if not lo <= value <= hi:
            raise self.fail(path, f"expected {what} from {lo} to {hi}; got {value}")
        return value

    def boolean(self, value: Any, path: KeyPath, what: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(path, f"expected {what} (true or false); got {kind(value)}")
        return value

    def port(self, value: Any, path: KeyPath) -> int:
        return self.integer(value, path, 1, 65535, "a TCP port")

    def choice(self, value: Any, path: KeyPath, choices: Sequence[str]) -> str:
        text = self.string(value, path, f"one of {', '.join(choices)}")
        if text not in choices:
            raise self.fail(path, f"expected one of {', '.join(choices)}; got '{text}'"
                            f"{did_you_mean(text, choices)}")
        return text

    def matching(self, value: Any, path: KeyPath, pattern: re.Pattern[str], what: str) -> str:
        text = self.string(value, path, what)
        if not pattern.match(text):
            raise self.fail(path, f"expected {what}; got '{text}'")
        return text

    def abs_path(self, value: Any, path: KeyPath, what: str) -> str:
        text = self.string(value, path, f"an absolute path to {what}")
        if not text.startswith("/"):
            raise self.fail(path, f"expected an absolute path to {what}; got '{text}' "
                            "(systemd runs commands without a search path)")
        if posixpath.normpath(text) != text and text != "/":
            raise self.fail(path, f"expected a normalized absolute path to {what}; got '{text}' "
                            f"(write '{posixpath.normpath(text)}')")
        if text.endswith("\\"):
            raise self.fail(path, f"expected a path to {what}; a trailing backslash would "
                            "continue the unit file line")
        return text

    def str_list(self, value: Any, path: KeyPath, what: str) -> tuple[str, ...]:
        items = self.sequence(value, path, what)
        out = []
        for i, item in enumerate(items):
            if isinstance(item, bool) or not isinstance(item, (str, int, float)):
                raise self.fail((*path, i), f"expected a string; got {kind(item)}")
            out.append(item if isinstance(item, str) else str(item))
        return tuple(out)

    def endpoint(self, value: Any, path: KeyPath) -> Endpoint:
        text = self.string(value, path, "an address HOST:PORT")
        parsed = parse_endpoint(text)
        if isinstance(parsed, str):
            raise self.fail(path, parsed)
        return parsed

    def optional(self, mapping: Mapping[str, Any], key: str, path: KeyPath,
                 read: Callable[[Any, KeyPath], T], default: T) -> T:
        if key not in mapping or mapping[key] is None:
            return default
        return read(mapping[key], (*path, key))

    def optional_int(self, mapping: Mapping[str, Any], key: str, path: KeyPath, lo: int, hi: int,
                     what: str, default: int) -> int:
        return self.optional(mapping, key, path,
                             lambda v, p: self.integer(v, p, lo, hi, what), default)


def kind(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"a string ('{value}')"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def ip_address(check: Checker, value: Any, path: KeyPath, what: str) -> str:
    text = check.string(value, path, what)
    if not is_ip(text):
        raise check.fail(path, f"expected {what}; got '{text}'")
    return text
