"""Plans -> unit file texts, through the Jinja2 templates shipped in the package.

The templates only lay out lines; every value goes through a filter from units/syntax.py,
so escaping lives in one place.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable

import jinja2

from llmgw_systemd.units import syntax
from llmgw_systemd.units.header import BY_RENDER, MARKER
from llmgw_systemd.units.plan import ShardPlan
from llmgw_systemd.units.templating import (
    COMPILED_PACKAGE_DIR,
    COMPILED_VERSION_FILE,
    TEMPLATE_OPTIONS,
)

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# The wheel ships the templates inside the package (pyproject.toml's force-include of
# the top-level templates/); a source checkout run in place (PYTHONPATH=., as
# bench/scale.py runs a baseline) has them at the top.
_SHIPPED = os.path.join(PACKAGE_DIR, "templates")
_SOURCE = os.path.join(os.path.dirname(os.path.dirname(PACKAGE_DIR)), "templates")
TEMPLATE_DIR = _SHIPPED if os.path.isdir(_SHIPPED) or not os.path.isdir(_SOURCE) else _SOURCE
COMPILED_DIR = os.path.join(PACKAGE_DIR, COMPILED_PACKAGE_DIR)


def make_environment(template_dir: str | None = None) -> jinja2.Environment:
    """The templates as the wheel ships them compiled (fast), or read from template_dir
    (or from the shipped sources, when this Jinja2's feature release is not the one that
    compiled them: compiled code imports names that differ between releases, and RHEL
    9's 2.11 lacks some that 3.1 compiles in)."""
    loader: jinja2.BaseLoader
    if template_dir is None and _release(_compiled_by()) == _release(jinja2.__version__):
        loader = jinja2.ModuleLoader(COMPILED_DIR)
    else:
        loader = jinja2.FileSystemLoader(template_dir or TEMPLATE_DIR)
    env = jinja2.Environment(loader=loader, undefined=jinja2.StrictUndefined,
                             **TEMPLATE_OPTIONS)  # type: ignore[arg-type]
    env.filters.update(exec=syntax.exec_line, env=syntax.env_assignment,
                       value=syntax.plain_value)
    return env


def _release(version: str | None) -> tuple[str, ...] | None:
    return tuple(version.split(".")[:2]) if version else None


def _compiled_by() -> str | None:
    try:
        with open(os.path.join(COMPILED_DIR, COMPILED_VERSION_FILE), encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


@functools.cache
def default_environment() -> jinja2.Environment:
    """One environment per process: a jinja2.ModuleLoader registers a module proxy in
    sys.modules, which must not come and go with every render."""
    return make_environment()




def header(plan: ShardPlan, unit: str, written_by: str = BY_RENDER) -> str:
    return "\n".join((
        MARKER,
        written_by,
        f"# Local changes go in a drop-in: systemctl edit {unit}",
        f"# Source: {syntax.comment(plan.source)}, replica {plan.replica}, node "
        f"{plan.node}, rank {plan.rank} of {plan.ranks}",
    ))


def render_shards(plans: Iterable[ShardPlan], env: jinja2.Environment | None = None,
                  written_by: str = BY_RENDER) -> dict[str, str]:
    """{unit file name: text} for every unit of the given shards."""
    env = env or default_environment()
    service = env.get_template("service.j2")
    target = env.get_template("target.j2")
    restart = env.get_template("restart.j2")
    out: dict[str, str] = {}
    for plan in plans:
        out[plan.target.name] = target.render(unit=plan.target,
                                              header=header(plan, plan.target.name, written_by))
        for unit in plan.services:
            out[unit.name] = service.render(unit=unit, header=header(plan, unit.name, written_by))
        for step in (plan.restart, plan.relaunch):
            out[step.name] = restart.render(unit=step, header=header(plan, step.name, written_by))
    return out
