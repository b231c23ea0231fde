"""Operators' drain requests (`llmgw-systemd drain`), kept as files in the supervisor's
state directory so that they survive a restart of the supervisor and of the node: a
replica drained before hardware work stays out of rotation until `resume`.

One JSON file per request under `<state dir>/drains/`: `replica-NAME.json` for one
replica, `node.json` for every replica with a shard on this node. Root writes them (the
request is local: no network verb, the API stays read-only); the supervisor only reads
them, every second by the folder's mtime. Written atomically (temporary file, fsync,
rename), world-readable: they hold nothing secret, and the supervisor runs as its own
user.
"""

from __future__ import annotations

import contextlib
import json
import os

from llmgw_systemd.errors import StateError
from llmgw_systemd.health.drain import DrainRequest
from llmgw_systemd.spec.names import is_replica_name
from llmgw_systemd.supervisor.state_file import sync_dir, write_atomically

FOLDER = "drains"
NODE_FILE = "node.json"
MAX_FILES = 4096  # a bound against a folder filled by mistake
MAX_BYTES = 16384  # per file
MAX_TEXT = 500  # characters of `by` and `reason` kept


def folder(state_dir: str) -> str:
    return os.path.join(state_dir, FOLDER)


def file_name(replica: str | None) -> str:
    return NODE_FILE if replica is None else f"replica-{replica}.json"


def stamp(state_dir: str) -> float:
    """The folder's mtime (0 when it does not exist): a change means read again."""
    try:
        return os.stat(folder(state_dir)).st_mtime
    except OSError:
        return 0.0


def load(state_dir: str) -> tuple[tuple[DrainRequest, ...], tuple[str, ...]]:
    """Every request in effect, and a warning per file that could not be read (it is
    ignored: a bad file must not take a replica out of rotation by accident)."""
    where = folder(state_dir)
    try:
        names = sorted(os.listdir(where))[:MAX_FILES]
    except FileNotFoundError:
        return (), ()
    except OSError as exc:
        return (), (f"cannot read {where}: {exc.strerror or exc}",)
    requests: list[DrainRequest] = []
    warnings: list[str] = []
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        path = os.path.join(where, name)
        try:
            with open(path, "rb") as handle:
                data = json.loads(handle.read(MAX_BYTES + 1)[:MAX_BYTES])
            request = _request(data)
        except (OSError, ValueError) as exc:
            warnings.append(f"drain request {path} ignored: {exc}")
            continue
        if file_name(request.replica) != name:
            warnings.append(f"drain request {path} ignored: it names "
                            f"{request.replica or 'the node'}, not its file")
            continue
        requests.append(request)
    return tuple(requests), tuple(warnings)


def _request(data: object) -> DrainRequest:
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object")
    replica = data.get("replica")
    if replica is not None and not (isinstance(replica, str) and is_replica_name(replica)):
        raise ValueError("replica: expected a replica name or null")
    texts = (data.get("by"), data.get("since"), data.get("reason", ""))
    if not all(isinstance(v, str) for v in texts):
        raise ValueError("by, since and reason: expected strings")
    by, since, reason = (_printable(str(v)) for v in texts)
    return DrainRequest(replica, by, since, reason)


def _printable(text: str) -> str:
    """One line of at most MAX_TEXT characters: it reaches logs, reports and the API."""
    return "".join(c if c.isprintable() else " " for c in text)[:MAX_TEXT]


def save(state_dir: str, request: DrainRequest) -> str:
    """Write one request atomically (replacing one for the same replica or the node);
    its path."""
    body = json.dumps({"replica": request.replica, "by": request.by, "since": request.since,
                       "reason": request.reason}, indent=1).encode()
    name = file_name(request.replica)
    try:
        return write_atomically(folder(state_dir), name, body, dir_mode=0o755,
                                file_mode=0o644)
    except OSError as exc:
        raise StateError(f"cannot write {os.path.join(folder(state_dir), name)}: "
                         f"{exc.strerror or exc}") from None


def remove(state_dir: str, replica: str | None) -> bool:
    """Remove one request; whether there was one."""
    where = folder(state_dir)
    path = os.path.join(where, file_name(replica))
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise StateError(f"cannot remove {path}: {exc.strerror or exc}") from None
    with contextlib.suppress(OSError):
        sync_dir(where)
    return True
