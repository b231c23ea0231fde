"""The repo explains itself: every citation of our docs in code, tests and docs points at
a page and a section that exist, and nothing cites the design brief outside the repo."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
TOPS = ("llmgw_systemd", "tests", "bench", "scripts", "packaging", "docs", "templates")
SUFFIXES = ("", ".py", ".md", ".j2", ".in", ".sh", ".spec")
SOURCES = [ROOT / "README.md", *sorted(
    p for top in TOPS for p in (ROOT / top).rglob("*")
    if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts)]
CITATION = re.compile(r"docs/([a-z0-9-]+)\.md(?:\s*§(\d+))?")
OUTSIDE = re.compile(r"\bDESIGN\.md\b")


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return ""


def _sections(page: Path) -> set[str]:
    return set(re.findall(r"^## (\d+)\. ", page.read_text(encoding="utf-8"), re.M))


def test_sources_are_found() -> None:
    assert ROOT / "llmgw_systemd" / "units" / "plan.py" in SOURCES and len(SOURCES) > 50


def test_citations_point_at_what_exists() -> None:
    problems = []
    for path in SOURCES:
        text, where = _text(path), path.relative_to(ROOT)
        if OUTSIDE.search(text):
            problems.append(f"{where}: cites the design brief outside the repo; cite docs/")
        for page, section in CITATION.findall(text):
            target = ROOT / "docs" / f"{page}.md"
            if not target.is_file():
                problems.append(f"{where}: cites docs/{page}.md, which does not exist")
            elif section and section not in _sections(target):
                problems.append(f"{where}: cites docs/{page}.md §{section}, which it lacks")
    assert not problems, "\n".join(problems)
