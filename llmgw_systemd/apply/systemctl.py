"""systemctl, for llmgw-render --apply (the I/O shell of rollout.py). Plain systemctl
rather than D-Bus: its error messages are the ones operators know, and llmgw-render
stays free of the D-Bus libraries (only gather/systemd_bus.py talks D-Bus)."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from llmgw_systemd.apply.rollout import SystemctlShow
from llmgw_systemd.errors import SystemctlError
from llmgw_systemd.units.plan import digest_in

SYSTEMCTL = "/usr/bin/systemctl"  # on Debian (merged /usr) and RHEL alike
PROPERTIES = ("Id", "LoadState", "ActiveState", "NeedDaemonReload", "UnitFileState",
              "MainPID")


def systemctl(user: bool, *args: str) -> str:
    """Run one systemctl command; its stdout, or SystemctlError with its stderr."""
    argv = [SYSTEMCTL, *(["--user"] if user else []), "--no-pager", "--no-ask-password",
            *args]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False,
                              stdin=subprocess.DEVNULL)
    except OSError as exc:
        raise SystemctlError(f"cannot run {SYSTEMCTL}: {exc.strerror}") from None
    if proc.returncode != 0:
        shown = " ".join(argv[1:]).replace(" --no-pager --no-ask-password", "")
        message = proc.stderr.strip() or proc.stdout.strip() or "no message"
        raise SystemctlError(f"systemctl {shown} failed (exit {proc.returncode}): {message}")
    return proc.stdout


def unit_states(user: bool, units: Sequence[str]) -> dict[str, SystemctlShow]:
    """Every unit's state in one systemctl show."""
    if not units:
        return {}
    out = systemctl(user, "show", f"--property={','.join(PROPERTIES)}", "--", *units)
    return parse_show(out)


def parse_show(text: str) -> dict[str, SystemctlShow]:
    """systemctl show's blocks (one per unit, a blank line between) -> state by Id."""
    states: dict[str, SystemctlShow] = {}
    for block in text.split("\n\n"):
        props = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        if "Id" not in props:
            continue
        states[props["Id"]] = SystemctlShow(
            active=props.get("ActiveState", "inactive"),
            masked=props.get("LoadState") == "masked",
            need_reload=props.get("NeedDaemonReload") == "yes",
            file_state=props.get("UnitFileState", ""),
            main_pid=int(props["MainPID"]) if props.get("MainPID", "").isdigit() else 0)
    return states


def running_digest(pid: int) -> str:
    """The spec version a running engine started with: the digest in its process's own
    environment, which no daemon-reload changes ("" when unreadable or absent)."""
    if pid <= 0:
        return ""
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            raw = handle.read(1 << 20)
    except OSError:
        return ""
    return digest_in(item.decode("utf-8", "replace") for item in raw.split(b"\0"))


def unit_path(user: bool) -> tuple[str, ...]:
    """The folders the manager reads unit files from (its UnitPath)."""
    return tuple(systemctl(user, "show", "--property=UnitPath", "--value").split())
