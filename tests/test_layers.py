"""The package's boundaries, read from its source. The tree is the architecture: a folder
is a role, and what it may import is its boundary (docs/design.md §2).

    spec/        spec files -> a validated Spec        pure, but files (reads the specs)
    units/       a Spec -> unit files                   pure, but render (loads the
                                                        templates) and install (writes)
    apply/       --apply: what to restart               rollout pure; systemctl the shell
    generator/   the systemd generator                  fast_path pure and import-free;
                                                        slow_path renders; program the shell
    health/      unit state and evidence -> verdicts    pure
    gather/      reading this node and its peers, shared by the daemon and `status`:
                 D-Bus, shards, probes, the peer client, TLS; wire, engine_metrics pure
    supervisor/  the daemon alone: its runtime, state, drain requests; http/
    helpers/     the small programs the units run
    commands/    what each command does (render/--apply, status, drain, the daemon's
                 start): shells over the roles above
    programs/    each program's command line (options only, the only click user)
    cli, errors  the console scripts' entry points, each loading its own program when it
                 runs; the one exception tree
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import llmgw_systemd

PACKAGE = Path(llmgw_systemd.__file__).parent


def _module_name(path: Path) -> str:
    """'cli', 'spec' (a package's __init__), 'spec.engines.vllm'."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# compiled_templates: Jinja2's output, built into the wheel, not our source
MODULES = sorted(name for name in map(_module_name, PACKAGE.rglob("*.py"))
                 if name and "compiled_templates" not in name)
PACKAGES = sorted(_module_name(p.parent) for p in PACKAGE.rglob("__init__.py")
                  if p.parent != PACKAGE and "compiled_templates" not in str(p))


def under(package: str) -> set[str]:
    return {m for m in MODULES if m == package or m.startswith(f"{package}.")}


# The shells: the only modules that may do I/O. Everything else is pure: decisions and
# data only (spec rules, plans, health, group restarts, the generator's and --apply's
# choices), testable without a system.
SHELLS = {
    "cli", *under("programs"),
    "spec.files",  # reads spec files and folders
    "units.render", "units.install",  # loads the package's templates; writes the unit folder
    "apply.systemctl",
    "generator.program", "generator.slow_path",  # the generator's I/O; its render
    *under("supervisor"), *under("helpers"), *under("commands"),
    # the engine's metrics page and the wire format are parsed without I/O: pure,
    # though beside the readers
    *(under("gather") - {"gather.engine_metrics", "gather.wire"}),
}
PURE = set(MODULES) - SHELLS
# What a pure module must not import: processes, sockets, threads, files, the clock.
IMPURE_STDLIB = {"os", "socket", "subprocess", "time", "threading", "asyncio", "signal",
                 "shutil", "tempfile", "pathlib", "sys", "io", "select", "ssl", "http",
                 "urllib", "fcntl"}
# Libraries that belong to one module each.
ONLY_IN = {"click": under("programs"), "gi": {"gather.systemd_bus"},
           "pydbus": {"gather.systemd_bus"}, "jinja2": {"units.render"},
           "prometheus_client": {"supervisor.http.metrics", "gather.engine_metrics"},
           # HTTP over sockets: the API's server, the peers' client, the engines' probes
           "h11": {
               "supervisor.http.server", "gather.peer_client", "gather.probes"}}
# Which role may use which: data flows one way (spec -> units -> files; unit state ->
# health -> report). A key imports nothing of ours outside its own folder and these.
MAY_IMPORT = {
    "errors": set(),
    "spec": {"errors"},
    "units": {"errors", "spec"},
    "apply": {"errors", "spec.names", "units"},
    "generator": {"errors", "spec", "units"},
    "health": {"errors", "spec"},
    # the readers plan unit names (units.plan) but never write units
    "gather": {"errors", "spec", "units.plan", "health"},
    "supervisor": {"errors", "spec", "units.plan", "health", "gather", "helpers.sd_notify",
                   "helpers.listen_fds"},
    "helpers": {"errors", "spec.endpoint", "spec.names", "health.drain", "health.versions"},
    "commands": {"errors", "spec", "units", "apply", "health", "gather", "supervisor",
                 "helpers.stop_group", "helpers.local_api"},
    # options only: their defaults from where each is written once, the work in commands/
    "programs": {"errors", "commands", "spec.endpoint", "supervisor.config"},
    # the entry points: each its own program, nothing else
    "cli": {"programs"},
}
# Never: the daemon must not reach the writers of unit files.
NEVER = {role: {"units.install", "units.render", "apply", "generator"}
         for role in ("supervisor", "gather")}


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


def _source(module: str) -> Path:
    path = PACKAGE.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def imports(module: str, *, typing_too: bool = False) -> set[str]:
    """Every module name imported anywhere in the file at run time (top level or inside
    functions; with typing_too, also under TYPE_CHECKING), ours as 'llmgw_systemd.NAME'."""
    tree = ast.parse(_source(module).read_text(encoding="utf-8"))
    nodes = list(ast.walk(tree)) if typing_too else _runtime_nodes(tree)
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module}: relative import (write llmgw_systemd.X)"
            if node.module == "llmgw_systemd" or (node.module or "").startswith(
                    "llmgw_systemd."):
                # `from llmgw_systemd.units import syntax` imports llmgw_systemd.units.syntax
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    names.add(full if _is_ours(full) else node.module or "")
            elif node.module:
                names.add(node.module)
    names.discard("__future__")
    return names


def _is_ours(name: str) -> bool:
    rel = name.split(".", 1)[1] if "." in name else ""
    return rel in MODULES


def ours(module: str, *, typing_too: bool = False) -> set[str]:
    """Our modules it imports, as 'spec.replicas' (the version, llmgw_systemd itself, left
    out: every module may read it)."""
    return {n.split(".", 1)[1] for n in imports(module, typing_too=typing_too)
            if n.startswith("llmgw_systemd.")}


def role(module: str) -> str:
    return module.split(".", maxsplit=1)[0]


def allowed(module: str, target: str) -> bool:
    if role(target) == role(module):
        return True
    return any(target == a or target.startswith(f"{a}.") for a in MAY_IMPORT[role(module)])


def test_every_module_has_a_role() -> None:
    assert {role(m) for m in MODULES} == set(MAY_IMPORT), sorted(
        {role(m) for m in MODULES} ^ set(MAY_IMPORT))


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_init_is_empty(package: str) -> None:
    """A folder is a job and its imports are its boundary: no re-exports."""
    assert _source(package).read_text(encoding="utf-8") == "", package


@pytest.mark.parametrize("module", MODULES)
def test_data_flows_one_way(module: str) -> None:
    found = ours(module, typing_too=True)
    wrong = sorted(t for t in found if not allowed(module, t))
    assert not wrong, f"{module} ({role(module)}/) imports {wrong}"
    never = sorted(t for t in found for bad in NEVER.get(role(module), ())
                   if t == bad or t.startswith(f"{bad}."))
    assert not never, f"{module} imports the unit writers {never}"


@pytest.mark.parametrize("module", MODULES)
def test_libraries_stay_in_their_one_module(module: str) -> None:
    for library, where in ONLY_IN.items():
        used = {n for n in imports(module) if n == library or n.startswith(f"{library}.")}
        assert not used or module in where, f"{module} imports {library}"


@pytest.mark.parametrize("module", sorted(PURE))
def test_the_pure_core_does_no_io(module: str) -> None:
    found = imports(module)
    stdlib = {n.split(".")[0] for n in found if not n.startswith("llmgw_systemd")}
    assert not stdlib & IMPURE_STDLIB, f"{module} imports {sorted(stdlib & IMPURE_STDLIB)}"
    shells = sorted(ours(module) & SHELLS)
    assert not shells, f"{module} imports the shell modules {shells}"


def test_programs_only_parse_options() -> None:
    """programs/ imports at the top only; every command's work (and what it imports) is in
    commands/. The entry points in cli.py are the one place that imports late, each its
    own program (what each then loads: tests/test_entry_points.py)."""
    for module in under("programs"):
        tree = ast.parse(_source(module).read_text(encoding="utf-8"))
        nested = [f"line {node.lineno}" for function in ast.walk(tree)
                  if isinstance(function, ast.FunctionDef)
                  for node in ast.walk(function)
                  if isinstance(node, (ast.Import, ast.ImportFrom))]
        assert not nested, f"{module} imports inside functions: {nested}"
    tree = ast.parse(_source("cli").read_text(encoding="utf-8"))
    top = {alias.name for node in tree.body if isinstance(node, ast.Import)
           for alias in node.names}
    top |= {node.module or "" for node in tree.body if isinstance(node, ast.ImportFrom)}
    assert top == {"__future__", "collections.abc", "importlib.util", "sys", "typing"}, top
    assert ours("cli") == {"programs.render", "programs.systemd", "programs.supervisor"}


def test_the_generators_fast_path_imports_only_what_it_must() -> None:
    """generator/program.py at import time: os, sys, marshal, the version, fast_path.py
    and the naming rules it shares with the spec (spec/names.py, import-free); the rest
    only inside the functions of its slow path."""
    tree = ast.parse(_source("generator.program").read_text(encoding="utf-8"))
    top: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            top.update(f"{node.module}.{alias.name}" for alias in node.names)
    assert top == {"marshal", "os", "stat", "sys", "llmgw_systemd.__version__",
                   "llmgw_systemd.generator.fast_path", "llmgw_systemd.spec.names.is_node_name",
                   "llmgw_systemd.spec.names.is_spec_file"}, top
    assert imports("generator.fast_path") == {"llmgw_systemd.spec.names"}
    assert imports("spec.names") == set()


def test_one_exception_tree() -> None:
    """Every exception class of ours is in errors.py, and its docstring draws each one."""
    tree_doc = ast.get_docstring(ast.parse(_source("errors").read_text(encoding="utf-8")))
    for module in MODULES:
        tree = ast.parse(_source(module).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
            if any(b.endswith(("Error", "Exception", "Input"))
                   for b in bases):
                assert module == "errors", f"{module} defines exception {node.name}"
                assert node.name in (tree_doc or ""), f"errors.py's tree lacks {node.name}"
