"""Rendered texts -> the unit directory: atomic, idempotent, and pruning only our files.

Everything is rendered and checked before this runs. Writes go to temporary files in
the same directory first; only when all of them are on disk are they renamed into
place, so a failure (disk full, permissions) leaves the directory as it was.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from llmgw_systemd.errors import InstallError
from llmgw_systemd.units.header import is_ours

OUR_NAME_RE = re.compile(r"llmgw-[A-Za-z0-9:_.-]+\.(service|target)\Z")
TEMP_SUFFIX = ".llmgw-tmp"
Action = Literal["create", "update", "remove", "keep"]
CREATE: Action = "create"
UPDATE: Action = "update"
REMOVE: Action = "remove"
KEEP: Action = "keep"


@dataclass(frozen=True)
class Change:
    """One file's fate: created, updated, removed or kept, with old and new text."""

    name: str
    action: Action
    old: str | None
    new: str | None


@dataclass(frozen=True)
class Survey:
    """What writing the units would change in the directory, and what it leaves alone."""

    changes: tuple[Change, ...]
    notes: tuple[str, ...]  # things left alone on purpose, for the user to know

    def count(self, action: Action) -> int:
        return sum(1 for c in self.changes if c.action == action)

    @property
    def dirty(self) -> bool:
        return any(c.action != KEEP for c in self.changes)


def survey(directory: str, rendered: Mapping[str, str]) -> Survey:
    """Compare what is in the directory with what should be; reads, never writes."""
    changes: list[Change] = []
    notes: list[str] = []
    try:
        present = sorted(os.listdir(directory))
    except FileNotFoundError:
        present = []
    except OSError as exc:
        raise InstallError(f"cannot read {directory}: {exc.strerror}") from None
    present_set = set(present)
    for name in sorted(rendered):
        path = os.path.join(directory, name)
        new = rendered[name]
        if name not in present_set:
            changes.append(Change(name, CREATE, None, new))
            continue
        if os.path.islink(path):
            if os.path.realpath(path) == "/dev/null":
                notes.append(f"{name} is masked (a link to /dev/null); left as it is")
                continue
            raise InstallError(f"{path} is a symbolic link not written by llmgw-render; "
                               "move it away or rename the replica")
        old = _read(path)
        if not is_ours(old[:4096]):
            raise InstallError(f"{path} exists and was not written by llmgw-render (it lacks "
                               "our marker); move it away or rename the replica")
        changes.append(Change(name, KEEP if old == new else UPDATE, old, new))
    for name in present:
        if name in rendered or not OUR_NAME_RE.match(name):
            continue
        path = os.path.join(directory, name)
        if os.path.islink(path) or not os.path.isfile(path):
            continue
        old = _read(path, limit=4096)
        if is_ours(old):
            changes.append(Change(name, REMOVE, _read(path), None))
    return Survey(tuple(changes), tuple(notes))


def _read(path: str, limit: int = -1) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(limit)
    except OSError as exc:
        raise InstallError(f"cannot read {path}: {exc.strerror}") from None
    return data.decode("utf-8", errors="replace") if limit > 0 else data.decode(
        "utf-8", errors="surrogateescape")


def apply(directory: str, changes: Sequence[Change]) -> None:
    """Carry out the survey's changes: all the writes land, or none does."""
    if not any(c.action != KEEP for c in changes):
        return
    with locked(directory):
        apply_locked(directory, changes)


@contextlib.contextmanager
def locked(directory: str) -> Iterator[None]:
    """The directory, created if need be and locked: a second llmgw-render on it waits."""
    try:
        os.makedirs(directory, mode=0o755, exist_ok=True)
    except OSError as exc:
        raise InstallError(f"cannot create {directory}: {exc.strerror}") from None
    lock = _lock(directory)
    try:
        yield
    finally:
        os.close(lock)


def apply_locked(directory: str, changes: Sequence[Change]) -> None:
    """apply(), inside locked(directory)."""
    writes = [c for c in changes if c.action in (CREATE, UPDATE)]
    removals = [c for c in changes if c.action == REMOVE]
    if writes or removals:
        _apply_locked(directory, writes, removals)


def _lock(directory: str) -> int:
    import fcntl

    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _apply_locked(directory: str, writes: Sequence[Change], removals: Sequence[Change]) -> None:
    staged: list[tuple[str, str]] = []
    try:
        for change in writes:
            assert change.new is not None  # noqa: S101 - CREATE and UPDATE carry text
            staged.append((_stage(directory, change.name, change.new),
                           os.path.join(directory, change.name)))
        # Durable before the renames, so a crash never leaves an empty unit behind; one
        # sync for all files costs a fraction of one fsync per file.
        if staged:
            os.sync()
    except OSError as exc:
        for temp, _ in staged:
            _unlink_quietly(temp)
        raise InstallError(f"cannot write into {directory}: {exc.strerror}; nothing was "
                           "changed") from None
    try:
        for temp, final in staged:
            os.replace(temp, final)
        for change in removals:
            os.unlink(os.path.join(directory, change.name))
        _fsync_dir(directory)
    except OSError as exc:
        for temp, _ in staged:
            _unlink_quietly(temp)
        raise InstallError(f"updating {directory} failed part way: {exc}") from None


def _stage(directory: str, name: str, text: str) -> str:
    """Write text to a temporary file beside its final name; return the temp path."""
    temp = os.path.join(directory, f".{name}{TEMP_SUFFIX}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(temp, flags, 0o644)
    except FileExistsError:  # left by a run that crashed: it was never a unit, drop it
        os.unlink(temp)
        fd = os.open(temp, flags, 0o644)
    try:
        os.fchmod(fd, 0o644)  # whatever the umask
        view = memoryview(text.encode("utf-8"))
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        os.close(fd)
        _unlink_quietly(temp)
        raise
    os.close(fd)
    return temp


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def unified_diff(changes: Sequence[Change], directory: str) -> str:
    """What apply() would do, as a unified diff (for --dry-run)."""
    import difflib  # only for --dry-run: it costs a few ms to import

    out: list[str] = []
    for change in changes:
        if change.action == KEEP:
            continue
        path = os.path.join(directory, change.name)
        old = (change.old or "").splitlines(keepends=True)
        new = (change.new or "").splitlines(keepends=True)
        out.extend(difflib.unified_diff(
            old, new,
            fromfile="/dev/null" if change.action == CREATE else path,
            tofile="/dev/null" if change.action == REMOVE else path))
    return "".join(out)

