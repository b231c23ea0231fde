"""The supervisor's durable state (docs/supervisor.md, "State"):
- when it last restarted each replica's shard as part of a group restart: the budget
  and backoff depend on it, so neither a crash nor a restart of the supervisor may
  reset them;
- which spec version each engine start began with (health/versions.py): a daemon-reload
  changes what systemd says of a unit, never what its running process was started
  with, so a supervisor restarted in the middle of a roll must not forget it.
(The evidence a stopping supervisor leaves for the next, on the monotonic clock of one
boot, is saved_evidence.py's.)

Stored as JSON in the state directory (systemd's StateDirectory=), written atomically
(temporary file, fsync, rename, fsync of the directory). Times are wall-clock seconds,
the only clock that means something to the next process; the daemon converts them to
and from its monotonic clock.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Mapping

from llmgw_systemd.errors import StateError

FILE_NAME = "group-restarts.json"
FORMAT = 1
MAX_TIMES = 1000  # per replica: a budget is far smaller; a bound against a bad file


def state_path(directory: str) -> str:
    return os.path.join(directory, FILE_NAME)


def load_record(directory: str, file_name: str, key: str, what: str
          ) -> tuple[dict[object, object] | None, str]:
    """The mapping under `key` in a format FORMAT state file, or None and a warning
    ("" for a missing file, an empty record)."""
    path = os.path.join(directory, file_name)
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError) as exc:
        return None, f"cannot read {path}, starting with no recorded {what}: {exc}"
    found = data.get(key) if isinstance(data, dict) else None
    if not isinstance(found, dict) or data.get("format") != FORMAT:
        return None, f"{path}: not a format {FORMAT} state file; ignored"
    return found, ""


def save_record(directory: str, file_name: str, key: str, record: object) -> None:
    """Replace a state file atomically: a crash leaves the old file or the new one."""
    body = json.dumps({"format": FORMAT, key: record}, indent=1).encode()
    try:
        write_atomically(directory, file_name, body)
    except OSError as exc:
        raise StateError(f"cannot write {os.path.join(directory, file_name)}: "
                         f"{exc.strerror or exc}") from None


def load_restarts(directory: str) -> tuple[dict[str, tuple[float, ...]], str]:
    """The recorded restart times per replica, and a warning ("" if none). A missing
    file is an empty record; an unreadable one is reported and treated as empty."""
    restarts, warning = load_record(directory, FILE_NAME, "restarts", "group restarts")
    out: dict[str, tuple[float, ...]] = {}
    for name, times in (restarts or {}).items():
        if isinstance(name, str) and isinstance(times, list) and all(
                isinstance(t, (int, float)) and not isinstance(t, bool) for t in times):
            out[name] = tuple(float(t) for t in times[-MAX_TIMES:])
    return out, warning


def save_restarts(directory: str, restarts: Mapping[str, tuple[float, ...]]) -> None:
    save_record(directory, FILE_NAME, "restarts", {
        name: list(times[-MAX_TIMES:]) for name, times in sorted(restarts.items())})


VERSIONS_FILE = "spec-versions.json"
MAX_VERSIONS = 10_000  # engine starts remembered; far more than the shards of a node


def load_versions(directory: str) -> tuple[dict[str, str], str]:
    """The spec version each recorded engine start began with (InvocationID -> digest),
    and a warning ("" if none); an unreadable file is reported and treated as empty."""
    starts, warning = load_record(directory, VERSIONS_FILE, "starts", "spec versions")
    return {k: v for k, v in list((starts or {}).items())[-MAX_VERSIONS:]
            if isinstance(k, str) and isinstance(v, str)}, warning


def save_versions(directory: str, starts: Mapping[str, str]) -> None:
    """Replace the record (the caller keeps only the starts still running)."""
    save_record(directory, VERSIONS_FILE, "starts", dict(sorted(starts.items())))

def write_atomically(directory: str, name: str, body: bytes, *, dir_mode: int = 0o700,
                     file_mode: int = 0o600) -> str:
    """Write directory/name so that a crash leaves the old file or the new one (a
    temporary file, fsync, rename, fsync of the directory); its path. OSError on
    failure, the temporary file removed."""
    path = os.path.join(directory, name)
    os.makedirs(directory, mode=dir_mode, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=directory)
    try:
        os.fchmod(fd, file_mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(body)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    sync_dir(directory)
    return path


def sync_dir(directory: str) -> None:
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def check_writable(directory: str) -> None:
    """Fail at start-up, not at the first group restart, if the record cannot be kept."""
    existing, _warning = load_restarts(directory)
    save_restarts(directory, existing)

