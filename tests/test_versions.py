"""Every installed command's --version names that command (and the one version)."""

from __future__ import annotations

import subprocess

import pytest
from installed import BIN_DIR

from llmgw_systemd import __version__

COMMANDS = ["llmgw-render", "llmgw-systemd", "llmgw-supervisor", "llmgw-wait-for-port",
            "llmgw-stop-group", "llmgw-systemd-generator"]


@pytest.mark.parametrize("command", COMMANDS)
def test_version_names_the_command(command: str) -> None:
    proc = subprocess.run([str(BIN_DIR / command), "--version"], capture_output=True,
                          text=True, timeout=60, check=False, stdin=subprocess.DEVNULL)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"{command} {__version__}\n", "")
