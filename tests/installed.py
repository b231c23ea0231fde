"""Where the installed entry points are: beside the interpreter running the tests (the
virtualenv scripts/setup installs the wheel into)."""

import sys
from pathlib import Path

BIN_DIR = Path(sys.executable).parent
RENDER = str(BIN_DIR / "llmgw-render")
WAIT_FOR_PORT = str(BIN_DIR / "llmgw-wait-for-port")
STOP_GROUP = str(BIN_DIR / "llmgw-stop-group")
GENERATOR = str(BIN_DIR / "llmgw-systemd-generator")
