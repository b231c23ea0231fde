"""The tests exercise the installed wheel, not the source tree: a template or module
missing from the wheel fails here first."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

import llmgw_systemd
from llmgw_systemd.units import render


def test_package_is_imported_from_the_installed_wheel() -> None:
    installed = Path(sysconfig.get_paths()["purelib"]).resolve()
    assert installed in Path(llmgw_systemd.__file__).resolve().parents


def test_templates_ship_inside_the_package() -> None:
    shipped = sorted(p.name for p in Path(render.TEMPLATE_DIR).glob("*.j2"))
    source = sorted(p.name for p in (Path(__file__).parents[1] / "templates").glob("*.j2"))
    assert shipped == source and shipped


def test_compiled_templates_are_used_only_under_the_jinja2_that_made_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled templates import names that differ between Jinja2 feature releases
    (RHEL 9's 2.11 lacks what 3.1 compiles in): under another, the shipped sources."""
    import jinja2

    assert type(render.make_environment().loader).__name__ == "ModuleLoader"
    monkeypatch.setattr(render, "_compiled_by", lambda: "2.11.3")
    assert jinja2.__version__ != "2.11.3"
    env = render.make_environment()
    assert type(env.loader).__name__ == "FileSystemLoader"
    assert env.get_template("service.j2") is not None


def test_compiled_templates_match_their_sources() -> None:
    """The wheel ships the templates compiled (hatch_build.py); they must give exactly
    what the template sources in this tree give, for every node of the example spec."""
    from llmgw_systemd.spec.files import read_documents
    from llmgw_systemd.spec.replicas import build_spec
    from llmgw_systemd.units.plan import Manager, plan_node

    root = Path(__file__).parents[1]
    assert Path(render.COMPILED_DIR).is_dir()
    spec = build_spec(read_documents([str(root / "examples")]))
    compiled, source = render.make_environment(), render.make_environment(str(root / "templates"))
    assert type(compiled.loader).__name__ == "ModuleLoader"
    for user in (False, True):
        manager = Manager(user=user, wait_for_port="/usr/bin/llmgw-wait-for-port")
        for node in spec.node_names():
            plans = plan_node(spec, node, manager)
            assert render.render_shards(plans, compiled) == render.render_shards(plans, source)


def test_generator_is_the_launcher_over_the_console_script() -> None:
    """scripts/setup installs llmgw-systemd-generator as the packages do: the launcher
    (packaging/generator-launcher.in, Python -IS), not the wheel's console script, naming
    this installation's package directory first, then only other package directories."""
    from installed import BIN_DIR, GENERATOR
    from test_packages import launcher_sitedirs

    own = str(Path(llmgw_systemd.__file__).parents[1])  # as scripts/setup names it
    sitedirs = launcher_sitedirs(Path(GENERATOR).read_text(encoding="utf-8"),
                                 str(BIN_DIR / "python3"))
    assert sitedirs[0] == own, sitedirs
    assert all(d.endswith("-packages") for d in sitedirs) and own not in sitedirs[1:], sitedirs
    waiter = Path(BIN_DIR / "llmgw-wait-for-port").read_text(encoding="utf-8")
    assert launcher_sitedirs(waiter, str(BIN_DIR / "python3"),
                             "wait-for-port-launcher.in") == sitedirs


def test_supervisor_unit_passes_systemd_analyze(tmp_path: Path) -> None:
    from helpers import verify_units

    unit = Path(__file__).parents[1] / "packaging" / "systemd" / "llmgw-supervisor.service"
    verify_units({unit.name: unit.read_text()}, tmp_path)
