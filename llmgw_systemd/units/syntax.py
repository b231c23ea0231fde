"""Writing values into unit files so systemd reads back exactly what we meant (pure).

Measured on systemd 252 (docs/design.md §4): an Exec argument quoted as a JSON string
(non-ASCII kept as is) with every '%' and '$' doubled round-trips quotes, backslashes,
';', '100%', '$HOME' and emoji. Control characters are rejected outright: a raw
newline would start a new directive, and no escape of ours is worth the risk.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable

from llmgw_systemd.errors import UnsafeValue
from llmgw_systemd.spec.control_chars import describe_char, find_control_char


def _check(text: str, what: str) -> None:
    bad = find_control_char(text)
    if bad is not None:
        raise UnsafeValue(f"{what} {text!r} contains {describe_char(bad)}")


# Words made only of these characters mean the same to systemd bare as quoted; bare
# words keep `systemctl cat` readable. Everything else is quoted.
BARE_WORD_RE = re.compile(r"[A-Za-z0-9_@%+=:,./-]+\Z")


def _quote(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _word(text: str) -> str:
    return text if BARE_WORD_RE.match(text) else _quote(text)


@functools.lru_cache(maxsize=4096)  # flags and values repeat across units
def exec_word(arg: str) -> str:
    """One argument of an Exec*= line."""
    _check(arg, "argument")
    return _word(arg).replace("%", "%%").replace("$", "$$")


def exec_line(argv: Iterable[str]) -> str:
    """A whole Exec*= command. The executable is never $-expanded by systemd, so a '$'
    in it could not be written faithfully and is refused."""
    words = list(argv)
    if not words or not words[0].startswith("/"):
        raise UnsafeValue(f"executable {words[0] if words else ''!r} is not an absolute path")
    if "$" in words[0]:
        raise UnsafeValue(f"executable {words[0]!r} contains '$'")
    _check(words[0], "executable")
    first = _word(words[0]).replace("%", "%%")
    return " ".join([first, *(exec_word(arg) for arg in words[1:])])


def env_assignment(name: str, value: str) -> str:
    """The value of one Environment= line: quoted; '%' doubled, '$' is not expanded there."""
    _check(name, "environment name")
    _check(value, f"value of {name}")
    return _word(f"{name}={value}").replace("%", "%%")


def plain_value(text: str) -> str:
    """A free-form value (Description=, a path): specifiers escaped, one line only."""
    _check(text, "value")
    if text.endswith("\\"):
        raise UnsafeValue(f"value {text!r} ends in a backslash, which continues the line")
    return text.replace("%", "%%")


def comment(text: str) -> str:
    """Text for a '#' comment line; JSON-quoted when it holds anything unusual."""
    if find_control_char(text) is None:
        return text
    return json.dumps(text)
