"""YAML bytes -> plain Python data plus the line of every key and value (pure).

PyYAML's loaders drop line numbers and silently keep the last of duplicate keys; we
compose the node tree instead (with libyaml when present: it is ~10x faster) and
convert it ourselves so every error can name its line and key path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import yaml

from .errors import SpecError

try:
    _Loader: Any = yaml.CSafeLoader
except AttributeError:  # pragma: no cover - PyYAML built without libyaml
    _Loader = yaml.SafeLoader

KeyPath = tuple[Union[str, int], ...]


def format_path(path: KeyPath) -> str:
    """('replicas', 0, 'nodes', 1, 'address') -> 'replicas[0].nodes[1].address'."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


@dataclass(frozen=True)
class Document:
    """One parsed spec file: its data and where each piece of it stands."""

    file: str
    data: Any
    value_lines: dict[KeyPath, int]
    key_lines: dict[KeyPath, int]

    def line_of(self, path: KeyPath) -> int | None:
        """Line of the value at path, else of its nearest ancestor."""
        while path not in self.value_lines and path:
            path = path[:-1]
        return self.value_lines.get(path)

    def error(self, path: KeyPath, message: str, *, at_key: bool = False) -> SpecError:
        line = self.key_lines.get(path) if at_key else None
        return SpecError(self.file, line or self.line_of(path), format_path(path), message)


def find_control_char(text: str) -> str | None:
    """The first character that must never reach a unit file, if any.

    C0/C1 controls (newline included) and the Unicode line separators can start new
    directives or corrupt a line; lone surrogates cannot be encoded as UTF-8.
    """
    for ch in text:
        code = ord(ch)
        if (code < 0x20 or 0x7F <= code <= 0x9F or 0xD800 <= code <= 0xDFFF
                or code in (0x2028, 0x2029)):
            return ch
    return None


def describe_char(ch: str) -> str:
    names = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", "\0": "a NUL byte"}
    return names.get(ch, f"the control character U+{ord(ch):04X}")


def decode(raw: bytes, file: str) -> str:
    """Strict UTF-8 (a BOM is allowed), with the line of the first bad byte on error."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise SpecError(
            file, line, "", f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset "
            f"{exc.start}); save the spec as UTF-8"
        ) from None
    return text


def parse(raw: bytes, file: str) -> Document:
    text = decode(raw, file)
    if not text.strip() or all(
        not ln.strip() or ln.lstrip().startswith("#") for ln in text.splitlines()
    ):
        raise SpecError(file, 1, "", "the file is empty; expected a mapping with a 'replicas' list")
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            raise SpecError(file, 1, "", "the file holds no document; expected a mapping with "
                            "a 'replicas' list")
        value_lines: dict[KeyPath, int] = {}
        key_lines: dict[KeyPath, int] = {}
        data = _Converter(loader, file, value_lines, key_lines).convert(node, ())
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        what = " ".join(str(p) for p in (exc.context, exc.problem) if p)
        raise SpecError(file, line, "", f"YAML syntax error: {what}") from None
    except yaml.YAMLError as exc:
        raise SpecError(file, None, "", f"YAML error: {exc}") from None
    finally:
        loader.dispose()
    return Document(file, data, value_lines, key_lines)


class _Converter:
    def __init__(
        self, loader: Any, file: str, value_lines: dict[KeyPath, int],
        key_lines: dict[KeyPath, int],
    ) -> None:
        self.loader = loader
        self.file = file
        self.value_lines = value_lines
        self.key_lines = key_lines

    def _fail(self, line: int, path: KeyPath, message: str) -> SpecError:
        return SpecError(self.file, line, format_path(path), message)

    def convert(self, node: Any, path: KeyPath) -> Any:
        line = node.start_mark.line + 1
        self.value_lines[path] = line
        if isinstance(node, yaml.MappingNode):
            self.loader.flatten_mapping(node)  # resolves '<<' merge keys
            result: dict[str, Any] = {}
            for key_node, value_node in node.value:
                key_line = key_node.start_mark.line + 1
                if not isinstance(key_node, yaml.ScalarNode):
                    raise self._fail(key_line, path, "a key must be a plain string")
                key = self.loader.construct_object(key_node)
                if not isinstance(key, str):
                    raise self._fail(key_line, path, f"key {key!r} must be a string")
                child = (*path, key)
                if key in result:
                    raise self._fail(
                        key_line, child, f"duplicate key (first set on line "
                        f"{self.key_lines[child]})")
                self._check_text(key, key_line, child)
                self.key_lines[child] = key_line
                result[key] = self.convert(value_node, child)
            return result
        if isinstance(node, yaml.SequenceNode):
            return [self.convert(item, (*path, i)) for i, item in enumerate(node.value)]
        value = self.loader.construct_object(node)
        if isinstance(value, str):
            self._check_text(value, line, path)
        return value

    def _check_text(self, text: str, line: int, path: KeyPath) -> None:
        bad = find_control_char(text)
        if bad is not None:
            raise self._fail(
                line, path, f"contains {describe_char(bad)}; values that reach unit files "
                "must be single-line text without control characters")
