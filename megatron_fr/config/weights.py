"""How the learner's weights reach the inference engines after each optimizer step."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class WeightSyncConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    transport: Literal["distributed", "tensor", "disk"] = "distributed"
    """distributed: broadcast from each stage's sending rank (NCCL on GPUs, gloo on CPU);
    tensor: colocated engines on the learner's GPUs (CUDA IPC); disk: a shared directory."""
    bucket_mib: int = Field(default=512, ge=1)
    """Tensors are sent in buckets of at most this size (a bigger tensor goes alone)."""
    timeout_s: float = Field(default=120.0, gt=0)
    """Deadline of every engine call and of each broadcast."""
    pause_mode: Literal["abort", "retract", "in_place"] = "abort"
    """How engines pause during the update; "abort" ends in-flight requests, which the rollout
    client continues under the new version, so every token's version is exact."""
    spot_check: int = Field(default=0, ge=0)
    """Read this many sent tensors back from every engine after the update, bitwise."""
    master_address: str = "127.0.0.1"
    """Address of the learner's sending rank, reachable from the engines."""
    master_port: int = Field(default=29600, ge=0, le=65535)
    """Port of stage 0's weight group; stage k uses master_port + k; 0: a free port picked
    by the first learner rank at start (single-node runs)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """auto: nccl where CUDA is present, gloo otherwise."""
    directory: str | None = None
    """The shared directory of the disk transport."""

    @model_validator(mode="after")
    def _disk_needs_directory(self) -> WeightSyncConfig:
        if self.transport == "disk" and not self.directory:
            raise ValueError("transport 'disk' needs directory (shared with the engines)")
        return self
