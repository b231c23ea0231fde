"""Test fixture only, never part of the product: a vLLM platform plugin that lets the
CPU build of vLLM 0.32 run with `--distributed-executor-backend ray`.

vLLM refuses Ray on CPU ("current platform cpu does not support ray") because the CPU
platform names no Ray resource for its workers. This plugin activates only when
LLMGW_TEST_RAY_ON_CPU=1 and then offers the CPU platform with Ray's "GPU" resource, so
`ray start --num-gpus=1` on each node places one tensor-parallel rank per node, as one GPU
per node would (docs/engines.md). scripts/setup-engines copies it into the engine
virtualenv with an entry point in the group `vllm.platform_plugins`.
"""

from __future__ import annotations

import os


def activate() -> str | None:
    if os.environ.get("LLMGW_TEST_RAY_ON_CPU") != "1":
        return None
    return "llmgw_test_raycpu.platform.RayOnCpuPlatform"
