"""What each entry point loads when it runs, checked on the running program: a subprocess
whose import system refuses the modules that program must not load (and records every
refusal, so a caller that swallows the ImportError is caught too), then runs the entry
point with real arguments. Reading the source would miss an import three modules down;
this does not.

llmgw-render runs during node provisioning and in the generator's slow path, on nodes
that may have no D-Bus bindings, no h11 and no prometheus_client (a plain `pip install
llmgw-systemd`): it must need none of them, nor asyncio, nor the daemon. llmgw-systemd
and llmgw-supervisor need them; without them they name what to install in one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from entry_guard import NOT_FOR_PLAIN_RENDER, SUPERVISOR_SIDE, run_entry

from llmgw_systemd import cli

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "replicas.yaml"

RENDER_RUNS = {
    "--version": ["--version"],
    "--help": ["--help"],
    "render": ["--node", "gpu-a1", "--output", "{tmp}/units", str(EXAMPLE)],
    "--dry-run": ["--node", "gpu-a1", "--dry-run", "--output", "{tmp}/units", str(EXAMPLE)],
    "bad input": ["--node", "gpu-a1", "--output", "{tmp}/units", "{tmp}/missing.yaml"],
    "unknown option": ["--frobnicate"],
}


@pytest.mark.parametrize("case", RENDER_RUNS)
def test_llmgw_render_loads_nothing_of_the_supervisor(case: str, tmp_path: Path) -> None:
    args = [a.replace("{tmp}", str(tmp_path)) for a in RENDER_RUNS[case]]
    proc, refused = run_entry("llmgw_systemd.cli:render_main", "llmgw-render", args,
                              NOT_FOR_PLAIN_RENDER, tmp_path)
    assert refused == [], f"llmgw-render {case} tried to import {refused}: {proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    expected = {"bad input": 2, "unknown option": 2}.get(case, 0)
    assert proc.returncode == expected, proc.stderr
    if case == "render":
        assert sorted(p.name for p in (tmp_path / "units").iterdir()), "nothing rendered"


def test_the_generators_slow_path_loads_nothing_of_the_supervisor(tmp_path: Path) -> None:
    config = tmp_path / "config"
    (config / "llmgw" / "replicas.d").mkdir(parents=True)
    (config / "llmgw" / "replicas.d" / "replicas.yaml").write_bytes(EXAMPLE.read_bytes())
    (config / "llmgw" / "node").write_text("gpu-a1\n")
    out = tmp_path / "normal"
    out.mkdir()
    runtime = tmp_path / "runtime"  # no cache there: the slow path renders
    runtime.mkdir(mode=0o700)
    proc, refused = run_entry("llmgw_systemd.generator.program:main",
                              "llmgw-systemd-generator", [str(out)], NOT_FOR_PLAIN_RENDER,
                              tmp_path, env={"SYSTEMD_SCOPE": "user",
                                             "XDG_CONFIG_HOME": str(config),
                                             "XDG_RUNTIME_DIR": str(runtime)})
    assert refused == [], f"the generator tried to import {refused}: {proc.stderr}"
    assert proc.returncode == 0, proc.stderr
    assert any(p.name.endswith(".service") for p in out.iterdir()), proc.stderr


SUPERVISOR_PROGRAMS = {
    "llmgw-supervisor": ("llmgw_systemd.cli:supervisor_main", ["--help"]),
    "llmgw-systemd status": ("llmgw_systemd.cli:systemd_main", ["status"]),
    "llmgw-systemd --help": ("llmgw_systemd.cli:systemd_main", ["--help"]),
}
# llmgw-systemd exports no metrics: it needs all but prometheus_client
NEEDS = [(program, absent) for program in SUPERVISOR_PROGRAMS for absent in SUPERVISOR_SIDE
         if program == "llmgw-supervisor" or absent != "prometheus_client"]


@pytest.mark.parametrize(("program", "absent"), NEEDS)
def test_without_the_supervisors_dependencies_one_line_says_what_to_install(
        program: str, absent: str, tmp_path: Path) -> None:
    entry, args = SUPERVISOR_PROGRAMS[program]
    proc, refused = run_entry(entry, program.split(maxsplit=1)[0], args, (absent,), tmp_path)
    assert refused, f"{program} never imported {absent}: the case proves nothing"
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = lines[0]
    assert line.startswith(f"{program.split(maxsplit=1)[0]}: error: "), line
    assert repr(absent) in line, line
    assert "llmgw-systemd[dbus]" in line, line
    for package in cli.SUPERVISOR_MODULES.values():
        assert package in line, (package, line)
    assert proc.stdout == ""


def test_another_import_error_stays_a_traceback(tmp_path: Path) -> None:
    """Only the supervisor side's missing modules are turned into the install hint: a
    missing module of our own is a bug and must show as one."""
    proc, refused = run_entry("llmgw_systemd.cli:supervisor_main", "llmgw-supervisor",
                              ["--help"], ("llmgw_systemd.supervisor.daemon",), tmp_path)
    assert refused and proc.returncode == 1 and "Traceback" in proc.stderr, proc.stderr


def test_the_install_hint_names_what_the_extra_and_the_deb_install() -> None:
    """cli.SUPERVISOR_MODULES, pyproject's dbus extra and the deb's Depends say the same."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    line = re.search(rf"^{cli.SUPERVISOR_EXTRA} = \[(.*)\]$", pyproject, re.MULTILINE)
    assert line, f"no {cli.SUPERVISOR_EXTRA} extra in pyproject.toml"
    names = {re.split(r"[<>=~! ]", req.strip(' "'), maxsplit=1)[0].lower().replace("-", "_")
             for req in line.group(1).split(",")}
    # PyGObject is pydbus's dependency, not named in the extra
    assert names == set(cli.SUPERVISOR_MODULES) - {"gi"}, names
    control = (ROOT / "packaging" / "debian" / "control").read_text()
    for package in cli.SUPERVISOR_MODULES.values():
        assert f"{package}," in control, package
