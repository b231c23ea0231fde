"""The tests' Debian roots take their mirror from this machine's apt configuration
(tests/support/aptsources.py): deb822 and one-line sources, the first that serves the suite."""

from __future__ import annotations

from pathlib import Path

import pytest
from aptsources import debian_mirror

DEB822 = """Types: deb
# a comment
URIs: http://mirror.example/debian-security
Suites: bookworm-security
Components: main

Types: deb-src
URIs: http://src.example/debian
Suites: bookworm

Types: deb
URIs: http://mirror.example/debian http://second.example/debian
Suites: bookworm bookworm-updates
Components: main
"""


@pytest.mark.parametrize(("files", "mirror"), [
    ({"sources.list.d/debian.sources": DEB822}, "http://mirror.example/debian"),
    ({"sources.list": "# deb http://old.example/debian bookworm main\n"
                      "deb [arch=amd64] http://one.example/debian bookworm main\n"},
     "http://one.example/debian"),
    ({"sources.list.d/debian.sources": "Types: deb\nURIs: http://off.example/debian\n"
                                      "Suites: bookworm\nEnabled: no\n",
      "sources.list.d/x.list": "deb http://list.example/debian bookworm main\n"},
     "http://list.example/debian"),
    ({"sources.list": "deb http://one.example/debian bullseye main\n"}, None),
])
def test_the_mirror_is_this_machines(tmp_path: Path, files: dict[str, str],
                                     mirror: str | None) -> None:
    (tmp_path / "sources.list.d").mkdir()
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    if mirror is None:
        with pytest.raises(AssertionError, match="no apt source for Debian bookworm"):
            debian_mirror(apt=tmp_path)
    else:
        assert debian_mirror(apt=tmp_path) == mirror


def test_this_machine_has_one() -> None:
    assert debian_mirror().startswith(("http://", "https://", "file:/"))
