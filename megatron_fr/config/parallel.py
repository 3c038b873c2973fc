"""Parallel layout of the learner: one config that both torch.distributed and megatron's
parallel_state are initialised from (megatron_fr.parallel.state.initialize)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt

from megatron_fr.config.base import StrictModel


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
