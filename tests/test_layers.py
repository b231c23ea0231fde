"""The package's boundaries, read from its source: only the CLI imports click, only the
D-Bus module imports gi or pydbus, and the pure core does no I/O and reads no clock, not
even through another module of ours."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import llmgw_systemd

PACKAGE = Path(llmgw_systemd.__file__).parent


def _module_name(path: Path) -> str:
    """'spec', 'engines' (a package's __init__), 'engines.vllm'."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# compiled_templates: Jinja2's output, built into the wheel, not our source
MODULES = sorted(name for name in map(_module_name, PACKAGE.rglob("*.py"))
                 if name and not name.startswith("compiled_templates"))

# Decisions and data only: spec rules, plans, health, group restarts, the generator's
# and --apply's choices. render (loads the package's own templates) and generate (renders
# through it) are the template shell; everything else is an I/O shell or an entry point.
PURE = {
    "endpoint", "engines", "errors", "evidence", "generated", "grouprestart", "health",
    "cluster", "plan", "replicastate", "rollout", "spec", "templating", "textrules",
    "unitheader",
    "unitstate", "unitsyntax", "yamldoc", "specread",
    # every engine module: what it runs is data
    *(name for name in MODULES if name == "engines" or name.startswith("engines.")),
}
# What a pure module must not import: processes, sockets, threads, files, the clock.
IMPURE_STDLIB = {"os", "socket", "subprocess", "time", "threading", "asyncio", "signal",
                 "shutil", "tempfile", "pathlib", "sys", "io", "select", "ssl", "http",
                 "urllib", "fcntl"}
ONLY_IN = {"click": {"cli"}, "gi": {"systemd_dbus"}, "pydbus": {"systemd_dbus"}}


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node but those under `if TYPE_CHECKING:` (imports for the type checker)."""
    out: list[ast.AST] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and \
                node.test.id == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        out.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return out


def imports(module: str) -> set[str]:
    """Every module name imported anywhere in the file at run time (top level or inside
    functions), ours as 'llmgw_systemd.NAME'."""
    path = PACKAGE.joinpath(*module.split("."))
    is_package = path.is_dir()
    source = path / "__init__.py" if is_package else path.with_suffix(".py")
    tree = ast.parse(source.read_text(encoding="utf-8"))
    # the package a relative import starts from: the module's own if it is a package
    here = module.split(".") if is_package else module.split(".")[:-1]
    names: set[str] = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                names.add(node.module)
            elif node.level > 0:
                base = ["llmgw_systemd", *here[:len(here) - (node.level - 1)]]
                if node.module:
                    names.add(".".join([*base, node.module]))
                else:
                    names.update(".".join([*base, alias.name]) for alias in node.names)
    names.discard("__future__")
    return names


def test_every_module_is_classified() -> None:
    assert set(MODULES) >= PURE, sorted(PURE - set(MODULES))


@pytest.mark.parametrize("module", MODULES)
def test_libraries_stay_in_their_one_module(module: str) -> None:
    for library, allowed in ONLY_IN.items():
        used = {n for n in imports(module) if n == library or n.startswith(f"{library}.")}
        assert not used or module in allowed, f"{module} imports {library}"


@pytest.mark.parametrize("module", sorted(PURE))
def test_the_pure_core_does_no_io(module: str) -> None:
    found = imports(module)
    stdlib = {n.split(".")[0] for n in found if not n.startswith("llmgw_systemd")}
    assert not stdlib & IMPURE_STDLIB, f"{module} imports {sorted(stdlib & IMPURE_STDLIB)}"
    ours = {n.split(".", 1)[1] for n in found if n.startswith("llmgw_systemd.")}
    assert ours <= PURE, f"{module} imports the shell modules {sorted(ours - PURE)}"


def test_the_generators_fast_path_imports_only_what_it_must() -> None:
    """generator.py at import time: os, sys, marshal and the import-free generated.py
    (the rest only inside the functions of its slow path)."""
    tree = ast.parse((PACKAGE / "generator.py").read_text(encoding="utf-8"))
    top: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            top.update(f"{'.' * node.level}{node.module or alias.name}" for alias in node.names)
    assert top == {"marshal", "os", "sys", ".__version__", ".generated"}, top
    assert imports("generated") == set()
