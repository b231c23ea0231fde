"""Plans -> unit file texts, through the Jinja2 templates shipped in the package.

The templates only lay out lines; every value goes through a filter from unitsyntax,
so escaping lives in one place.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import jinja2

from . import unitsyntax
from .plan import ShardPlan

TEMPLATE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")
# The marker that makes a file ours: only files that carry it are ever pruned.
MARKER = "# llmgw-systemd: generated unit (marker v1)"
MARKER_LINES = 4  # the marker stands within this many lines from the top


def make_environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["exec"] = unitsyntax.exec_line
    env.filters["env"] = unitsyntax.env_assignment
    env.filters["value"] = unitsyntax.plain_value
    return env


def header(plan: ShardPlan, unit: str) -> str:
    return "\n".join((
        MARKER,
        "# Written by llmgw-render; do not edit: it rewrites or removes this file.",
        f"# Local changes go in a drop-in: systemctl edit {unit}",
        f"# Source: {unitsyntax.comment(plan.source)}, replica {plan.replica}, node "
        f"{plan.node}, rank {plan.rank} of {plan.ranks}",
    ))


def render_shards(plans: Iterable[ShardPlan], env: jinja2.Environment | None = None
                  ) -> dict[str, str]:
    """{unit file name: text} for every unit of the given shards."""
    env = env or make_environment()
    service = env.get_template("service.j2")
    target = env.get_template("target.j2")
    out: dict[str, str] = {}
    for plan in plans:
        out[plan.target.name] = target.render(unit=plan.target,
                                              header=header(plan, plan.target.name))
        for unit in plan.services:
            out[unit.name] = service.render(unit=unit, header=header(plan, unit.name))
    return out


def is_ours(head: str) -> bool:
    """Whether a unit file's first lines carry our marker."""
    return MARKER in head.splitlines()[:MARKER_LINES]
