"""The engine tier: the real vLLM (its CPU build from PyPI, scripts/setup-engines) under
the rendered units and a real systemd user manager. Single node: a completion, then a
stop that leaves every unit inactive (not failed), no process and the port free; and a
stop in the middle of start-up, which must end the same way."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from realengine import MODEL, OFFLINE, QUICK_STOP, VENV, assert_engines
from specs import free_port, write
from systemd_harness import UserManager, port_is_free, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.engines]

TARGET, ENGINE = "llmgw-tiny.target", "llmgw-tiny-engine.service"


@pytest.fixture(scope="module")
def engines() -> tuple[Path, Path]:
    assert_engines()  # missing is a failure, never a skip
    return VENV, MODEL


def spec_text(port: int) -> str:
    env = ", ".join(f"{k}: {json.dumps(v)}" for k, v in OFFLINE.items())
    return f"""\
replicas:
  - name: tiny
    engine: vllm
    launch_mode: mp
    model: {MODEL}
    host: 127.0.0.1
    port: {port}
    virtualenv: {VENV}
    env: {{{env}}}
    args: [--max-model-len, "256", --enforce-eager, --dtype, float32]
    restart: {{delay: 2, burst: 3, interval: 600}}
    nodes: [{{name: node, address: 127.0.0.1}}]
"""


def http(url: str, body: dict[str, object] | None = None, timeout: float = 30
         ) -> tuple[int, object]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except OSError:
        return 0, None


@pytest.fixture
def tiny(one_node: UserManager, tmp_path: Path, engines: tuple[Path, Path]
         ) -> Iterator[tuple[UserManager, int]]:
    port = free_port()
    one_node.render(write(tmp_path / "spec.yaml", spec_text(port)), "node")
    yield one_node, port


def assert_clean_stop(manager: UserManager, port: int) -> None:
    info = manager.show(ENGINE, "ActiveState", "Result", "ExecMainStatus")
    assert info["ActiveState"] == "inactive" and info["Result"] == "success", info
    assert manager.state_of(TARGET)[0] == "inactive"
    assert not manager.unit_pids(ENGINE), "processes left in the engine's cgroup"
    assert port_is_free(port, "127.0.0.1")


def test_start_complete_stop(tiny: tuple[UserManager, int]) -> None:
    manager, port = tiny
    manager.systemctl("start", TARGET)
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: http(f"{base}/health", timeout=5)[0] == 200, 300,
               "vLLM's /health", interval=1)
    status, answer = http(f"{base}/v1/completions",
                          {"model": str(MODEL), "prompt": "Hello", "max_tokens": 3})
    assert status == 200 and isinstance(answer, dict) and answer["choices"], answer
    manager.systemctl("stop", TARGET)
    assert_clean_stop(manager, port)
    # it served: the stop kept its drain
    assert QUICK_STOP not in (manager.log_dir / f"{ENGINE}.log").read_text(errors="replace")


def test_stop_during_start_up(tiny: tuple[UserManager, int]) -> None:
    manager, port = tiny
    manager.systemctl("start", TARGET)
    wait_until(lambda: manager.state_of(ENGINE)[0] == "active", 60, "the engine to run")
    time.sleep(5)  # well inside vLLM's start-up (its /health comes after 20 s or more)
    assert http(f"http://127.0.0.1:{port}/health", timeout=2)[0] != 200
    stopping = time.monotonic()
    manager.systemctl("stop", TARGET)
    print(f"figure: stop 5 s into start-up took {time.monotonic() - stopping:.1f} s")
    assert_clean_stop(manager, port)
    # it never served: nothing to drain, so no wait for a grace it would ignore
    assert QUICK_STOP in (manager.log_dir / f"{ENGINE}.log").read_text(errors="replace")
