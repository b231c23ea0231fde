"""Rendering, data-driven: each file in cases/render holds a spec, the node to render
and the expected units with their keys. Every case also passes systemd-analyze verify
and re-renders byte-identically without touching a file."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import WAIT_FOR_PORT, rendered_dir, run_render, snapshot, verify_units
from installed import STOP_GROUP
from unitfile import read_env, read_exec, read_unit

from llmgw_systemd.spec.names import DIGEST_VAR

CASES = sorted((Path(__file__).parent / "cases" / "render").glob("*.yaml"))


def _expand(value: Any) -> Any:
    if isinstance(value, list):
        return [_expand(v) for v in value]
    return {"WAIT_FOR_PORT": WAIT_FOR_PORT, "STOP_GROUP": STOP_GROUP}.get(value, value) \
        if isinstance(value, str) else value


def check_unit(name: str, text: str, expected: dict[str, Any]) -> None:
    entries = read_unit(text)
    for key, want in expected.items():
        if key == "absent":
            for absent in want:
                assert absent not in entries, f"{name}: {absent} should not be set"
            continue
        plain, _, decode = key.partition("~")
        got = entries.get(plain, [])
        if decode == "argv":
            assert [read_exec(v) for v in got] == _expand(want), f"{name}: {plain}"
        elif decode == "env":
            env = dict(read_env(v) for v in got)
            expected_env = dict(want)
            if want.get(DIGEST_VAR) == "SPEC_DIGEST":  # a digest: its form, not its value
                assert re.fullmatch(r"[0-9a-f]{16}", env.get(DIGEST_VAR, "")), name
                expected_env[DIGEST_VAR] = env[DIGEST_VAR]
            assert env == expected_env, f"{name}: {plain}"
            assert len(got) == len(want), f"{name}: {plain} sets a name twice"
        else:
            assert got == want, f"{name}: {plain}"


@pytest.mark.parametrize("case_file", CASES, ids=[c.stem for c in CASES])
def test_render_case(case_file: Path, tmp_path: Path) -> None:
    case = yaml.safe_load(case_file.read_text(encoding="utf-8"))
    spec = tmp_path / "spec.yaml"
    spec.write_text(case["spec"], encoding="utf-8")
    out = tmp_path / "units"
    args = ["--node", case["node"], "--output", str(out), *(["--user"] if case.get("user")
                                                            else []), str(spec)]
    first = run_render(*args)
    assert first.returncode == 0, first.stderr
    units = rendered_dir(out)
    assert sorted(units) == sorted(case["units"])
    for name, expected in case["units"].items():
        try:
            check_unit(name, units[name], expected or {})
        except AssertionError as exc:  # the whole unit, to see what was rendered instead
            raise AssertionError(f"{exc}\n----- {name}, as rendered -----\n{units[name]}"
                                 ) from None
    verify_units(units, tmp_path / "verify", user=bool(case.get("user")))

    before = snapshot(out)
    again = run_render(*args)
    assert again.returncode == 0, again.stderr
    assert "nothing to do" in again.stdout
    assert snapshot(out) == before


def test_bundled_example_renders_and_verifies_for_every_node(tmp_path: Path) -> None:
    example = Path(__file__).parents[1] / "examples" / "replicas.yaml"
    nodes = {n["name"] for r in yaml.safe_load(example.read_text())["replicas"]
             for n in r["nodes"]}
    for node in sorted(nodes):
        out = tmp_path / node
        proc = run_render("--node", node, "--output", str(out), str(example))
        assert proc.returncode == 0, proc.stderr
        verify_units(rendered_dir(out), tmp_path / f"verify-{node}")


def test_node_defaults_to_this_machines_host_name(tmp_path: Path) -> None:
    import os

    host = os.uname().nodename
    spec = tmp_path / "spec.yaml"
    spec.write_text("replicas:\n  - name: here\n    engine: sglang\n    model: /m\n"
                    f"    nodes: [{{name: {host}, address: 10.0.0.1}}]\n", encoding="utf-8")
    proc = run_render("--output", str(tmp_path / "out"), str(spec))
    assert proc.returncode == 0, proc.stderr
    assert sorted(rendered_dir(tmp_path / "out")) == [
        "llmgw-here-engine.service", "llmgw-here-relaunch.service", "llmgw-here-restart.service",
        "llmgw-here.target"]
