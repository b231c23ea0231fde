"""Reading unit files back the way systemd does, for tests.

`read_unit` splits a unit into {"Section.Key": [values]}. `read_exec` and `read_env`
undo our quoting by systemd's documented rules (systemd.service(5) "Command lines",
systemd.syntax(7) quoting and C escapes, systemd.unit(5) specifiers): '%%' becomes '%'
for the whole line first, then words split on whitespace outside quotes with C escapes
resolved, then '$$' becomes '$' in every argument but the executable. The real
read-back, by running the unit under systemd, is in the integration tests.
"""

from __future__ import annotations

ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
           "\\": "\\", '"': '"', "'": "'", "s": " "}


def read_unit(text: str) -> dict[str, list[str]]:
    entries: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {raw!r}"
        assert not value.endswith("\\"), f"line continuation: {raw!r}"
        entries.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return entries


def split_words(line: str) -> list[str]:
    words: list[str] = []
    i, n = 0, len(line)
    while i < n:
        while i < n and line[i] in " \t":
            i += 1
        if i >= n:
            break
        word: list[str] = []
        quote = ""
        while i < n:
            ch = line[i]
            if ch == "\\":
                i += 1
                code = line[i]
                if code == "x":
                    word.append(chr(int(line[i + 1:i + 3], 16)))
                    i += 3
                    continue
                if code == "u":
                    word.append(chr(int(line[i + 1:i + 5], 16)))
                    i += 5
                    continue
                if code == "U":
                    word.append(chr(int(line[i + 1:i + 9], 16)))
                    i += 9
                    continue
                word.append(ESCAPES[code])
                i += 1
                continue
            if quote:
                if ch == quote:
                    quote = ""
                else:
                    word.append(ch)
            elif ch in "\"'":
                quote = ch
            elif ch in " \t":
                break
            else:
                word.append(ch)
            i += 1
        assert not quote, f"unterminated quote in {line!r}"
        words.append("".join(word))
    return words


def _collapse(text: str, sign: str) -> str:
    """One left-to-right pass: 'XX' -> 'X' for X = sign; a lone X would be expanded by
    systemd (a specifier, or a variable), so it means our escaping failed."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] == sign:
            assert text[i + 1:i + 2] == sign, f"unescaped {sign!r} in {text!r}"
            out.append(sign)
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def read_exec(value: str) -> list[str]:
    """An Exec*= value -> the argv the process receives."""
    words = split_words(_collapse(value, "%"))
    return [words[0], *(_collapse(w, "$") for w in words[1:])]


def read_env(value: str) -> tuple[str, str]:
    """An Environment= value (one assignment) -> (name, value); no '$' expansion there."""
    name, sep, rest = value.partition("=")
    if sep and rest.startswith("%d/") and '"' not in name:
        # the one specifier we write on purpose: the unit's credentials directory
        (word,) = split_words(_collapse(rest[2:], "%"))
        return name, "%d" + word
    (word,) = split_words(_collapse(value, "%"))
    name, _, val = word.partition("=")
    return name, val
