"""The header of every unit file we write (pure): the marker that makes a file ours,
the line that says who wrote it, and reading them back. Only files that carry the marker
are ever rewritten or removed (units/install.py); the generator's files say so on line 2
(llmgw-render notes a replica made both ways); a file's replica comes from its Source line
(apply/rollout.py, for files about to be removed).
"""

from __future__ import annotations

import re

# The marker that makes a file ours: only files that carry it are ever pruned.
MARKER = "# llmgw-systemd: generated unit (marker v1)"
MARKER_LINES = 4  # the marker stands within this many lines from the top
# Line 2 of every unit: who wrote it. The generator's units are otherwise byte for byte
# what llmgw-render writes for the same specs (tests/test_generator.py holds it to that).
BY_RENDER = "# Written by llmgw-render; do not edit: it rewrites or removes this file."
BY_GENERATOR = ("# Written by llmgw-systemd-generator at every daemon-reload; edit the spec, "
                "not this file.")


_SOURCE_RE = re.compile(r"# Source: .*, replica ([a-z0-9-]+), node [^ ,]+, rank [0-9]+ of "
                        r"[0-9]+\Z")


def replica_of(text: str) -> str | None:
    """The replica a unit we wrote belongs to, from its header's Source line (the last
    ', replica NAME, node' wins: the spec's path before it may hold anything)."""
    for line in text.splitlines()[:MARKER_LINES]:
        match = _SOURCE_RE.match(line)
        if match:
            return match.group(1)
    return None


def is_generated(head: str) -> bool:
    """Whether a unit file's first lines say the generator wrote it."""
    return is_ours(head) and BY_GENERATOR in head.splitlines()[:MARKER_LINES]


def is_ours(head: str) -> bool:
    """Whether a unit file's first lines carry our marker."""
    return MARKER in head.splitlines()[:MARKER_LINES]
