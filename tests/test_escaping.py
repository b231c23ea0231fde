"""Escaping values into unit files: every value either reads back exactly, by systemd's
rules, or is refused with a clear error. Property-based (hypothesis) plus a table of
the cases that matter most. Running the units for real is in the integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import env_names, values
from unitfile import read_env, read_exec, read_unit

from llmgw_systemd.errors import SpecError, UnsafeValue
from llmgw_systemd.spec.control_chars import find_control_char
from llmgw_systemd.spec.document import parse
from llmgw_systemd.spec.replicas import build_spec
from llmgw_systemd.units.plan import Manager, plan_node
from llmgw_systemd.units.render import render_shards
from llmgw_systemd.units.syntax import env_assignment, exec_line, exec_word, plain_value

EXE = "/usr/bin/printf"
TRICKY = ["%", "100%", "%n", "%%", "$HOME", "${HOME}", "$$", "$", "a;b", ";", "\\", "\\;",
          '"', "'", "'quoted'", '"dq"', "", " ", "two words", "é", "🦙", "\\x41", "\\n",
          "--flag=a b", "#hash", "a=b", "C:\\path\\"]


@pytest.mark.parametrize("arg", TRICKY)
def test_tricky_arguments_read_back(arg: str) -> None:
    assert read_exec(exec_line([EXE, arg])) == [EXE, arg]


@pytest.mark.parametrize("arg, written", [
    ("plain", "plain"),
    ("/a/b.c:d=e,f@g+h", "/a/b.c:d=e,f@g+h"),
    ("100%", "100%%"),
    ("$HOME", '"$$HOME"'),
    ("two words", '"two words"'),
    ('say "hi"', '"say \\"hi\\""'),
    ("back\\slash", '"back\\\\slash"'),
    (";", '";"'),
    ("", '""'),
    ("🦙", '"🦙"'),
])
def test_words_are_written_minimally_quoted(arg: str, written: str) -> None:
    assert exec_word(arg) == written


@given(values)
@settings(max_examples=400)
def test_any_argument_reads_back_or_is_refused(arg: str) -> None:
    if find_control_char(arg) is not None:
        with pytest.raises(UnsafeValue, match="contains"):
            exec_word(arg)
        return
    line = exec_line([EXE, "-", arg, "x"])
    assert "\n" not in line
    assert read_exec(line) == [EXE, "-", arg, "x"]


@given(values)
@settings(max_examples=400)
def test_any_environment_value_reads_back_or_is_refused(value: str) -> None:
    if find_control_char(value) is not None:
        with pytest.raises(UnsafeValue):
            env_assignment("NAME", value)
        return
    assert read_env(env_assignment("NAME", value)) == ("NAME", value)


@given(values)
def test_plain_values_never_span_lines(value: str) -> None:
    try:
        written = plain_value(value)
    except UnsafeValue:
        assert find_control_char(value) is not None or value.endswith("\\")
        return
    assert "\n" not in written
    assert "%" not in written.replace("%%", "")


@pytest.mark.parametrize("exe", ["relative/bin", "/opt/$venv/bin/x", "/bin/a\nb"])
def test_unwritable_executables_are_refused(exe: str) -> None:
    with pytest.raises(UnsafeValue):
        exec_line([exe, "x"])


def _render_spec(args: list[str], env: dict[str, str]) -> dict[str, str]:
    text = yaml.safe_dump({"replicas": [{
        "name": "p", "engine": "vllm", "launch_mode": "mp", "model": "/m",
        "args": args, "env": env, "nodes": [{"name": "n1", "address": "10.0.0.1"}]}]},
        allow_unicode=True, default_style='"')  # every value escaped: YAML keeps it as is
    spec = build_spec([parse(text.encode("utf-8"), "spec.yaml")])
    manager = Manager(user=False, wait_for_port="/usr/bin/llmgw-wait-for-port")
    return render_shards(plan_node(spec, "n1", manager))


@given(st.lists(values, max_size=4), st.dictionaries(env_names, values, max_size=3))
@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
def test_spec_values_reach_the_unit_exactly_or_fail_clearly(
        args: list[str], env: dict[str, str]) -> None:
    """Through the whole path: YAML spec -> validation -> plan -> template."""
    try:
        units = _render_spec(args, env)
    except SpecError as exc:
        assert exc.file == "spec.yaml" and exc.line is not None
        # ours, or libyaml's own refusal of a lone surrogate escape
        assert "contains" in exc.message or "invalid Unicode" in exc.message
        assert any(find_control_char(v) for v in [*args, *env.values()])
        return
    entries = read_unit(units["llmgw-p-engine.service"])
    (argv,) = [read_exec(v) for v in entries["Service.ExecStart"]]
    assert argv[len(argv) - len(args):] == args
    got_env = dict(read_env(v) for v in entries["Service.Environment"])
    for key, value in env.items():
        assert got_env[key] == value


def test_rendered_tricky_values_pass_systemd_analyze(tmp_path: Path) -> None:
    from helpers import verify_units

    units = _render_spec(TRICKY, {"A": "100% $x \"q\" \\ ;", "B": "🦙 é"})
    verify_units(units, tmp_path)
