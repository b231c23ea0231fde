"""llmgw-systemd-generator, run as systemd runs it (a user generator, or a system one in
a private mount namespace), on each test's own files: what it writes, what it says,
and that its cache never serves stale units."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from generatorrun import GeneratorRun
from helpers import rendered_dir, run_render, verify_units
from installed import BIN_DIR, WAIT_FOR_PORT

from llmgw_systemd.units.header import BY_GENERATOR, BY_RENDER

CASES = sorted((Path(__file__).parent / "cases" / "render").glob("*.yaml"))

ALPHA = """\
replicas:
  - name: alpha
    engine: command
    port: 9000
    enable: true
    nodes: [{name: n1, address: 127.0.0.1}]
    ranks:
      - commands:
          - argv: [/usr/bin/sleep, infinity]
"""
BETA = ALPHA.replace("alpha", "beta").replace("9000", "9001").replace(
    "    enable: true\n", "")


def world(tmp_path: Path, scope: str = "user") -> GeneratorRun:
    run = GeneratorRun(tmp_path / "gen", scope=scope)
    run.node("n1\n")
    return run


def as_rendered(text: str) -> str:
    assert text.splitlines()[1] == BY_GENERATOR
    return text.replace(BY_GENERATOR, BY_RENDER, 1)


@pytest.mark.parametrize("case_file", CASES, ids=[c.stem for c in CASES])
def test_generator_writes_what_llmgw_render_writes(case_file: Path, tmp_path: Path) -> None:
    """Every render case: the same files, byte for byte but for the writer's line."""
    case = yaml.safe_load(case_file.read_text(encoding="utf-8"))
    gen = world(tmp_path, "user" if case.get("user") else "system")
    gen.node(f"# this machine\n  {case['node']}  \n")
    spec = gen.spec("case.yaml", case["spec"])
    rendered = tmp_path / "rendered"
    proc = run_render("--node", case["node"], "--output", str(rendered),
                      *(["--user"] if case.get("user") else []), str(spec))
    assert proc.returncode == 0, proc.stderr
    result = gen.run()
    assert result.returncode == 0, result.stderr
    # silent, but for what llmgw-render notes too (user: root, hardening: off)
    notes = [line.removeprefix("note: ") for line in proc.stderr.splitlines()
             if line.startswith("note: replica ")]
    said = [line.split(": ", 2)[2] for line in gen.kmsg_text().splitlines()]
    assert result.stderr == "" and said == notes, gen.kmsg_text()
    generated = gen.units()
    assert sorted(generated) == sorted(case["units"])
    # a system generator reads /etc/llmgw, here this test's folder mounted there
    seen_as = "/etc/llmgw/replicas.d/case.yaml" if gen.scope == "system" else str(spec)
    assert {name: as_rendered(text) for name, text in generated.items()} == {
        name: text.replace(str(spec), seen_as) for name, text in rendered_dir(rendered).items()}
    verify_units(generated, tmp_path / "verify", user=bool(case.get("user")))


def test_enabled_replica_is_wanted_by_the_default_target(tmp_path: Path) -> None:
    gen = world(tmp_path)
    gen.spec("a.yaml", ALPHA)
    gen.spec("b.yaml", BETA)
    assert gen.run().returncode == 0
    assert gen.links() == {"default.target.wants/llmgw-alpha.target": "../llmgw-alpha.target"}
    assert "llmgw-beta.target" in gen.units()


def test_system_generator_links_into_multi_user_target(tmp_path: Path) -> None:
    gen = world(tmp_path, "system")
    gen.spec("a.yaml", ALPHA)
    proc = gen.run()
    assert proc.returncode == 0, proc.stderr
    assert gen.links() == {
        "multi-user.target.wants/llmgw-alpha.target": "../llmgw-alpha.target"}
    assert gen.kmsg_text() == ""
    assert sorted(p.name for p in gen.runtime.iterdir()) == ["llmgw-systemd"]  # the cache


def test_a_bad_file_costs_only_its_own_replicas(tmp_path: Path) -> None:
    gen = world(tmp_path)
    gen.spec("a.yaml", ALPHA)
    bad = gen.spec("b.yaml", BETA.replace("port: 9001", "port: ninety"))
    gen.spec("c.yaml", ALPHA.replace("alpha", "gamma").replace("9000", "9002"))
    proc = gen.run()
    assert proc.returncode == 0
    assert {n for n in gen.units() if n.endswith(".target")} == {
        "llmgw-alpha.target", "llmgw-gamma.target"}
    lines = proc.stderr.splitlines()
    assert lines == [f"llmgw-systemd-generator: error: {bad}:4: replicas[0].port: expected a "
                     "TCP port (an integer from 1 to 65535); got a string ('ninety') (every "
                     "replica in this file is skipped)"]


def test_two_files_that_conflict_both_lose_their_replicas(tmp_path: Path) -> None:
    gen = world(tmp_path)
    first = gen.spec("a.yaml", ALPHA)
    second = gen.spec("b.yaml", BETA.replace("beta", "alpha").replace("9001", "9003"))
    gen.spec("c.yaml", BETA)
    third = gen.spec("d.yaml", BETA.replace("beta", "delta"))  # beta's port 9001 again
    proc = gen.run()
    assert proc.returncode == 0
    assert {n for n in gen.units() if n.endswith(".target")} == set()
    errors = proc.stderr.splitlines()
    assert len(errors) == 4, proc.stderr
    name_errors = [e for e in errors if "replica name 'alpha'" in e]
    assert len(name_errors) == 2
    for line in name_errors:  # each names both places
        assert f"{first}:2" in line and f"{second}:2" in line
    port_errors = [e for e in errors if "port 9001" in e]
    assert len(port_errors) == 2
    for line in port_errors:
        assert str(gen.specs / "c.yaml") in line and str(third) in line


def test_an_unparsable_or_unreadable_file_is_named(tmp_path: Path) -> None:
    gen = world(tmp_path)
    gen.spec("a.yaml", ALPHA)
    broken = gen.spec("b.yaml", "replicas: [\n")
    gen.spec(".hidden.yaml", "not: a spec")
    gen.spec("notes.txt", "not a spec either")
    proc = gen.run()
    assert "llmgw-alpha.target" in gen.units()
    assert len(proc.stderr.splitlines()) == 1
    assert proc.stderr.startswith(f"llmgw-systemd-generator: error: {broken}:")


def test_an_admins_unit_of_the_same_name_wins(tmp_path: Path) -> None:
    gen = world(tmp_path)
    gen.spec("a.yaml", ALPHA)
    gen.spec("b.yaml", BETA)
    (gen.admin_units / "llmgw-alpha-engine.service").write_text("[Service]\n")
    (gen.admin_units / "llmgw-beta.target.d").mkdir()  # a drop-in folder is no unit
    proc = gen.run()
    assert "llmgw-alpha.target" not in gen.units()
    assert "llmgw-beta.target" in gen.units()
    assert gen.links() == {}
    assert proc.stderr.splitlines() == [
        f"llmgw-systemd-generator: notice: replica alpha skipped: {gen.admin_units}/"
        "llmgw-alpha-engine.service takes precedence over generated units; keep the replica "
        "in one place (its spec, or units rendered by llmgw-render)"]


@pytest.mark.parametrize(("node_file", "message"), [
    ("n1\nn2\n", "expected one node name; got 2 (n1, n2)"),
    ("# only a comment\n", "expected one node name; got 0"),
    ("bad/name\n", "expected a node's host name (letters, digits, '.', '_', '-'); got "
                   "'bad/name'"),
])
def test_a_bad_node_file_generates_nothing(tmp_path: Path, node_file: str,
                                           message: str) -> None:
    gen = world(tmp_path)
    gen.spec("a.yaml", ALPHA)
    gen.node(node_file)
    proc = gen.run()
    assert gen.units() == {}
    assert proc.stderr == (f"llmgw-systemd-generator: error: {gen.llmgw}/node: {message}; "
                           "nothing generated\n")


def test_without_a_node_file_the_host_name_is_the_node(tmp_path: Path) -> None:
    gen = world(tmp_path)
    (gen.llmgw / "node").unlink()
    gen.spec("a.yaml", ALPHA.replace("name: n1", f"name: {os.uname().nodename}"))
    assert gen.run().returncode == 0
    assert "llmgw-alpha.target" in gen.units()


def test_a_node_with_no_shard_says_so_once(tmp_path: Path) -> None:
    gen = world(tmp_path)
    gen.node("elsewhere\n")
    gen.spec("a.yaml", ALPHA)
    gen.spec("b.yaml", BETA)
    proc = gen.run()
    assert gen.units() == {}
    assert proc.stderr == (f"llmgw-systemd-generator: notice: node 'elsewhere' has no shard "
                           f"in {gen.specs} (nodes there: n1); nothing generated\n")


def test_no_spec_folder_means_nothing_to_do_and_nothing_said(tmp_path: Path) -> None:
    gen = world(tmp_path)
    shutil.rmtree(gen.specs)
    proc = gen.run()
    assert (proc.returncode, proc.stderr, gen.units()) == (0, "", {})


def test_it_finds_wait_for_port_beside_its_real_path_not_on_path(tmp_path: Path) -> None:
    """Installed by symlink and run with systemd's PATH: the units name the helper of its
    own installation; a generator with no helper beside it says so."""
    gen = world(tmp_path)
    gen.spec("a.yaml", ALPHA.replace("argv: [/usr/bin/sleep, infinity]",
                                     "argv: [/usr/bin/sleep, infinity]\n"
                                     "            wait_for: ['127.0.0.1:7000']"))
    links = tmp_path / "user-generators"
    links.mkdir()
    (links / "llmgw-systemd-generator").symlink_to(gen.generator)
    gen.generator = str(links / "llmgw-systemd-generator")
    env_path = os.environ.get("PATH")
    os.environ["PATH"] = "/usr/bin:/bin"  # no virtualenv on it
    try:
        assert gen.run().returncode == 0
    finally:
        os.environ["PATH"] = env_path or ""
    assert f"ExecStartPre={WAIT_FOR_PORT} " in gen.units()["llmgw-alpha-engine.service"]

    alone = tmp_path / "alone" / "llmgw-systemd-generator"
    alone.parent.mkdir()
    shutil.copy2(BIN_DIR / "llmgw-systemd-generator", alone)
    gen.generator = str(alone)
    proc = gen.run()
    assert gen.units() == {}
    assert proc.stderr == (f"llmgw-systemd-generator: error: cannot find llmgw-wait-for-port "
                           f"beside {alone} (its own installation); nothing generated\n")


def imports(gen: GeneratorRun) -> set[str]:
    """The modules one run imported (python -X importtime)."""
    python = Path(gen.generator).read_text().splitlines()[0][2:].split()[0]
    proc = gen.run(python, "-X", "importtime", "-IS")
    assert proc.returncode == 0, proc.stderr
    return {line.split("|")[-1].strip() for line in proc.stderr.splitlines()
            if line.startswith("import time:")}


def test_nothing_changed_means_no_yaml_and_no_jinja2(tmp_path: Path) -> None:
    gen = world(tmp_path)
    gen.spec("a.yaml", ALPHA)
    first = imports(gen)
    assert {"yaml", "jinja2", "llmgw_systemd.spec.replicas"} <= first
    units = gen.units()
    second = imports(gen)
    assert not {"yaml", "jinja2", "llmgw_systemd.spec.replicas", "dataclasses", "typing"} & second
    assert gen.units() == units and gen.links()


@pytest.mark.parametrize("change", ["spec", "node", "new file", "removed file"])
def test_the_cache_never_serves_stale_units(tmp_path: Path, change: str) -> None:
    gen = world(tmp_path)
    gen.spec("a.yaml", ALPHA)
    gen.spec("b.yaml", ALPHA.replace("alpha", "beta").replace("n1", "n2").replace(
        "9000", "9001"))
    imports(gen)
    before = gen.units()
    if change == "spec":
        gen.spec("a.yaml", ALPHA.replace("infinity", "3600"))
    elif change == "node":
        gen.node("n2\n")
    elif change == "new file":
        gen.spec("c.yaml", ALPHA.replace("alpha", "gamma").replace("9000", "9002"))
    else:
        (gen.specs / "a.yaml").unlink()
    assert "yaml" in imports(gen)
    assert gen.units() != before


@pytest.mark.parametrize(("module", "old", "new"), [
    ("units/header.py", "at every daemon-reload;", "at every daemon-reload (edited);"),
    # a module two folders away from generator/ counts as much as one beside it
    ("spec/engines/command.py", 'role=f"command {cmd.name}"',
     'role=f"command {cmd.name} (edited)"'),
])
def test_an_edited_installation_of_the_same_version_is_a_new_cache_key(
        tmp_path: Path, module: str, old: str, new: str) -> None:
    """A copy of the installation (launcher, helper, package); after one run, one of its
    modules is edited in place: the next run must render with the edit."""
    import llmgw_systemd

    bindir, site = tmp_path / "bin", tmp_path / "site"
    bindir.mkdir()
    shutil.copytree(Path(llmgw_systemd.__file__).parent, site / "llmgw_systemd",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(WAIT_FOR_PORT, bindir / "llmgw-wait-for-port")
    launcher = Path(BIN_DIR / "llmgw-systemd-generator").read_text()
    own = str(Path(llmgw_systemd.__file__).parents[1])
    (bindir / "llmgw-systemd-generator").write_text(launcher.replace(f"'{own}'", f"'{site}'"))
    (bindir / "llmgw-systemd-generator").chmod(0o755)
    gen = world(tmp_path)
    gen.generator = str(bindir / "llmgw-systemd-generator")
    gen.spec("a.yaml", ALPHA)
    assert "yaml" in imports(gen)
    assert "yaml" not in imports(gen)
    edited = site / "llmgw_systemd" / module
    source = edited.read_text()
    assert old in source
    edited.write_text(source.replace(old, new))
    assert "yaml" in imports(gen)
    assert "(edited)" in gen.units()["llmgw-alpha-engine.service"]


@pytest.mark.parametrize("tamper", ["group-writable", "garbage", "truncated"])
def test_a_cache_it_cannot_trust_is_ignored(tmp_path: Path, tamper: str) -> None:
    gen = world(tmp_path)
    gen.spec("a.yaml", ALPHA)
    imports(gen)
    good = gen.units()
    if tamper == "group-writable":
        gen.cache.chmod(0o620)
    elif tamper == "garbage":
        gen.cache.write_bytes(b"\x00not marshal")
    else:
        gen.cache.write_bytes(gen.cache.read_bytes()[:100])
    assert "yaml" in imports(gen)
    assert gen.units() == good


def test_system_scope_reports_to_kmsg_without_a_journal(tmp_path: Path) -> None:
    gen = world(tmp_path, "system")
    for i in range(12):
        gen.spec(f"bad{i:02d}.yaml", f"replicas: {i}\n")
    proc = gen.run()
    assert proc.returncode == 0
    assert proc.stderr == ""
    records = gen.kmsg_text().splitlines()
    assert len(records) == 8  # the kernel would drop a burst beyond 10 anyway
    assert records[0].startswith("<3>llmgw-systemd-generator: /etc/llmgw/replicas.d/bad00.yaml:1: "
                                 "replicas: expected a list of replicas")
    assert records[-1] == ("<3>llmgw-systemd-generator: and 5 more; run "
                           "'llmgw-systemd-generator /tmp/llmgw-out' in a terminal to see "
                           "them all")


def test_wrong_arguments_are_a_usage_error(tmp_path: Path) -> None:
    for args in ([], ["relative"], ["/a", "/b"]):
        proc = subprocess.run([str(BIN_DIR / "llmgw-systemd-generator"), *args],
                              capture_output=True, text=True, timeout=30, check=False)
        assert proc.returncode == 2 and proc.stderr.startswith(
            "usage: llmgw-systemd-generator NORMAL_DIR")
