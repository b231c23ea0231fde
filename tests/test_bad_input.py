"""Bad input, data-driven: each file in cases/bad holds a spec and the one error it must
produce (line, key path, message). Every case exits 2 with exactly one line on stderr,
and the unit directory it pointed at, holding our units and a foreign one, is left
byte-for-byte and mtime-for-mtime as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers import run_render, snapshot

CASES = sorted((Path(__file__).parent / "cases" / "bad").glob("*.yaml"))

GOOD_SPEC = """\
replicas:
  - name: keep
    engine: sglang
    model: /m/keep
    nodes: [{name: n1, address: 10.0.0.1}]
"""
FOREIGN_UNIT = "[Unit]\nDescription=not ours\n[Service]\nExecStart=/bin/true\n"


@pytest.fixture
def populated_dir(tmp_path: Path) -> Path:
    """A unit directory with a previous good render and a foreign unit in it."""
    out = tmp_path / "units"
    good = tmp_path / "good.yaml"
    good.write_text(GOOD_SPEC, encoding="utf-8")
    assert run_render("--node", "n1", "--output", str(out), str(good)).returncode == 0
    (out / "llmgw-foreign.service").write_text(FOREIGN_UNIT, encoding="utf-8")
    return out


@pytest.mark.parametrize("case_file", CASES, ids=[c.stem for c in CASES])
def test_bad_input(case_file: Path, tmp_path: Path, populated_dir: Path) -> None:
    case = yaml.safe_load(case_file.read_text(encoding="utf-8"))
    spec = tmp_path / "spec.yaml"
    if "spec_latin1" in case:
        spec.write_bytes(case["spec_latin1"].encode("latin-1"))
    else:
        spec.write_text(case["spec"], encoding="utf-8")
    before = snapshot(populated_dir)

    proc = run_render(*case.get("args", ["--node", "n1"]), "--output", str(populated_dir),
                      str(spec))

    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    error = case["error"]
    if "argument" in error:
        prefix = f"llmgw-render: error: {error['argument']}: "
    else:
        place = f"{spec}:{error['line']}: "
        prefix = f"llmgw-render: error: {place}{error['path'] + ': ' if error['path'] else ''}"
    assert lines[0].startswith(prefix), lines[0]
    assert error["message"] in lines[0]
    assert snapshot(populated_dir) == before


def test_duplicate_name_across_files(tmp_path: Path) -> None:
    """A folder of specs is one spec: a name used in two files names both places."""
    folder = tmp_path / "replicas.d"
    folder.mkdir()
    (folder / "a.yaml").write_text(GOOD_SPEC, encoding="utf-8")
    (folder / "b.yaml").write_text("# second\n" + GOOD_SPEC, encoding="utf-8")
    out = tmp_path / "units"
    proc = run_render("--node", "n1", "--output", str(out), str(folder))
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"llmgw-render: error: {folder / 'b.yaml'}:3: "
                                  "replicas[0].name: replica name 'keep' is already used at "
                                  f"{folder / 'a.yaml'}:2")
    assert not out.exists()


@pytest.mark.parametrize("args, expected", [
    (["--bogus"], "llmgw-render: error: No such option"),  # click words the rest
    ([], "Missing argument 'SPEC...'"),
    (["/nonexistent/spec.yaml"], "/nonexistent/spec.yaml: no such file"),
])
def test_bad_arguments(args: list[str], expected: str, tmp_path: Path) -> None:
    proc = run_render("--node", "n1", "--output", str(tmp_path / "out"), *args)
    assert proc.returncode == 2
    assert expected in proc.stderr
    assert "--bogus" in proc.stderr or "--bogus" not in args
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert not (tmp_path / "out").exists()


def test_empty_folder(tmp_path: Path) -> None:
    proc = run_render("--node", "n1", "--output", str(tmp_path / "out"), str(tmp_path))
    assert proc.returncode == 2
    assert "the folder holds no *.yaml spec file" in proc.stderr
