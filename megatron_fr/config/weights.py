"""How the learner's weights reach the inference engines after each optimizer step."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from megatron_fr.config.base import Seconds, StrictModel


class WeightSyncConfig(StrictModel):
    transport: Literal["distributed", "tensor", "disk"] = "distributed"
    """distributed: broadcast from each stage's sending rank (NCCL on GPUs, gloo on CPU);
    tensor: colocated engines on the learner's GPUs (CUDA IPC); disk: a shared directory."""
    bucket_mib: int = Field(default=512, ge=1, le=65536)
    """Tensors are sent in buckets of at most this size (a bigger tensor goes alone)."""
    bucket_format: Literal["auto", "tensors", "flattened"] = "auto"
    """distributed transport to SGLang-protocol engines: "tensors" broadcasts tensor by tensor
    (SGLang's default load_format), "flattened" one uint8 buffer per bucket (load_format
    "flattened_bucket": SGLang 0.5.23's update_weights_from_distributed receives it with one
    broadcast into FlattenedTensorBucket.empty(names, dtypes, shapes) and rebuilds the
    tensors, model_runner_components/weight_updater.py). auto: flattened on NCCL (SGLang on
    GPUs: one broadcast per bucket, 115 for Qwen3-30B-A3B's 18,867 tensors at 512 MiB,
    tools/bench_weight_sync.py --broadcasts), tensors on gloo (the CPU engine: tensor by
    tensor was 3.1x faster there, tools/bench_weight_sync.py --target-gb 1 --bucket-mib 128
    --receivers 2: 0.45 vs 0.15 GB/s); tools/gpu_check.sh measures both on NCCL."""
    overlap: bool = True
    """Build the next bucket (the shards' messages, the HF mapping) while the previous one is
    being sent, on a second thread: two buckets in memory instead of one. Off: one after the
    other."""
    timeout_s: Seconds = 120.0
    """Deadline of every engine call and of each broadcast."""
    regroup_timeout_s: Seconds = 30.0
    """Deadline for each engine to leave the old weight-update groups when the learner
    connects (ending an open update session, destroying the groups of a previous connect);
    timeout_s where that is shorter. An engine that does not answer in time is taken out of
    the pool as dead: SGLang's scheduler answers a destroy only after the collective it is
    stuck in, so waiting longer would hold every other engine's regroup."""
    verify_every: int = Field(default=1, ge=0)
    """Check every this many syncs that each engine computes the learner's log-probs
    (weights/verify.py: a 16-token probe per engine, scored by the learner); 0: never."""
    verify_tolerance: float = Field(default=1.0, gt=0)
    """Largest per-token |engine - learner| log-prob (nats) an engine may show on the probe;
    past it the engine is taken out of the pool. Engines and learner in float32 agree to
    about 1e-5; in bf16 single tokens can differ by tenths (a routing tie in an MoE layer),
    so the default only catches weights that are wrong, not bf16 noise: read the run's
    sync_logprob_gap before tightening it."""
    pause_mode: Literal["abort", "retract", "in_place"] = "abort"
    """How engines pause during the update; "abort" ends in-flight requests, which the rollout
    client continues under the new version, so every token's version is exact."""
    flush_cache: bool = True
    """Empty every engine's prefix cache after the update (POST /flush_cache, retried while
    requests are pending), so no KV computed by the old weights is reused, e.g. by the
    continuations of aborted requests. Turn off only for servers run with
    --disable-radix-cache."""
    spot_check: int = Field(default=0, ge=0)
    """Read this many sent tensors back from every engine after the update, bitwise (the CPU
    engine only: SGLang 0.5.23 implements /get_weights_by_name for none of the project's
    model families, and a sync with spot_check > 0 against SGLang is refused)."""
    master_address: str | None = None
    """Address of stage 0's sending rank (global rank 0), reachable from the engines; None:
    the address of its interface that routes to the first engine. Other stages' senders
    always use their own such address."""
    master_port: int = Field(default=29600, ge=0, le=65535)
    """Port of stage 0's weight group; stage k uses master_port + k; 0: a free port picked
    by the first learner rank at start (single-node runs)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """auto: nccl where CUDA is present, gloo otherwise."""
    directory: str | None = None
    """The shared directory of the disk transport."""

    def flattened(self, backend: str) -> bool:
        """Whether the distributed transport sends flattened buckets over `backend` (nccl or
        gloo, resolved): bucket_format, auto resolved as its docstring says."""
        if self.bucket_format == "auto":
            return backend == "nccl"
        return self.bucket_format == "flattened"

    @model_validator(mode="after")
    def _check(self) -> WeightSyncConfig:
        if self.transport == "disk" and not self.directory:
            raise ValueError("transport 'disk' needs directory (shared with the engines)")
        if self.flush_cache and self.pause_mode == "in_place":
            raise ValueError(
                "pause_mode 'in_place' keeps requests running through the update, and SGLang "
                "refuses to flush its prefix cache while requests run: use 'abort' or "
                "'retract', or serve with --disable-radix-cache and set flush_cache false"
            )
        return self
