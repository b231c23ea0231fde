"""Man pages and bash completions: generated from the commands' own option definitions
(scripts/manpages.py), committed, and checked here: up to date, clean for groff, and
offering every option."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
MAN = sorted((ROOT / "packaging" / "man").iterdir())
COMPLETIONS = sorted((ROOT / "packaging" / "completion").iterdir())
COMMANDS = ["llmgw-render", "llmgw-systemd", "llmgw-supervisor", "llmgw-wait-for-port",
            "llmgw-stop-group", "llmgw-systemd-generator"]


def test_one_page_and_one_completion_per_command() -> None:
    assert sorted(p.name.rsplit(".", 1)[0] for p in MAN) == sorted(COMMANDS)
    assert sorted(p.name for p in COMPLETIONS) == sorted(COMMANDS)


def test_committed_pages_match_the_commands() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "manpages.py"), "--check"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"run scripts/manpages.py:\n{proc.stdout}{proc.stderr}"


@pytest.mark.parametrize("page", MAN, ids=[p.name for p in MAN])
def test_man_page_renders_without_warnings(page: Path) -> None:
    proc = subprocess.run(["man", "--warnings", "-E", "UTF-8", "-l", str(page)],
                          capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "MANWIDTH": "80", "LC_ALL": "C.UTF-8"})
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert "OPTIONS" in proc.stdout and "EXIT STATUS" in proc.stdout


def complete(script: Path, *words: str) -> list[str]:
    """What the completion offers for the last word, run in a real bash."""
    func = "_" + script.name.replace("-", "_")
    quoted = " ".join(f"'{w}'" for w in words)
    proc = subprocess.run(["bash", "-c", f"source '{script}'; COMP_WORDS=({quoted}); "
                           f"COMP_CWORD={len(words) - 1}; {func}; "
                           'printf "%s\\n" "${COMPREPLY[@]}"'],
                          capture_output=True, text=True, timeout=30, check=True)
    return [w for w in proc.stdout.splitlines() if w]


def help_options(command: str, *sub: str) -> set[str]:
    """The long options the installed command's --help lists (one per option line)."""
    import re

    from installed import BIN_DIR

    out = subprocess.run([str(BIN_DIR / command), *sub, "--help"], capture_output=True,
                         text=True, timeout=60, check=False).stdout
    found = {m.group(1) for m in re.finditer(r"^ {2}(?:-\w, )?(--[a-z][a-z-]*)", out, re.M)}
    assert len(found) >= 2, out
    return found


@pytest.mark.parametrize(("command", "sub"), [
    ("llmgw-render", ()), ("llmgw-supervisor", ()), ("llmgw-wait-for-port", ()),
    ("llmgw-stop-group", ()), ("llmgw-systemd", ("status",))])
def test_completion_offers_every_option_of_help(command: str, sub: tuple[str, ...]) -> None:
    offered = set(complete(ROOT / "packaging" / "completion" / command, command, *sub, "--"))
    assert help_options(command, *sub) <= offered, help_options(command, *sub) - offered
    assert complete(ROOT / "packaging" / "completion" / command, command, *sub, "--ver") \
        in ([], ["--version"])


def test_completion_of_llmgw_systemd_starts_with_its_subcommand() -> None:
    assert complete(ROOT / "packaging" / "completion" / "llmgw-systemd", "llmgw-systemd",
                    "st") == ["status"]
