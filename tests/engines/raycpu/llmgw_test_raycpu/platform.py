"""The CPU platform with Ray's "GPU" resource as its device key (see __init__), and a
communicator that uses shared memory only between ranks that share it (communicator.py)."""

from __future__ import annotations

from vllm.platforms.cpu import CpuPlatform


class RayOnCpuPlatform(CpuPlatform):  # type: ignore[misc]  # vLLM ships no types
    ray_device_key: str = "GPU"

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "llmgw_test_raycpu.communicator.NodeLocalShmCommunicator"
