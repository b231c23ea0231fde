"""The engine table (pure): one entry per `engine:` value, each from its own module.

Adding an engine means a module with its settings class (base.EngineSettings), its key
table and reader, one line here, and its render cases; the spec reader, the planner,
the supervisor and the docs (scripts/manpages.py writes the README's key tables from
these entries) take everything else from it.
"""

from __future__ import annotations

from llmgw_systemd.spec.engines import command, sglang, vllm
from llmgw_systemd.spec.engines.base import EngineEntry

ENGINES: dict[str, EngineEntry] = {e.name: e for e in (vllm.ENTRY, sglang.ENTRY,
                                                       command.ENTRY)}
