"""The CPU platform with Ray's "GPU" resource as its device key (see __init__)."""

from __future__ import annotations

from vllm.platforms.cpu import CpuPlatform


class RayOnCpuPlatform(CpuPlatform):  # type: ignore[misc]  # vLLM ships no types
    ray_device_key: str = "GPU"
