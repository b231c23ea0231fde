"""Typed reads of plain data (pure): parsed YAML from a spec file, or the JSON a peer
supervisor answered. Each read checks one value and fails with one error naming the key
path and what was expected; who the error is for is the caller's: a spec's error names
the file and line (DocumentReader), a peer's names the peer (gather/peer_client.py).
One reader, so a value is checked the same way whether an operator or a peer wrote it.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Sequence
from typing import Any, Callable, TypeVar

from llmgw_systemd.errors import SpecError
from llmgw_systemd.spec.document import Document, KeyPath
from llmgw_systemd.spec.endpoint import Endpoint, is_ip, parse_endpoint

C = TypeVar("C", bound=str)
# (key path, message, whether the error points at the key rather than its value)
Fail = Callable[[KeyPath, str, bool], Exception]
SHOWN_MAX = 80  # characters of a received string quoted in an error


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    import difflib  # only on the error path: it costs a few ms to import

    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


class Reader:
    """Typed reads, each failing through `fail` with the key path and what was expected."""

    def __init__(self, fail: Fail) -> None:
        self._fail = fail

    def fail(self, path: KeyPath, message: str, *, at_key: bool = False) -> Exception:
        return self._fail(path, message, at_key)

    def mapping(self, value: Any, path: KeyPath, allowed: Sequence[str],
                required: Sequence[str] = (), *, others: bool = False) -> dict[str, Any]:
        """A mapping with these keys. others=True lets keys beyond `allowed` pass (a
        newer peer's fields); a spec refuses them, naming the closest allowed key."""
        if not isinstance(value, dict):
            raise self.fail(path, f"expected a mapping with keys {', '.join(allowed)}; "
                            f"got {kind(value)}")
        if not others:
            for key in value:
                if key not in allowed:
                    raise self.fail((*path, key), f"unknown key '{key}'"
                                    f"{did_you_mean(key, allowed)} (allowed: "
                                    f"{', '.join(allowed)})", at_key=True)
        for key in required:
            if key not in value:
                raise self.fail(path, f"missing required key '{key}'")
        return value

    def sequence(self, value: Any, path: KeyPath, what: str, *, min_len: int = 0,
                 max_len: int | None = None) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(path, f"expected a list of {what}; got {kind(value)}")
        if len(value) < min_len:
            raise self.fail(path, f"expected at least {min_len} {what}; got {len(value)}")
        if max_len is not None and len(value) > max_len:
            raise self.fail(path, f"expected at most {max_len} {what}; got {len(value)}")
        return value

    def string(self, value: Any, path: KeyPath, what: str = "a string", *,
               empty: bool = False, max_len: int | None = None) -> str:
        if not isinstance(value, str):
            raise self.fail(path, f"expected {what}; got {kind(value)}")
        if not value and not empty:
            raise self.fail(path, f"expected {what}; got an empty string")
        if max_len is not None and len(value) > max_len:
            raise self.fail(path, f"expected {what} of at most {max_len} characters; got "
                            f"{len(value)}")
        return value

    def integer(self, value: Any, path: KeyPath, lo: int, hi: int, what: str) -> int:
        # bool is an int in Python, and true is not a number
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

    def choice(self, value: Any, path: KeyPath, choices: Sequence[C]) -> C:
        """One of `choices`, returned as the choice itself (a Literal stays a Literal)."""
        text = self.string(value, path, f"one of {', '.join(choices)}")
        for option in choices:
            if text == option:
                return option
        raise self.fail(path, f"expected one of {', '.join(choices)}; got {show(text)}"
                        f"{did_you_mean(text, choices)}")

    def matching(self, value: Any, path: KeyPath, test: re.Pattern[str] | Callable[[str], bool],
                 what: str, *, empty: bool = False) -> str:
        """A string that the pattern (or the test) accepts."""
        text = self.string(value, path, what, empty=empty)
        ok = bool(test.match(text)) if isinstance(test, re.Pattern) else test(text)
        if not ok:
            raise self.fail(path, f"expected {what}; got {show(text)}")
        return text

    def abs_path(self, value: Any, path: KeyPath, what: str) -> str:
        text = self.string(value, path, f"an absolute path to {what}")
        if not text.startswith("/"):
            raise self.fail(path, f"expected an absolute path to {what}; got {show(text)} "
                            "(systemd runs commands without a search path)")
        if posixpath.normpath(text) != text and text != "/":
            raise self.fail(path, f"expected a normalized absolute path to {what}; got "
                            f"{show(text)} (write '{posixpath.normpath(text)}')")
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

    def ip_address(self, value: Any, path: KeyPath, what: str) -> str:
        return self.matching(value, path, is_ip, what)


class DocumentReader(Reader):
    """Reads of one parsed spec file: its errors are SpecErrors with the file and line."""

    def __init__(self, doc: Document) -> None:
        super().__init__(lambda path, message, at_key: doc.error(path, message,
                                                                   at_key=at_key))
        self.doc = doc

    def fail(self, path: KeyPath, message: str, *, at_key: bool = False) -> SpecError:
        return self.doc.error(path, message, at_key=at_key)


def show(text: str) -> str:
    """A received string in an error, quoted, short and on one line (a peer's may be
    anything)."""
    clipped = text if len(text) <= SHOWN_MAX else f"{text[:SHOWN_MAX - 3]}..."
    return "'" + "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in clipped) + "'"


def kind(value: Any) -> str:
    """What a value is, for an error: 'a string ('x')', 'a number (5)', 'a list'."""
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"a string ({show(value)})"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__
