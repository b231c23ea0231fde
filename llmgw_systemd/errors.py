"""The one exception tree. Only entry points turn these into exit statuses."""

from __future__ import annotations

from typing import NoReturn


def unreachable(value: NoReturn) -> NoReturn:
    """The end of an exhaustive match over a closed vocabulary (a Literal type): mypy
    fails here if a value was left unhandled; at run time it never is."""
    raise AssertionError(f"unhandled value {value!r}")


class LlmgwError(Exception):
    """Base of every error raised on purpose; entry points exit 1 on it."""


class BadInput(LlmgwError):
    """Malformed spec, value or argument; entry points exit 2 on it."""


class SpecError(BadInput):
    """A spec value is wrong: names the file, line, key path and what was expected."""

    def __init__(self, file: str, line: int | None, path: str, message: str) -> None:
        self.file = file
        self.line = line
        self.path = path
        self.message = message
        super().__init__(self.render())

    def render(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


class NoShard(BadInput):
    """The node has no shard in the spec (the CLI says which option to pass)."""

    def __init__(self, node: str, known: list[str]) -> None:
        self.node, self.known = node, known
        super().__init__(f"node '{node}' is not in any replica (nodes in the spec: "
                         f"{', '.join(known) or 'none'})")


class UsageError(BadInput):
    """A command-line argument is wrong."""

    def __init__(self, option: str, message: str) -> None:
        self.option = option
        super().__init__(f"{option}: {message}")


class UnsafeValue(BadInput):
    """A value cannot be written into a unit file without changing its meaning."""


class InstallError(LlmgwError):
    """Writing or pruning the unit directory failed."""


class SystemctlError(LlmgwError):
    """A systemctl step of llmgw-render --apply failed; nothing after it was done."""
