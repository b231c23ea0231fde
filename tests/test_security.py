"""Least privilege, scored by systemd itself (docs/hardening.md): every service of every
render case, rendered for the system manager as the product ships, and the supervisor's
packaged unit, through `systemd-analyze security --offline=true` (0 best, 10 worst).

Goals: engine and sidecar services at most 3.0 with the defaults, restart services at
most 1.0, the supervisor at most 1.5 and not root. A replica that turns its sandbox off
(hardening: off) is scored too, and must score worse than the goal: the key must do
what it says."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from unitfile import read_unit

from llmgw_systemd.spec.document import parse
from llmgw_systemd.spec.replicas import build_spec
from llmgw_systemd.units.plan import Manager, plan_node
from llmgw_systemd.units.render import render_shards

ROOT = Path(__file__).resolve().parents[1]
CASES = sorted((ROOT / "tests" / "cases" / "render").glob("*.yaml"))
SUPERVISOR = ROOT / "packaging" / "systemd" / "llmgw-supervisor.service"
SYSTEM = Manager(user=False, wait_for_port="/usr/bin/llmgw-wait-for-port")
GOALS = {"member": 3.0, "restart": 1.0, "supervisor": 1.5}
OVERALL = re.compile(r"Overall exposure level for (\S+): ([0-9.]+)")


def scores(files: list[Path]) -> dict[str, float]:
    """unit name -> its exposure, all files in one systemd-analyze call."""
    proc = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager",
                           *map(str, files)], capture_output=True, text=True, timeout=120,
                          check=False)
    found = {m.group(1): float(m.group(2)) for m in OVERALL.finditer(proc.stdout)}
    assert len(found) == len(files), proc.stdout[-2000:] + proc.stderr
    return found


def system_units(case_file: Path) -> dict[str, str]:
    case = yaml.safe_load(case_file.read_text(encoding="utf-8"))
    spec = build_spec([parse(case["spec"].encode(), str(case_file))])
    return render_shards(plan_node(spec, case["node"], SYSTEM))


@pytest.mark.parametrize("case_file", CASES, ids=[c.stem for c in CASES])
def test_every_unit_of_every_case_meets_its_goal(case_file: Path, tmp_path: Path) -> None:
    units = {n: t for n, t in system_units(case_file).items() if n.endswith(".service")}
    for name, text in units.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    got = scores([tmp_path / n for n in sorted(units)])
    for name, score in got.items():
        entries = read_unit(units[name])
        kind = "restart" if name.endswith(("-restart.service", "-relaunch.service")) else "member"
        sandboxed = kind == "restart" or "Service.NoNewPrivileges" in entries
        if sandboxed:
            assert score <= GOALS[kind], f"{name}: {score} > {GOALS[kind]}"
        else:  # hardening: off, as the case says
            assert score > GOALS[kind], f"{name}: {score} with its sandbox off?"
        if kind == "member":
            assert entries.get("Service.User") not in (None, ["root"]) or \
                "hardening: off" in case_file.read_text() or "user: root" in \
                case_file.read_text(), f"{name} runs as root by default"


def test_the_supervisor_meets_its_goal_and_is_not_root() -> None:
    got = scores([SUPERVISOR])
    assert got["llmgw-supervisor.service"] <= GOALS["supervisor"], got
    entries = read_unit(SUPERVISOR.read_text(encoding="utf-8"))
    assert entries["Service.User"] == ["llmgw-supervisor"]
    assert entries["Service.CapabilityBoundingSet"] == [""]
