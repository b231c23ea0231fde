"""vLLM's own argument parser and config check, on every data-parallel command line we
render: `vllm serve`'s parser reads the argv, then vLLM builds its engine config from it
(the tiny model's, so vLLM's own data-parallel rules run: ranks, local sizes, the
load-balancing mode, headless). No engine starts; each parse takes a few seconds."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import rendered_dir, run_render
from realengine import ENGINE_ARGS, MODEL, OFFLINE, VENV, assert_engines
from specs import write
from unitfile import read_exec, read_unit

pytestmark = [pytest.mark.engines]

# Runs in the engine virtualenv: parse `vllm serve` argv as vLLM does, build its config,
# print where each data-parallel value landed.
_PARSE = """\
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
argv = sys.argv[1:]
assert argv[0] == "serve", argv
args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[2:])
args.model = argv[1]
config = AsyncEngineArgs.from_cli_args(args).create_engine_config(headless=args.headless)
pc = config.parallel_config
print(json.dumps({"headless": args.headless, "port": args.port, **{k: getattr(pc, k) for k in (
    "tensor_parallel_size", "data_parallel_size", "data_parallel_size_local",
    "data_parallel_rank", "data_parallel_master_ip", "data_parallel_rpc_port",
    "data_parallel_hybrid_lb", "data_parallel_external_lb", "enable_expert_parallel")}}))
"""


def spec(dp: int, lb: str) -> str:
    return f"""\
replicas:
  - name: dp
    engine: vllm
    launch_mode: mp
    model: {MODEL}
    virtualenv: {VENV}
    port: 8100
    data_parallel_size: {dp}
    data_parallel_lb: {lb}
    rendezvous_port: 29650
    args: {ENGINE_ARGS}
    nodes:
      - {{name: n0, address: 10.1.0.1}}
      - {{name: n1, address: 10.1.0.2}}
"""


def vllm_config(tmp_path: Path, text: str, node: str) -> subprocess.CompletedProcess[str]:
    assert_engines()
    out = tmp_path / node
    proc = run_render("--node", node, "--output", str(out), str(write(tmp_path / "s.yaml", text)))
    assert proc.returncode == 0, proc.stderr
    unit = read_unit(rendered_dir(out)["llmgw-dp-engine.service"])
    argv = read_exec(unit["Service.ExecStart"][0])
    assert argv[0] == str(VENV / "bin/vllm"), argv
    return subprocess.run([str(VENV / "bin/python"), "-c", _PARSE, *argv[1:]],
                          capture_output=True, text=True, timeout=300, check=False,
                          env={**OFFLINE, "PATH": "/usr/bin:/bin"})


def landed(proc: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


COMMON = {"tensor_parallel_size": 1, "data_parallel_master_ip": "10.1.0.1",
          "data_parallel_rpc_port": 29650, "data_parallel_external_lb": False,
          "enable_expert_parallel": False}


@pytest.mark.parametrize(("node", "rank"), [("n0", 0), ("n1", 1)])
def test_internal_load_balancing_as_vllm_reads_it(tmp_path: Path, node: str, rank: int) -> None:
    got = landed(vllm_config(tmp_path, spec(2, "internal"), node))
    # a headless node binds no HTTP port: vLLM's default stays, unused
    assert got == {**COMMON, "headless": rank == 1, "port": 8000 if rank else 8100,
                   "data_parallel_size": 2,
                   "data_parallel_size_local": 1, "data_parallel_rank": rank,
                   "data_parallel_hybrid_lb": False}


@pytest.mark.parametrize(("node", "rank"), [("n0", 0), ("n1", 1)])
def test_hybrid_load_balancing_as_vllm_reads_it(tmp_path: Path, node: str, rank: int) -> None:
    """Two data-parallel ranks per node: each node's API server serves its own two."""
    got = landed(vllm_config(tmp_path, spec(4, "hybrid"), node))
    assert got == {**COMMON, "headless": False, "port": 8100, "data_parallel_size": 4,
                   "data_parallel_size_local": 2, "data_parallel_rank": 2 * rank,
                   "data_parallel_hybrid_lb": True}


@pytest.mark.parametrize(("node", "rank"), [("n0", 0), ("n1", 1)])
def test_hybrid_with_one_rank_per_node_is_vllms_external_mode(tmp_path: Path, node: str,
                                                              rank: int) -> None:
    """With one rank per node vLLM turns hybrid into its external mode: each node's API
    server sends only to its own rank (docs/engines.md, "Data parallel")."""
    got = landed(vllm_config(tmp_path, spec(2, "hybrid"), node))
    assert got == {**COMMON, "headless": False, "port": 8100, "data_parallel_size": 2,
                   "data_parallel_size_local": 1, "data_parallel_rank": rank,
                   "data_parallel_hybrid_lb": False, "data_parallel_external_lb": True}
