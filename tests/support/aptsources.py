"""The Debian mirror this machine's own apt uses, read from its configuration: the
tests' Debian roots (debootstrap) come from wherever this machine gets its packages, and
no mirror's host is written in the repo."""

from __future__ import annotations

from pathlib import Path

APT = Path("/etc/apt")


def debian_mirror(suite: str = "bookworm", apt: Path = APT) -> str:
    """The first URI that serves `suite` in deb822 sources (sources.list.d/*.sources) or
    one-line sources (sources.list, sources.list.d/*.list)."""
    for path in sorted((apt / "sources.list.d").glob("*.sources")):
        for stanza in path.read_text(encoding="utf-8").split("\n\n"):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if line.startswith("#") or ":" not in line:
                    continue
                key, _, value = line.partition(":")
                fields[key.strip().lower()] = value.strip()
            if ("deb" in fields.get("types", "").split()
                    and suite in fields.get("suites", "").split()
                    and fields.get("enabled", "yes").lower() != "no" and fields.get("uris")):
                return fields["uris"].split()[0]
    for path in [apt / "sources.list", *sorted((apt / "sources.list.d").glob("*.list"))]:
        if not path.exists():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            words = line.split("#", 1)[0].split()
            if words[:1] == ["deb"]:
                words = [w for w in words[1:] if not w.startswith("[")]  # options
                if len(words) >= 2 and words[1] == suite:
                    return words[0]
    raise AssertionError(f"no apt source for Debian {suite} in {apt}: the tests' Debian "
                         "roots come from this machine's own mirror")
