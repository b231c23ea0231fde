"""Exact argv and environment under a real systemd: whatever value the renderer
accepts, the process receives exactly (docs/design.md §4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from installed import RENDER
from specs import PYTHON
from strategies import env_names, values
from systemd_harness import STANDINS, UserManager, read_json

pytestmark = pytest.mark.integration

TARGET, ENGINE = "llmgw-argv.target", "llmgw-argv-engine.service"


def spec_text(out: Path, args: list[str], env: dict[str, str]) -> str:
    return yaml.safe_dump({"replicas": [{
        "name": "argv", "engine": "command", "serving_rank": None,
        "env": env, "nodes": [{"name": "node", "address": "127.0.0.1"}],
        "ranks": [{"commands": [{"argv": [PYTHON, str(STANDINS / "report_argv.py"), str(out),
                                          *args]}]}],
    }]}, allow_unicode=True, default_style='"')


@given(args=st.lists(values, max_size=6), env=st.dictionaries(env_names, values, max_size=3))
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_process_receives_exactly_what_the_spec_says(
        one_node: UserManager, tmp_path: Path, args: list[str], env: dict[str, str]) -> None:
    import subprocess

    out = tmp_path / "received.json"
    out.unlink(missing_ok=True)
    spec = tmp_path / "spec.yaml"
    spec.write_text(spec_text(out, args, env), encoding="utf-8")
    render = subprocess.run([RENDER, "--user", "--node", "node", "--output",
                             str(one_node.unit_dir), str(spec)], capture_output=True,
                            text=True, timeout=60, check=False)
    if render.returncode != 0:  # refused: it must say which value and why, and exit 2
        assert render.returncode == 2, render.stderr
        assert "contains" in render.stderr or "invalid Unicode" in render.stderr
        return
    one_node.systemctl("daemon-reload")
    one_node.systemctl("start", TARGET)
    try:
        received = read_json(out)
    finally:
        one_node.systemctl("stop", TARGET)
    assert received["argv"] == args
    got_env = received["env"]
    assert isinstance(got_env, dict)
    for key, value in env.items():
        assert got_env.get(key) == value, (key, json.dumps(value))
