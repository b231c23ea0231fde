"""YAML bytes -> plain Python data plus the line of every key and value (pure).

PyYAML's loaders drop line numbers and silently keep the last of duplicate keys; we
compose the node tree instead (with libyaml when present: it is ~10x faster) and
convert it ourselves so every error can name its line and key path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import yaml

from llmgw_systemd.errors import SpecError
from llmgw_systemd.spec.control_chars import describe_char, find_control_char

KeyPath = tuple[Union[str, int], ...]
_STR_TAG = "tag:yaml.org,2002:str"
_BaseLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when built with it
# First characters for which YAML 1.1 has an implicit type (int, bool, null, float, ...);
# a plain scalar starting with anything else is a string.
_TYPED_FIRST_CHARS = frozenset(_BaseLoader.yaml_implicit_resolvers)


class _Loader(_BaseLoader):  # type: ignore[misc]
    def resolve(self, kind: Any, value: Any, implicit: Any) -> Any:
        # Called from libyaml for every scalar: skip the regex walk for the common case
        # (names, paths, flags). Same answer as SafeResolver.resolve by construction.
        if (kind is yaml.ScalarNode and implicit[0] and value
                and value[0] not in _TYPED_FIRST_CHARS and None not in _TYPED_FIRST_CHARS):
            return _STR_TAG
        return super().resolve(kind, value, implicit)


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
    """One parsed spec file: its data, and its YAML node tree to find lines in.

    Lines are looked up only when an error is reported, so the common path pays
    nothing for them."""

    file: str
    data: Any
    root: Any  # yaml.Node

    def _walk(self, path: KeyPath) -> tuple[Any, Any, bool]:
        """(deepest node found along path, key node of its last step, whole path found)."""
        node, key_node = self.root, None
        for part in path:
            if isinstance(node, yaml.MappingNode):
                match = [(k, v) for k, v in node.value if k.value == part]
                if not match:
                    return node, None, False
                key_node, node = match[-1]
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and (
                    0 <= part < len(node.value)):
                key_node, node = None, node.value[part]
            else:
                return node, None, False
        return node, key_node, True

    def has(self, path: KeyPath) -> bool:
        """Whether the file spells out this key path (rather than leaving a default)."""
        return self._walk(path)[2]

    def line_of(self, path: KeyPath) -> int:
        """Line of the value at path, else of its nearest ancestor."""
        return int(self._walk(path)[0].start_mark.line) + 1

    def key_line(self, path: KeyPath) -> int:
        """Line of the key that ends path (for 'unknown key'), else of the value."""
        node, key_node, _ = self._walk(path)
        return int((key_node or node).start_mark.line) + 1

    def error(self, path: KeyPath, message: str, *, at_key: bool = False) -> SpecError:
        line = self.key_line(path) if at_key else self.line_of(path)
        return SpecError(self.file, line, format_path(path), message)


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
        data = _Converter(loader, file).convert(node, ())
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        what = " ".join(str(p) for p in (exc.context, exc.problem) if p)
        raise SpecError(file, line, "", f"YAML syntax error: {what}") from None
    except yaml.YAMLError as exc:
        raise SpecError(file, None, "", f"YAML error: {exc}") from None
    finally:
        loader.dispose()
    return Document(file, data, node)


class _Converter:
    def __init__(self, loader: Any, file: str) -> None:
        self.loader = loader
        self.file = file

    def _fail(self, line: int, path: KeyPath, message: str) -> SpecError:
        return SpecError(self.file, line, format_path(path), message)

    def convert(self, node: Any, path: KeyPath) -> Any:
        if isinstance(node, yaml.MappingNode):
            self.loader.flatten_mapping(node)  # resolves '<<' merge keys
            result: dict[str, Any] = {}
            key_lines: dict[str, int] = {}
            for key_node, value_node in node.value:
                key_line = key_node.start_mark.line + 1
                if not isinstance(key_node, yaml.ScalarNode):
                    raise self._fail(key_line, path, "a key must be a plain string")
                key = (key_node.value if key_node.tag == _STR_TAG
                       else self.loader.construct_object(key_node))
                if not isinstance(key, str):
                    raise self._fail(key_line, path, f"key {key!r} must be a string")
                child = (*path, key)
                if key in result:
                    raise self._fail(key_line, child, "duplicate key (first set on line "
                                     f"{key_lines[key]})")
                self._check_text(key, key_node, child)
                key_lines[key] = key_line
                result[key] = self.convert(value_node, child)
            return result
        if isinstance(node, yaml.SequenceNode):
            return [self.convert(item, (*path, i)) for i, item in enumerate(node.value)]
        # Plain strings are most of a spec: take them as they are; let PyYAML construct
        # the rest (ints, bools, nulls, floats in all their YAML spellings).
        value = node.value if node.tag == _STR_TAG else self.loader.construct_object(node)
        if isinstance(value, str):
            self._check_text(value, node, path)
        return value

    def _check_text(self, text: str, node: Any, path: KeyPath) -> None:
        bad = find_control_char(text)
        if bad is None:
            return
        raise self._fail(
            node.start_mark.line + 1, path, f"contains {describe_char(bad)}; values that "
            "reach unit files must be single-line text without control characters")
