"""Parallel layout of the learner: one config that both torch.distributed and megatron's
parallel_state are initialised from (megatron_fr.parallel.state.initialize)."""

from __future__ import annotations

import ipaddress
import re
from typing import Literal

from pydantic import Field, PositiveInt, field_validator

from megatron_fr.config.base import StrictModel

MAX_HOST_CHARS = 253
"""The longest DNS name (RFC 1035), so the longest host name an address can be."""
_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")
ADDRESS_FORM = "write a host name or an IP address, without a port (e.g. 10.0.0.5 or node001)"


def address_problem(address: str) -> str | None:
    """Why `address` is no host a data group can be hosted at (said in the words of
    ADDRESS_FORM), None when it is one: a host name of RFC 1123 labels, an IPv4 address in
    dotted decimal, or an IPv6 address (labels may hold `_`, which resolvers of cluster
    host files accept though RFC 1123 does not). A port, a space, a control character or dotted
    digits that are no IPv4 address (999.1.1.1) would otherwise surface as a resolver error
    or a connection timeout on every node when the run starts."""
    if not address:
        return "is empty"
    if len(address) > MAX_HOST_CHARS:
        return f"has {len(address)} characters, more than a host name's {MAX_HOST_CHARS}"
    if not address.isascii() or not address.isprintable() or " " in address:
        return "holds spaces, control or non-ASCII characters"
    try:
        ipaddress.ip_address(address)
        return None
    except ValueError:
        pass
    labels = address.removesuffix(".").split(".")
    if labels[-1].isdigit():  # 999.1.1.1, 1.2.3: dotted digits that are no IPv4 address
        return "is no IPv4 address (four numbers 0-255) and no host name"
    if ":" in address:
        return "is no IPv6 address and no host name (a port does not belong here)"
    if not all(_LABEL.fullmatch(label) for label in labels):
        return "is no host name (letters, digits, _ and inner hyphens, dot-separated)"
    return None


class ParallelConfig(StrictModel):
    """Megatron model-parallel sizes. Data parallelism is what is left of the world size."""

    tensor: PositiveInt = 1
    """Tensor-parallel size (TP). Must divide the attention query groups and the vocabulary."""
    pipeline: PositiveInt = 1
    """Pipeline-parallel size (PP). The loss lives on the last stage only."""
    context: PositiveInt = 1
    """Context-parallel size (CP): one trajectory's tokens are split over this many ranks."""
    expert: PositiveInt = 1
    """Expert-parallel size (EP) for MoE layers. Must divide the number of experts."""
    expert_tensor: PositiveInt | None = None
    """Expert tensor-parallel size (ETP); None means the same as `tensor`, as in megatron."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tensor > 1; required by megatron for MoE with TP>1)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend; auto picks nccl when CUDA is available and gloo otherwise."""
    timeout_minutes: int = Field(default=30, ge=1, le=10080)
    """Collective timeout for the process groups."""
    data_address: str | None = None
    """Address of the first learner rank's node, where the rollout process hosts the data
    group that the other nodes' stage leaders join (each binds its end to its own address
    that routes there, or to GLOO_SOCKET_IFNAME's interface when set). None: the launcher's
    MASTER_ADDR (torchrun's rank 0 is on that node; the Slurm job gives it the node's
    NodeAddr), or loopback when every rank is on one node."""

    @field_validator("data_address")
    @classmethod
    def _host(cls, address: str | None) -> str | None:
        """A host name or an IP address, without a port (address_problem)."""
        problem = None if address is None else address_problem(address)
        if problem is not None:
            raise ValueError(f"{problem} ({ADDRESS_FORM})")
        return address

    @property
    def effective_expert_tensor(self) -> int:
        return self.tensor if self.expert_tensor is None else self.expert_tensor

    def data_parallel_size(self, world_size: int) -> int:
        """DP size for `world_size` ranks; raises ValueError naming the size that does not fit."""
        self.validate_world(world_size)
        return world_size // (self.tensor * self.pipeline * self.context)

    def validate_world(self, world_size: int) -> None:
        """Check the layout against the world size, with megatron's own divisibility rules."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        dense = self.tensor * self.pipeline * self.context
        if world_size % dense:
            raise ValueError(
                f"world_size {world_size} is not divisible by tensor ({self.tensor}) x pipeline "
                f"({self.pipeline}) x context ({self.context}) = {dense}"
            )
        expert = self.effective_expert_tensor * self.expert * self.pipeline
        if world_size % expert:
            raise ValueError(
                f"world_size {world_size} is not divisible by expert_tensor "
                f"({self.effective_expert_tensor}) x expert ({self.expert}) x pipeline "
                f"({self.pipeline}) = {expert}"
            )
        if self.sequence_parallel and self.tensor == 1:
            raise ValueError("sequence_parallel needs tensor > 1")
