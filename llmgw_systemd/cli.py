"""The console scripts' entry points. Each imports its own program (programs/) only when
it runs, so each program loads what its job needs and nothing more: `llmgw-render` runs
during node provisioning and in the generator's slow path, on machines that may lack the
supervisor's dependencies (D-Bus, h11, prometheus_client), and pays for none of them.
tests/test_entry_points.py holds each program's import closure.

`llmgw-systemd` and `llmgw-supervisor` need those dependencies: without them they say in
one line what to install and exit 2, instead of a traceback."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterable
from typing import NoReturn

# The supervisor side's third-party modules (the package's `dbus` extra, pyproject.toml)
# and the Debian packages that carry them (packaging/debian/control): one home for the
# message a program without them prints; tests/test_entry_points.py holds all three equal.
SUPERVISOR_EXTRA = "dbus"
SUPERVISOR_MODULES = {
    "gi": "python3-gi",  # PyGObject, under pydbus
    "pydbus": "python3-pydbus",
    "h11": "python3-h11",
    "prometheus_client": "python3-prometheus-client",
}


def render_main() -> None:
    from llmgw_systemd.programs import render

    render.main()


def systemd_main() -> None:
    # status, drain and resume read systemd over D-Bus (gi and pydbus are imported when
    # they first connect, so look for them first) and probe engines with h11
    _require("llmgw-systemd", ("gi", "pydbus", "h11"))
    try:
        from llmgw_systemd.programs import systemd
    except ImportError as exc:
        _missing("llmgw-systemd", exc)
    systemd.main()


def supervisor_main() -> None:
    _require("llmgw-supervisor", SUPERVISOR_MODULES)
    try:
        from llmgw_systemd.programs import supervisor
    except ImportError as exc:
        _missing("llmgw-supervisor", exc)
    supervisor.main()


def _require(prog: str, modules: Iterable[str]) -> None:
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError:
            found = False
        if not found:
            _say_missing(prog, name)


def _missing(prog: str, exc: ImportError) -> NoReturn:
    """An import error of the supervisor side's: the install hint. Any other is a bug
    and stays a traceback."""
    name = (exc.name or "").split(".")[0]
    if name not in SUPERVISOR_MODULES:
        raise exc
    _say_missing(prog, name)


def _say_missing(prog: str, name: str) -> NoReturn:
    """One line naming what to install, exit 2."""
    print(f"{prog}: error: needs the supervisor's dependencies, and Python module {name!r} "
          f"is missing: install the extra with pip install 'llmgw-systemd[{SUPERVISOR_EXTRA}]' "
          "(PyGObject from pip needs libgirepository1.0-dev), or on Debian apt-get install "
          f"{' '.join(SUPERVISOR_MODULES.values())}", file=sys.stderr)
    sys.exit(2)
