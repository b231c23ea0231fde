"""vLLM's CPU communicator, joining ranks over shared memory only where they share it.

The CPU build joins the ranks of a tensor-parallel group through files in /dev/shm when
they agree on one SHM group name, and under Ray they always do (the name comes from the
rendezvous port). Ranks on two machines share no /dev/shm: measured on two booted node
containers, the join failed ("open shm in SHMManager failed. errno: 2") and vLLM never
started (docs/engines.md). A GPU build talks NCCL across machines and never meets this.
Here the ranks also compare which /dev/shm they have (the kernel's boot and the mount's
device), so ranks on different machines fall back to torch.distributed, as vLLM itself
does when the names differ. Ranks on one machine (the network-namespace tier) keep it.
"""

from __future__ import annotations

import os

import torch.distributed
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator


def shm_identity() -> str:
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
        boot = f.read().strip()
    return f"{boot}:{os.stat('/dev/shm').st_dev}"


class NodeLocalShmCommunicator(CpuCommunicator):  # type: ignore[misc]  # vLLM ships no types
    def _all_group_ranks_share_shm_group_name(self) -> bool:
        identities: list[str] = [""] * self.world_size
        torch.distributed.all_gather_object(identities, shm_identity(),
                                            group=self.device_group)
        shared = len(set(identities)) == 1
        return bool(super()._all_group_ranks_share_shm_group_name()) and shared
