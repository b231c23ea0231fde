"""Runs an entry point in a subprocess whose import system refuses named modules and
records each refusal (a caller that swallows the ImportError is caught too): what a
program loads, checked on the running program (tests/test_entry_points.py,
tests/integration/test_apply.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from installed import BIN_DIR

# Installed into the subprocess before the entry point runs: a meta path finder that
# refuses every module named in LLMGW_REFUSE (a name or its submodules) and appends the
# refused name to LLMGW_REFUSED.
GUARD = """
import os, sys
refuse = tuple(os.environ["LLMGW_REFUSE"].split(","))
log = os.environ["LLMGW_REFUSED"]
class Refuse:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if any(name == r or name.startswith(r + ".") for r in refuse):
            with open(log, "a") as f:
                f.write(name + "\\n")
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Refuse)
"""

SUPERVISOR_SIDE = ("gi", "pydbus", "h11", "prometheus_client")
# What no render, --dry-run, --version or --apply may load: the supervisor's
# dependencies, its event loop, the daemon and the readers of this node and its peers.
NOT_FOR_RENDER = (*SUPERVISOR_SIDE, "asyncio", "concurrent",
                  "llmgw_systemd.supervisor.daemon", "llmgw_systemd.supervisor.http",
                  "llmgw_systemd.gather.systemd_bus",
                  "llmgw_systemd.gather.peer_client", "llmgw_systemd.gather.probes",
                  "llmgw_systemd.gather.shard_reader", "llmgw_systemd.commands.status",
                  "llmgw_systemd.commands.drain", "llmgw_systemd.commands.supervisor")
# --apply alone runs systemctl and asks this node's supervisor over http.client (which
# loads ssl).
NOT_FOR_PLAIN_RENDER = (*NOT_FOR_RENDER, "http", "ssl", "subprocess", "llmgw_systemd.apply",
                        "llmgw_systemd.commands.apply_units", "llmgw_systemd.gather.wire",
                        "llmgw_systemd.supervisor")


def run_entry(entry: str, script: str, args: list[str], refuse: tuple[str, ...],
              tmp_path: Path, env: dict[str, str] | None = None,
              argv_prefix: tuple[str, ...] = (), timeout: float = 60
              ) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run `module:function` as the console script `script` (argv[0] is its installed
    path, as the real one's) with `refuse` refused, after `argv_prefix` (nsenter); its
    result and what was refused."""
    module, function = entry.split(":")
    refused = tmp_path / "refused"
    refused.write_text("")
    code = (f"{GUARD}\nsys.argv = [{str(BIN_DIR / script)!r}, *{args!r}]\n"
            f"from {module} import {function}\nsys.exit({function}())")
    proc = subprocess.run([*argv_prefix, sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=timeout, check=False,
                          stdin=subprocess.DEVNULL, cwd=tmp_path,
                          env={**os.environ, **(env or {}), "LLMGW_REFUSE": ",".join(refuse),
                               "LLMGW_REFUSED": str(refused)})
    return proc, refused.read_text().split()
