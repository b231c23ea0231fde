"""Characters no spec value may carry, because no unit file may hold them (pure): the one
rule both the spec reader (spec/document.py, which refuses them early, with their line) and the
unit writer (units/syntax.py, the last check before a unit file) apply."""

from __future__ import annotations

import re

# C0/C1 controls (newline included) and the Unicode line separators can start new
# directives or corrupt a line; lone surrogates cannot be encoded as UTF-8.
_FORBIDDEN_RE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\u2028\u2029]")


def find_control_char(text: str) -> str | None:
    """The first character that must never reach a unit file, if any."""
    match = _FORBIDDEN_RE.search(text)
    return match.group() if match else None


def describe_char(ch: str) -> str:
    names = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", "\0": "a NUL byte"}
    return names.get(ch, f"the control character U+{ord(ch):04X}")
