"""The process group between one learner rank and the inference engines' ranks.

It lives outside the learner's default group (the engines are other programs), so it is built
to meet SGLang's ``init_custom_process_group``: a TCP store at master_address:master_port
(hosted by the learner rank, rank 0), prefixed by the group name, and a process group of the
requested backend on it. Both ends
calling this with the same address, port, name and world size meet; rank 0 is the sender.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class WeightUpdateGroup:
    """The group and the TCP store it was built on (rank 0's store socket must outlive it)."""

    group: dist.ProcessGroup
    store: dist.Store
    rank: int
    world_size: int

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Send (rank 0) or receive (the others) one tensor, in place."""
        self.group.broadcast([tensor], dist.BroadcastOptions()).wait()


def create_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 300.0,
) -> WeightUpdateGroup:
    """Join (rank 0: host) the weight-update group; blocks until all world_size ranks arrive."""
    timeout = datetime.timedelta(seconds=timeout_s)
    # A TCPStore made directly, not through dist.rendezvous("tcp://..."): under torchrun that
    # handler turns rank 0 into a client of the job's agent store, and nobody would host.
    store = dist.TCPStore(
        master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
        wait_for_workers=False,
    )  # fmt: skip
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    elif backend == "nccl":
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size)
    else:
        raise ValueError(f"weight-update backend must be 'gloo' or 'nccl', got {backend!r}")
    return WeightUpdateGroup(group, store, rank, world_size)
