"""What a test of a rolled change reads: each engine's starts while it rolls, and the
environment of the engine process itself (not just of its unit file)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from systemd_harness import Sampler, UserManager


def engine_environ(manager: UserManager, unit: str) -> dict[str, str]:
    """The environment of the unit's main process, once it is active."""
    pid = int(manager.wait_state(unit, "active", 60)["MainPID"])
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


class Starts(Sampler[dict[str, str]]):
    """Each node's InvocationID of `unit` (systemd gives each start of a unit a new one),
    sampled in a thread from entry to exit: every start seen, the running one included."""

    def __init__(self, managers: Mapping[str, UserManager], unit: str,
                 interval: float = 0.3) -> None:
        super().__init__(lambda: {node: m.show(unit, "InvocationID")["InvocationID"]
                                  for node, m in managers.items()}, interval, lambda _exc: {})

    def invocations(self) -> dict[str, list[str]]:
        """Every invocation seen on each node, in order."""
        seen: dict[str, list[str]] = {}
        for _, value in self.seen:
            for node, invocation in value.items():
                if invocation and invocation not in seen.setdefault(node, []):
                    seen[node].append(invocation)
        return seen

    def counts(self) -> dict[str, int]:
        return {node: len(ids) for node, ids in self.invocations().items()}
