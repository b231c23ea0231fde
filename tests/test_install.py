"""Writing the unit directory: idempotent, atomic, pruning only what carries our marker."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import rendered_dir, run_render, snapshot

TWO = """\
replicas:
  - name: alpha
    engine: sglang
    model: /m/a
    nodes: [{name: n1, address: 10.0.0.1}]
  - name: beta
    engine: sglang
    model: /m/b
    port: 30001
    nodes: [{name: n1, address: 10.0.0.1}]
"""
ONE = TWO.split("  - name: beta", maxsplit=1)[0]


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(TWO, encoding="utf-8")
    return path


def render(spec: Path, out: Path, *extra: str) -> str:
    proc = run_render("--node", "n1", "--output", str(out), *extra, str(spec))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_second_run_changes_nothing(spec: Path, tmp_path: Path) -> None:
    out = tmp_path / "units"
    first = render(spec, out)
    assert "8 created, 0 updated, 0 removed, 0 unchanged" in first
    before = snapshot(out)
    second = render(spec, out)
    assert second.strip() == f"nothing to do: 8 units in {out} are up to date"
    assert snapshot(out) == before  # same bytes, same mtimes
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp files left


def test_units_are_world_readable_not_writable(spec: Path, tmp_path: Path) -> None:
    out = tmp_path / "units"
    old_umask = os.umask(0o077)
    try:
        render(spec, out)
    finally:
        os.umask(old_umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert set(modes.values()) == {0o644}, modes


def test_removed_replica_is_pruned_foreign_units_untouched(spec: Path, tmp_path: Path) -> None:
    out = tmp_path / "units"
    render(spec, out)
    foreign = {
        "llmgw-mine.service": "[Service]\nExecStart=/bin/true\n",  # our prefix, no marker
        "other.service": "[Service]\nExecStart=/bin/true\n",
        "llmgw-beta-engine.service.d": None,  # an admin's drop-in directory
    }
    for name, text in foreign.items():
        if text is None:
            (out / name).mkdir()
            (out / name / "override.conf").write_text("[Service]\nNice=5\n")
        else:
            (out / name).write_text(text)
    kept = snapshot(out)
    spec.write_text(ONE, encoding="utf-8")
    output = render(spec, out)
    assert "0 created, 0 updated, 4 removed, 4 unchanged" in output
    assert sorted(rendered_dir(out)) == sorted(
        ["llmgw-alpha.target", "llmgw-alpha-engine.service", "llmgw-alpha-relaunch.service",
         "llmgw-alpha-restart.service",
         "llmgw-mine.service", "other.service"])
    after = snapshot(out)
    for name, value in kept.items():
        if not name.startswith("llmgw-beta") or name.startswith("llmgw-beta-engine.service.d"):
            assert after[name] == value, name


def test_dry_run_prints_a_diff_and_writes_nothing(spec: Path, tmp_path: Path) -> None:
    out = tmp_path / "units"
    render(spec, out)
    before = snapshot(out)
    changed = TWO.replace("model: /m/a", "model: /m/a2").split("  - name: beta")[0]
    spec.write_text(changed, encoding="utf-8")
    output = render(spec, out, "--dry-run")
    assert f"--- {out}/llmgw-alpha-engine.service" in output
    assert "-ExecStart=/usr/local/bin/python -m sglang.launch_server --model-path /m/a " in output
    assert "+ExecStart=/usr/local/bin/python -m sglang.launch_server --model-path /m/a2 " in output
    assert "+++ /dev/null" in output  # beta's units would go
    assert "would have: 0 created, 1 updated, 4 removed, 3 unchanged" in output
    assert snapshot(out) == before


def test_dry_run_into_a_missing_directory_creates_nothing(spec: Path, tmp_path: Path) -> None:
    out = tmp_path / "not-yet"
    output = render(spec, out, "--dry-run")
    assert "--- /dev/null" in output
    assert "would have: 8 created" in output
    assert not out.exists()


def test_a_foreign_file_in_the_way_stops_everything(spec: Path, tmp_path: Path) -> None:
    out = tmp_path / "units"
    out.mkdir()
    (out / "llmgw-beta.target").write_text("[Unit]\nDescription=hand-written\n")
    before = snapshot(out)
    proc = run_render("--node", "n1", "--output", str(out), str(spec))
    assert proc.returncode == 1
    assert "llmgw-beta.target exists and was not written by llmgw-render" in proc.stderr
    assert snapshot(out) == before


def test_a_masked_unit_stays_masked(spec: Path, tmp_path: Path) -> None:
    out = tmp_path / "units"
    render(spec, out)
    (out / "llmgw-beta-engine.service").unlink()
    (out / "llmgw-beta-engine.service").symlink_to("/dev/null")
    proc = run_render("--node", "n1", "--output", str(out), str(spec))
    assert proc.returncode == 0
    assert "llmgw-beta-engine.service is masked" in proc.stderr
    assert os.readlink(out / "llmgw-beta-engine.service") == "/dev/null"


def test_full_disk_fails_with_nothing_changed(spec: Path, tmp_path: Path) -> None:
    """A write that fails part way leaves the directory as it was: a tmpfs of three
    pages has room for one more file, not four. (Mounting needs root, as CI is.)"""
    import subprocess

    out = tmp_path / "small"
    out.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12k", "tmpfs", str(out)], check=True)
    try:
        (out / "llmgw-alpha.target").write_text("# llmgw-systemd: generated unit (marker v1)\n")
        (out / "filler").write_bytes(b"x" * 2048)
        before = snapshot(out)
        proc = run_render("--node", "n1", "--output", str(out), str(spec))
        assert proc.returncode == 1, proc.stdout
        assert "nothing was changed" in proc.stderr
        assert snapshot(out) == before
        assert sorted(p.name for p in out.iterdir()) == ["filler", "llmgw-alpha.target"]
    finally:
        subprocess.run(["umount", str(out)], check=True)


def test_no_shard_on_this_node_with_allow_empty_prunes(spec: Path, tmp_path: Path) -> None:
    out = tmp_path / "units"
    render(spec, out)
    output = render(spec, out, "--node", "n9", "--allow-empty")
    assert "0 created, 0 updated, 8 removed" in output
    assert list(out.iterdir()) == []
