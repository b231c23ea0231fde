"""Running the installed llmgw-systemd-generator on a test's own files, as systemd would:
as a user generator (SYSTEMD_SCOPE=user, XDG dirs of the test's own) or as a system
generator inside a private mount namespace (tests/harness/system-generator)."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from installed import GENERATOR

HARNESS = Path(__file__).resolve().parents[1] / "harness" / "system-generator"


@dataclass
class GeneratorRun:
    """One test's generator world: its llmgw folder, admin unit folder, cache, output."""

    root: Path
    scope: str = "user"
    generator: str = GENERATOR

    def __post_init__(self) -> None:
        for folder in (self.llmgw / "replicas.d", self.admin_units, self.runtime):
            folder.mkdir(parents=True, exist_ok=True)
        self.runtime.chmod(0o700)
        if self.scope == "system":  # the dynamic linker reads its cache from /etc
            shutil.copy2("/etc/ld.so.cache", self.etc / "ld.so.cache")
            self.kmsg.touch()

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def config(self) -> Path:
        return self.root / "config"

    @property
    def llmgw(self) -> Path:
        return self.etc / "llmgw" if self.scope == "system" else self.config / "llmgw"

    @property
    def specs(self) -> Path:
        return self.llmgw / "replicas.d"

    @property
    def admin_units(self) -> Path:
        return (self.etc / "systemd" / "system" if self.scope == "system"
                else self.config / "systemd" / "user")

    @property
    def runtime(self) -> Path:
        """XDG_RUNTIME_DIR (user) or what stands in for /run (system)."""
        return self.root / "runtime"

    @property
    def cache(self) -> Path:
        return self.runtime / "llmgw-systemd" / "generator.cache"

    @property
    def kmsg(self) -> Path:
        return self.root / "kmsg"

    @property
    def out(self) -> Path:
        return self.root / "out"

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("JOURNAL_STREAM",)}
        env.update(SYSTEMD_SCOPE=self.scope, XDG_CONFIG_HOME=str(self.config),
                   XDG_RUNTIME_DIR=str(self.runtime), XDG_CONFIG_DIRS="/nonexistent")
        return env

    def spec(self, name: str, text: str) -> Path:
        path = self.specs / name
        path.write_text(text, encoding="utf-8")
        return path

    def node(self, text: str) -> None:
        (self.llmgw / "node").write_text(text, encoding="utf-8")

    def run(self, *prefix: str) -> subprocess.CompletedProcess[str]:
        """One generator run into a fresh output folder, as at every daemon-reload."""
        shutil.rmtree(self.out, ignore_errors=True)
        self.out.mkdir()
        if self.scope == "system":
            argv = ["unshare", "-m", "--propagation", "private", str(HARNESS), str(self.etc),
                    str(self.runtime), str(self.kmsg), self.generator, str(self.out)]
        else:
            argv = [*prefix, self.generator, str(self.out), f"{self.out}.early",
                    f"{self.out}.late"]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False,
                              env=self.env, stdin=subprocess.DEVNULL)

    def kmsg_text(self) -> str:
        return self.kmsg.read_text(encoding="utf-8") if self.kmsg.exists() else ""

    def units(self) -> dict[str, str]:
        return {p.name: p.read_text(encoding="utf-8") for p in sorted(self.out.iterdir())
                if p.is_file()}

    def links(self) -> dict[str, str]:
        return {str(p.relative_to(self.out)): os.readlink(p)
                for p in sorted(self.out.rglob("*")) if p.is_symlink()}
