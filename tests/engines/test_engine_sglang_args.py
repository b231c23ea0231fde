"""SGLang has no CPU build, so its engine keeps a stand-in; but SGLang's own argument
parser imports without a GPU (scripts/setup-engines puts sglang 0.5.23 on a path of its
own). Every SGLang command line we render must parse with it, each value landing where
SGLang reads it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import rendered_dir, run_render
from realengine import CACHE, VENV, assert_engines
from specs import write
from unitfile import read_exec, read_unit

pytestmark = [pytest.mark.engines]

SGLANG = CACHE / "sglang-parser-0.5.23"
# Runs in the engine virtualenv: parse argv with SGLang's parser, print what it read.
_PARSE = """\
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
args = parser.parse_args(sys.argv[1:])
print(json.dumps({k: getattr(args, k) for k in ("model_path", "host", "port", "tp_size",
      "pp_size", "nnodes", "node_rank", "dist_init_addr", "mem_fraction_static",
      "attn_dp_size", "ep_size")}))
"""

SPEC = """\
replicas:
  - name: sg
    engine: sglang
    model: /models/qwen
    tensor_parallel_size: 8
    pipeline_parallel_size: 2
    rendezvous_port: 20100
    port: 30001
    args: [--mem-fraction-static, "0.8"]
    nodes:
      - {name: n0, address: 10.0.0.1}
      - {name: n1, address: 10.0.0.2}
"""
# Wide expert parallel: attention data parallel inside the tensor-parallel group, the
# experts over all of it.
WIDE_EP = SPEC.replace("    pipeline_parallel_size: 2\n", "    data_parallel_size: 8\n"
                       "    expert_parallel_size: 8\n")


def sglang_parse(argv: list[str]) -> subprocess.CompletedProcess[str]:
    assert_engines()
    assert (SGLANG / ".complete").exists(), f"{SGLANG} missing: run scripts/setup-engines"
    return subprocess.run([str(VENV / "bin/python"), "-c", _PARSE, *argv], capture_output=True,
                          text=True, timeout=120, check=False,
                          env={"PYTHONPATH": str(SGLANG), "PATH": "/usr/bin:/bin"})


def rendered_argv(tmp_path: Path, node: str, spec: str = SPEC) -> list[str]:
    out = tmp_path / node
    proc = run_render("--node", node, "--output", str(out), str(write(tmp_path / "s.yaml",
                                                                      spec)))
    assert proc.returncode == 0, proc.stderr
    unit = read_unit(rendered_dir(out)["llmgw-sg-engine.service"])
    argv = read_exec(unit["Service.ExecStart"][0])
    assert argv[1:3] == ["-m", "sglang.launch_server"], argv
    return argv[3:]


@pytest.mark.parametrize(("node", "rank"), [("n0", 0), ("n1", 1)])
def test_rendered_sglang_command_parses_with_sglangs_own_parser(
        tmp_path: Path, node: str, rank: int) -> None:
    proc = sglang_parse(rendered_argv(tmp_path, node))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"model_path": "/models/qwen", "host": "0.0.0.0", "port": 30001,
                   "tp_size": 8, "pp_size": 2, "nnodes": 2, "node_rank": rank,
                   "dist_init_addr": "10.0.0.1:20100", "mem_fraction_static": 0.8,
                   "attn_dp_size": 1, "ep_size": 1}


@pytest.mark.parametrize(("node", "rank"), [("n0", 0), ("n1", 1)])
def test_rendered_wide_expert_parallel_parses_with_sglangs_own_parser(
        tmp_path: Path, node: str, rank: int) -> None:
    assert "pipeline_parallel_size" not in WIDE_EP
    proc = sglang_parse(rendered_argv(tmp_path, node, WIDE_EP))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"model_path": "/models/qwen", "host": "0.0.0.0", "port": 30001,
                   "tp_size": 8, "pp_size": 1, "nnodes": 2, "node_rank": rank,
                   "dist_init_addr": "10.0.0.1:20100", "mem_fraction_static": 0.8,
                   "attn_dp_size": 8, "ep_size": 8}


def test_sglangs_parser_refuses_what_it_does_not_know() -> None:
    """The check can fail: a flag SGLang does not have is an error there."""
    proc = sglang_parse(["--model-path", "/m", "--tensor-parallel-size", "2",
                         "--no-such-flag"])
    assert proc.returncode == 2 and "unrecognized arguments: --no-such-flag" in proc.stderr
