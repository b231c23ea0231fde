"""The generator under a real systemd user manager: installed into the manager's own
/run/systemd/user-generators, run by it at start and at every daemon-reload."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from installed import GENERATOR
from specs import PYTHON, free_port, write, yaml_list
from systemd_harness import UserManager, wait_until

pytestmark = pytest.mark.integration


def serving(name: str, port: int, *, enable: bool, argv_extra: tuple[str, ...] = ()) -> str:
    """One node, one command: Python's own HTTP server on port."""
    argv = [PYTHON, "-m", "http.server", str(port), "--bind", "127.0.0.1", *argv_extra]
    return f"""\
replicas:
  - name: {name}
    engine: command
    port: {port}
    enable: {str(enable).lower()}
    restart: {{delay: 1, burst: 5, interval: 120}}
    nodes: [{{name: node, address: 127.0.0.1}}]
    ranks:
      - commands:
          - argv: {yaml_list(argv)}
"""


@pytest.fixture
def generated(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[UserManager]:
    """A manager with the generator installed; the test writes specs before start()."""
    manager = UserManager(f"llmgw-gen-{os.getpid()}-{abs(hash(request.node.nodeid)) % 10**6}",
                          tmp_path / "node", generator=GENERATOR)
    manager.specs_dir.mkdir(parents=True)
    (manager.specs_dir.parent / "node").write_text("node\n")
    try:
        yield manager
    finally:
        if getattr(request.node, "report_call", None) is None or request.node.report_call.failed:
            print(manager.dump())
            print(manager.log_text()[-4000:])
        manager.stop()


def test_generated_replicas_come_up_and_follow_their_specs(generated: UserManager) -> None:
    a_port, b_port = free_port(), free_port()
    write(generated.specs_dir / "alpha.yaml", serving("alpha", a_port, enable=True))
    write(generated.specs_dir / "beta.yaml", serving("beta", b_port, enable=False))
    broken = write(generated.specs_dir / "gamma.yaml",
                   serving("gamma", free_port(), enable=True).replace("engine: command",
                                                                      "engine: komand"))
    generated.start()

    # enabled: started by the manager itself, with no systemctl from us
    generated.wait_state("llmgw-alpha-engine.service", "active", 30)
    assert generated.state_of("llmgw-alpha.target")[0] == "active"
    # generated but not enabled: loaded, not started
    assert generated.show("llmgw-beta.target", "LoadState", "ActiveState",
                          "FragmentPath") == {
        "LoadState": "loaded", "ActiveState": "inactive",
        "FragmentPath": str(generated.generated_dir / "llmgw-beta.target")}
    # the broken file: skipped, and named with its line and key path in the manager's log
    assert generated.show("llmgw-gamma.target", "LoadState")["LoadState"] == "not-found"
    wait_until(lambda: f"{broken}:3: replicas[0].engine: expected one of vllm, sglang, "
               "command; got 'komand'" in generated.log_text(), 10, "the generator's error")

    # an edited spec plus daemon-reload changes the unit
    write(generated.specs_dir / "beta.yaml", serving("beta", b_port, enable=False,
                                                     argv_extra=("--directory", "/tmp")))
    generated.systemctl("daemon-reload")
    exec_start = generated.show("llmgw-beta-engine.service", "ExecStart")["ExecStart"]
    assert "--directory /tmp" in exec_start
    generated.systemctl("start", "llmgw-beta.target")
    generated.wait_state("llmgw-beta-engine.service", "active", 30)

    # a replica leaving the folder leaves the generated units at the next reload
    (generated.specs_dir / "alpha.yaml").unlink()
    generated.systemctl("stop", "llmgw-alpha.target")
    generated.systemctl("daemon-reload")
    assert not (generated.generated_dir / "llmgw-alpha.target").exists()
    assert generated.show("llmgw-alpha.target", "LoadState")["LoadState"] == "not-found"


def test_units_rendered_into_the_user_folder_take_precedence(generated: UserManager,
                                                             tmp_path: Path) -> None:
    port = free_port()
    spec = write(generated.specs_dir / "alpha.yaml", serving("alpha", port, enable=False))
    generated.start()
    assert generated.show("llmgw-alpha.target", "FragmentPath")["FragmentPath"] == str(
        generated.generated_dir / "llmgw-alpha.target")

    proc = generated.apply(spec, "node")  # into $XDG_CONFIG_HOME/systemd/user, reloaded
    assert ("note: llmgw-alpha.target is also made by llmgw-systemd-generator from its spec "
            "folder; the units written here take precedence") in proc.stderr
    assert generated.show("llmgw-alpha.target", "FragmentPath")["FragmentPath"] == str(
        generated.unit_dir / "llmgw-alpha.target")
    assert not (generated.generated_dir / "llmgw-alpha.target").exists()
    wait_until(lambda: f"replica alpha skipped: {generated.unit_dir}/" in generated.log_text(),
               10, "the generator to say it skipped alpha")
