"""What the commands share: their defaults (read by programs/ for the options' help, so
light to import) and how they print."""

from __future__ import annotations

import os
import sys

SYSTEM_UNIT_DIR = "/etc/systemd/system"
DEFAULT_SPECS = ("/etc/llmgw/replicas.d",)
DEFAULT_TLS_DIR = "/etc/llmgw/tls"
# The supervisor's state directory (group restarts, drain requests) when neither
# --state-dir nor systemd's $STATE_DIRECTORY says otherwise (StateDirectory=llmgw-supervisor
# in its unit).
DEFAULT_STATE_DIR = "/var/lib/llmgw-supervisor"


def say(text: str = "", *, end: str = "\n") -> None:
    """A line of the command's result, on stdout."""
    print(text, end=end, flush=True)


def warn(text: str) -> None:
    """A note or progress line, on stderr (stdout stays the result)."""
    print(text, file=sys.stderr, flush=True)


def this_node(node: str | None) -> str:
    """--node, else this machine's host name (= gethostname())."""
    return node if node is not None else os.uname().nodename


def default_user_dir() -> str:
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return os.path.join(config, "systemd", "user")


def default_state_dir(user_manager: bool) -> str:
    """systemd's StateDirectory= (it sets $STATE_DIRECTORY), else the usual place."""
    if os.environ.get("STATE_DIRECTORY"):
        return os.environ["STATE_DIRECTORY"].split(":")[0]
    if user_manager:
        base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
        return os.path.join(base, "llmgw-supervisor")
    return DEFAULT_STATE_DIR
