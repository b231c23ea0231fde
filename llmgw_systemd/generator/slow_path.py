"""Spec files -> this node's generated units (pure): the systemd generator's slow path,
taken when its cache does not match (docs/generator.md).

The same spec rules, plans and templates as llmgw-render, so the units are the same
bytes but for the header line that names their writer. Unlike llmgw-render, one bad
file never costs the others: its replicas are skipped and its error reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from llmgw_systemd.errors import BadInput, SpecError
from llmgw_systemd.generator.fast_path import ERROR, NOTICE
from llmgw_systemd.spec.document import Document, parse
from llmgw_systemd.spec.replicas import collect_spec
from llmgw_systemd.units.header import BY_GENERATOR
from llmgw_systemd.units.plan import Manager, plan_node
from llmgw_systemd.units.render import render_shards

if TYPE_CHECKING:  # plain tuples, named in fast_path.py for the type checker only
    from llmgw_systemd.generator.fast_path import Message, Output, Replica


def generate(contents: Sequence[tuple[str, bytes | None]], node: str, manager: Manager,
             spec_dir: str) -> Output:
    """contents: (path, bytes, or None when unreadable) of each spec file, in order."""
    documents: list[Document | SpecError] = []
    for path, raw in contents:
        if raw is None:
            documents.append(SpecError(path, None, "", "cannot read the file"))
            continue
        try:
            documents.append(parse(raw, path))
        except SpecError as exc:
            documents.append(exc)
    spec, errors = collect_spec(documents)
    messages: list[Message] = [(ERROR, f"{e} (every replica in this file is skipped)")
                               for e in errors]
    plans = plan_node(spec, node, manager, allow_empty=True)
    if spec.replicas and not plans:
        messages.append((NOTICE, f"node '{node}' has no shard in {spec_dir} (nodes there: "
                         f"{', '.join(spec.node_names())}); nothing generated"))
    replicas: list[Replica] = []
    for plan in plans:
        try:
            units = render_shards([plan], written_by=BY_GENERATOR)
        except BadInput as exc:  # a value no unit file can hold: this replica only
            messages.append((ERROR, f"{plan.source}: replica {plan.replica}: {exc} "
                             "(replica skipped)"))
            continue
        messages.extend((NOTICE, f"{plan.source}: {note}") for note in plan.notes)
        replicas.append((plan.replica, plan.target.name, plan.target.wanted_by, plan.enable,
                         tuple(sorted(units.items()))))
    return tuple(replicas), tuple(messages)
